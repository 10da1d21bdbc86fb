"""zero8.optim.AdamW8bit on FSDP2 (fully_shard) against torch.optim.AdamW on the same sharded model: the
optimizer state each rank holds, and the time of optimizer.step(), measured side by side in one job (each round
steps every optimizer once, on its own copy of the model with the same gradients; medians of the rounds).

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_fsdp2.py            # CPU, gloo
    torchrun --standalone --nproc_per_node 1 benchmarks/bench_fsdp2.py --device cuda

The model is a stack of MLP blocks (dim x 4 dim and back), every weight sharded by rows over the ranks. Rank
0 prints a table and, last, one JSON line (also written to --json-out).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zero8.optim as zo


def state_bytes(opt) -> int:
    """Bytes of this rank's optimizer state (DTensors: their local shards; the shared code maps not counted)."""
    total = 0
    for st in opt.state.values():
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and not key.startswith("qmap"):
                v = v.to_local() if hasattr(v, "to_local") else v
                total += v.numel() * v.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(args.device, (world,))
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.dim, 4 * args.dim), torch.nn.GELU(), torch.nn.Linear(4 * args.dim, args.dim)]
    base = torch.nn.Sequential(*layers).to(args.device)
    numel = sum(p.numel() for p in base.parameters())

    def sharded():
        m = copy.deepcopy(base)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    variants = {"zero8 AdamW8bit": lambda ps: zo.AdamW8bit(ps, lr=1e-4, weight_decay=0.01),
                "torch AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True),
                "torch AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)}
    runs = {}
    for name, make in variants.items():
        m = sharded()
        runs[name] = (m, make(m.parameters()))
    x = torch.randn(64, args.dim, device=args.device)
    for m, _ in runs.values():  # gradients once; every round steps with them
        m(x).pow(2).mean().backward()
    times = {name: [] for name in runs}

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(args.rounds + 2):  # 2 warm-up rounds (the states are made in the first)
            for name, (_, opt) in runs.items():
                sync()
                t0 = time.perf_counter()
                opt.step()
                sync()
                if r >= 2:
                    times[name].append(time.perf_counter() - t0)
    out = {"device": args.device, "world": world, "params": numel, "rounds": args.rounds, "rows": []}
    ref = statistics.median(times["torch AdamW (fused)"])
    for name, (_, opt) in runs.items():
        med = statistics.median(times[name])
        out["rows"].append({"optimizer": name, "state_bytes_per_rank": state_bytes(opt), "step_ms": med * 1e3,
                            "speed_vs_torch_fused": ref / med})
    if rank == 0:
        print(f"FSDP2 over {world} rank(s), {args.device}, {numel / 1e6:.1f} M parameters, "
              f"median of {args.rounds} steps")
        print("| optimizer | state bytes / parameter (per rank, x ranks) | step ms | speed / torch fused |")
        print("|---|---|---|---|")
        for row in out["rows"]:
            print(f"| {row['optimizer']} | {row['state_bytes_per_rank'] * world / numel:.3f} | {row['step_ms']:.2f} "
                  f"| {row['speed_vs_torch_fused']:.2f} |")
        print(json.dumps(out))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
