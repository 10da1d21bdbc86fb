#!/usr/bin/env python3
"""One rank of one run of benchmarks/bench_vs_deepspeed.py: the pretraining example's GPT, corpus and
batches (examples/pretrain_gpt.py) trained for --warmup + --steps steps by zero8's engine (started by
zero8-launch) or by DeepSpeed's (started by torchrun, gloo), from the same DeepSpeed JSON config. Rank 0
writes one JSON object with every rank's figures to --out. The driver is the way to run it.

Measured over the timed steps (after --warmup untimed ones), between barriers: the wall time per step,
the bytes each network interface of this rank's network namespace sent and received (/sys/class/net;
with one rank per namespace that is the rank's link), zero8's own byte and time counters, and at the end
the optimizer-state bytes of this rank's partition, its peak RSS, the training loss of the last step's
global batch (and of the first, which the same model, data and seed make equal for both systems) and the
validation loss.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path

from pretrain_example import gloo_rank_exit, load_example


def link_counters() -> dict:
    """{interface: [tx_bytes, rx_bytes]} of this process's network namespace (ip netns exec mounts its
    own /sys, so a rank started in a namespace sees that namespace's interfaces)."""
    out = {}
    for d in sorted(glob.glob("/sys/class/net/*")):
        try:
            with open(os.path.join(d, "statistics", "tx_bytes")) as f:
                tx = int(f.read())
            with open(os.path.join(d, "statistics", "rx_bytes")) as f:
                rx = int(f.read())
        except OSError:
            continue
        out[os.path.basename(d)] = [tx, rx]
    return out


class TorchComm:
    """The two collectives the example's evaluate() and this worker use, over torch.distributed (gloo),
    with the names of zero8's communicator."""

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        self.dist.barrier()

    def all_reduce_f64(self, values, op: str):
        import torch
        t = torch.tensor(list(values), dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM if op == "sum" else self.dist.ReduceOp.MAX)
        return t.tolist()

    def all_gather_bytes(self, data: bytes) -> list:
        out = [None] * self.size
        self.dist.all_gather_object(out, data)
        return out


def zero8_counters(engine) -> dict:
    """zero8's own counters (the timed steps take the difference of two readings): bytes sent, seconds inside
    collectives, and the overlap thread's seconds: the reductions' and the all-gather's, and how long the
    training loop waited for each."""
    s = engine.comm_stats()
    o = s["overlap"]
    return {"bytes": s["bytes"], "gradient_bytes": s["gradient_bytes"], "step_bytes": s["step_bytes"],
            "seconds": sum(float(v["seconds"]) for v in s["ops"].values()),
            **{k: float(o[k]) for k in ("reduce_seconds", "reduce_wait_seconds", "gather_seconds",
                                        "gather_wait_seconds")}}


