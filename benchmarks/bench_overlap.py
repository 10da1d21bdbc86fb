#!/usr/bin/env python3
"""How much of zero8's gradient reduction and parameter all-gather the training loop does not wait for
(issue 31, point 3): the pretraining example's GPT (examples/pretrain_gpt.py) on 2 ranks under mpirun,
zero_optimization.overlap_comm on (the reductions on the sharded optimizer's thread while backward goes
on, the all-gather pieces while the step goes on) and off (both in the loop's thread), interleaved
(on, off, on, off, ...) so that the machine's noise shows in both.

Per run, over the timed steps (after --warmup untimed ones; rank 0's view): the step time (forward,
backward, step), the reductions' wall time and the time the loop waited for them, the same for the
all-gather, and the share of the reductions' time hidden (1 - waited / took) from the engine's
comm_stats()["overlap"]. Results are the same bits either way (tests/python/dist/dist_engine.py).

    python3 benchmarks/bench_overlap.py --d_model 384 --n_layer 6 --bucket 1048576 --runs 2

Prints a table and one JSON line (`{"bench": "overlap", ...}`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pretrain_example import load_example

VOCAB = 256


def worker(args) -> int:
    import torch

    import zero8
    from zero8.engine import world_comm

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    ex = load_example()
    world = world_comm("auto")
    layers = ex.gpt_layers(args.d_model, args.n_layer, args.d_model // 64, args.seq_len, False)
    model = ex.LayerModule(layers, seed_layers=True, base_seed=args.seed)
    cfg = {
        "train_batch_size": args.batch * world.size,
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket,
                              "overlap_comm": args.overlap == "on"},
        "zero8": {},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = zero8.initialize(model=model, model_parameters=ex.param_groups(model), config=cfg)
    gen = torch.Generator().manual_seed(args.seed * 1000 + world.rank)

    def step():
        seq = torch.randint(0, VOCAB, (args.batch, args.seq_len + 1), generator=gen)
        engine.backward(ex.lm_loss(engine(seq[:, :-1]), seq[:, 1:]))
        engine.step()

    for _ in range(args.warmup):
        step()
    world.barrier()
    before = engine.comm_stats()["overlap"]
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    world.barrier()
    seconds = time.perf_counter() - t0
    after = engine.comm_stats()["overlap"]
    delta = {k: after[k] - before[k] for k in ("reductions", "reduce_seconds", "reduce_wait_seconds", "gathers",
                                               "gather_seconds", "gather_wait_seconds")}
    if world.rank == 0:
        out = {"step_ms": 1e3 * seconds / args.steps, "threaded": after["threaded"],
               "params": sum(p.numel() for p in model.parameters()),
               **{k: (v / args.steps if k.endswith("seconds") else v) for k, v in delta.items()}}
        with open(args.out, "w") as f:
            json.dump(out, f)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d_model", type=int, default=384)
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--bucket", type=int, default=1 << 20, help="reduce_bucket_size and allgather_bucket_size")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=2, help="runs per setting, interleaved")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--overlap", choices=["on", "off"], default="on", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        print("mpirun not found (scripts/setup.sh installs OpenMPI)", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY="passive", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONWARNINGS="ignore")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for overlap in ("on", "off"):
                out = Path(tmp) / f"{overlap}{run}.json"
                cmd = [mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, __file__, "--worker",
                       "--overlap", overlap, "--out", str(out)]
                for k in ("d_model", "n_layer", "seq_len", "batch", "bucket", "steps", "warmup", "threads", "seed"):
                    cmd += [f"--{k}", str(getattr(args, k))]
                r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if r.returncode != 0:
                    print((r.stdout + r.stderr)[-4000:], file=sys.stderr)
                    return 1
                rows.append({"overlap": overlap, "run": run, **json.loads(out.read_text())})
                print(f"  overlap_comm {overlap}: {rows[-1]['step_ms']:.1f} ms per step", flush=True)
    n = rows[0]["params"]
    print(f"\nGPT d_model {args.d_model}, {args.n_layer} blocks ({n / 1e6:.1f}M parameters), 2 ranks, "
          f"{args.batch}x{args.seq_len} tokens per rank, buckets of {args.bucket} elements; per step, rank 0:")
    print("| overlap_comm | step (ms) | reductions (ms) | waited for them (ms) | hidden | all-gather (ms) | "
          "waited for it (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        hidden = 1.0 - r["reduce_wait_seconds"] / r["reduce_seconds"] if r["reduce_seconds"] > 0 else 0.0
        print(f"| {r['overlap']} | {r['step_ms']:.1f} | {1e3 * r['reduce_seconds']:.1f} | "
              f"{1e3 * r['reduce_wait_seconds']:.1f} | {100 * max(0.0, hidden):.0f}% | {1e3 * r['gather_seconds']:.1f} | "
              f"{1e3 * r['gather_wait_seconds']:.1f} |")
    print(json.dumps({"bench": "overlap", "args": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
