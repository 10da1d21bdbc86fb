"""zero8's Python surface on a CUDA GPU against PyTorch, measured side by side in one process (ratios of
times taken in the same rounds): zero8.optim.AdamW8bit against torch.optim.AdamW(fused=True) at 1e8 and 1e9
parameters; zero8.nn.Int8Linear (both GEMM modes, the exact one at blocks 32 and 128) forward and
forward+backward, the three per-block int8 products of a layer alone, and Linear8bitLt forward,
against a bfloat16 nn.Linear at transformer shapes; and one training step of zero8's engine (one rank, bf16
model, fp32 master, 8-bit AdamW states) against PyTorch's mixed precision (fp32 model under bf16 autocast,
AdamW(fused=True)) on a stack of transformer MLP blocks, with the memory each holds; and the time of an int8
exchange's codec work (zero8.ddp/fsdp) with every rank's piece in one call against one call per piece
(bench_fsdp2.py --codec-calls, host clock). Times come from CUDA events after warm-ups (median of the rounds).
A zero8 call that raises (not supported on CUDA yet) makes its rows "not available: <error>"; the others are
still measured. Prints a table and, last, one JSON line (also written to --json-out).

    python benchmarks/bench_gpu.py                      # everything, about 2 minutes on an H200
    python benchmarks/bench_gpu.py --only optim --optim-numel 1e8
    python benchmarks/bench_gpu.py --only linear --shapes 4096x16384 --tokens 8192
    python benchmarks/bench_gpu.py --only engine --engine-model 2048x8 --engine-tokens 8192
    python benchmarks/bench_gpu.py --only wire
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# Targets of the GPU issue: the 8-bit optimizer at 1e9 parameters, and Int8Linear's training step at the
# largest layer of a 1-2B-parameter transformer's MLP.
TARGET_OPTIM = {"numel": 10**9, "ratio": 1.5}
TARGET_LINEAR = {"shape": (4096, 16384), "tokens": 8192, "ratio": 1.3}
# Int8Linear's variants (gemm, block_size): the default, the exact product at a block whose per-slice scaling
# no longer bounds it on Hopper (docs/INT8.md, "GPU"), and the vector-wise GEMM.
LINEAR_VARIANTS = (("exact", 32), ("exact", 128), ("fast", 32))
HYPER = dict(lr=1e-4, weight_decay=0.01)
SMALL_TENSORS, SMALL_NUMEL = 300, 4096  # the optimizers' steps on many small tensors
GROUPS = ("optim", "linear", "engine", "wire")


def count(s: str) -> int:
    """A positive integer, also written as 1e8."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: '{s}'") from None
    if v != int(v) or v < 1 or v > 2**40:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got '{s}'")
    return int(v)


def shape(s: str) -> tuple:
    parts = s.lower().split("x")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"a shape is IN x OUT, e.g. 4096x16384; got '{s}'")
    return count(parts[0]), count(parts[1])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--only", action="append", choices=GROUPS, help="run only this group (repeatable)")
    ap.add_argument("--optim-numel", type=count, nargs="+", default=[10**8, 10**9],
                    help="total parameters of each optimizer comparison (default 1e8 1e9)")
    ap.add_argument("--tensor-numel", type=count, default=4096 * 4096,
                    help="parameters per tensor; the total is split into such tensors (default 4096*4096)")
    ap.add_argument("--shapes", type=shape, nargs="+", default=[(4096, 4096), (4096, 16384)],
                    help="linear layers IN x OUT (default 4096x4096 4096x16384)")
    ap.add_argument("--tokens", type=count, nargs="+", default=[4096, 8192, 16384],
                    help="tokens (rows of the input) per linear call (default 4096 8192 16384)")
    ap.add_argument("--engine-model", type=shape, default=(2048, 8),
                    help="the engine comparison's model: WIDTH x BLOCKS of transformer MLP blocks (default 2048x8, "
                         "268M parameters)")
    ap.add_argument("--engine-tokens", type=count, default=8192, help="tokens per training step (default 8192)")
    ap.add_argument("--repeat", type=count, default=10, help="timed rounds (default 10; fewer for slow calls)")
    ap.add_argument("--warmup", type=count, default=3, help="untimed calls of each variant first (default 3)")
    ap.add_argument("--max-seconds", type=float, default=300.0,
                    help="stop starting new comparisons after this long (default 300); the rest are 'not run'")
    ap.add_argument("--json-out", help="also write the JSON line to this file")
    return ap.parse_args(argv)


