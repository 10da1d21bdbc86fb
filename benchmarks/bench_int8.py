"""Int8 linear layers versus torch.nn.Linear on CPU, measured side by side in one process: the int8 GEMM
choice (torch._int_mm vs zero8's oneDNN path vs float32/bf16 matmul); the per-block (Jetfire) product,
fused kernel against the per-slice library path it replaced, for the three products of a linear layer;
then forward and forward+backward of Linear8bitLt (inference) and Int8Linear (training, both GEMM modes)
against nn.Linear in float32 and bfloat16 at transformer shapes, and the weight / saved-activation
memory; then the host time per call of small Int8Linear layers through torch's dispatcher against the ops'
functions called directly. Variants are timed round-robin (each runs once per round, so all see the same machine load);
the minimum and the median over the rounds are reported. Prints tables and a final JSON line.

    python benchmarks/bench_int8.py            # 4096x4096 and 4096x16384, tokens 512, 2048, 4096
    python benchmarks/bench_int8.py --quick    # 4096x4096, tokens 512 only
    python benchmarks/bench_int8.py --gemm-only  # torch._int_mm vs zero8's oneDNN GEMM (interleaved)
    python benchmarks/bench_int8.py --dispatch-only  # small layers: through the dispatcher vs direct calls
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import zero8
from zero8 import _C, _tensors
from zero8.nn import Int8Linear, Linear8bitLt
from zero8.nn import int8_linear as il_mod
from zero8.nn import linear8bit as l8


def best_time(fn, reps: int) -> float:
    """Minimum wall time of `reps` calls after one warm-up: the least disturbed run on a shared machine."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def round_robin(fns: dict, reps: int) -> dict:
    """{name: (min, median) seconds}: one warm-up call each, then `reps` rounds calling every fn once."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: (min(ts), statistics.median(ts)) for name, ts in times.items()}


class per_slice_exact_mode:
    """Within this block Int8Linear(gemm="exact") runs the per-slice library path (one int8 GEMM per
    block-wide slice plus a float32 epilogue): the implementation before the fused kernel, for
    before/after timings. Same results bit for bit (tests/python/test_int8.py)."""

    def __enter__(self):
        self.saved = il_mod.blockwise_int8_matmul
        il_mod.blockwise_int8_matmul = il_mod._blockwise_int8_matmul_sliced

    def __exit__(self, *exc):
        il_mod.blockwise_int8_matmul = self.saved


def bench_gemm(shapes, reps):
    """The two int8 GEMMs called alternately (so both see the same machine load), then fp32/bf16."""
    rows = []
    for m, k, n in shapes:
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        c = torch.empty((m, n), dtype=torch.int32)
        af, wf = a.float(), w.float()
        ab, wb = af.bfloat16(), wf.bfloat16()
        run_torch = lambda: torch._int_mm(a, w.t())  # noqa: E731
        run_zero8 = lambda: _C.int8_gemm(a.data_ptr(), w.data_ptr(), c.data_ptr(), m, n, k, True)  # noqa: E731
        run_torch(), run_zero8()
        assert torch.equal(c, run_torch()), "the two int8 GEMMs disagree"
        tt, tz = [], []
        for _ in range(2 * reps):
            for fn, ts in ((run_torch, tt), (run_zero8, tz)):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
        t_torch, t_zero8 = min(tt), min(tz)
        t_f32 = best_time(lambda: af @ wf.t(), reps)
        t_bf16 = best_time(lambda: ab @ wb.t(), reps)
        rows.append(dict(m=m, k=k, n=n, torch_int_mm_ms=t_torch * 1e3, zero8_int8_gemm_ms=t_zero8 * 1e3,
                         torch_int_mm_median_ms=statistics.median(tt) * 1e3,
                         zero8_int8_gemm_median_ms=statistics.median(tz) * 1e3, fp32_ms=t_f32 * 1e3,
                         bf16_ms=t_bf16 * 1e3))
        print(f"{m:6d} {k:6d} {n:6d} | {t_torch*1e3:9.1f} {t_zero8*1e3:9.1f} {t_f32*1e3:9.1f} {t_bf16*1e3:9.1f} | "
              f"{t_zero8/t_torch:6.2f} {statistics.median(tz)/statistics.median(tt):6.2f} {t_f32/min(t_torch, t_zero8):6.2f}",
              flush=True)
    return rows


def bench_blockwise(m, k, n, block, reps, with_sliced):
    """The per-block product at tokens m, in features k, out features n, as the layer runs it: forward
    X W^T (m x k x n), input gradient dY W (m x n x k, W as a .t() view), weight gradient dY^T X (n x m x k,
    both .t() views). Fused kernel vs the per-slice library path (`with_sliced`: slow, ~2 s per product at
    512 x 4096 x 4096), one plain int8 GEMM and fp32 / bf16 matmul of the same size."""
    torch.manual_seed(0)
    x, w, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    qx, sx = l8.quantize_blocks(x, block)
    qw, sw = l8.quantize_blocks(w, block)
    qg, sg = l8.quantize_blocks(g, block, stochastic=True)
    products = {"fwd X W^T": (qx, sx, qw, sw, x, w.t()), "dX = dY W": (qg, sg, qw.t(), sw.t(), g, w),
                "dW = dY^T X": (qg.t(), sg.t(), qx.t(), sx.t(), g.t(), x)}
    rows = []
    for name, (qa, sa, qb, sb, fa, fb) in products.items():
        fa, fb = fa.contiguous(), fb.contiguous()
        ba, bb = fa.bfloat16(), fb.bfloat16()
        ia, ib = qa.contiguous(), qb.contiguous()
        fns = {"fused": lambda: il_mod.blockwise_int8_matmul(qa, sa, qb, sb, block),
               "int8_gemm": lambda: l8.int8_mm(ia, ib),
               "fp32": lambda: fa @ fb, "bf16": lambda: ba @ bb}
        t = round_robin(fns, reps)
        if with_sliced:
            t.update(round_robin({"sliced": lambda: il_mod._blockwise_int8_matmul_sliced(qa, sa, qb, sb, block)}, 1))
        mm, kk = qa.shape
        nn_ = qb.shape[0]
        row = dict(product=name, m=mm, k=kk, n=nn_, block=block, **{f"{v}_ms": t[v][0] * 1e3 for v in t},
                   **{f"{v}_median_ms": t[v][1] * 1e3 for v in t})
        rows.append(row)
        sl = t.get("sliced", (float("nan"),))[0]
        print(f"{name:12s} {mm:5d} x {kk:5d} x {nn_:5d} | {t['fused'][0]*1e3:8.1f} {sl*1e3:9.1f} {t['int8_gemm'][0]*1e3:8.1f} "
              f"{t['fp32'][0]*1e3:8.1f} {t['bf16'][0]*1e3:8.1f} | {sl/t['fused'][0]:7.1f} {t['fp32'][0]/t['fused'][0]:6.2f} "
              f"{t['bf16'][0]/t['fused'][0]:6.2f} {t['fused'][0]/t['int8_gemm'][0]:6.2f}", flush=True)
    return rows


def bench_layers(k, n, tokens, reps, with_sliced):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n)
    lin_bf = torch.nn.Linear(k, n).to(torch.bfloat16)
    l8bit = Linear8bitLt.from_linear(lin)
    il_fast = Int8Linear.from_linear(lin, gemm="fast")
    il_exact = Int8Linear.from_linear(lin, gemm="exact")
    x = torch.randn(tokens, k)
    xb = x.bfloat16()
    gy = torch.randn(tokens, n)
    gyb = gy.bfloat16()
    # LLM.int8 with 4 emergent-feature columns (|x| ~ 20-60) to pay the decomposition's price too.
    xo = x.clone()
    xo[:, [7, 100, 2000, 3000]] *= 40.0

    def fwd(mod, inp):
        with torch.no_grad():
            return mod(inp)

    def fwd_bwd(mod, inp, g):
        inp = inp.detach().requires_grad_()
        mod(inp).backward(g)

    fns = {"fp32_fwd": lambda: fwd(lin, x), "bf16_fwd": lambda: fwd(lin_bf, xb),
           "linear8bitlt_fwd": lambda: fwd(l8bit, x), "linear8bitlt_outliers_fwd": lambda: fwd(l8bit, xo),
           "int8linear_fast_fwd": lambda: fwd(il_fast, x), "int8linear_exact_fwd": lambda: fwd(il_exact, x),
           "fp32_fwdbwd": lambda: fwd_bwd(lin, x, gy), "bf16_fwdbwd": lambda: fwd_bwd(lin_bf, xb, gyb),
           "int8linear_fast_fwdbwd": lambda: fwd_bwd(il_fast, x, gy),
           "int8linear_exact_fwdbwd": lambda: fwd_bwd(il_exact, x, gy)}
    t = round_robin(fns, reps)
    if with_sliced:  # before the fused kernel: exact mode through per-slice library GEMMs (slow: 1 round)
        with per_slice_exact_mode():
            t.update(round_robin({"int8linear_exact_sliced_fwd": lambda: fwd(il_exact, x),
                                  "int8linear_exact_sliced_fwdbwd": lambda: fwd_bwd(il_exact, x, gy)}, 1))
    r = {key: v[0] for key, v in t.items()}
    mem = il_exact.activation_memory()
    out = dict(k=k, n=n, tokens=tokens, reps=reps, **{key + "_ms": v * 1e3 for key, v in r.items()},
               **{key + "_median_ms": v[1] * 1e3 for key, v in t.items()},
               fwd_speedup_int8linear_exact=r["fp32_fwd"] / r["int8linear_exact_fwd"],
               fwd_speedup_int8linear_fast=r["fp32_fwd"] / r["int8linear_fast_fwd"],
               fwd_speedup_linear8bitlt=r["fp32_fwd"] / r["linear8bitlt_fwd"],
               fwdbwd_speedup_int8linear_exact=r["fp32_fwdbwd"] / r["int8linear_exact_fwdbwd"],
               fwdbwd_speedup_int8linear_fast=r["fp32_fwdbwd"] / r["int8linear_fast_fwdbwd"],
               fwd_vs_bf16_int8linear_exact=r["bf16_fwd"] / r["int8linear_exact_fwd"],
               fwdbwd_vs_bf16_int8linear_exact=r["bf16_fwdbwd"] / r["int8linear_exact_fwdbwd"],
               weight_bytes_fp32=lin.weight.numel() * 4, weight_bytes_int8=l8bit.weight_bytes(),
               saved_activation_bytes=mem["saved_bytes"], fp32_activation_bytes=mem["unquantized_bytes"])
    ms = {key: v * 1e3 for key, v in r.items()}
    print(f"{k:5d}x{n:<6d} {tokens:5d} | {ms['fp32_fwd']:8.1f} {ms['bf16_fwd']:8.1f} {ms['linear8bitlt_fwd']:8.1f} "
          f"{ms['linear8bitlt_outliers_fwd']:8.1f} {ms['int8linear_fast_fwd']:8.1f} {ms['int8linear_exact_fwd']:8.1f} | "
          f"{ms['fp32_fwdbwd']:8.1f} {ms['bf16_fwdbwd']:8.1f} {ms['int8linear_fast_fwdbwd']:8.1f} "
          f"{ms['int8linear_exact_fwdbwd']:8.1f} | {out['fwd_speedup_int8linear_exact']:5.2f} "
          f"{out['fwdbwd_speedup_int8linear_exact']:5.2f} {out['fwd_vs_bf16_int8linear_exact']:5.2f} "
          f"{out['fwdbwd_vs_bf16_int8linear_exact']:5.2f} {out['fwd_speedup_int8linear_fast']:5.2f} "
          f"{out['fwdbwd_speedup_int8linear_fast']:5.2f}", flush=True)
    if with_sliced:
        print(f"{'':12s} {'':5s}   exact mode before the fused kernel (per-slice library GEMMs): forward "
              f"{ms['int8linear_exact_sliced_fwd']:.1f} ms, forward + backward {ms['int8linear_exact_sliced_fwdbwd']:.1f} ms "
              f"({ms['int8linear_exact_sliced_fwd'] / ms['int8linear_exact_fwd']:.1f}x and "
              f"{ms['int8linear_exact_sliced_fwdbwd'] / ms['int8linear_exact_fwdbwd']:.1f}x the fused times)", flush=True)
    return out


class through_the_ops:
    """Within this block zero8.nn calls every int8 op through torch's dispatcher (the path before
    ``zero8._ops.eager`` ran the ops' functions directly in plain eager calls), for before/after timings.
    The same bits (tests/python/test_compile.py)."""

    def __enter__(self):
        self.saved = _tensors.direct
        _tensors.direct = lambda args: False

    def __exit__(self, *exc):
        _tensors.direct = self.saved


DISPATCH_HEADER = (
    "\nsmall layers, host time per call (us, median round): Int8Linear exact through torch's dispatcher (ops) and\n"
    "calling the ops' functions directly (zero8._ops.eager, plain eager calls)\n"
    f"{'K x N':>12} {'tok':>5} | {'ops':>8} {'direct':>8} {'ratio':>6} | {'ops':>8} {'direct':>8} {'ratio':>6}\n"
    f"{'':>12} {'':>5} | {'forward':^24} | {'forward + backward':^24}")


def bench_dispatch(reps):
    """Int8Linear (exact, block 32) at small shapes, where the host's time per op counts: the ops' functions
    called directly against the same calls through the dispatcher, round-robin (each round `calls` calls of
    each). Microseconds per call."""
    out = []
    for k, n, tokens, calls in ((64, 64, 16, 200), (256, 256, 64, 100), (1024, 1024, 256, 10)):
        torch.manual_seed(0)
        mod = Int8Linear(k, n)
        x = torch.randn(tokens, k)
        g = torch.randn(tokens, n)

        def fwd():
            with torch.no_grad():
                mod(x)

        def fwd_bwd():
            mod(x.detach().requires_grad_()).backward(g)

        def ops(fn):
            def run():
                with through_the_ops():
                    fn()
            return run

        timed = {name: (lambda f=f: [f() for _ in range(calls)])
                 for name, f in {"fwd_direct": fwd, "fwd_ops": ops(fwd), "fwdbwd_direct": fwd_bwd,
                                 "fwdbwd_ops": ops(fwd_bwd)}.items()}
        t = {name: v[1] / calls * 1e6 for name, v in round_robin(timed, reps).items()}  # median round
        row = dict(k=k, n=n, tokens=tokens, calls=calls, **{key + "_us": v for key, v in t.items()},
                   fwd_speedup=t["fwd_ops"] / t["fwd_direct"], fwdbwd_speedup=t["fwdbwd_ops"] / t["fwdbwd_direct"])
        out.append(row)
        print(f"{k:5d}x{n:<6d} {tokens:5d} | {t['fwd_ops']:8.1f} {t['fwd_direct']:8.1f} {row['fwd_speedup']:6.2f} | "
              f"{t['fwdbwd_ops']:8.1f} {t['fwdbwd_direct']:8.1f} {row['fwdbwd_speedup']:6.2f}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4096x4096 at 512 tokens only")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (the minimum is reported)")
    p.add_argument("--gemm-only", action="store_true", help="only the int8 GEMM comparison")
    p.add_argument("--dispatch-only", action="store_true",
                   help="only the small layers' host time through the dispatcher against direct calls")
    p.add_argument("--no-sliced", action="store_true",
                   help="skip the per-slice exact-mode timings (the path before the fused kernel; ~2 s per product)")
    args = p.parse_args()

    load = os.getloadavg()[0]
    print(f"zero8 {zero8.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"zero8 ISA {_C.isa_active().name}, zero8 int8 GEMM {_C.int8_gemm_backend()}, per-block product "
          f"{_C.int8_block_matmul_backend()}, layers use "
          f"{l8.int8_gemm_backend()}, load average {load:.2f}")

    if args.dispatch_only:
        print(DISPATCH_HEADER)
        print(json.dumps({"bench": "int8_dispatch", "load_avg_start": load, "load_avg_end": os.getloadavg()[0],
                          "threads": torch.get_num_threads(), "dispatch": bench_dispatch(max(args.reps, 5))}))
        return
    gemm_shapes = [(512, 4096, 4096)] if args.quick else [(512, 4096, 4096), (2048, 4096, 4096), (512, 4096, 16384)]
    print("\nint8 GEMM (ms; int8 rows are int8 x int8 -> int32, fp32/bf16 are torch matmul)")
    print(f"{'M':>6} {'K':>6} {'N':>6} | {'_int_mm':>9} {'zero8':>9} {'fp32':>9} {'bf16':>9} | "
          f"{'z8/_int':>6} {'(med)':>6} {'fp32/i8':>6}")
    print(f"{'':>20} | {'minimum over interleaved calls':^39} |")
    gemm = bench_gemm(gemm_shapes, args.reps)
    if args.gemm_only:
        print(json.dumps({"bench": "int8_gemm", "load_avg_start": load, "load_avg_end": os.getloadavg()[0],
                          "threads": torch.get_num_threads(), "gemm": gemm}))
        return
    print(f"\nper-block int8 product, block 32 (ms; fused = zero8._C.int8_block_matmul ({_C.int8_block_matmul_backend()}), "
          f"sliced = one library int8 GEMM per 32-wide slice, the path before the fused kernel)")
    print(f"{'product':12s} {'M':>5s}   {'K':>5s}   {'N':>5s} | {'fused':>8s} {'sliced':>9s} {'int8mm':>8s} {'fp32':>8s} "
          f"{'bf16':>8s} | {'sl/fus':>7s} {'fp32/f':>6s} {'bf16/f':>6s} {'f/i8mm':>6s}")
    blockwise = bench_blockwise(512, 4096, 4096, 32, args.reps, not args.no_sliced)

    layer_shapes = [(4096, 4096)] if args.quick else [(4096, 4096), (4096, 16384)]
    tokens_list = [512] if args.quick else [512, 2048, 4096]
    print("\nlayers (ms, minimum over round-robin rounds; speedups are fp32 (or bf16) time / Int8Linear time)")
    print(f"{'K x N':>12} {'tok':>5} | {'fp32':>8} {'bf16':>8} {'8bitLt':>8} {'8bitLt+o':>8} {'I8 fast':>8} "
          f"{'I8 exact':>8} | {'fp32':>8} {'bf16':>8} {'I8 fast':>8} {'I8 exact':>8} | {'exact/fp32':^11} "
          f"{'exact/bf16':^11} {'fast/fp32':^11}")
    print(f"{'':>12} {'':>5} | {'forward':^53} | {'forward + backward':^35} | {'fwd':>5} {'f+b':>5} {'fwd':>5} "
          f"{'f+b':>5} {'fwd':>5} {'f+b':>5}")
    layers = [bench_layers(k, n, t, args.reps if t * n <= 2048 * 4096 else max(2, args.reps - 1),
                           with_sliced=(k, n, t) == (4096, 4096, 512) and not args.no_sliced)
              for k, n in layer_shapes for t in tokens_list]
    print(DISPATCH_HEADER)
    dispatch = bench_dispatch(max(args.reps, 5))
    l0 = layers[0]
    print(f"\nweights: fp32 {l0['weight_bytes_fp32']} B, Linear8bitLt int8 + scales {l0['weight_bytes_int8']} B "
          f"({l0['weight_bytes_fp32'] / l0['weight_bytes_int8']:.2f}x smaller); Int8Linear saved activation "
          f"{l0['saved_activation_bytes']} B vs fp32 {l0['fp32_activation_bytes']} B "
          f"({l0['fp32_activation_bytes'] / l0['saved_activation_bytes']:.2f}x smaller)")
    print(json.dumps({"bench": "int8", "load_avg_start": load, "load_avg_end": os.getloadavg()[0],
                      "threads": torch.get_num_threads(), "gemm": gemm, "blockwise": blockwise, "layers": layers,
                      "dispatch": dispatch}))


if __name__ == "__main__":
    main()
