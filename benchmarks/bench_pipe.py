"""Pipeline parallelism on the pretraining example's GPT: throughput against the number of micro-batches
per step (the pipeline bubble), and the bytes crossing each stage boundary with fp32 and with int8
activations (zero8.int8_activations). Run under mpirun with one rank per stage and one thread each:

    mpirun -np 2 python benchmarks/bench_pipe.py            # 2 stages
    mpirun -np 4 python benchmarks/bench_pipe.py            # 4 stages

Every rank first trains the whole model alone (the plain engine, one thread, the same micro-batch): that
time per micro-batch, t1, is the no-pipeline reference; all ranks do it at once, so they load the machine
as the pipeline does. Then the pipeline trains with M = 1, 2, 4, 8, 16 micro-batches per step. A perfect
pipeline of S stages runs S micro-batches' work at once once it is full, and idles (S - 1) micro-batch
times per step filling and draining, so its speed-up over t1 is S * M / (M + S - 1). Prints a table and a
final JSON line (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import zero8  # noqa: E402
from zero8.config import load_config  # noqa: E402
from zero8.engine import world_comm  # noqa: E402
from zero8.engine.training import Zero8Engine  # noqa: E402
from zero8.pipe import LayerModule, PipelineModule  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from pretrain_gpt import VOCAB, gpt_layers, lm_loss  # noqa: E402


def config(micro: int, gas: int, dp: int, int8: bool) -> dict:
    return {"train_batch_size": micro * gas * dp, "gradient_accumulation_steps": gas, "steps_per_print": 1 << 62,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
            "zero_optimization": {"stage": 1}, "zero8": {"int8_gradients": True, "int8_activations": int8}}


def data(micro: int, seq: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        t = torch.randint(0, VOCAB, (micro, seq + 1), generator=g)
        yield t[:, :-1], t[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d_model", type=int, default=128)
    ap.add_argument("--n_layer", type=int, default=8)
    ap.add_argument("--n_head", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--micro_batches", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per setting (after one warm-up step)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = world_comm("auto")
    stages, rank = world.size, world.rank
    layers = gpt_layers(args.d_model, args.n_layer, args.n_head, args.seq_len, False)
    tokens = args.micro * args.seq_len

    # The whole model on every rank alone: seconds per micro-batch (forward, backward, step every 4).
    solo = world.split(rank, 0, "solo")
    plain = Zero8Engine(LayerModule(layers, seed_layers=True), load_config(config(args.micro, 4, 1, False), 1,
                                                                          warn=False), solo, world)
    batches = list(data(args.micro, args.seq_len, 4 * (args.steps + 1)))
    times = []
    for s in range(args.steps + 1):
        world.barrier()
        t0 = time.perf_counter()
        for x, y in batches[4 * s:4 * s + 4]:
            plain.backward(lm_loss(plain(x), y))
            plain.step()
        times.append((time.perf_counter() - t0) / 4)
    t1 = statistics.median(times[1:])
    plain.destroy()

    rows = []
    for m in [int(v) for v in args.micro_batches.split(",")]:
        for int8 in (False, True) if m == max(int(v) for v in args.micro_batches.split(",")) else (False,):
            model = PipelineModule(layers, num_stages=stages, loss_fn=lm_loss, seed_layers=True)
            engine, _, _, _ = zero8.initialize(model=model, config=config(args.micro, m, 1, int8))
            step_s = []
            for s in range(args.steps + 1):
                world.barrier()
                t0 = time.perf_counter()
                engine.train_batch(data(args.micro, args.seq_len, m, seed=s))
                step_s.append(time.perf_counter() - t0)
            per_step = statistics.median(step_s[1:])
            bounds = engine.boundary_stats()
            steps_run = args.steps + 1
            rows.append({
                "stages": stages, "micro_batches": m, "int8_activations": int8, "step_s": per_step,
                "tokens_per_s": m * tokens / per_step, "speedup": m * t1 / per_step,
                "ideal_speedup": stages * m / (m + stages - 1),
                "boundary_bytes_per_step": [b["bytes"] / steps_run for b in bounds],
                "boundary_ratio_to_fp32": [b["bytes"] / b["fp32_bytes"] for b in bounds],
            })
            engine.destroy()
    if rank != 0:
        return
    print(f"GPT d_model={args.d_model} n_layer={args.n_layer} seq_len={args.seq_len}, micro-batch {args.micro} "
          f"sequences ({tokens} tokens), {stages} stages x 1 data-parallel rank, 1 thread each; "
          f"whole model alone: {1e3 * t1:.1f} ms per micro-batch ({tokens / t1:,.0f} tokens/s)")
    print(f"{'M':>3} {'activations':>11} {'step ms':>8} {'tokens/s':>9} {'speed-up':>8} {'ideal':>6} "
          f"{'bytes/step per boundary':>24} {'x fp32':>7}")
    for r in rows:
        print(f"{r['micro_batches']:>3} {'int8' if r['int8_activations'] else 'fp32':>11} {1e3 * r['step_s']:>8.1f} "
              f"{r['tokens_per_s']:>9,.0f} {r['speedup']:>8.2f} {r['ideal_speedup']:>6.2f} "
              f"{', '.join(f'{b:,.0f}' for b in r['boundary_bytes_per_step']):>24} "
              f"{', '.join(f'{q:.4f}' for q in r['boundary_ratio_to_fp32']):>7}")
    print(json.dumps({"bench": "pipe", "solo_ms_per_micro_batch": 1e3 * t1, "rows": rows}))


if __name__ == "__main__":
    main()