class Bench:
    def __init__(self, args, torch):
        self.args, self.torch = args, torch
        self.rows = []
        self.t0 = time.monotonic()

    def out_of_time(self) -> bool:
        return time.monotonic() - self.t0 > self.args.max_seconds

    def row(self, group, figure, value=None, unit=None, target=None, error=None, **extra):
        met = None
        if target is not None and value is not None and error is None:
            met = value >= target[1] if target[0] == ">=" else value <= target[1]
        self.rows.append({"group": group, "figure": figure, "value": value, "unit": unit,
                          "target": f"{target[0]} {target[1]}" if target else None, "met": met,
                          "error": error, **extra})

    def time_rounds(self, fns: dict) -> dict:
        """{name: median seconds}: `warmup` calls each, then rounds calling every fn once between two CUDA
        events (so all variants see the same clocks and load). A call of over half a second cuts the rounds
        to 3."""
        torch = self.torch
        t = time.monotonic()
        for fn in fns.values():
            for _ in range(self.args.warmup):
                fn()
        torch.cuda.synchronize()
        per_call = (time.monotonic() - t) / max(1, self.args.warmup * len(fns))
        rounds = self.args.repeat if per_call < 0.5 else min(3, self.args.repeat)
        ev = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rounds)]
              for n in fns}
        for r in range(rounds):
            for name, fn in fns.items():
                ev[name][r][0].record()
                fn()
                ev[name][r][1].record()
        torch.cuda.synchronize()
        return {n: statistics.median(a.elapsed_time(b) for a, b in e) * 1e-3 for n, e in ev.items()}


def zero8_call(what: str, fn):
    """(result, None) or (None, 'not available: ...') when zero8 raises."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - any failure of the zero8 side is a row, not a crash
        return None, f"not available: {what}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def bench_optim(b: Bench, numel: int, tensor_numel: int = 0):
    """The optimizers' steps on `numel` parameters in tensors of tensor_numel (default --tensor-numel); with many
    small tensors the step's host time per tensor is what the CUDA events show."""
    torch = b.torch
    import zero8.optim as zo

    tensor_numel = tensor_numel or b.args.tensor_numel
    sizes = [tensor_numel] * (numel // tensor_numel)
    if numel % tensor_numel:
        sizes.append(numel % tensor_numel)
    label = f"{numel:.2g} params in {len(sizes)} tensors".replace("e+0", "e")
    gen = torch.Generator(device="cuda").manual_seed(0)
    # The gradients are shared (neither optimizer writes them); each optimizer has its own parameters.
    grads = [torch.randn(n, device="cuda", generator=gen) * 1e-3 for n in sizes]
    p_torch = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=gen) * 0.02) for n in sizes]
    for p, g in zip(p_torch, grads):
        p.grad = g
    opt_torch = torch.optim.AdamW(p_torch, fused=True, **HYPER)
    fns = {"torch": opt_torch.step}

    def make_zero8():
        ps = [torch.nn.Parameter(p.detach().clone()) for p in p_torch]
        for p, g in zip(ps, grads):
            p.grad = g
        opt = zo.AdamW8bit(ps, **HYPER)
        opt.step()  # the first step creates the state: a failure shows here, not inside the timing
        torch.cuda.synchronize()
        return ps, opt

    made, err = zero8_call("zero8.optim.AdamW8bit on CUDA parameters", make_zero8)
    if made is not None:
        # Each form of the CUDA kernels in turn on the one optimizer (they give the same bits): "zero8" the
        # block kernels, "zero8_warp" the warp ones (zero8/kernels/dispatch.h, CudaQuantKernels).
        from zero8 import _C

        def step_with(kernel, opt=made[1]):
            def f():
                _C.set_cuda_quant_kernels(kernel)
                opt.step()
            return f

        kernel_before = _C.cuda_quant_kernels()
        fns["zero8"], fns["zero8_warp"] = step_with("block"), step_with("warp")
    try:
        times = b.time_rounds(fns)
    except Exception as e:  # noqa: BLE001 - zero8's step failing after its first call
        if "zero8" not in fns:
            raise
        err = f"not available: zero8.optim.AdamW8bit.step: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        del fns["zero8"], fns["zero8_warp"]
        times = b.time_rounds(fns)
    finally:
        if made is not None:
            _C.set_cuda_quant_kernels(kernel_before)
    target = (">=", TARGET_OPTIM["ratio"]) if numel == TARGET_OPTIM["numel"] else None
    b.row("optim", f"torch AdamW(fused=True) step, {label}", times["torch"] * 1e3, "ms",
          ns_per_param=times["torch"] / numel * 1e9)
    for key, kernel in (("zero8", ""), ("zero8_warp", ", warp kernels")):
        if key in times:
            b.row("optim", f"zero8 AdamW8bit step{kernel}, {label}", times[key] * 1e3, "ms",
                  ns_per_param=times[key] / numel * 1e9)
            b.row("optim", f"AdamW8bit speed{kernel} / torch fused AdamW, {label}", times["torch"] / times[key], "x",
                  target)
        else:
            b.row("optim", f"zero8 AdamW8bit step{kernel}, {label}", error=err)
            b.row("optim", f"AdamW8bit speed{kernel} / torch fused AdamW, {label}", unit="x", target=target, error=err)
    del fns, opt_torch, p_torch, grads, made
    torch.cuda.empty_cache()


