"""torch.compile of the int8 layers: their zero8._C kernels are torch custom ops (zero8._ops), so a model
with Linear8bitLt and Int8Linear compiles with fullgraph=True, forward and backward, and gives the eager
bits: the compiled graph calls the same kernels on the same inputs, and the seeds of stochastic rounding
are drawn from torch's generator in the same order. The same for zero8.functional's block-wise codec
(ops zero8::quantize_blockwise and zero8::dequantize_blockwise): user code calling quantize_blockwise and
dequantize_blockwise compiles with fullgraph=True and gives the eager bits. Also torch.library.opcheck on
every op (schema, fake function against the kernel, AOT dispatch with dynamic shapes). And zero8.optim's step
called from compiled code: kept out of the graph, it runs eagerly, with the eager bits.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch._dynamo

import zero8.nn  # noqa: F401  (registers the zero8:: ops)
import zero8.optim
from zero8 import _ops, _tensors
from zero8 import functional as F
from zero8.nn import Int8Linear, Linear8bitLt

EPS32 = 2.0**-24  # float32 unit roundoff

LAYERS = {
    "Linear8bitLt": lambda k, n: Linear8bitLt(k, n, has_fp16_weights=False, threshold=6.0),
    "Linear8bitLt-no-outliers": lambda k, n: Linear8bitLt(k, n, has_fp16_weights=False, threshold=0.0),
    "Linear8bitLt-fp16-weights": lambda k, n: Linear8bitLt(k, n, has_fp16_weights=True, threshold=6.0),
    "Int8Linear-exact": lambda k, n: Int8Linear(k, n),
    "Int8Linear-fast": lambda k, n: Int8Linear(k, n, gemm="fast", block_size=16),
}
# (dtype, input shape): every input rank the layers take, each float dtype.
INPUTS = [(torch.float32, (4, 7, 64)), (torch.bfloat16, (9, 64)), (torch.float16, (2, 3, 5, 64))]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern (so that -0.0 and 0.0 differ, as torch.equal does not tell)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def make_input(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., 3] *= 20.0  # an outlier feature (|x| >= 6 somewhere) for LLM.int8's decomposition
    return x.to(dtype)


def run(model, x, seed=7, backward=True):
    """Output, input gradient and parameter gradients of one step; torch.manual_seed(seed) first, so the
    stochastic rounding of Int8Linear's backward draws the same seeds in eager and compiled runs."""
    x = x.clone().requires_grad_(backward)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    y = model(x)
    if not backward:
        return y, None, {}
    # A loss whose gradient differs per element (not all ones), in float32 as a training loss would be.
    (y.float() * torch.linspace(-1.0, 2.0, y.shape[-1])).pow(2).sum().backward()
    params = getattr(model, "_orig_mod", model).named_parameters()  # the compiled wrapper's names have a prefix
    return y, x.grad, {n: p.grad for n, p in params if p.grad is not None}


