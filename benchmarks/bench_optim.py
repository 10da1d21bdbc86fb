"""Optimizer step time on CPU: zero8.optim.AdamW8bit / AdamW32bit versus torch.optim.AdamW (foreach and
fused), DeepSpeed's DeepSpeedCPUAdam (adamw_mode=True) and bitsandbytes' AdamW8bit, on the same float32
parameters (a list of 4096-row matrices adding up to the total) with the same gradients, in one process.
Each optimizer has its own copy of the parameters and takes 2 warm-up steps so its states exist. Then,
when every optimizer's copy fits in memory together, the timed steps are interleaved: R rounds in which
each optimizer takes one step, so a change in the machine's load or memory bandwidth (large on a shared
VM) hits all of them alike; otherwise (2e8 on a 24 GiB machine) each runs its R steps alone and is freed
before the next. The median of each optimizer's timed steps is reported.
Prints a table per size and, as the last line, one JSON object.

    python benchmarks/bench_optim.py                      # sizes 1e7 3e7 1e8 2e8, 2 threads
    python benchmarks/bench_optim.py --quick              # 1e7 only
    python benchmarks/bench_optim.py --sizes 1e5 --repeat 1 --threads 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

ROWS = 4096  # rows of every parameter matrix: transformer-like 4096 x k blocks
MAX_COLS = 4096  # the largest matrix is 4096 x 4096 (16.8M parameters)
ALL_OPTIMIZERS = ["zero8_adamw8bit", "zero8_adamw32bit", "torch_adamw_foreach", "torch_adamw_fused",
                  "deepspeed_cpu_adam", "bnb_adamw8bit"]
REFERENCE = "zero8_adamw8bit"
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=float, default=None,
                    help="total parameter counts (default 1e7 3e7 1e8 2e8; 1e7 with --quick)")
    ap.add_argument("--quick", action="store_true", help="size 1e7 only (unless --sizes is given)")
    ap.add_argument("--threads", type=int, default=2, help="torch and OpenMP threads for every optimizer")
    ap.add_argument("--repeat", type=int, default=5, help="timed steps per optimizer (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first, so the states exist")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="stop timing an optimizer after this many seconds of timed steps (at least one "
                         "timed step is always run): bitsandbytes' CPU path takes ~40 s a step at 2e8")
    ap.add_argument("--sequential", action="store_true",
                    help="time each optimizer alone even when all fit in memory together")
    ap.add_argument("--only", nargs="+", choices=ALL_OPTIMIZERS, default=None, help="a subset of optimizers")
    ap.add_argument("--tensor_numel", type=float, default=None,
                    help="parameters of this many elements each (1-D; the last one takes the rest) instead of "
                         "4096-row matrices: with small ones, the cost of each tensor's step beside the "
                         "arithmetic (Python, launches) shows")
    args = ap.parse_args(argv)
    if args.sizes is None:
        args.sizes = [1e7] if args.quick else [1e7, 3e7, 1e8, 2e8]
    args.sizes = [int(s) for s in args.sizes]
    if args.tensor_numel is not None:
        args.tensor_numel = int(args.tensor_numel)
    if (args.threads < 1 or args.repeat < 1 or args.warmup < 1 or any(s < 1 for s in args.sizes)
            or (args.tensor_numel is not None and args.tensor_numel < 1)):
        ap.error("--threads, --repeat, --warmup, --sizes and --tensor_numel must be >= 1 (a warm-up step creates "
                 "the states)")
    return args


def shapes_for(total: int, tensor_numel: int | None = None):
    """4096 x 4096 matrices, then one 4096 x k matrix and a 1-D tail, adding up to exactly `total`; with
    tensor_numel, 1-D tensors of that many elements and a tail."""
    if tensor_numel is not None:
        return [(tensor_numel,)] * (total // tensor_numel) + ([(total % tensor_numel,)] if total % tensor_numel else [])
    shapes = []
    left = total
    while left >= ROWS * MAX_COLS:
        shapes.append((ROWS, MAX_COLS))
        left -= ROWS * MAX_COLS
    if left >= ROWS:
        shapes.append((ROWS, left // ROWS))
        left -= ROWS * (left // ROWS)
    if left > 0:
        shapes.append((left,))
    return shapes


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "unavailable"


def state_bytes(opt, torch) -> int:
    """Bytes of every tensor in the optimizer's state, each storage counted once (bitsandbytes may share
    its quantization maps between parameters; scalar step tensors count too, a few bytes each)."""
    seen = set()
    total = 0

    def add(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                add(v)
    return total


def make_factories(torch, names):
    """Name -> (constructor(params) or None, reason it is unavailable), for the selected names only (importing
    deepspeed takes seconds). Imports happen here, once."""
    out = {}
    if {"zero8_adamw8bit", "zero8_adamw32bit"} & set(names):
        try:
            import zero8.optim as zo
            out["zero8_adamw8bit"] = (lambda ps: zo.AdamW8bit(ps, **HYPER), None)
            out["zero8_adamw32bit"] = (lambda ps: zo.AdamW32bit(ps, **HYPER), None)
        except Exception as e:  # noqa: BLE001 - any import failure is reported, not fatal
            for n in ("zero8_adamw8bit", "zero8_adamw32bit"):
                out[n] = (None, f"import zero8.optim failed: {type(e).__name__}: {e}")
    out["torch_adamw_foreach"] = (lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER), None)
    out["torch_adamw_fused"] = (lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER), None)
    if "deepspeed_cpu_adam" in names:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            out["deepspeed_cpu_adam"] = (lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **HYPER), None)
        except Exception as e:  # noqa: BLE001
            out["deepspeed_cpu_adam"] = (None, f"import deepspeed.ops.adam failed: {type(e).__name__}: {e}")
    if "bnb_adamw8bit" in names:
        try:
            import bitsandbytes as bnb
            out["bnb_adamw8bit"] = (lambda ps: bnb.optim.AdamW8bit(ps, **HYPER), None)
        except Exception as e:  # noqa: BLE001
            out["bnb_adamw8bit"] = (None, f"import bitsandbytes failed: {type(e).__name__}: {e}")
    return out


def mem_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def bytes_per_param(name: str) -> int:
    """Bytes per parameter one optimizer holds: its parameter copy (4) plus its states (two 8-bit codes
    and scales: ~2; two float32 moments: 8)."""
    return 4 + (2 if name.endswith("8bit") else 8)


def setup_one(torch, make, base, grads, args):
    """Own copy of the parameters with the shared gradients, and the optimizer after its warm-up."""
    params = [torch.nn.Parameter(b.clone()) for b in base]
    for p, g in zip(params, grads):
        p.grad = g  # the same gradient tensors for every optimizer, never modified
    opt = make(params)
    for _ in range(args.warmup):
        opt.step()
    return opt, params


def timed_step(opt) -> float:
    t = time.perf_counter()
    opt.step()
    return time.perf_counter() - t


def run_interleaved(torch, makes, base, grads, args):
    """name -> (median s, steps, state bytes, finite) for optimizers that are all alive at once, timed in
    rounds (one step each per round); an optimizer over its budget sits out the remaining rounds. With
    one optimizer: that optimizer timed alone."""
    live = {name: setup_one(torch, make, base, grads, args) for name, make in makes.items()}
    times = {name: [] for name in live}
    for _ in range(args.repeat):
        for name, (opt, _) in live.items():
            if not times[name] or sum(times[name]) < args.budget:
                times[name].append(timed_step(opt))
    out = {}
    for name, (opt, params) in live.items():
        finite = all(bool(torch.isfinite(p).all()) for p in params)
        out[name] = (statistics.median(times[name]), len(times[name]), state_bytes(opt, torch), finite)
    del live
    gc.collect()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    # Same thread count for torch's intra-op pool and every OpenMP runtime (zero8's kernels, DeepSpeed's
    # op); set before torch or any extension is loaded so the runtimes read it at start-up.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("DS_BUILD_OPS", "0")  # DeepSpeed JIT-builds its CPU Adam op on first use
    import torch

    torch.set_num_threads(args.threads)
    load_before = loadavg()
    names = args.only or ALL_OPTIMIZERS
    factories = make_factories(torch, names)
    failed = {}  # name -> error of its first failure; not retried at larger sizes (e.g. a failed JIT build)
    results = []
    print(f"optimizer step on CPU, float32 params, threads {args.threads}, warm-up {args.warmup}, "
          f"median of {args.repeat} steps (budget {args.budget:.0f} s); load average {load_before}", flush=True)
    for total in args.sizes:
        shapes = shapes_for(total, args.tensor_numel)
        gen = torch.Generator().manual_seed(0)
        base = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
        grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
        rows = []
        usable = {n: factories[n][0] for n in names if factories[n][0] is not None and n not in failed}
        # Together: every optimizer's bytes plus the shared initial values and gradients (8 B/param),
        # within 80% of the memory available now.
        need = total * (8 + sum(bytes_per_param(n) for n in usable))
        interleave = need < 0.8 * mem_available() and not args.sequential
        timed = {}
        if interleave:
            try:
                timed = run_interleaved(torch, usable, base, grads, args)
            except Exception as e:  # noqa: BLE001 - fall back to one at a time, which names the failing one
                print(f"  [{total:.0e}] interleaved run failed ({type(e).__name__}: {e}); timing one at a time",
                      flush=True)
                interleave = False
                gc.collect()
        for name in names:
            make, reason = factories[name]
            entry = dict(optimizer=name, size=total, tensors=len(shapes))
            if make is None:
                entry.update(status="skipped", reason=reason)
            elif name in failed:
                entry.update(status="failed", error=failed[name])
            else:
                try:
                    t, steps, sb, finite = timed[name] if name in timed else (
                        run_interleaved(torch, {name: make}, base, grads, args)[name])
                    entry.update(status="ok", ms_per_step=t * 1e3, ns_per_param=t * 1e9 / total, steps_timed=steps,
                                 state_bytes=sb, state_bytes_per_param=sb / total, finite=finite)
                except Exception as e:  # noqa: BLE001 - record the exact error and go on with the others
                    msg = f"{type(e).__name__}: {e}".strip()
                    failed[name] = msg
                    entry.update(status="failed", error=msg)
                    traceback.print_exc(file=sys.stderr)
                gc.collect()
            rows.append(entry)
            results.append(entry)
            print(f"  [{total:.0e}] {name}: {entry.get('status')} "
                  f"{'%.1f ms' % entry['ms_per_step'] if 'ms_per_step' in entry else ''}", flush=True)
        ref = next((r for r in rows if r["optimizer"] == REFERENCE and r["status"] == "ok"), None)
        for r in rows:
            if r["status"] == "ok" and ref is not None:
                r["ratio_to_zero8_adamw8bit"] = r["ms_per_step"] / ref["ms_per_step"]
        del base, grads
        gc.collect()
        for r in rows:
            r["interleaved"] = bool(interleave)
        print(f"\nsize {total:.0e} ({len(shapes)} tensors, largest {shapes[0]}; "
              f"{'timed in interleaved rounds' if interleave else 'each optimizer timed alone'})")
        print(f"| {'optimizer':<22} | {'ms/step':>9} | {'ns/param':>8} | {'x zero8 8-bit':>13} | "
              f"{'state B/param':>13} | steps |")
        print(f"|{'-' * 24}|{'-' * 11}|{'-' * 10}|{'-' * 15}|{'-' * 15}|-------|")
        for r in rows:
            if r["status"] != "ok":
                why = r.get("reason") or r.get("error")
                print(f"| {r['optimizer']:<22} | {r['status']}: {why[:90]}")
                continue
            ratio = r.get("ratio_to_zero8_adamw8bit")
            print(f"| {r['optimizer']:<22} | {r['ms_per_step']:9.1f} | {r['ns_per_param']:8.2f} | "
                  f"{'%13.2f' % ratio if ratio is not None else '%13s' % '-'} | "
                  f"{r['state_bytes_per_param']:13.4f} | {r['steps_timed']:5d} |")
        print(flush=True)
    load_after = loadavg()
    print(f"load average after: {load_after}")
    print(json.dumps(dict(bench="optim_step", threads=args.threads, warmup=args.warmup, repeat=args.repeat,
                          budget_s=args.budget, sizes=args.sizes, tensor_numel=args.tensor_numel,
                          torch=torch.__version__,
                          load_before=load_before, load_after=load_after, results=results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