def deepspeed_state_bytes(engine) -> int:
    """Bytes of the tensors in the optimizer state of this rank's partition (Adam's two moments of the
    flat fp32 partition, and the step counter)."""
    import torch
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    total = 0
    for state in inner.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("zero8", "deepspeed"), required=True)
    p.add_argument("--config", required=True, help="DeepSpeed JSON config of the run")
    p.add_argument("--out", required=True, help="JSON result (rank 0 writes it)")
    p.add_argument("--d_model", type=int, required=True)
    p.add_argument("--n_layer", type=int, required=True)
    p.add_argument("--n_head", type=int, required=True)
    p.add_argument("--seq_len", type=int, required=True)
    p.add_argument("--micro_batch", type=int, required=True, help="sequences per rank and step")
    p.add_argument("--steps", type=int, required=True, help="timed steps")
    p.add_argument("--warmup", type=int, required=True, help="untimed steps first")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus_mb", type=float, default=2.0)
    p.add_argument("--eval_seqs", type=int, default=64)
    p.add_argument("--torch_adamw", action="store_true",
                   help="DeepSpeed: torch.optim.AdamW as the client optimizer, with the config's hyperparameters, "
                        "instead of the optimizer DeepSpeed builds from the config (its JIT-compiled fused Adam)")
    a = p.parse_args()

    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ex = load_example()
    with open(a.config, encoding="utf-8") as f:
        cfg = json.load(f)

    corpus = ex.Corpus(int(a.corpus_mb * 1e6))
    # as the example builds it for the data-parallel engine: its layers, each from its own seed
    model = ex.LayerModule(ex.gpt_layers(a.d_model, a.n_layer, a.n_head, a.seq_len, tie_weights=False),
                           seed_layers=True, base_seed=a.seed)
    n_params = sum(q.numel() for q in model.parameters())
    groups = ex.param_groups(model)

    t_init = time.perf_counter()
    if a.system == "zero8":
        import zero8
        from zero8.engine import world_comm
        comm = world_comm()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, _, _, _ = zero8.initialize(model=model, model_parameters=groups, config=cfg)
    else:
        import deepspeed
        from deepspeed.utils import logger as ds_logger
        ds_logger.setLevel("ERROR")
        deepspeed.init_distributed(dist_backend="gloo")
        comm = TorchComm()
        optimizer = None
        if a.torch_adamw:
            hp = cfg.pop("optimizer")["params"]
            optimizer = torch.optim.AdamW(groups, lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                                          weight_decay=hp["weight_decay"])
            cfg["zero_allow_untested_optimizer"] = True
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=None if optimizer else groups,
                                               optimizer=optimizer, config=cfg)
    init_s = time.perf_counter() - t_init
    rank, world = comm.rank, comm.size
    micro = a.micro_batch
    batch = micro * world
    val_offsets = torch.linspace(0, corpus.val.numel() - a.seq_len - 2, a.eval_seqs).long()

    local_losses, step_s = [], []
    total = a.warmup + a.steps
    for step in range(total):
        if step == a.warmup:
            comm.barrier()
            links0 = link_counters()
            z0 = zero8_counters(engine) if a.system == "zero8" else None
            t0 = t_prev = time.perf_counter()
        offsets = ex.batch_offsets(a.seed, step, batch, corpus.train.numel(), a.seq_len)
        x, y = ex.sequences(corpus.train, offsets[rank * micro:(rank + 1) * micro], a.seq_len)
        loss = ex.lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        local_losses.append(float(loss.detach()))
        if step >= a.warmup:
            now = time.perf_counter()
            step_s.append(now - t_prev)
            t_prev = now
    comm.barrier()
    elapsed = time.perf_counter() - t0
    links1 = link_counters()
    z1 = zero8_counters(engine) if a.system == "zero8" else None

    val = ex.evaluate(engine, corpus, val_offsets, a.seq_len, rank, world, comm, micro)
    global_losses = comm.all_reduce_f64(local_losses, "sum")
    if a.system == "zero8":
        mem = engine.memory_stats()
        state_bytes, master_bytes = int(mem["state"]), int(mem.get("master", 0))
    else:
        state_bytes, master_bytes = deepspeed_state_bytes(engine), None
    mine = {
        "rank": rank, "host": os.uname().nodename, "init_s": init_s, "elapsed_s": elapsed, "step_s": step_s,
        "links": {k: [links1[k][0] - v[0], links1[k][1] - v[1]] for k, v in links0.items() if k in links1},
        "zero8": None if z0 is None else {k: z1[k] - z0[k] for k in z0},
        "state_bytes": state_bytes, "master_bytes": master_bytes,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "cpus": len(os.sched_getaffinity(0)),  # a launcher that binds ranks to cores shows here
    }
    ranks = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(mine).encode())]
    if rank == 0:
        result = {
            "system": a.system, "world": world, "params": n_params, "steps": a.steps, "warmup": a.warmup,
            # From the barrier before the timed steps to the end of the last one, on the slowest rank: the
            # cost per step of a long run. Not the closing barrier, which would add zero8's last all-gather
            # (left to the next forward, which belongs to a step after the run) to these few steps.
            "tokens_per_step": batch * a.seq_len,
            "seconds_per_step": max(sum(rk["step_s"]) for rk in ranks) / a.steps,
            "first_loss": global_losses[0] / world, "train_loss": global_losses[-1] / world, "val_loss": val,
            "ranks": ranks,
            "versions": {"torch": torch.__version__, a.system: _version(a.system)},
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    if a.system == "deepspeed":
        gloo_rank_exit()
    return 0


def _version(system: str) -> str:
    import importlib.metadata
    return importlib.metadata.version(system)


if __name__ == "__main__":
    sys.exit(main())