@pytest.mark.parametrize("dtype,shape", INPUTS, ids=["f32-rank3", "bf16-rank2", "f16-rank4"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_fullgraph_aot_eager_matches_eager_bit_for_bit(layer, dtype, shape):
    torch.manual_seed(1)
    m = LAYERS[layer](64, 24)
    x = make_input(shape, dtype)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    y0, gx0, gp0 = run(m, x)
    y1, gx1, gp1 = run(compiled, x)
    assert y0.dtype == dtype and same_bits(y0, y1)
    assert same_bits(gx0, gx1)
    assert sorted(gp0) == sorted(gp1) and len(gp0) >= 1
    for name in gp0:
        assert same_bits(gp0[name], gp1[name]), name
    if layer.startswith("Int8Linear"):
        # The equality is not vacuous: the backward rounds stochastically, so another seed gives other
        # gradients, and the compiled run matched because it drew the eager seeds.
        _, gx2, gp2 = run(m, x, seed=8)
        assert not torch.equal(gx0, gx2) and not torch.equal(gp0["weight"], gp2["weight"])
    # Eval mode without autograd (inference), the same graph without the backward.
    m.eval()
    with torch.no_grad():
        assert same_bits(m(x), compiled(x))


def test_compiled_training_matches_eager_step_for_step():
    # A model mixing both layers, trained a few SGD steps in eager and compiled (fullgraph) from the same
    # start: the same parameters, bit for bit, after every step.
    def model():
        torch.manual_seed(2)
        lin = torch.nn.Linear(48, 64)
        return torch.nn.Sequential(Int8Linear(32, 48), torch.nn.GELU(), Linear8bitLt.from_linear(lin, has_fp16_weights=True),
                                   torch.nn.ReLU(), Int8Linear(64, 16, gemm="fast"))

    eager, compiled_model = model(), model()
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, compiled_model)]
    for step in range(3):
        x = make_input((3, 10, 32), torch.float32, seed=step)
        for m, opt in zip((eager, compiled), opts):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            m(x).pow(2).mean().backward()
            opt.step()
        for (name, p0), p1 in zip(eager.named_parameters(), compiled_model.parameters()):
            assert same_bits(p0.detach(), p1.detach()), (step, name)
    # activation_memory() reports the compiled forward as the eager one.
    assert compiled_model[0].activation_memory() == eager[0].activation_memory()
    assert eager[0].activation_memory()["saved_bytes"] == 30 * 32 + 4 * 1 * 1


def _trained_with_an_optimizer_step(how: str, steps: int = 4):
    """Parameters and states after `steps` steps of AdamW8bit: eager, the optimizer's step compiled
    (torch.compile(opt.step)) or a compiled training step that calls it."""
    torch.manual_seed(9)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = zero8.optim.AdamW8bit(m.parameters(), lr=1e-2, min_8bit_size=0)
    step = torch.compile(opt.step, backend="aot_eager") if how == "step" else opt.step

    def train_step(x):
        opt.zero_grad()
        m(x).square().mean().backward()
        step()

    if how == "train_step":
        train_step = torch.compile(train_step, backend="aot_eager")
    for i in range(steps):
        train_step(make_input((8, 64), torch.float32, seed=i))
    return list(m.parameters()), opt


@pytest.mark.parametrize("how", ["step", "train_step"])
def test_compiled_code_calling_an_optimizer_step_matches_eager(how):
    # dynamo cannot trace the step (pybind objects built for the kernel broke its guards on the frame that made
    # them); kept out of the graph, it runs eagerly between the graphs, on the same gradients.
    want, want_opt = _trained_with_an_optimizer_step("eager")
    got, got_opt = _trained_with_an_optimizer_step(how)
    for i, (p0, p1) in enumerate(zip(want, got)):
        assert same_bits(p0.detach(), p1.detach()), i
        s0, s1 = want_opt.state[p0], got_opt.state[p1]
        assert s0["step"] == s1["step"] == 4
        for key in ("state1", "absmax1", "state2", "absmax2"):
            assert same_bits(s0[key], s1[key]), (i, key)


def test_changing_batch_sizes_recompile_dynamic_and_match_eager():
    torch.manual_seed(3)
    m = torch.nn.Sequential(Linear8bitLt(64, 40, has_fp16_weights=False, threshold=6.0), Int8Linear(40, 24))
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    for rows in (5, 9, 33, 70):  # the second size makes the batch dimension dynamic
        x = make_input((rows, 64), torch.float32, seed=rows)
        y0, gx0, gp0 = run(m, x)
        y1, gx1, gp1 = run(compiled, x)
        assert same_bits(y0, y1) and same_bits(gx0, gx1), rows
        assert all(same_bits(gp0[n], gp1[n]) for n in gp0), rows


