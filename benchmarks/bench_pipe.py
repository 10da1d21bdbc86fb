"""Pipeline parallelism on the pretraining example's GPT: throughput against the number of micro-batches
per step (the pipeline bubble), and the bytes crossing each stage boundary with fp32 and with int8
activations (zero8.int8_activations). Run under mpirun with one rank per stage and one thread each:

    mpirun -np 2 python benchmarks/bench_pipe.py            # 2 stages
    mpirun -np 4 python benchmarks/bench_pipe.py            # 4 stages

Every rank also trains the whole model alone (the plain engine, one thread, the same micro-batch): that
time per micro-batch, t1, is the no-pipeline reference; all ranks do it at once, so they load the machine
as the pipeline does. The pipeline trains with M = 1, 2, 4, 8, 16 micro-batches per step. The settings take
turns over several rounds and each reports its fastest step (other load on the machine only adds time). A perfect
pipeline of S stages runs S micro-batches' work at once once it is full, and idles (S - 1) micro-batch
times per step filling and draining, so its speed-up over t1 is S * M / (M + S - 1). Prints a table and a
final JSON line (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--steps", type=int, default=4, help="timed steps per setting and round (after a warm-up step)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all the settings")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = world_comm("auto")
    stages, rank = world.size, world.rank
    layers = gpt_layers(args.d_model, args.n_layer, args.n_head, args.seq_len, False)
    tokens = args.micro * args.seq_len

    # The whole model on every rank alone (forward, backward, a step every 4), and the pipelines; the
    # settings take turns for --rounds rounds and each keeps its fastest step: another job's load on the
    # machine only adds time.
    solo = world.split(rank, 0, "solo")
    plain = Zero8Engine(LayerModule(layers, seed_layers=True), load_config(config(args.micro, 4, 1, False), 1,
                                                                          warn=False), solo, world)
    sizes = [int(v) for v in args.micro_batches.split(",")]
    settings = [(m, False) for m in sizes] + [(max(sizes), True)]
    engines = {}
    for m, int8 in settings:
        model = PipelineModule(layers, num_stages=stages, loss_fn=lm_loss, seed_layers=True, device="cpu")
        engines[m, int8], _, _, _ = zero8.initialize(model=model, config=config(args.micro, m, 1, int8))
    best = {key: float("inf") for key in ["solo", *settings]}
    for _ in range(args.rounds):
        for x, y in data(args.micro, args.seq_len, 4):  # warm-up, then timed steps of 4 micro-batches
            plain.backward(lm_loss(plain(x), y))
            plain.step()
        for s in range(args.steps):
            world.barrier()
            t0 = time.perf_counter()
            for x, y in data(args.micro, args.seq_len, 4, seed=s):
                plain.backward(lm_loss(plain(x), y))
                plain.step()
            best["solo"] = min(best["solo"], (time.perf_counter() - t0) / 4)
        for key in settings:
            engine = engines[key]
            for s in range(args.steps + 1):
                world.barrier()
                t0 = time.perf_counter()
                engine.train_batch(data(args.micro, args.seq_len, key[0], seed=s))
                if s:
                    best[key] = min(best[key], time.perf_counter() - t0)
    t1 = best["solo"]
    rows = []
    for (m, int8) in settings:
        engine = engines[m, int8]
        bounds = engine.boundary_stats()
        per_step = best[m, int8]
        rows.append({
            "stages": stages, "micro_batches": m, "int8_activations": int8, "step_s": per_step,
            "tokens_per_s": m * tokens / per_step, "speedup": m * t1 / per_step,
            "ideal_speedup": stages * m / (m + stages - 1),
            "boundary_bytes_per_step": [b["bytes"] / (args.rounds * (args.steps + 1)) for b in bounds],
            "boundary_ratio_to_fp32": [b["bytes"] / b["fp32_bytes"] for b in bounds],
        })
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