def linear_key(mode: str, block: int) -> str:
    return f"int8_{mode}" if block == 32 else f"int8_{mode}{block}"


def rel_err(torch, y, ref) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def bench_linear(b: Bench, fin: int, fout: int, tokens: int):
    torch = b.torch
    from zero8.nn import Int8Linear, Linear8bitLt

    label = f"{fin}x{fout}, {tokens} tokens"
    gen = torch.Generator(device="cuda").manual_seed(1)
    lin = torch.nn.Linear(fin, fout, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, fin, device="cuda", dtype=torch.bfloat16, generator=gen)
    gy = torch.randn(tokens, fout, device="cuda", dtype=torch.bfloat16, generator=gen)
    xg = x.clone().requires_grad_(True)

    def fwd(m):
        def f():
            with torch.no_grad():
                return m(x)
        return f

    def fwd_bwd(m):
        def f():
            xg.grad = None
            for p in m.parameters():
                p.grad = None
            m(xg).backward(gy)
        return f

    with torch.no_grad():
        ref = lin(x)
    fns_fwd, fns_train, errs = {"bf16": fwd(lin)}, {"bf16": fwd_bwd(lin)}, {}
    for mode, blk in LINEAR_VARIANTS:
        def make(mode=mode, blk=blk):
            m = Int8Linear(fin, fout, gemm=mode, block_size=blk, device="cuda")
            with torch.no_grad():
                m.weight.copy_(lin.weight.float())
                m.bias.copy_(lin.bias.float())
                e = rel_err(torch, m(x), ref)
            # int8 operands: about 1e-2 relative error; far more means a wrong product, whose time is no figure.
            if not e < 0.1:
                raise RuntimeError(f"output differs from nn.Linear's by {e:.3g} (relative)")
            return m
        m, err = zero8_call(f"Int8Linear(gemm='{mode}', block_size={blk}) on CUDA", make)
        if m is not None:
            fns_fwd[linear_key(mode, blk)], fns_train[linear_key(mode, blk)] = fwd(m), fwd_bwd(m)
        else:
            errs[linear_key(mode, blk)] = err

    def make_lt():
        m = Linear8bitLt.from_linear(lin, threshold=0.0)
        with torch.no_grad():
            e = rel_err(torch, m(x), ref)
        if not e < 0.1:
            raise RuntimeError(f"output differs from nn.Linear's by {e:.3g} (relative)")
        return m
    m, err = zero8_call("Linear8bitLt.from_linear on a CUDA nn.Linear", make_lt)
    if m is not None:
        fns_fwd["lt"] = fwd(m)
    else:
        errs["lt"] = err

    # The yardstick: the layer's three products alone, torch._int_mm (cuBLASLt's int8 kernels, what the layers
    # call) against bf16 torch.mm at the same shapes (forward X W^T; backward dY W and dY^T X). No int8 layer
    # can beat bf16 by more than this ratio; the layers add the quantization and the scaling around it.
    w16 = lin.weight.detach()
    qx = torch.randint(-127, 128, (tokens, fin), dtype=torch.int8, device="cuda", generator=gen)
    qw = torch.randint(-127, 128, (fout, fin), dtype=torch.int8, device="cuda", generator=gen)
    qg = torch.randint(-127, 128, (tokens, fout), dtype=torch.int8, device="cuda", generator=gen)
    qw_t, qg_t, qx_t = qw.t().contiguous(), qg.t().contiguous(), qx.t().contiguous()  # the TN form for each
    gemms = {"bf16": lambda: (x @ w16.t(), gy @ w16, gy.t() @ x),
             "int8": lambda: (torch._int_mm(qx, qw.t()), torch._int_mm(qg, qw_t.t()), torch._int_mm(qg_t, qx_t.t()))}
    # The same three products as Int8Linear(exact) runs them: zero8's per-block kernel with one scale per
    # 32 x 32 tile of each operand (the layer's quantization passes left out).
    from zero8 import _C
    from zero8.nn.int8_linear import blockwise_int8_matmul
    blk = 32

    def tile_scales(rows, cols):
        return torch.rand(-(-rows // blk), -(-cols // blk), device="cuda", generator=gen) * 0.01 + 1e-3
    sx, sw, sg = tile_scales(tokens, fin), tile_scales(fout, fin), tile_scales(tokens, fout)

    def per_block():
        return (blockwise_int8_matmul(qx, sx, qw, sw, blk), blockwise_int8_matmul(qg, sg, qw.t(), sw.t(), blk),
                blockwise_int8_matmul(qg.t(), sg.t(), qx.t(), sx.t(), blk))
    _, block_err = zero8_call("blockwise_int8_matmul on CUDA", per_block)
    if block_err is None:
        gemms["block"] = per_block
    t_gemm = b.time_rounds(gemms)
    b.row("linear", f"int8 GEMMs speed / bf16 GEMMs (torch._int_mm vs torch.mm, the three products of forward+"
          f"backward: the bound on Int8Linear's forward+backward), {label}", t_gemm["bf16"] / t_gemm["int8"], "x",
          ms=t_gemm["int8"] * 1e3, bf16_ms=t_gemm["bf16"] * 1e3)
    kernel = zero8_call("the CUDA per-block kernel's name", lambda: _C.int8_block_matmul_cuda_backend(blk))[0]
    figure = (f"per-block int8 products speed / bf16 GEMMs (zero8's kernel ({kernel}), block {blk}, the three "
              f"products of Int8Linear(exact) without its quantization), {label}")
    if block_err is None:
        b.row("linear", figure, t_gemm["bf16"] / t_gemm["block"], "x", ms=t_gemm["block"] * 1e3)
    else:
        b.row("linear", figure, unit="x", error=block_err)
    del gemms, qx, qw, qg, qw_t, qg_t, qx_t, sx, sw, sg

    t_fwd, t_train = b.time_rounds(fns_fwd), b.time_rounds(fns_train)
    is_target = (fin, fout) == TARGET_LINEAR["shape"] and tokens == TARGET_LINEAR["tokens"]
    target = (">=", TARGET_LINEAR["ratio"]) if is_target else None
    b.row("linear", f"bf16 nn.Linear forward, {label}", t_fwd["bf16"] * 1e3, "ms")
    b.row("linear", f"bf16 nn.Linear forward+backward, {label}", t_train["bf16"] * 1e3, "ms")
    for mode, blk in LINEAR_VARIANTS:
        k = linear_key(mode, blk)
        name = f"Int8Linear({mode})" if blk == 32 else f"Int8Linear({mode}, block {blk})"
        if k in t_fwd:
            b.row("linear", f"{name} forward speed / bf16 nn.Linear, {label}", t_fwd["bf16"] / t_fwd[k], "x",
                  ms=t_fwd[k] * 1e3)
            b.row("linear", f"{name} forward+backward speed / bf16 nn.Linear, {label}",
                  t_train["bf16"] / t_train[k], "x", target, ms=t_train[k] * 1e3)
        else:
            b.row("linear", f"{name} forward speed / bf16 nn.Linear, {label}", unit="x", error=errs[k])
            b.row("linear", f"{name} forward+backward speed / bf16 nn.Linear, {label}", unit="x",
                  target=target, error=errs[k])
    if "lt" in t_fwd:
        b.row("linear", f"Linear8bitLt forward speed / bf16 nn.Linear, {label}", t_fwd["bf16"] / t_fwd["lt"], "x",
              ms=t_fwd["lt"] * 1e3)
    else:
        b.row("linear", f"Linear8bitLt forward speed / bf16 nn.Linear, {label}", unit="x", error=errs["lt"])
    del fns_fwd, fns_train, lin, x, gy, xg, ref
    torch.cuda.empty_cache()


def mlp_stack(torch, width: int, blocks: int, device, dtype, seed: int = 2):
    """The engine comparison's model: `blocks` pre-norm MLP blocks of `width` (4x inner), seeded."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(width)
            self.fc = nn.Linear(width, 4 * width)
            self.out = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.out(torch.nn.functional.gelu(self.fc(self.ln(x))))

    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(blocks)]).to(device=device, dtype=dtype)


def engine_steps(torch, device, width: int, blocks: int, tokens: int) -> dict:
    """{name: (one training step as a function returning its loss, the peak memory of a step in bytes)}:
    "torch", PyTorch's mixed precision (fp32 parameters under bf16 autocast, AdamW(fused=True) on a GPU),
    and "zero8" (or why it is not available), zero8's engine on one rank (bf16 model, bf16 config: fp32
    master, 8-bit AdamW states). The peak is taken over a step after the first (states made): what torch
    allocated beyond what was there before the system was built, plus for zero8 its own device buffers
    (engine.memory_stats()["total"], allocated outside torch). 0 on the CPU."""
    import zero8

    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(tokens, width, device=device, generator=gen)
    on_gpu = device.type == "cuda"

    def peak_of(step, before: int) -> int:
        step()  # the first step makes the optimizer states
        if not on_gpu:
            step()
            return 0
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before

    def allocated() -> int:
        return torch.cuda.memory_allocated(device) if on_gpu else 0

    out = {}
    before = allocated()
    model = mlp_stack(torch, width, blocks, device, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), fused=on_gpu, **HYPER)

    def torch_step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    out["torch"] = (torch_step, peak_of(torch_step, before))

    def make_zero8():
        before = allocated()
        m = mlp_stack(torch, width, blocks, device, torch.bfloat16)
        cfg = {"train_batch_size": 1, "bf16": {"enabled": True}, "steps_per_print": 10**9,
               "optimizer": {"type": "AdamW", "params": HYPER}, "zero_optimization": {"stage": 2},
               "zero8": {"optim_bits": 8}}
        engine, *_ = zero8.initialize(model=m, config=cfg)
        xb = x.to(torch.bfloat16)

        def step():
            loss = engine(xb).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            return loss.detach()

        return step, peak_of(step, before) + int(engine.memory_stats()["total"])

    made, err = zero8_call("zero8.initialize with a bf16 model on one rank", make_zero8)
    out["zero8"] = made if made is not None else err
    return out


def bench_engine(b: Bench, width: int, blocks: int, tokens: int):
    torch = b.torch
    params = blocks * (2 * 4 * width * width + 7 * width)
    label = f"{params / 1e6:.0f}M params ({blocks} MLP blocks of {width}), {tokens} tokens"
    made = engine_steps(torch, torch.device("cuda"), width, blocks, tokens)
    fns = {"torch": made["torch"][0]}
    err = made["zero8"] if isinstance(made["zero8"], str) else None
    if err is None:
        fns["zero8"] = made["zero8"][0]
    times = b.time_rounds(fns)
    b.row("engine", f"PyTorch AMP training step (AdamW fused), {label}", times["torch"] * 1e3, "ms",
          gb=made["torch"][1] / 1e9)
    if err is None:
        b.row("engine", f"zero8 engine training step (bf16, 8-bit AdamW, 1 rank), {label}", times["zero8"] * 1e3, "ms",
              gb=made["zero8"][1] / 1e9)
        b.row("engine", f"zero8 engine step speed / PyTorch AMP, {label}", times["torch"] / times["zero8"], "x")
        b.row("engine", f"zero8 engine peak memory of a step / PyTorch AMP, {label}",
              made["zero8"][1] / made["torch"][1], "x")
    else:
        for figure in ("engine training step", "engine step speed / PyTorch AMP",
                       "engine peak memory of a step / PyTorch AMP"):
            b.row("engine", f"zero8 {figure}, {label}", error=err)
    del fns, made
    torch.cuda.empty_cache()


def bench_wire(b: Bench, device: str = "cuda"):
    """bench_fsdp2.py's codec calls per exchange on the GPU: one call for all ranks' pieces / one per piece."""
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import bench_fsdp2
    finally:
        sys.path.pop(0)
    for c in bench_fsdp2.codec_call_cases(device, rounds=5).values():
        label = f"{c['ranks']} ranks x {c['piece']} elements"
        b.row("wire", f"int8 exchange's codec work, one call per piece, {label}", c["us"]["per_piece"], "us")
        b.row("wire", f"int8 exchange's codec work, speed of one call for all pieces / one per piece, {label}",
              c["speedup"], "x")


def emit(result: dict, json_out) -> None:
    line = json.dumps(result)
    print(line)
    if json_out:
        with open(json_out, "w") as f:
            f.write(line + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    groups = args.only or list(GROUPS)
    try:
        import torch
    except ImportError as e:
        emit({"bench": "gpu", "error": f"torch cannot be imported: {e}"}, args.json_out)
        return 1
    if not torch.cuda.is_available():
        msg = "no CUDA device (torch.cuda.is_available() is False): nothing to measure"
        print(f"bench_gpu: {msg}", file=sys.stderr)
        emit({"bench": "gpu", "error": msg}, args.json_out)
        return 1
    try:
        import zero8
    except ImportError as e:
        emit({"bench": "gpu", "error": f"zero8 cannot be imported: {e}"}, args.json_out)
        return 1
    b = Bench(args, torch)
    plan = []
    if "optim" in groups:
        plan += [("optim", f"{n:.0e} params", lambda n=n: bench_optim(b, n)) for n in args.optim_numel]
        # a model of many small tensors (norms, biases, small layers): the step's host time per tensor
        plan += [("optim", f"{SMALL_TENSORS} tensors of {SMALL_NUMEL}",
                  lambda: bench_optim(b, SMALL_TENSORS * SMALL_NUMEL, SMALL_NUMEL))]
    if "linear" in groups:
        plan += [("linear", f"{i}x{o}, {t} tokens", lambda i=i, o=o, t=t: bench_linear(b, i, o, t))
                 for i, o in args.shapes for t in args.tokens]
    if "engine" in groups:
        w, n = args.engine_model
        plan += [("engine", f"{w}x{n}, {args.engine_tokens} tokens",
                  lambda: bench_engine(b, w, n, args.engine_tokens))]
    if "wire" in groups:
        plan += [("wire", "codec calls per exchange", lambda: bench_wire(b))]
    print(f"bench_gpu | zero8 {zero8.__version__} | torch {torch.__version__} | {torch.cuda.get_device_name()} | "
          f"median of {args.repeat} rounds after {args.warmup} warm-ups (CUDA events)", flush=True)
    failed = False
    for group, what, run in plan:
        if b.out_of_time():
            b.row(group, what, error=f"not run: --max-seconds {args.max_seconds:g} reached")
            continue
        try:
            run()
        except Exception as e:  # noqa: BLE001 - the baseline itself failing (out of memory, ...) is recorded
            failed = True
            b.row(group, what, error=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            torch.cuda.empty_cache()
        if b.rows:  # progress: the comparison's last row
            r = b.rows[-1]
            print(f"  {r['figure']}: {r['error'] or format(r['value'], '.4g')}", flush=True)
    w = max(len(r["figure"]) for r in b.rows) if b.rows else 10
    print(f"\n{'figure':<{w}} {'value':>10} {'unit':<5} {'target':<7} met")
    for r in b.rows:
        value = "" if r["value"] is None else f"{r['value']:.4g}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['figure']:<{w}} {value:>10} {r['unit'] or '':<5} {r['target'] or '':<7} {met}"
              + (f"  {r['error']}" if r["error"] else ""))
    emit({"bench": "gpu", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
          "zero8": zero8.__version__, "seconds": round(time.monotonic() - b.t0, 1), "rows": b.rows}, args.json_out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