def test_no_graph_breaks():
    torch.manual_seed(4)
    m = torch.nn.Sequential(Linear8bitLt(64, 40, has_fp16_weights=False, threshold=6.0), torch.nn.GELU(),
                            Linear8bitLt(40, 40, has_fp16_weights=True, threshold=6.0),
                            Int8Linear(40, 32), torch.nn.Tanh(), Int8Linear(32, 16, gemm="fast"))
    x = make_input((6, 64), torch.float32)
    # Training: dynamo traces each autograd.Function's backward while tracing the forward.
    explained = torch._dynamo.explain(m)(x.clone().requires_grad_())
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(m.eval())(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_inductor_fullgraph_forward_bits_and_gradients():
    # The default backend: inductor generates code for the float ops between the zero8 ops, so only what
    # the zero8 ops produce (and exact float ops) keeps the eager bits; the bias gradient (a float sum inductor reduces in its
    # own order) is compared within the summation bound. fallback_random: inductor would otherwise draw
    # the stochastic-rounding seeds from its own generator (different seeds, equally valid).
    import torch._inductor.config as inductor_config

    torch.manual_seed(5)
    # ReLU between the layers: exact in any implementation (inductor's GELU may differ from aten's by an ulp,
    # and the next layer would then quantize another input).
    m = torch.nn.Sequential(Linear8bitLt(64, 40, has_fp16_weights=False, threshold=6.0), torch.nn.ReLU(),
                            Int8Linear(40, 24))
    x = make_input((2, 9, 64), torch.float32)
    # The output gradients of the two layers in eager, for the bound on their bias gradients.
    outputs = {}

    def keep(i):
        def hook(mod, inp, out):
            out.retain_grad()
            outputs[i] = out
        return hook

    hooks = [m[i].register_forward_hook(keep(i)) for i in (0, 2)]
    y0, gx0, gp0 = run(m, x)
    for h in hooks:
        h.remove()
    start = time.perf_counter()
    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(m, fullgraph=True)
        y1, gx1, gp1 = run(compiled, x)
    print(f"inductor compile + run: {time.perf_counter() - start:.1f} s")
    assert same_bits(y0, y1)
    assert same_bits(gx0, gx1)
    assert same_bits(gp0["2.weight"], gp1["2.weight"])  # Int8Linear's int8 weight gradient
    for i in (0, 2):
        # Each float32 sum of n terms is within (n - 1) u sum |terms| of the exact one, in any order.
        g = outputs[i].grad.reshape(-1, outputs[i].shape[-1])
        bound = 2 * (g.shape[0] - 1) * EPS32 * g.double().abs().sum(0)
        diff = (gp1[f"{i}.bias"].double() - gp0[f"{i}.bias"].double()).abs()
        assert (diff <= bound).all(), (i, (diff - bound).max().item())


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the calls of zero8's int8 ops through the dispatcher: ``_ops.eager``'s fallbacks and the ops
    by their module names (mm_dequantize's, or a call site that names an op itself)."""
    calls = []
    for name in vars(_ops.eager):
        e = getattr(_ops.eager, name)
        if isinstance(e, _tensors.EagerOp):
            def counted(*args, _op=e.op, _name=name):
                calls.append(_name)
                return _op(*args)
            monkeypatch.setattr(e, "op", counted)
            monkeypatch.setattr(_ops, name, counted)
    return calls


@pytest.mark.parametrize("layer", list(LAYERS))
def test_eager_layers_call_the_op_functions_with_the_ops_bits(layer, op_calls, monkeypatch):
    # Plain eager training calls the ops' functions without the dispatcher (its 10-20 us per call were most
    # of a small layer's time): the same bits as through the ops, forward and backward.
    torch.manual_seed(1)
    m = LAYERS[layer](64, 24)
    x = make_input((9, 64), torch.bfloat16)
    y0, gx0, gp0 = run(m, x)
    assert op_calls == []
    monkeypatch.setattr(_tensors, "direct", lambda args: False)
    y1, gx1, gp1 = run(m, x)
    assert op_calls, "the forced fallback dispatched no op"
    assert same_bits(y0, y1) and same_bits(gx0, gx1) and sorted(gp0) == sorted(gp1)
    for name in gp0:
        assert same_bits(gp0[name], gp1[name]), name


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching")
def test_traced_or_intercepted_calls_go_through_the_ops(op_calls):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(5, 16)
    assert _tensors.direct((x,))
    assert not _tensors.direct((x.requires_grad_(),)), "autograd would record: the op says it has no derivative"
    with torch.no_grad():
        assert _tensors.direct((x,))
    x = x.detach()
    with FlopCounterMode(display=False):
        assert not _tensors.direct((x,))
    with FakeTensorMode():
        assert not _tensors.direct((torch.empty(5, 16),))
    with torch.device("cpu"):  # a torch-function mode
        assert not _tensors.direct((x,))
    with torch.profiler.profile():
        assert not _tensors.direct((x,))
    with torch.autograd.forward_ad.dual_level():
        assert not _tensors.direct((x,))
    assert not _tensors.direct((x.as_subclass(_Sub),))
    # torch.jit.trace records the op (a direct call would record only the function's torch.empty), and vmap
    # runs it per slice: both give the eager values.
    from zero8.nn import linear8bit as L

    x2 = torch.randn(5, 16) * 3
    traced = torch.jit.trace(L.quantize_rows, x, check_trace=False)
    assert all(torch.equal(a, b) for a, b in zip(traced(x2), L.quantize_rows(x2)))
    batch = torch.randn(3, 5, 16)
    q, s = torch.vmap(L.quantize_rows)(batch)
    for i in range(3):
        qi, si = L.quantize_rows(batch[i])
        assert torch.equal(q[i], qi) and torch.equal(s[i], si)
    # A call under each of them reaches the op: the profiler's trace names it.
    m = Int8Linear(16, 8)
    with torch.no_grad(), torch.profiler.profile() as prof:
        m(x)
    assert "zero8::int8_quantize_blocks" in {e.name for e in prof.events()}
    assert "int8_quantize_blocks" in op_calls


class _Sub(torch.Tensor):
    pass


def test_eager_codec_calls_run_the_op_functions_with_the_ops_bits(monkeypatch):
    # zero8.functional's block-wise codec likewise: plain eager calls dispatch nothing, the same bits.
    calls = []
    for e in (F._quantize_blockwise_eager, F._dequantize_blockwise_eager):
        monkeypatch.setattr(e, "op", lambda *args, _op=e.op: calls.append(_op) or _op(*args))
    x = torch.randn(3, 1000)
    q0, s0 = F.quantize_blockwise(x, blocksize=256, nested=True)
    y0 = F.dequantize_blockwise(q0, s0)
    assert calls == []
    monkeypatch.setattr(_tensors, "direct", lambda args: False)
    q1, s1 = F.quantize_blockwise(x, blocksize=256, nested=True)
    y1 = F.dequantize_blockwise(q1, s1)
    assert len(calls) >= 2
    assert torch.equal(q0, q1) and torch.equal(s0.absmax, s1.absmax) and same_bits(y0, y1)


def _opcheck_cases():
    torch.manual_seed(6)
    x, w = torch.randn(37, 70), torch.randn(20, 70)
    xo = x.clone()
    xo[:, 5] *= 40.0  # outlier column
    seed = torch.tensor([12345])
    qx, sx = _ops.int8_quantize_blocks(x, 16, None)
    qw, sw = _ops.int8_quantize_blocks(w, 16, None)
    qr, sr = _ops.int8_quantize_rows(x, None, None)
    qwr, swr = _ops.int8_quantize_rows(w, None, None)
    mask = torch.zeros(70, dtype=torch.uint8)
    mask[3] = 1
    return {
        "quantize_rows": (_ops.int8_quantize_rows, (x, None, None)),
        "quantize_rows-mask-stochastic": (_ops.int8_quantize_rows, (x.bfloat16(), mask, seed)),
        "quantize_cols-stochastic": (_ops.int8_quantize_cols, (x, seed)),
        "quantize_blocks-stochastic": (_ops.int8_quantize_blocks, (x.half(), 16, seed)),
        "dequantize_blocks": (_ops.int8_dequantize_blocks, (qx, sx, 16, torch.bfloat16)),
        "gemm-b-trans": (_ops.int8_gemm, (qr, qwr, True)),
        "gemm": (_ops.int8_gemm, (qr, qwr.t().contiguous(), False)),
        "dequantize_matmul": (_ops.int8_dequantize_matmul, (_ops.int8_gemm(qr, qwr, True), sr, swr, torch.float16,
                                                            None, torch.randn(20), 1, 1, 1, 1)),
        "block_matmul": (_ops.int8_block_matmul, (qx, sx, qw, sw, 16, torch.float32, torch.randn(20), "zero8")),
        "block_matmul-transposed": (_ops.int8_block_matmul, (qx.t(), sx.t(), qx.t(), sx.t(), 16, torch.bfloat16,
                                                             None, "torch")),
        "llm_int8_matmul": (_ops.llm_int8_matmul, (xo, qwr, swr, None, 6.0, None, "zero8")),
        "llm_int8_matmul-fp-weight": (_ops.llm_int8_matmul, (xo.half(), qwr, swr, w, 6.0, torch.randn(20), "torch")),
    }


def _opcheck_codec_cases():
    # zero8.functional's ops, by name in torch.ops.zero8.
    torch.manual_seed(10)
    x = torch.randn(5, 300)
    cube = torch.linspace(-1, 1, 256).pow(3)
    q, s = F.quantize_blockwise(x, blocksize=64)
    qc, sc = F.quantize_blockwise(x, code=cube, blocksize=128)
    return {
        "quantize_blockwise": ("quantize_blockwise", (x, None, 64, False)),
        "quantize_blockwise-nonnegative-bf16": ("quantize_blockwise", (x.bfloat16(), None, 256, True)),
        "quantize_blockwise-unsigned-map-f16": ("quantize_blockwise",
                                                (x.half(), F.create_dynamic_map(signed=False), 128, True)),
        "quantize_blockwise-custom-map": ("quantize_blockwise", (x, cube, 4096, False)),
        "dequantize_blockwise": ("dequantize_blockwise", (q, s.absmax, s.code, 64, torch.float32)),
        "dequantize_blockwise-no-map-bf16": ("dequantize_blockwise", (q, s.absmax, None, 64, torch.bfloat16)),
        "dequantize_blockwise-custom-map-f16": ("dequantize_blockwise", (qc, sc.absmax, cube, 128, torch.float16)),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    results = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in results.values()), results


@pytest.mark.parametrize("case", list(_opcheck_codec_cases()))
def test_opcheck_codec(case):
    name, args = _opcheck_codec_cases()[case]
    results = torch.library.opcheck(getattr(torch.ops.zero8, name).default, args)
    assert all(v == "SUCCESS" for v in results.values()), results


def test_ops_are_registered_in_the_zero8_namespace():
    names = {"int8_quantize_rows", "int8_quantize_cols", "int8_quantize_blocks", "int8_dequantize_blocks",
             "int8_gemm", "int8_dequantize_matmul", "int8_block_matmul", "llm_int8_matmul", "quantize_blockwise",
             "dequantize_blockwise"}
    for name in names:
        assert hasattr(torch.ops.zero8, name), name
    # Their fake functions give shapes and dtypes without running a kernel: meta tensors.
    q, s = torch.ops.zero8.int8_quantize_blocks(torch.empty(70, 40, device="meta"), 32, None)
    assert q.shape == (70, 40) and q.dtype == torch.int8 and s.shape == (3, 2) and s.dtype == torch.float32
    q, s = torch.ops.zero8.quantize_blockwise(torch.empty(70, 40, device="meta"), None, 256, False)
    assert q.shape == (70, 40) and q.dtype == torch.uint8 and s.shape == (11,) and s.dtype == torch.float32
    y = torch.ops.zero8.dequantize_blockwise(q, s, None, 256, torch.bfloat16)
    assert y.shape == (70, 40) and y.dtype == torch.bfloat16 and y.device.type == "meta"


# ---------------------------------------------------------------------------------------------------
# zero8.functional's block-wise codec under torch.compile


def quantize_round_trip(x, code=None, blocksize=256, nested=False, out_dtype=None):
    """What user code does: quantize, dequantize (into `out` when out_dtype is given), and return the
    codes, the stored scales and the decoded tensor."""
    codes, state = F.quantize_blockwise(x, code=code, blocksize=blocksize, nested=nested)
    out = None if out_dtype is None else torch.empty(x.shape, dtype=out_dtype)
    y = F.dequantize_blockwise(codes, state, out=out)
    return codes, state.absmax, y


CODEC_CASES = {
    "f32": dict(),
    "bf16-nested": dict(nested=True, dtype=torch.bfloat16),
    "f16-blocksize-64-into-f32": dict(blocksize=64, dtype=torch.float16, out_dtype=torch.float32),
    "custom-map": dict(code=torch.linspace(-1, 1, 256).pow(3), blocksize=128),
    "unsigned-map-nested": dict(code=F.create_dynamic_map(signed=False), nested=True, blocksize=4096),
}


def codec_input(case, shape=(33, 300)):
    kw = dict(CODEC_CASES[case])
    g = torch.Generator().manual_seed(11)
    x = torch.randn(*shape, generator=g) * 10.0 ** (torch.rand(*shape, generator=g) * 4 - 2)
    return x.to(kw.pop("dtype", torch.float32)), kw


@pytest.mark.parametrize("case", list(CODEC_CASES))
def test_codec_fullgraph_aot_eager_matches_eager_bit_for_bit(case):
    x, kw = codec_input(case)
    compiled = torch.compile(quantize_round_trip, backend="aot_eager", fullgraph=True)
    for a, b in zip(quantize_round_trip(x, **kw), compiled(x, **kw)):
        assert same_bits(a, b)


def test_codec_out_and_absmax_arguments_compile():
    # bitsandbytes' out= and absmax= buffers are filled inside the compiled graph as in eager.
    def fill(x, out, absmax):
        codes, state = F.quantize_blockwise(x, absmax=absmax, out=out, blocksize=128)
        return F.dequantize_blockwise(codes, absmax=state.absmax, blocksize=128)

    x = torch.randn(1000, generator=torch.Generator().manual_seed(12))
    want = [torch.empty(1000, dtype=torch.uint8), torch.empty(8)]
    got = [torch.empty(1000, dtype=torch.uint8), torch.empty(8)]
    y0 = fill(x, *want)
    y1 = torch.compile(fill, backend="aot_eager", fullgraph=True)(x, *got)
    assert same_bits(y0, y1) and all(same_bits(a, b) for a, b in zip(want, got))


def test_codec_changing_sizes_recompile_dynamic_and_match_eager():
    compiled = torch.compile(quantize_round_trip, backend="aot_eager", fullgraph=True)
    for n in (1000, 3000, 4097, 70001):  # the second size makes the length dynamic
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        for a, b in zip(quantize_round_trip(x, nested=True), compiled(x, nested=True)):
            assert same_bits(a, b), n


def test_codec_no_graph_breaks():
    x, kw = codec_input("bf16-nested")
    explained = torch._dynamo.explain(quantize_round_trip)(x, **kw)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1


def test_codec_inductor_fullgraph():
    # Inductor runs the ops as they are, so without nesting it gives the eager bits. With nesting the
    # scales' mean (the offset) is a float sum inductor reduces in its own order: the codes are the eager
    # ones and the offset is within the float32 summation bound of the eager offset.
    compiled = torch.compile(quantize_round_trip, fullgraph=True)
    x, kw = codec_input("f16-blocksize-64-into-f32")
    for a, b in zip(quantize_round_trip(x, **kw), compiled(x, **kw)):
        assert same_bits(a, b)

    def offset_of(x):
        codes, state = F.quantize_blockwise(x, blocksize=64, nested=True)
        return codes, state.offset

    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(13))
    codes0, offset0 = offset_of(x)
    codes1, offset1 = torch.compile(offset_of, fullgraph=True)(x)
    assert same_bits(codes0, codes1)
    _, plain = F.quantize_blockwise(x, blocksize=64)
    scales = plain.absmax.abs().double()
    bound = 2 * (scales.numel() - 1) * EPS32 * scales.sum() / scales.numel()
    assert abs(float(offset1) - float(offset0)) <= bound
