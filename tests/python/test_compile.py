"""torch.compile of the int8 layers: their zero8._C kernels are torch custom ops (zero8._ops), so a model
with Linear8bitLt and Int8Linear compiles with fullgraph=True, forward and backward, and gives the eager
bits: the compiled graph calls the same kernels on the same inputs, and the seeds of stochastic rounding
are drawn from torch's generator in the same order. Also torch.library.opcheck on every op (schema, fake
function against the kernel, AOT dispatch with dynamic shapes).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch._dynamo

import zero8.nn  # noqa: F401  (registers the zero8:: ops)
from zero8 import _ops
from zero8.nn import Int8Linear, Linear8bitLt

EPS32 = 2.0**-24  # float32 unit roundoff

LAYERS = {
    "Linear8bitLt": lambda k, n: Linear8bitLt(k, n),
    "Linear8bitLt-no-outliers": lambda k, n: Linear8bitLt(k, n, threshold=0.0),
    "Linear8bitLt-fp16-weights": lambda k, n: Linear8bitLt(k, n, has_fp16_weights=True),
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


def test_changing_batch_sizes_recompile_dynamic_and_match_eager():
    torch.manual_seed(3)
    m = torch.nn.Sequential(Linear8bitLt(64, 40), Int8Linear(40, 24))
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    for rows in (5, 9, 33, 70):  # the second size makes the batch dimension dynamic
        x = make_input((rows, 64), torch.float32, seed=rows)
        y0, gx0, gp0 = run(m, x)
        y1, gx1, gp1 = run(compiled, x)
        assert same_bits(y0, y1) and same_bits(gx0, gx1), rows
        assert all(same_bits(gp0[n], gp1[n]) for n in gp0), rows


def test_no_graph_breaks():
    torch.manual_seed(4)
    m = torch.nn.Sequential(Linear8bitLt(64, 40), torch.nn.GELU(), Linear8bitLt(40, 40, has_fp16_weights=True),
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
    m = torch.nn.Sequential(Linear8bitLt(64, 40), torch.nn.ReLU(), Int8Linear(40, 24))
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


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    results = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in results.values()), results


def test_ops_are_registered_in_the_zero8_namespace():
    names = {"int8_quantize_rows", "int8_quantize_cols", "int8_quantize_blocks", "int8_dequantize_blocks",
             "int8_gemm", "int8_dequantize_matmul", "int8_block_matmul", "llm_int8_matmul"}
    for name in names:
        assert hasattr(torch.ops.zero8, name), name
    # Their fake functions give shapes and dtypes without running a kernel: meta tensors.
    q, s = torch.ops.zero8.int8_quantize_blocks(torch.empty(70, 40, device="meta"), 32, None)
    assert q.shape == (70, 40) and q.dtype == torch.int8 and s.shape == (3, 2) and s.dtype == torch.float32
