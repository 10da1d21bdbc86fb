"""A training job for the multi-node tests (tests/python/test_multinode.py), run on every rank by
zero8-launch: an MLP regression trained with zero8.initialize (ZeRO stage 2) on deterministic synthetic
batches (batch of step s and rank r depends only on s and r, so a resumed run sees the same data).
With --count_net it reads this host's network byte counters (/sys/class/net/*/statistics, loopback
excluded; in a namespace that is the veth) around the gradient phase (forward+backward, where stage 2
reduce-scatters the gradients) and the step phase of every step, between barriers, on local rank 0.
Without the engine (zero8.initialize missing) it runs a comm-only workload (fp32 all-reduces).

    train_job.py --steps N [--mode fp32|int8] [--hidden H] [--layers L] [--batch B] [--ckpt_dir D]
                 [--save_every K] [--resume] [--sleep_step S [--sleep_ranks R,...]] [--out result.json]
                 [--count_net] [--comm_only]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import torch

try:
    import zero8
    from zero8.engine import world_comm
    HAVE_ENGINE = hasattr(zero8, "initialize")
except ImportError:  # an older zero8 without the engine
    HAVE_ENGINE = False

IN_DIM = 64


def net_tx_bytes() -> int:
    """Bytes this host's network interfaces (all but loopback) have sent."""
    total = 0
    for d in glob.glob("/sys/class/net/*"):
        if os.path.basename(d) == "lo":
            continue
        try:
            with open(os.path.join(d, "statistics", "tx_bytes")) as f:
                total += int(f.read())
        except OSError:
            pass
    return total


def say_test_event(rank: int, what: str) -> None:
    """Marks an injected failure with its wall-clock time: the launcher tests time the job's end from it,
    not from the launch (on a loaded machine start-up alone takes more than their 30 s)."""
    print(f"test event: rank {rank} {what} at t={time.time():.3f}", flush=True)


def make_model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(1234)
    mods = [torch.nn.Linear(IN_DIM, hidden), torch.nn.Tanh()]
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    mods.append(torch.nn.Linear(hidden, 1))
    return torch.nn.Sequential(*mods)


def batch(step: int, rank: int, rows: int):
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(rows, IN_DIM, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * x[:, 4:5]
    return x, y


def config(mode: str, world: int, rows: int) -> dict:
    cfg = {
        "train_batch_size": rows * world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1 << 22},
        "steps_per_print": 1 << 30,
        "gradient_clipping": 0.0,  # the short run's held-out loss must fall; clipping at 1.0 slows it
    }
    if mode == "int8":
        # int8 gradient reduce-scatter only: the parameter all-gather stays in fp32, as in the fp32 run,
        # so the two runs differ in the gradient traffic alone.
        cfg["zero8"] = {"enabled": True, "int8_gradients": True, "int8_params": False}
    return cfg


