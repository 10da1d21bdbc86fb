"""Int8 linear layers versus torch.nn.Linear on CPU, measured side by side in one process: the int8 GEMM
choice (torch._int_mm vs zero8's oneDNN path vs float32/bf16 matmul), then forward and forward+backward
of Linear8bitLt (inference) and Int8Linear (training) against nn.Linear in float32 and bfloat16 at
transformer shapes, and the weight / saved-activation memory. Prints tables and a final JSON line.

    python benchmarks/bench_int8.py            # 4096x4096 and 4096x16384, tokens 512, 2048, 4096
    python benchmarks/bench_int8.py --quick    # 4096x4096, tokens 512 only
    python benchmarks/bench_int8.py --gemm-only  # torch._int_mm vs zero8's oneDNN GEMM (interleaved)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import zero8
from zero8 import _C
from zero8.nn import Int8Linear, Linear8bitLt
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


def bench_exact(m, k, n, block, reps):
    """The exact per-block product (one int8 GEMM per block-wide K slice) against one vector-wise GEMM."""
    x, w = torch.randn(m, k), torch.randn(n, k)
    qx, sx = l8.quantize_blocks(x, block)
    qw, sw = l8.quantize_blocks(w, block)
    from zero8.nn.int8_linear import blockwise_int8_matmul

    t_exact = best_time(lambda: blockwise_int8_matmul(qx, sx, qw, sw, block), reps)
    t_fast = best_time(lambda: torch._int_mm(qx, qw.t()), reps)
    t_f32 = best_time(lambda: x @ w.t(), reps)
    print(f"exact per-block {m}x{k}x{n} (block {block}): {t_exact*1e3:.1f} ms; one int8 GEMM {t_fast*1e3:.1f} ms; "
          f"fp32 {t_f32*1e3:.1f} ms", flush=True)
    return dict(m=m, k=k, n=n, block=block, exact_ms=t_exact * 1e3, int8_gemm_ms=t_fast * 1e3, fp32_ms=t_f32 * 1e3)


def bench_layers(k, n, tokens, reps):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n)
    lin_bf = torch.nn.Linear(k, n).to(torch.bfloat16)
    l8bit = Linear8bitLt.from_linear(lin)
    il = Int8Linear.from_linear(lin)
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

    r = {}
    r["fp32_fwd"] = best_time(lambda: fwd(lin, x), reps)
    r["bf16_fwd"] = best_time(lambda: fwd(lin_bf, xb), reps)
    r["linear8bitlt_fwd"] = best_time(lambda: fwd(l8bit, x), reps)
    r["linear8bitlt_outliers_fwd"] = best_time(lambda: fwd(l8bit, xo), reps)
    r["int8linear_fwd"] = best_time(lambda: fwd(il, x), reps)
    r["fp32_fwdbwd"] = best_time(lambda: fwd_bwd(lin, x, gy), reps)
    r["bf16_fwdbwd"] = best_time(lambda: fwd_bwd(lin_bf, xb, gyb), reps)
    r["int8linear_fwdbwd"] = best_time(lambda: fwd_bwd(il, x, gy), reps)
    mem = il.activation_memory()
    out = dict(k=k, n=n, tokens=tokens, **{key + "_ms": v * 1e3 for key, v in r.items()},
               fwd_speedup_int8linear=r["fp32_fwd"] / r["int8linear_fwd"],
               fwd_speedup_linear8bitlt=r["fp32_fwd"] / r["linear8bitlt_fwd"],
               fwdbwd_speedup_int8linear=r["fp32_fwdbwd"] / r["int8linear_fwdbwd"],
               fwd_vs_bf16_int8linear=r["bf16_fwd"] / r["int8linear_fwd"],
               fwdbwd_vs_bf16_int8linear=r["bf16_fwdbwd"] / r["int8linear_fwdbwd"],
               weight_bytes_fp32=lin.weight.numel() * 4, weight_bytes_int8=l8bit.weight_bytes(),
               saved_activation_bytes=mem["saved_bytes"], fp32_activation_bytes=mem["unquantized_bytes"])
    print(f"{k:5d}x{n:<6d} {tokens:5d} | {r['fp32_fwd']*1e3:8.1f} {r['bf16_fwd']*1e3:8.1f} "
          f"{r['linear8bitlt_fwd']*1e3:8.1f} {r['linear8bitlt_outliers_fwd']*1e3:8.1f} {r['int8linear_fwd']*1e3:8.1f} | "
          f"{r['fp32_fwdbwd']*1e3:8.1f} {r['bf16_fwdbwd']*1e3:8.1f} {r['int8linear_fwdbwd']*1e3:8.1f} | "
          f"{out['fwd_speedup_linear8bitlt']:5.2f} {out['fwd_speedup_int8linear']:5.2f} "
          f"{out['fwdbwd_speedup_int8linear']:5.2f}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4096x4096 at 512 tokens only")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (the minimum is reported)")
    p.add_argument("--gemm-only", action="store_true", help="only the int8 GEMM comparison")
    args = p.parse_args()

    load = os.getloadavg()[0]
    print(f"zero8 {zero8.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"zero8 ISA {_C.isa_active().name}, zero8 int8 GEMM {_C.int8_gemm_backend()}, layers use "
          f"{l8.int8_gemm_backend()}, load average {load:.2f}")

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
    exact = bench_exact(512, 4096, 4096, 32, 1)

    layer_shapes = [(4096, 4096)] if args.quick else [(4096, 4096), (4096, 16384)]
    tokens_list = [512] if args.quick else [512, 2048, 4096]
    print("\nlayers (ms; speedups are fp32 time / int8 time)")
    print(f"{'K x N':>12} {'tok':>5} | {'fp32':>8} {'bf16':>8} {'8bitLt':>8} {'8bitLt+o':>8} {'Int8Lin':>8} | "
          f"{'fp32':>8} {'bf16':>8} {'Int8Lin':>8} | {'Lt':>5} {'I8fwd':>5} {'I8f+b':>5}")
    print(f"{'':>12} {'':>5} | {'forward':^44} | {'forward + backward':^26} |")
    layers = [bench_layers(k, n, t, args.reps if t * n <= 2048 * 4096 else max(1, args.reps - 1))
              for k, n in layer_shapes for t in tokens_list]
    l0 = layers[0]
    print(f"\nweights: fp32 {l0['weight_bytes_fp32']} B, Linear8bitLt int8 + scales {l0['weight_bytes_int8']} B "
          f"({l0['weight_bytes_fp32'] / l0['weight_bytes_int8']:.2f}x smaller); Int8Linear saved activation "
          f"{l0['saved_activation_bytes']} B vs fp32 {l0['fp32_activation_bytes']} B "
          f"({l0['fp32_activation_bytes'] / l0['saved_activation_bytes']:.2f}x smaller)")
    print(json.dumps({"bench": "int8", "load_avg_start": load, "load_avg_end": os.getloadavg()[0],
                      "threads": torch.get_num_threads(), "gemm": gemm, "exact_blockwise": exact, "layers": layers}))


if __name__ == "__main__":
    main()
