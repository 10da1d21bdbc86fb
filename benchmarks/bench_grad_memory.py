"""Gradient memory of the ZeRO stage-2 engine with its reduced buckets kept in a pool for the next ones
and freed (the config's zero8.release_gradients), measured side by side in one process: the most the
gradient buckets held at once (memory_stats()["grads_peak"]) and what they hold after backward, and the
time of a training iteration (forward, backward, step). Two engines over copies of the same MLP,
iterations interleaved so both see the same machine load. Prints a table and a final JSON line.

    python benchmarks/bench_grad_memory.py                        # 1 rank, 8 x 2048x2048, 256 tokens
    mpirun -np 2 python benchmarks/bench_grad_memory.py --layers 16
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch

import zero8


def build(model: torch.nn.Module, release: bool, bucket: int):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": bucket},
        "zero8": {"int8_gradients": True, "release_gradients": release},
    }
    engine, _, _, _ = zero8.initialize(model=model, config=cfg)
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--bucket", type=int, default=1 << 22, help="reduce_bucket_size (elements)")
    ap.add_argument("--tokens", type=int, default=256, help="rows of the input batch")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    base = torch.nn.Sequential(*layers)
    engines = {name: build(copy.deepcopy(base), name == "release", args.bucket)
               for name in ("keep", "release")}
    x = torch.randn(args.tokens, args.width)
    times = {name: [] for name in engines}
    after = {}
    for it in range(args.iters + 2):
        for name, engine in engines.items():
            t = time.perf_counter()
            loss = engine(x).square().mean()
            engine.backward(loss)
            after[name] = engine.memory_stats()["grads"]
            engine.step()
            if it > 1:  # the first iterations map the memory (and the kernel assembles huge pages)
                times[name].append(time.perf_counter() - t)
    params = sum(p.numel() for p in base.parameters())
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if rank != 0:
        return
    full = params * 4
    print(f"bench_grad_memory | {params / 1e6:.1f}M parameters, fp32 gradients {full / 2**20:.0f} MiB, "
          f"bucket {args.bucket} elements, {args.tokens} tokens, median of {args.iters} iterations (rank 0)")
    print(f"{'mode':<10}{'peak grads MiB':>16}{'after backward MiB':>20}{'iteration ms':>14}")
    out = {"bench": "grad_memory", "params": params, "bucket": args.bucket}
    for name, engine in engines.items():
        ms = statistics.median(times[name]) * 1e3
        peak = [engine.memory_stats()["grads_peak"]]  # the most the gradient buckets held at once
        print(f"{name:<10}{peak[0] / 2**20:>16.1f}{after[name] / 2**20:>20.1f}{ms:>14.1f}")
        out[name] = {"peak_grad_bytes": peak[0], "grad_bytes_after_backward": after[name], "iteration_ms": ms}
    out["peak_ratio"] = out["release"]["peak_grad_bytes"] / max(out["keep"]["peak_grad_bytes"], 1)
    out["time_ratio"] = out["release"]["iteration_ms"] / out["keep"]["iteration_ms"]
    print(f"release / keep: peak gradient memory {out['peak_ratio']:.2f}x, iteration time {out['time_ratio']:.3f}x")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