def train(a, rank: int, world: int, local_rank: int) -> dict:
    comm = world_comm()
    model = make_model(a.hidden, a.layers)
    engine, _, _, _ = zero8.initialize(model=model, model_parameters=model.parameters(),
                                       config=config(a.mode, world, a.batch))
    start_step = 0
    if a.resume:
        path, client = engine.load_checkpoint(a.ckpt_dir)
        if path is None:
            raise RuntimeError(f"--resume: no checkpoint in {a.ckpt_dir}")
        start_step = engine.global_steps
        if rank == 0:
            print(f"resumed from {path} at step {start_step}", flush=True)
    counting = a.count_net and local_rank == 0
    grad_tx = step_tx = 0
    losses = {}
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"model: {n_params} parameters, mode {a.mode}, world {world}", flush=True)
    # A fixed held-out batch, the same for every rank and run: its loss before and after shows progress.
    x_eval, y_eval = batch(10**6, 0, 256)

    def eval_loss() -> float:
        with torch.no_grad():
            return torch.nn.functional.mse_loss(engine(x_eval), y_eval).item()

    eval_first = eval_loss()
    t0 = time.time()
    sleepers = {int(r) for r in a.sleep_ranks.split(",") if r}
    for step in range(start_step, a.steps):
        if rank in sleepers:
            if step == start_step:
                say_test_event(rank, f"starts sleeping {a.sleep_step:g} s at step {step}")
            time.sleep(a.sleep_step)  # the other ranks wait for this one inside the step's collectives
        if rank == a.raise_rank and step == a.raise_step:
            say_test_event(rank, f"raises at step {step}")
            raise RuntimeError(f"rank {rank} raises at step {step} on purpose (test)")
        if rank == a.exit_rank and step == a.exit_step:
            say_test_event(rank, f"ends its loop at step {step}")
            print(f"rank {rank} ends its loop at step {step} (out of data, test)", flush=True)
            return {"mode": a.mode, "world": world, "losses": losses}
        if rank == a.save_alone_rank and step == a.save_alone_step:
            say_test_event(rank, f"saves alone at step {step}")
            engine.save_checkpoint(a.ckpt_dir)  # the others go on to the step's reduction
        x, y = batch(step, rank, a.batch)
        if a.count_net:
            comm.barrier()
            c0 = net_tx_bytes() if counting else 0
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        if a.count_net:
            comm.barrier()
            c1 = net_tx_bytes() if counting else 0
        engine.step()
        if a.count_net:
            comm.barrier()
            c2 = net_tx_bytes() if counting else 0
            grad_tx += c1 - c0
            step_tx += c2 - c1
        losses[step + 1] = loss.item()
        if rank == 0:
            print(f"step {step + 1}/{a.steps} loss {loss.item():.6f}", flush=True)
        if a.save_every and (step + 1) % a.save_every == 0:
            engine.save_checkpoint(a.ckpt_dir)
            if rank == 0:
                print(f"saved checkpoint at step {step + 1}", flush=True)
        if a.sleep_step and not sleepers:
            time.sleep(a.sleep_step)
    stats = engine.comm_stats()
    # Per host (its local rank 0's counters) and per rank (the engine's own counts), gathered on rank 0.
    mine = {"rank": rank, "host_grad_tx": grad_tx if counting else 0, "host_step_tx": step_tx if counting else 0,
            "gradient_bytes": stats["gradient_bytes"], "step_bytes": stats["step_bytes"]}
    everyone = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(mine).encode())]
    return {"mode": a.mode, "world": world, "params": n_params, "start_step": start_step, "losses": losses,
            "eval_first": eval_first, "eval_last": eval_loss(),
            "net_grad_tx": sum(e["host_grad_tx"] for e in everyone),
            "net_step_tx": sum(e["host_step_tx"] for e in everyone),
            "engine_gradient_bytes": sum(e["gradient_bytes"] for e in everyone),
            "engine_step_bytes": sum(e["step_bytes"] for e in everyone),
            "seconds": time.time() - t0}


def comm_only(a, rank: int, world: int) -> dict:
    from zero8 import _C
    comm = _C.comm_create("auto")
    buf = torch.ones(a.hidden * a.hidden, dtype=torch.float32)
    for step in range(a.steps):
        comm.all_reduce_ptr(buf.data_ptr(), buf.numel(), "f32", "sum")
        buf /= world
        if rank == 0:
            print(f"step {step + 1}/{a.steps} all-reduce of {buf.numel()} floats", flush=True)
        if a.sleep_step:
            time.sleep(a.sleep_step)
    return {"mode": "comm-only", "world": world, "losses": {}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--mode", choices=["fp32", "int8"], default="int8")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="rows per rank")
    p.add_argument("--ckpt_dir", default="")
    p.add_argument("--save_every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sleep_step", type=float, default=0.0, help="seconds every rank sleeps after each step")
    p.add_argument("--sleep_ranks", default="", help="only these ranks sleep, at the start of each step")
    p.add_argument("--raise_rank", type=int, default=-1, help="this rank raises RuntimeError at --raise_step")
    p.add_argument("--raise_step", type=int, default=1)
    p.add_argument("--exit_rank", type=int, default=-1, help="this rank leaves its loop at --exit_step, as "
                   "one that ran out of data, and exits normally")
    p.add_argument("--exit_step", type=int, default=1)
    p.add_argument("--save_alone_rank", type=int, default=-1, help="this rank alone calls save_checkpoint at "
                   "--save_alone_step")
    p.add_argument("--save_alone_step", type=int, default=1)
    p.add_argument("--out", default="")
    p.add_argument("--count_net", action="store_true")
    p.add_argument("--comm_only", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)  # 4 ranks share 2 cores in the tests
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if a.comm_only or not HAVE_ENGINE:
        result = comm_only(a, rank, world)
    else:
        result = train(a, rank, world, local_rank)
    if rank == 0 and a.out:
        with open(a.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
    if rank == 0:
        print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
