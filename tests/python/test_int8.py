"""Int8 linear layers: Linear8bitLt (LLM.int8 inference with outlier decomposition) and Int8Linear (INT8
training, Jetfire-style per-block). Errors are checked against float64 references with element-wise bounds
derived from the quantization steps (a value rounded to nearest is off by at most half its scale; a
stochastically rounded one by less than a whole scale), gradients against autograd of the float32
nn.Linear, the outlier decomposition on a model with emergent outlier features, state dicts, the
conversion helper, a small GPT trained with Int8Linear to within 2% of float32, FLOP counts, and bad
inputs.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import inspect
import io
import itertools
import math
import os
import time

import pytest
import torch
import torch.nn.functional as F

import zero8
from zero8 import _C, _ops
from zero8.nn import Int8Linear, Linear8bitLt, bnb_state_dict, convert_linear8bit
from zero8.nn import linear8bit as l8
from zero8.nn.int8_linear import _blockwise_int8_matmul_sliced, blockwise_int8_matmul

EPS32 = 2.0**-24  # float32 unit roundoff
# Linear8bitLt for inference (int8 weights, the paper's outlier threshold); its defaults are bitsandbytes'
# (float weights kept and trained, no outlier decomposition).
INT8_INFERENCE = dict(has_fp16_weights=False, threshold=6.0)


def fp_slack(x64: torch.Tensor, w64: torch.Tensor, k: int) -> torch.Tensor:
    """Float32 rounding allowance of an epilogue/accumulation over k terms: the standard k * u bound on
    sum |x||w| (plus a few roundings for the scale products), negligible next to int8 steps."""
    return (k + 8) * EPS32 * (x64.abs() @ w64.abs().t())


def vectorwise_bound(x64, w64, sx, sw, exact_cols=None):
    """Element-wise bound of |xq wq^T - x w^T| for row scales sx (of x) and sw (of w's rows), both
    rounded to nearest: per term |e_x w| + |x e_w| + |e_x e_w| <= sx/2 |w| + |x| sw/2 + sx sw/4. Columns in
    exact_cols (outlier features kept in float) only carry the weight's error |x| sw/2."""
    sx, sw = sx.double()[:, None], sw.double()[None, :]
    if exact_cols is None:
        exact_cols = torch.zeros(x64.shape[1], dtype=torch.bool)
    xn, wn = x64[:, ~exact_cols], w64[:, ~exact_cols]
    b = sx / 2 * wn.abs().sum(1)[None, :] + (xn.abs().sum(1)[:, None]) * sw / 2 + xn.shape[1] * sx * sw / 4
    if exact_cols.any():
        b = b + x64[:, exact_cols].abs().sum(1)[:, None] * sw / 2
    return b


def outlier_input(m, k, cols, scale=40.0, seed=0):
    """Normal activations with systematic outlier feature dimensions (LLM.int8's emergent features: a few
    columns with magnitudes ~20-60 in every token)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, cols] = x[:, cols].sign() * (scale / 2 + torch.rand(m, len(cols), generator=g) * scale)
    return x


# ------------------------------------------------------------------------------------------- Linear8bitLt


def test_linear8bitlt_weights_are_rowwise_absmax_round_to_nearest():
    torch.manual_seed(0)
    lin = torch.nn.Linear(200, 70)
    m = Linear8bitLt.from_linear(lin)
    w = lin.weight.detach()
    s = w.abs().amax(1) / 127  # float32, as the kernel
    assert torch.equal(m.weight_scale, s)
    assert m.weight.dtype == torch.int8
    assert torch.equal(m.weight, torch.round(w / s[:, None]).to(torch.int8))  # torch.round: ties to even
    assert m.weight_bytes() == w.numel() + 4 * w.shape[0]  # int8 codes + one float32 scale per row
    assert w.numel() * 4 / m.weight_bytes() > 3.9  # ~4x smaller than float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear8bitlt_error_within_quantization_bound(dtype):
    torch.manual_seed(1)
    k, n, mtok = 256, 96, 48
    lin = torch.nn.Linear(k, n)
    x = outlier_input(mtok, k, [3, 100, 201]).to(dtype)
    m = Linear8bitLt.from_linear(lin, threshold=6.0)
    y = m(x)
    assert y.dtype == dtype and y.shape == (mtok, n)
    x64, w64, b64 = x.double(), lin.weight.double(), lin.bias.double()
    y64 = x64 @ w64.t() + b64
    outl = (x64.abs() >= 6.0).any(0)
    assert outl.sum() == 3
    sx = x64[:, ~outl].abs().amax(1) / 127
    bound = vectorwise_bound(x64, w64, sx, m.weight_scale, outl) + fp_slack(x64, w64, k) + 1e-6 * b64.abs()
    if dtype == torch.bfloat16:
        bound = bound * (1 + 2.0**-8) + y64.abs() * 2.0**-8  # output rounded to bfloat16 (half an ulp, 8 bits)
    err = (y.double() - y64).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def test_outlier_decomposition_restores_accuracy_where_vectorwise_fails():
    # A two-layer model whose first layer sees 4 emergent outlier features (|x| 20-60 in every token).
    torch.manual_seed(2)
    k, h, n, mtok = 512, 512, 128, 256
    model = torch.nn.Sequential(torch.nn.Linear(k, h), torch.nn.GELU(), torch.nn.Linear(h, n))
    cols = [5, 77, 300, 411]
    x = outlier_input(mtok, k, cols, seed=3)
    with torch.no_grad():
        # The weights reading the outlier features are ~1/20 of the others, so those features inform the
        # output about as much as ordinary ones instead of swamping it (what makes them matter in an LLM
        # without dominating its output norm).
        model[0].weight[:, cols] /= 20.0
    with torch.no_grad():
        ref = model.double()(x.double())
        model.float()
        y32 = model(x)
    dec = convert_linear8bit(copy.deepcopy(model), threshold=6.0)
    vec = convert_linear8bit(copy.deepcopy(model), threshold=0.0)
    with torch.no_grad():
        e32 = ((y32.double() - ref).norm() / ref.norm()).item()
        e_dec = ((dec(x).double() - ref).norm() / ref.norm()).item()
        e_vec = ((vec(x).double() - ref).norm() / ref.norm()).item()
    # The decomposition leaves the int8 error of the ordinary features: per layer, an activation row of
    # absmax ~4 sigma rounds with rms error (4/127)/sqrt(12) ~ 0.9% of sigma and a uniform weight row with
    # ~0.5%, about 1% of the output; plus the outlier features times their (relatively coarse) int8
    # weights. Over two layers that is ~2%: it must stay below 3%. Vector-wise int8 puts every activation
    # row's scale at ~40/127, 10x coarser: its error must be > 4x the decomposition's and > 5%.
    print(f"\nrelative error: fp32 {e32:.2e}, LLM.int8 {e_dec:.4f}, vector-wise int8 {e_vec:.4f}")
    assert e32 < 1e-5
    assert e_dec < 0.03, (e_dec, e_vec)
    assert e_vec > 4 * e_dec and e_vec > 0.05, (e_dec, e_vec)


def test_linear8bitlt_state_dict_roundtrip_without_float_weights():
    torch.manual_seed(4)
    lin = torch.nn.Linear(64, 40)
    m = Linear8bitLt.from_linear(lin)
    sd = m.state_dict()
    assert set(sd) == {"weight", "weight_scale", "bias"}
    assert sd["weight"].dtype == torch.int8 and sd["weight_scale"].dtype == torch.float32
    fresh = Linear8bitLt(64, 40, **INT8_INFERENCE)
    # No float weight anywhere: the int8 codes and their scales are frozen Parameters (bitsandbytes' Int8Params).
    assert [(n, p.dtype, p.requires_grad) for n, p in fresh.named_parameters()] == [
        ("weight", torch.int8, False), ("weight_scale", torch.float32, False), ("bias", torch.float32, True)]
    fresh.load_state_dict(sd)
    x = outlier_input(10, 64, [7])
    assert torch.equal(fresh(x), m(x))
    # And the plain torch.save / torch.load path of a whole converted model.
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh2 = Linear8bitLt(64, 40, **INT8_INFERENCE)
    fresh2.load_state_dict(torch.load(buf))
    assert torch.equal(fresh2(x), m(x))


def test_convert_linear8bit_skip_list_and_in_place():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(32, 32)
            self.block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
            self.lm_head = torch.nn.Linear(32, 10)

        def forward(self, x):
            return self.lm_head(self.block(self.fc1(x)))

    torch.manual_seed(5)
    net = Net()
    x = torch.randn(8, 32)
    ref = net(x).detach()
    out = convert_linear8bit(net, skip=["lm_head", "block.2"])
    assert out is net
    assert isinstance(net.fc1, Linear8bitLt) and isinstance(net.block[0], Linear8bitLt)
    assert type(net.block[2]) is torch.nn.Linear and type(net.lm_head) is torch.nn.Linear
    # Whole subtrees by a parent's name.
    net2 = convert_linear8bit(Net(), skip=["block"])
    assert isinstance(net2.fc1, Linear8bitLt) and type(net2.block[0]) is torch.nn.Linear
    assert isinstance(net2.lm_head, Linear8bitLt)
    # Still the same function (int8 error only: ~1% relative for three small layers).
    assert ((net(x) - ref).norm() / ref.norm()).item() < 0.03


def test_convert_linear8bit_keeps_frozen_parameters_and_ties():
    torch.manual_seed(7)
    emb = torch.nn.Embedding(10, 16)
    net = torch.nn.ModuleDict({"a": torch.nn.Linear(16, 16), "b": torch.nn.Linear(16, 16),
                               "c": torch.nn.Linear(16, 16), "head": torch.nn.Linear(16, 10, bias=False)})
    net["b"].weight = net["a"].weight  # tied linears
    net["head"].weight = emb.weight    # tied to a module that stays float
    net["a"].bias.requires_grad_(False)
    net["c"].weight.requires_grad_(False)
    model = torch.nn.ModuleDict({"emb": emb, "net": net})
    x = torch.randn(4, 16)
    want = {k: net[k](x).detach() for k in ("a", "b")}
    with pytest.warns(UserWarning, match=r"net\.head\.weight shares its weight with emb\.weight, which is not "
                                         r"converted"):
        convert_linear8bit(model)
    a, b, c = net["a"], net["b"], net["c"]
    assert a.weight is b.weight and a.weight_scale is b.weight_scale and a.weight.dtype == torch.int8
    assert not a.bias.requires_grad and b.bias.requires_grad
    for k in ("a", "b"):
        assert ((net[k](x) - want[k]).norm() / want[k].norm()).item() < 0.02
    # has_fp16_weights keeps float Parameters: the tie is the same Parameter, and a frozen weight stays so.
    net2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    net2[1].weight = net2[0].weight
    net2[2].weight.requires_grad_(False)
    convert_linear8bit(net2, has_fp16_weights=True)
    assert net2[0].weight is net2[1].weight and net2[0].weight.requires_grad
    assert not net2[2].weight.requires_grad and net2[2].bias.requires_grad
    # Int8Linear.from_linear too.
    lin = torch.nn.Linear(8, 8)
    lin.bias.requires_grad_(False)
    il = Int8Linear.from_linear(lin)
    assert il.weight.requires_grad and not il.bias.requires_grad


def test_linear8bitlt_fp16_weights_train_straight_through():
    torch.manual_seed(6)
    lin = torch.nn.Linear(48, 24)
    m = Linear8bitLt.from_linear(lin, has_fp16_weights=True)
    assert m.weight.requires_grad and m.weight.dtype == torch.float32
    x = torch.randn(16, 48, requires_grad=True)
    g = torch.randn(16, 24)
    m(x).backward(g)
    # Straight-through backward: exactly the float gradients of x W^T + b.
    assert torch.allclose(m.weight.grad, g.t() @ x.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad, g @ lin.weight.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(m.bias.grad, g.sum(0), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- Linear8bitLt and bitsandbytes

# bitsandbytes 0.50's Linear8bitLt(input_features, output_features, ...) defaults, checked against the
# installed bitsandbytes when there is one.
BNB_LINEAR8BITLT_DEFAULTS = {"bias": True, "has_fp16_weights": True, "threshold": 0.0, "index": None, "device": None}


def _bnb_int8_linear(bnb, lin: torch.nn.Linear, threshold: float = 6.0):
    """bitsandbytes' int8 Linear8bitLt holding ``lin``: loaded as floats, quantized by the move to its device
    (on the CPU as on a GPU), as its docstring says."""
    b = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, has_fp16_weights=False, threshold=threshold)
    b.load_state_dict(lin.state_dict())
    return b.to("cpu")


def test_linear8bitlt_constructor_defaults_are_bitsandbytes():
    # bitsandbytes code that trains Linear8bitLt(in, out) must train its weight here too; the defaults
    # were inference's (has_fp16_weights=False, threshold=6.0), which silently froze the weight.
    ours = inspect.signature(Linear8bitLt).parameters
    want = dict(BNB_LINEAR8BITLT_DEFAULTS)
    try:
        import bitsandbytes as bnb
    except ImportError:
        bnb = None
    if bnb is not None:
        theirs = inspect.signature(bnb.nn.Linear8bitLt).parameters
        want = {name: p.default for name, p in theirs.items() if p.default is not inspect.Parameter.empty}
        assert list(ours)[:len(theirs)] == list(theirs)  # the same names in the same positions
    assert {name: ours[name].default for name in want} == want
    torch.manual_seed(7)
    m = Linear8bitLt(48, 24)
    assert m.has_fp16_weights and m.threshold == 0.0 and m.index is None
    assert [(n, p.dtype) for n, p in m.named_parameters() if p.requires_grad] == [("weight", torch.float32),
                                                                                 ("bias", torch.float32)]
    before = m.weight.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(16, 48)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(m.weight.detach(), before)  # the weight trains


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("has_fp16_weights", [False, True])
def test_linear8bitlt_loads_a_bitsandbytes_int8_state_dict(has_fp16_weights, strict):
    # bitsandbytes saves weight (int8 codes), SCB (each row's absmax: weight = codes * SCB / 127) and
    # weight_format. A strict load used to fail on SCB and weight_format; strict=False loaded the codes with
    # the layer's own scales, silently ~10x worse than bitsandbytes.
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(8)
    k, n = 64, 40
    lin = torch.nn.Linear(k, n)
    sd = _bnb_int8_linear(bnb, lin).state_dict()
    assert {key: v.dtype for key, v in sd.items()} == {"weight": torch.int8, "bias": torch.float32,
                                                      "SCB": torch.float32, "weight_format": torch.uint8}
    bnb_weight = bnb.functional.int8_vectorwise_dequant(sd["weight"], sd["SCB"])  # bitsandbytes' own decoding
    m = Linear8bitLt(k, n, has_fp16_weights=has_fp16_weights, threshold=6.0)
    result = m.load_state_dict(sd, strict=strict)
    assert result.missing_keys == [] and result.unexpected_keys == []
    if has_fp16_weights:
        w = m.weight.detach()
    else:
        assert torch.equal(m.weight, sd["weight"]) and torch.equal(m.weight_scale, sd["SCB"] / 127)
        w = m.weight.float() * m.weight_scale[:, None]
    # The same weights: bitsandbytes multiplies by float32(1/127), zero8 divides by 127, each rounded.
    assert ((w.double() - bnb_weight.double()).abs() <= 4 * EPS32 * bnb_weight.double().abs()).all()
    # The same outputs, to float rounding, as the layer given bitsandbytes' decoded weight as floats (its
    # forward quantizes them back to bitsandbytes' codes, with scales within an ulp of SCB / 127).
    x = outlier_input(12, k, [3, 50])
    ref = Linear8bitLt(k, n, has_fp16_weights=True, threshold=6.0)
    ref.load_state_dict({"weight": bnb_weight, "bias": sd["bias"]})
    x64, w64 = x.double(), bnb_weight.double()
    y, y_ref = m(x).double(), ref(x).double()
    assert ((y - y_ref).abs() <= fp_slack(x64, w64, k) + EPS32 * sd["bias"].double().abs()).all()
    # And the int8 error of the activations alone against float64 with those weights (the weights being
    # exact, the bound has no weight term), where the old load was off by the wrong scales.
    y64 = x64 @ w64.t() + sd["bias"].double()
    outl = (x64.abs() >= 6.0).any(0)
    sx = x64[:, ~outl].abs().amax(1) / 127
    bound = vectorwise_bound(x64, w64, sx, torch.zeros(n), outl) + fp_slack(x64, w64, k) + 8 * EPS32 * y64.abs()
    assert ((y - y64).abs() <= bound).all()


def test_bnb_state_dict_loads_into_bitsandbytes_and_back():
    # bnb_state_dict(model) writes each int8 layer's scales as bitsandbytes' SCB (+ weight_format): a
    # bitsandbytes model quantized the same way loads it strictly and decodes the same weights; zero8 loads
    # it back. model.state_dict() keeps zero8's weight_scale (bit-exact round trip).
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(9)
    lin0, lin2 = torch.nn.Linear(32, 48), torch.nn.Linear(48, 16)
    model = torch.nn.Sequential(Linear8bitLt.from_linear(lin0), torch.nn.ReLU(),
                                Linear8bitLt.from_linear(lin2, has_fp16_weights=True))
    sd = bnb_state_dict(model)
    assert set(sd) == {"0.weight", "0.bias", "0.SCB", "0.weight_format", "2.weight", "2.bias"}
    assert set(model.state_dict()) == {"0.weight", "0.weight_scale", "0.bias", "2.weight", "2.bias"}
    theirs = torch.nn.Sequential(bnb.nn.Linear8bitLt(32, 48, has_fp16_weights=False, threshold=6.0),
                                 torch.nn.ReLU(), bnb.nn.Linear8bitLt(48, 16)).to("cpu")
    result = theirs.load_state_dict(sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(theirs[0].weight.data, model[0].weight)
    decoded = bnb.functional.int8_vectorwise_dequant(theirs[0].weight.data, theirs[0].weight.SCB)
    ours = model[0].weight.float() * model[0].weight_scale[:, None]
    assert ((decoded.double() - ours.double()).abs() <= 4 * EPS32 * ours.double().abs()).all()
    assert torch.equal(theirs[2].weight.data, model[2].weight.detach())
    back = torch.nn.Sequential(Linear8bitLt(32, 48, **INT8_INFERENCE), torch.nn.ReLU(),
                               Linear8bitLt(48, 16, has_fp16_weights=True, threshold=6.0))
    result = back.load_state_dict(sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(back[0].weight, model[0].weight)
    assert ((back[0].weight_scale - model[0].weight_scale).abs() <= 2 * EPS32 * model[0].weight_scale).all()


def test_linear8bitlt_malformed_state_dicts_raise_naming_the_key():
    torch.manual_seed(10)
    good = bnb_state_dict(torch.nn.Sequential(Linear8bitLt.from_linear(torch.nn.Linear(16, 8))))

    def load(change, strict=True, layer=None):
        sd = dict(good)
        change(sd)
        model = torch.nn.Sequential(layer or Linear8bitLt(16, 8, **INT8_INFERENCE))
        return model.load_state_dict(sd, strict=strict)

    load(lambda sd: None)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "0.CB"'):
        load(lambda sd: sd.update({"0.CB": sd["0.weight"]}))
    with pytest.raises(zero8.Zero8ValueError, match=r"0\.SCB must be a 1-D float tensor of 8 .*shape \(7,\)"):
        load(lambda sd: sd.update({"0.SCB": sd["0.SCB"][:7]}), strict=False)
    with pytest.raises(zero8.Zero8ValueError, match=r"0\.SCB must be .*dtype torch.int32"):
        load(lambda sd: sd.update({"0.SCB": sd["0.SCB"].int()}))
    with pytest.raises(zero8.Zero8ValueError,
                       match=r"0\.weight_format is tensor\(2, dtype=torch.uint8\) \(col_turing\): only .*row-major"):
        load(lambda sd: sd.update({"0.weight_format": torch.tensor(2, dtype=torch.uint8)}))
    with pytest.raises(zero8.Zero8ValueError, match=r"0\.weight_format is 'col32'"):
        load(lambda sd: sd.update({"0.weight_format": "col32"}))
    load(lambda sd: sd.update({"0.weight_format": "row"}))  # older bitsandbytes saved the name
    with pytest.raises(zero8.Zero8ValueError, match=r"both 0\.weight_scale .* and 0\.SCB"):
        load(lambda sd: sd.update({"0.weight_scale": sd["0.SCB"] / 127}))
    with pytest.raises(zero8.Zero8ValueError, match=r"0\.SCB .* int8 codes of 0\.weight.*dtype torch.float32"):
        load(lambda sd: sd.update({"0.weight": sd["0.weight"].float()}))
    # int8 codes without any scales: strict=False used to keep the layer's old scales, silently.
    for layer in (None, Linear8bitLt(16, 8, has_fp16_weights=True)):
        with pytest.raises(zero8.Zero8ValueError, match=r"0\.weight holds int8 codes .* 0\.weight_scale .* 0\.SCB"):
            load(lambda sd: (sd.pop("0.SCB"), sd.pop("0.weight_format")), strict=False, layer=layer)


# --------------------------------------------------------------------------------------------- Int8Linear


def _blocks_dequant64(t, block, stochastic=False):
    q, s = l8.quantize_blocks(t, block, stochastic=stochastic)
    return q, s, l8.dequantize_blocks(q, s, block, torch.float32).double()


def _expand(s, block, rows, cols):
    return s.double().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


@pytest.mark.parametrize("block", [32, 16])
def test_int8linear_exact_forward_is_the_per_block_definition(block):
    torch.manual_seed(7)
    mtok, k, n = 70, 100, 45  # partial edge blocks on every axis
    lin = torch.nn.Linear(k, n)
    il = Int8Linear.from_linear(lin, block_size=block, gemm="exact")
    x = outlier_input(mtok, k, [9], scale=30.0)
    y = il(x).double()
    # The definition: per-block codes and scales, products of dequantized blocks, float32 accumulation.
    _, sx, xd = _blocks_dequant64(x, block)
    _, sw, wd = _blocks_dequant64(lin.weight.detach(), block)
    y_def = xd @ wd.t() + lin.bias.double()
    slack = (math.ceil(k / block) + 8) * EPS32 * (xd.abs() @ wd.abs().t() + lin.bias.double().abs())
    assert ((y - y_def).abs() <= slack).all()
    # Against the unquantized product: per term sx/2 |w| + |x| sw/2 + sx sw/4, with each element's own
    # block scales.
    x64, w64 = x.double(), lin.weight.double()
    y64 = x64 @ w64.t() + lin.bias.double()
    sxe, swe = _expand(sx, block, mtok, k), _expand(sw, block, n, k)
    bound = (sxe / 2) @ w64.abs().t() + x64.abs() @ (swe / 2).t() + (sxe / 2) @ (swe / 2).t() + slack
    assert ((y - y64).abs() <= bound).all()


def test_int8linear_exact_on_the_cpu_does_not_warn():
    # Only on a GPU is the exact kernel the slow one (a warning there: test_cuda_int8.py).
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = Int8Linear(64, 32)(torch.randn(40, 64))
    assert y.shape == (40, 32)


def test_int8linear_fast_forward_error_within_vectorwise_bound():
    torch.manual_seed(8)
    mtok, k, n = 64, 128, 96
    lin = torch.nn.Linear(k, n)
    il = Int8Linear.from_linear(lin, gemm="fast")
    assert Int8Linear.from_linear(lin).gemm == "exact"  # the default: Jetfire's per-block math
    x = torch.randn(mtok, k)
    y = il(x).double()
    x64, w64 = x.double(), lin.weight.double()
    y64 = x64 @ w64.t() + lin.bias.double()
    sx = x.abs().amax(1) / 127
    sw = lin.weight.detach().abs().amax(1) / 127
    bound = vectorwise_bound(x64, w64, sx, sw) + fp_slack(x64, w64, k) + 1e-6 * lin.bias.double().abs()
    assert ((y - y64).abs() <= bound).all()


@pytest.mark.parametrize("gemm", ["fast", "exact"])
def test_int8linear_gradients_against_fp32_autograd(gemm):
    torch.manual_seed(9)
    mtok, k, n, block = 96, 64, 80, 32
    lin = torch.nn.Linear(k, n)
    il = Int8Linear.from_linear(lin, block_size=block, gemm=gemm)
    x = torch.randn(mtok, k)
    g = torch.randn(mtok, n)
    g[5] *= 20.0  # a token with a large gradient (Jetfire: gradient outliers run along tokens)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    lin(xa).backward(g)
    il(xb).backward(g)
    x64, w64, g64 = x.double(), lin.weight.double(), g.double()
    dx64, dw64 = g64 @ w64, g64.t() @ x64
    # fp32 autograd itself is within rounding of float64: the reference the int8 layer is compared with.
    assert torch.allclose(xa.grad.double(), dx64, rtol=1e-5, atol=1e-5)
    if gemm == "fast":
        # dX = dY W: dY per token, stochastic (error < one step sg), W per input feature (sw/2).
        sg = g.abs().amax(1).double() / 127
        sw = lin.weight.detach().abs().amax(0).double() / 127
        bx = sg[:, None] * (w64.abs().sum(0))[None, :] + g64.abs().sum(1)[:, None] * sw[None, :] / 2 \
            + n * sg[:, None] * sw[None, :] / 2
        # dW = dY^T X: dY per output feature (stochastic), X from its per-block int8 copy requantized per
        # input feature (half a block step + half a column step).
        sgc = g.abs().amax(0).double() / 127
        _, sxb, xd = _blocks_dequant64(x, block)
        sxc = xd.abs().amax(0) / 127
        ex = _expand(sxb, block, mtok, k) / 2 + sxc[None, :] / 2  # per element of X
        bw = sgc[:, None] * x64.abs().sum(0)[None, :] + g64.abs().t() @ ex + sgc[:, None] * ex.sum(0)[None, :]
    else:
        # Per-block everywhere: dY blocks stochastic (< sg), W and X blocks to nearest (/2).
        _, sgb, _ = _blocks_dequant64(g, block, stochastic=True)  # same max per block: the scales agree
        sge = _expand(sgb, block, mtok, n)
        _, swb, _ = _blocks_dequant64(lin.weight.detach(), block)
        swe = _expand(swb, block, n, k)
        _, sxb, _ = _blocks_dequant64(x, block)
        sxe = _expand(sxb, block, mtok, k)
        bx = sge @ w64.abs() + g64.abs() @ (swe / 2) + sge @ (swe / 2)
        bw = sge.t() @ x64.abs() + g64.abs().t() @ (sxe / 2) + sge.t() @ (sxe / 2)
    bx = bx + (n + 8) * EPS32 * (g64.abs() @ w64.abs())
    bw = bw + (mtok + 8) * EPS32 * (g64.abs().t() @ x64.abs())
    assert ((xb.grad.double() - dx64).abs() <= bx).all()
    assert ((il.weight.grad.double() - dw64).abs() <= bw).all()
    assert torch.allclose(il.bias.grad.double(), g64.sum(0), rtol=1e-5, atol=1e-4)
    # Overall: int8 gradients within a few percent of the exact ones (the element bounds are worst cases;
    # the rms error of independent roundings is ~sqrt(count) smaller). Relative Frobenius error < 5%.
    assert ((xb.grad.double() - dx64).norm() / dx64.norm()).item() < 0.05
    assert ((il.weight.grad.double() - dw64).norm() / dw64.norm()).item() < 0.05


def test_int8linear_saves_int8_activations_and_reports_memory():
    torch.manual_seed(10)
    mtok, k, n = 100, 160, 48
    il = Int8Linear(k, n)
    x = torch.randn(mtok, k, requires_grad=True)
    y = il(x)
    saved = y.grad_fn.saved_tensors
    dtypes = sorted(str(t.dtype) for t in saved)
    assert dtypes == ["torch.float32", "torch.float32", "torch.int8"]  # codes, block scales, the master weight
    assert not any(t.shape == x.shape and t.is_floating_point() for t in saved)  # no float copy of x
    mem = il.activation_memory()
    nblocks = math.ceil(mtok / 32) * math.ceil(k / 32)
    assert mem["saved_bytes"] == mtok * k + 4 * nblocks
    assert mem["unquantized_bytes"] == mtok * k * 4
    assert mem["ratio"] == pytest.approx(0.25 + 1 / 1024, rel=0.2)  # 1 byte + 4/1024 per element vs 4


@pytest.mark.parametrize("shape", [(5, 13, 7), (17, 8, 8), (1, 1, 1), (16, 24, 9), (40, 64, 32), (300, 1000, 50),
                                   (0, 3, 4), (3, 0, 4), (3, 4, 0)])
def test_gpu_gemm_padding_on_cpu_tensors(shape, monkeypatch):
    """The GPU int8 GEMMs' padding, run on CPU tensors (they take any device): _ops._int_mm_cuda with
    torch._int_mm replaced by a check of its CUDA rules (m > 16, k and n nonzero multiples of 8, a row-major and
    mat2 the transpose of a row-major n x k, the TN form cuBLASLt's int8 kernels take; k and n at least 16, the
    smallest its own tests run), and _ops._gemm_cuda
    through _C.int8_gemm (the CPU twin of int8_gemm_cuda, given the same k and n, multiples of 4). Exact
    products whatever the shape, from contiguous and transposed operands."""

    torch_int_mm = torch._int_mm

    def cuda_rules(a, b):
        rows, inner, cols = a.shape[0], a.shape[1], b.shape[1]
        assert rows > 16 and inner >= 16 and inner % 8 == 0 and cols >= 16 and cols % 8 == 0, \
            (tuple(a.shape), tuple(b.shape))
        assert a.is_contiguous() and b.t().is_contiguous(), (a.stride(), b.stride())
        return torch_int_mm(a, b)

    monkeypatch.setattr(torch, "_int_mm", cuda_rules)
    m, k, n = shape
    g = torch.Generator().manual_seed(m + k + n)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    want = a.long() @ b.long().t()
    for a_, b_ in ((a, b), (a.t().contiguous().t(), b.t().contiguous().t())):
        got = _ops._int_mm_cuda(a_, b_)
        assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got.long(), want)
        if m > 0 and n > 0:
            got = _ops._gemm_cuda(a_, b_)
            assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got.long(), want)


def test_blockwise_matmul_matches_dequantized_product_and_gemm_backends_agree():
    torch.manual_seed(11)
    a, b = torch.randn(33, 70), torch.randn(21, 70)
    qa, sa = l8.quantize_blocks(a, 16)
    qb, sb = l8.quantize_blocks(b, 16)
    ref = l8.dequantize_blocks(qa, sa, 16).double() @ l8.dequantize_blocks(qb, sb, 16).double().t()
    out = blockwise_int8_matmul(qa, sa, qb, sb, 16)
    slack = (5 + 8) * EPS32 * (l8.dequantize_blocks(qa, sa, 16).double().abs() @
                               l8.dequantize_blocks(qb, sb, 16).double().abs().t())
    assert ((out.double() - ref).abs() <= slack).all()
    # zero8's GEMM (oneDNN or the reference) and torch._int_mm give identical int32 products.
    qa8 = torch.randint(-128, 128, (37, 129), dtype=torch.int8)
    qb8 = torch.randint(-128, 128, (23, 129), dtype=torch.int8)
    exact = qa8.long() @ qb8.long().t()
    before = l8._GEMM
    try:
        for name in ("torch", "zero8"):
            l8.set_int8_gemm_backend(name)
            assert torch.equal(l8.int8_mm(qa8, qb8).long(), exact)
            assert torch.equal(l8.int8_mm(qa8, qb8.t().contiguous(), b_trans=False).long(), exact)
    finally:
        l8._GEMM = before
    assert l8.int8_gemm_backend().startswith(("torch", "zero8"))


@pytest.mark.parametrize("block", [32, 16, 64, 128, 20])
def test_blockwise_matmul_fused_equals_per_slice_definition_bit_for_bit(block):
    # The fused kernel (zero8._C.int8_block_matmul: AVX-512 VNNI here, else the reference) against the
    # previous definition, one library int8 GEMM per block-wide slice with an accumulating float32
    # epilogue, on the three products of a linear layer: X W^T (both row-major), dY W (the weight as a
    # .t() view), dY^T X (both .t() views); edge blocks partial on every axis; with a bias; all out dtypes.
    torch.manual_seed(20 + block)
    tokens, fin, fout = 70, 100, 45
    x, w, g = torch.randn(tokens, fin), torch.randn(fout, fin), torch.randn(tokens, fout)
    g[3] *= 30.0
    qx, sx = l8.quantize_blocks(x, block)
    qw, sw = l8.quantize_blocks(w, block)
    qg, sg = l8.quantize_blocks(g, block, stochastic=True)
    bias = torch.randn(fout)
    products = {
        "X W^T": (qx, sx, qw, sw),
        "dY W": (qg, sg, qw.t(), sw.t()),
        "dY^T X": (qg.t(), sg.t(), qx.t(), sx.t()),
    }
    for name, (qa, sa, qb, sb) in products.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            b = bias if name == "X W^T" else None
            fused = blockwise_int8_matmul(qa, sa, qb, sb, block, out_dtype=dtype, bias=b)
            sliced = _blockwise_int8_matmul_sliced(qa, sa, qb, sb, block, out_dtype=dtype, bias=b)
            assert fused.dtype == dtype and fused.shape == sliced.shape
            assert torch.equal(fused.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               sliced.view(torch.int16 if dtype != torch.float32 else torch.int32)), (name, dtype)


def test_blockwise_matmul_backend_and_bad_arguments():
    assert _C.int8_block_matmul_backend() in ("avx512-vnni", "reference")
    if zero8.build_info()["cuda"]:  # which CUDA kernel a block takes, whether or not a GPU is present
        assert [_C.int8_block_matmul_cuda_backend(b) for b in (32, 16, 48, 20, 3)] == ["wmma"] * 3 + ["tiled"] * 2
    else:
        with pytest.raises(zero8.Zero8NotSupportedError, match="not built with CUDA"):
            _C.int8_block_matmul_cuda_backend(32)
    for bad in (0, -16, 65537):
        with pytest.raises(zero8.Zero8ValueError, match=rf"'block'.*must be in 1\.\.65536, got {bad}"):
            _C.int8_block_matmul_cuda_backend(bad)
    qa, sa = l8.quantize_blocks(torch.randn(40, 50), 32)
    qb, sb = l8.quantize_blocks(torch.randn(30, 50), 32)
    assert blockwise_int8_matmul(qa, sa, qb, sb, 32).shape == (40, 30)
    with pytest.raises(zero8.Zero8ValueError, match="sa"):
        blockwise_int8_matmul(qa, sa[:1], qb, sb, 32)
    with pytest.raises(zero8.Zero8ValueError, match="sb_t"):
        blockwise_int8_matmul(qa, sa, qb, sb.t(), 32)
    with pytest.raises(zero8.Zero8ValueError, match="qb_t"):
        blockwise_int8_matmul(qa, sa, qb[:, :49], sb, 32)
    with pytest.raises(zero8.Zero8ValueError, match="qa"):
        blockwise_int8_matmul(qa.float(), sa, qb, sb, 32)
    with pytest.raises(zero8.Zero8ValueError, match="bias"):
        blockwise_int8_matmul(qa, sa, qb, sb, 32, bias=torch.zeros(31))
    with pytest.raises(zero8.Zero8ValueError, match="block"):
        blockwise_int8_matmul(qa, sa, qb, sb, 0)
    # The C++ layer validates again and names its argument.
    with pytest.raises(zero8.Zero8ValueError, match="'block'"):
        _C.int8_block_matmul(0, 0, False, 0, 0, True, 1, 1, 1, 0)
    with pytest.raises(zero8.Zero8ValueError, match="'a'"):
        _C.int8_block_matmul(0, 0, False, 0, 0, True, 1, 1, 1, 32)


# ---------------------------------------------------------------------- a small GPT trained in int8


class _Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, 2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class _GPT(torch.nn.Module):
    def __init__(self, vocab, d=64, layers=2, heads=4, ctx=64):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def _corpus(max_bytes=400_000):
    """A real text corpus available offline: the Python standard library's own source."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    data = bytearray()
    for f in files:
        with open(f, "rb") as fh:
            data += fh.read()
        if len(data) >= max_bytes:
            break
    return torch.tensor(list(data[:max_bytes]), dtype=torch.long)


def _train(model, opt, data, steps, batch, ctx, seed):
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        i = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=g)
        xb = torch.stack([data[j:j + ctx] for j in i])
        yb = torch.stack([data[j + 1:j + ctx + 1] for j in i])
        loss = F.cross_entropy(model(xb).reshape(-1, 256), yb.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


@torch.no_grad()
def _val_loss(model, data, ctx):
    model.eval()
    n = (data.numel() - 1) // ctx
    xb = data[:n * ctx].view(n, ctx)
    yb = data[1:n * ctx + 1].view(n, ctx)
    return sum(F.cross_entropy(model(xb[i:i + 64]).reshape(-1, 256), yb[i:i + 64].reshape(-1), reduction="sum").item()
               for i in range(0, n, 64)) / (n * ctx)


def test_small_gpt_trained_with_int8linear_within_2pct_of_fp32():
    data = _corpus()
    split = int(data.numel() * 0.9)
    train, val = data[:split], data[split:split + 32_768]
    ctx, batch, steps, lr = 64, 32, 250, 3e-3
    torch.manual_seed(12)
    ref = _GPT(256, ctx=ctx)
    q = copy.deepcopy(ref)
    for blk in q.blocks:  # every attention and MLP projection in int8 (the LM head stays float32)
        for name in ("qkv", "proj", "fc1", "fc2"):
            setattr(blk, name, Int8Linear.from_linear(getattr(blk, name)))
    try:
        from zero8.optim import AdamW8bit

        q_opt = AdamW8bit(q.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        opt_name = "zero8.optim.AdamW8bit"
    except (ImportError, AttributeError):  # pyoptim's module not installed: say so in the output
        q_opt = torch.optim.AdamW(q.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        opt_name = "torch.optim.AdamW (zero8.optim.AdamW8bit not available)"
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    t0 = time.perf_counter()
    _train(ref, ref_opt, train, steps, batch, ctx, seed=13)
    t1 = time.perf_counter()
    torch.manual_seed(14)
    _train(q, q_opt, train, steps, batch, ctx, seed=13)
    t2 = time.perf_counter()
    v_ref, v_q = _val_loss(ref, val, ctx), _val_loss(q, val, ctx)
    print(f"\nval loss fp32 {v_ref:.4f} ({t1 - t0:.1f} s), Int8Linear + {opt_name} {v_q:.4f} ({t2 - t1:.1f} s), "
          f"ratio {v_q / v_ref:.4f}")
    assert v_ref < 0.8 * math.log(256)  # it learned something (uniform over bytes: ln 256 = 5.55)
    assert v_q <= 1.02 * v_ref


# ------------------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("make", [lambda: Linear8bitLt(16, 8, **INT8_INFERENCE), lambda: Int8Linear(16, 8)])
def test_bad_inputs_raise_zero8_value_errors_naming_the_tensor(make):
    m = make()
    with pytest.raises(zero8.Zero8ValueError, match="input"):
        m(torch.randn(4, 15))  # wrong feature size
    with pytest.raises(zero8.Zero8ValueError, match="input"):
        m(torch.randn(4, 16, dtype=torch.float64))  # dtype the kernels do not take
    with pytest.raises(zero8.Zero8ValueError, match="input"):
        m(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(zero8.Zero8ValueError, match="input"):
        m(torch.empty(4, 16, device="meta"))  # not a CPU tensor
    with pytest.raises(TypeError, match="input"):
        m([1.0] * 16)
    # A non-contiguous input is fine (the layer makes a contiguous copy).
    x = torch.randn(16, 4).t()
    assert m(x).shape == (4, 8)
    assert isinstance(zero8.Zero8ValueError("x"), ValueError)


def test_bad_constructor_arguments():
    with pytest.raises(zero8.Zero8ValueError, match="block_size"):
        Int8Linear(8, 8, block_size=0)
    with pytest.raises(zero8.Zero8ValueError, match="gemm"):
        Int8Linear(8, 8, gemm="fastest")
    with pytest.raises(zero8.Zero8ValueError, match="threshold"):
        Linear8bitLt(8, 8, threshold=-1.0)
    with pytest.raises(zero8.Zero8ValueError, match="x"):
        l8.quantize_rows(torch.randn(2, 3, 4))
    with pytest.raises(zero8.Zero8ValueError, match="col_mask"):
        l8.quantize_rows(torch.randn(2, 3), col_mask=torch.zeros(4, dtype=torch.uint8))
    # The C++ layer validates again and names its argument.
    with pytest.raises(zero8.Zero8ValueError, match="block_rows"):
        _C.int8_quantize_blocks(0, _C.DType.f32, 0, 0, 0, 32, 0, 0)


# ------------------------------------------------------------------------------ module conversions and loading


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double"])
def test_linear8bitlt_dtype_cast_keeps_float32_weight_scale(cast):
    # model.half() / model.to(torch.bfloat16) on a converted model casts floating buffers; the per-row
    # scales must stay float32 (the kernels read them as float32) so the output is unchanged up to the bias
    # rounding, instead of garbage from reinterpreted bytes.
    torch.manual_seed(30)
    lin = torch.nn.Linear(40, 24)
    m = Linear8bitLt.from_linear(lin)
    x = torch.randn(6, 40)
    before = m(x)
    getattr(m, cast)()
    assert m.weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32
    assert m.bias.dtype == getattr(torch, cast if cast != "half" else "float16")
    y = m(x)
    # The only change is the bias rounded to the new dtype (half an ulp: 2^-11 for float16, 2^-8 for bf16).
    tol = lin.bias.detach().abs().max().item() * 2.0**-8 + 1e-6
    assert (y - before).abs().max().item() <= tol
    x.requires_grad_()
    m(x).sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("strict", [True, False])
def test_linear8bitlt_loads_a_float_linear_state_dict_by_quantizing_it(strict):
    # An nn.Linear checkpoint (float weight, no weight_scale) into an int8 layer: the weight is quantized
    # as from_linear does, not cast to int8 codes with stale scales (what strict=False used to do silently).
    torch.manual_seed(31)
    lin = torch.nn.Linear(40, 24)
    want = Linear8bitLt.from_linear(lin)
    m = Linear8bitLt(40, 24, **INT8_INFERENCE)
    result = m.load_state_dict(lin.state_dict(), strict=strict)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(m.weight, want.weight) and torch.equal(m.weight_scale, want.weight_scale)
    x = outlier_input(5, 40, [3])
    assert torch.equal(m(x), want(x))
    # The reverse: an int8 checkpoint into a layer that keeps float weights gets the dequantized weight.
    fp = Linear8bitLt(40, 24, has_fp16_weights=True)
    result = fp.load_state_dict(want.state_dict(), strict=strict)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert fp.weight.dtype == torch.float32
    assert torch.equal(fp.weight.detach(), want.weight.float() * want.weight_scale[:, None])
    # A float weight of the wrong shape still fails by shape.
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        Linear8bitLt(40, 25, **INT8_INFERENCE).load_state_dict(lin.state_dict(), strict=strict)


def test_int8linear_double_backward_raises_instead_of_dropping_terms():
    # A gradient penalty through an Int8Linear: its backward runs int8 kernels autograd cannot see, so a
    # second derivative through it must fail loudly; it used to return one that silently lacked the terms
    # passing through the layer (half the norm of the true one for this net).
    torch.manual_seed(32)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), Int8Linear(16, 4))
    x = torch.randn(32, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(net(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.pow(2).sum().backward()


def test_convert_linear8bit_leaves_linears_it_cannot_replace_and_converts_a_bare_linear():
    torch.manual_seed(33)
    # MultiheadAttention reads out_proj.weight directly (it never calls out_proj), so converting it broke
    # the attention with a dtype error: it stays float, the feed-forward linears are converted.
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
            self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            x = x + self.attn(x, x, x, need_weights=False)[0]
            return x + self.fc2(torch.relu(self.fc1(x)))

    block = Block()
    x = torch.randn(2, 5, 16)
    ref = block(x).detach()
    convert_linear8bit(block)
    assert type(block.attn.out_proj) is torch.nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(block.fc1, Linear8bitLt) and isinstance(block.fc2, Linear8bitLt)
    for grad in (True, False):  # with and without autograd (MultiheadAttention's fast path)
        with torch.set_grad_enabled(grad):
            y = block.eval()(x)
        assert ((y - ref).norm() / ref.norm()).item() < 0.03  # int8 error of two small layers (~1%)

    # A subclass with its own forward would lose it: left alone.
    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    net = convert_linear8bit(torch.nn.Sequential(Doubled(8, 8), torch.nn.Linear(8, 8)))
    assert type(net[0]) is Doubled and isinstance(net[1], Linear8bitLt)
    # A bare nn.Linear cannot be replaced in place: its int8 copy is returned.
    lin = torch.nn.Linear(8, 4)
    out = convert_linear8bit(lin, threshold=0.0)
    assert isinstance(out, Linear8bitLt) and out.threshold == 0.0
    xs = torch.randn(3, 8)
    assert torch.equal(out(xs), Linear8bitLt.from_linear(lin, threshold=0.0)(xs))


@pytest.mark.parametrize("make", [lambda: Linear8bitLt(16, 8, **INT8_INFERENCE),
                                  lambda: Linear8bitLt(16, 8, has_fp16_weights=True, threshold=6.0),
                                  lambda: Int8Linear(16, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_batch_backpropagates_zero_gradients(make, dtype):
    # As nn.Linear: an empty batch gives an empty output that is still part of the graph (backward used to
    # fail with "does not require grad"), and zero gradients for the input and the trainable parameters.
    m = make()
    for shape in [(0, 16), (2, 0, 16)]:
        m.zero_grad(set_to_none=True)
        x = torch.randn(*shape, dtype=dtype, requires_grad=True)
        y = m(x)
        assert y.shape == (*shape[:-1], 8) and y.dtype == dtype and y.requires_grad
        y.sum().backward()
        assert x.grad.shape == x.shape
        for name, p in m.named_parameters():
            if p.requires_grad:  # Linear8bitLt's int8 codes and scales are frozen Parameters
                assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any(), name


def test_float64_weights_raise_errors_naming_the_layer_weight():
    # The kernels take float32/bfloat16/float16: a float64 weight used to fail as "x has dtype float64",
    # naming an internal argument.
    with pytest.raises(zero8.Zero8ValueError, match="dtype"):
        Linear8bitLt(8, 4, dtype=torch.float64)
    with pytest.raises(zero8.Zero8ValueError, match="linear.weight"):
        convert_linear8bit(torch.nn.Sequential(torch.nn.Linear(8, 4)).double())
    x = torch.randn(2, 8)
    int8_linear = Int8Linear(8, 4)
    int8_linear.weight.data = int8_linear.weight.data.double()  # .double() keeps its master weight float32
    for m in (Linear8bitLt(8, 4, has_fp16_weights=True).double(), int8_linear):
        with pytest.raises(zero8.Zero8ValueError, match=f"{type(m).__name__}.weight has dtype torch.float64"):
            m(x)


# ------------------------------------------------------------------------------------------- meta device


@contextlib.contextmanager
def _init_empty_weights():
    """accelerate's ``init_empty_weights()`` (include_buffers=False, its default) when accelerate is
    installed, else the same thing: every parameter registered inside moves to the meta device, buffers
    and plain tensors stay where they are made."""
    try:
        from accelerate import init_empty_weights
    except ImportError:
        init_empty_weights = None
    if init_empty_weights is not None:
        with init_empty_weights():
            yield
        return
    register = torch.nn.Module.register_parameter

    def register_empty_parameter(module, name, param):
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            kwargs = dict(p.__dict__, requires_grad=param.requires_grad)
            module._parameters[name] = type(p)(p.to("meta"), **kwargs)

    torch.nn.Module.register_parameter = register_empty_parameter
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _on_meta(how, make):
    """``make()`` run under one of the ways big models are created without memory."""
    if how == "torch.device":
        with torch.device("meta"):
            return make(None)
    if how == "device=":
        return make("meta")
    with _init_empty_weights():
        return make(None)


_META_LAYERS = {
    "Linear8bitLt": lambda device: Linear8bitLt(40, 24, **INT8_INFERENCE, device=device),
    "Linear8bitLt-fp16-weights": lambda device: Linear8bitLt(40, 24, has_fp16_weights=True, threshold=6.0,
                                                             device=device),
    "Int8Linear": lambda device: Int8Linear(40, 24, block_size=16, device=device),
}


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].device.type == "cpu" and sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("load", ["to_empty", "assign"])
@pytest.mark.parametrize("layer", list(_META_LAYERS))
def test_layer_created_on_meta_then_loaded_equals_one_built_on_cpu(layer, load):
    # Big models are created on the meta device (no memory, no initialisation), then given their weights:
    # to_empty(device="cpu") + load_state_dict, or load_state_dict(assign=True). The layer must end up
    # exactly the one built on the CPU and loaded from the same checkpoint. Before, device="meta" was
    # refused by both layers and Linear8bitLt failed under torch.device("meta") ("x is on device meta").
    torch.manual_seed(40)
    lin = torch.nn.Linear(40, 24)
    ckpts = {"nn.Linear": lin.state_dict()}
    if layer != "Int8Linear":
        ckpts["int8"] = Linear8bitLt.from_linear(lin).state_dict()
    x = outlier_input(6, 40, [5])
    for (name, sd), how in itertools.product(ckpts.items(), ["torch.device", "device=", "init_empty_weights"]):
        ref = _META_LAYERS[layer](None)
        ref.load_state_dict(sd)
        m = _on_meta(how, _META_LAYERS[layer])
        assert all(t.is_meta for t in m.parameters())
        if load == "to_empty":
            m.to_empty(device="cpu")
            result = m.load_state_dict(sd)
        else:
            result = m.load_state_dict(sd, assign=True)
        assert result.missing_keys == [] and result.unexpected_keys == [], (name, how)
        _same_state(m, ref)
        if isinstance(m, Linear8bitLt) and not m.has_fp16_weights:
            assert m.weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32
        outs = []
        for layer_ in (ref, m):
            xx = x.clone().requires_grad_()
            torch.manual_seed(41)  # Int8Linear's backward rounds stochastically
            y = layer_(xx)
            y.pow(2).sum().backward()
            outs.append((y.detach(), xx.grad, [p.grad for p in layer_.parameters() if p.requires_grad]))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (name, how)
        assert len(outs[0][2]) == len(outs[1][2]) > 0, (name, how)
        assert all(torch.equal(g0, g1) for g0, g1 in zip(outs[0][2], outs[1][2])), (name, how)


@pytest.mark.parametrize("load", ["to_empty", "assign"])
def test_convert_linear8bit_on_a_meta_model_then_load(load):
    # transformers' flow: the model is built on meta, its nn.Linear modules replaced, then the float
    # checkpoint (or an int8 one saved from a converted model) is loaded; the result equals converting the
    # loaded float model. convert_linear8bit used to refuse meta weights.
    def net():
        return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40),
                                   torch.nn.ReLU(), torch.nn.Linear(40, 8))

    torch.manual_seed(42)
    trained = net()
    ref = convert_linear8bit(copy.deepcopy(trained), skip=["4"])
    x = outlier_input(5, 32, [2, 9])
    want = ref(x)
    for sd in (trained.state_dict(), ref.state_dict()):
        with torch.device("meta"):
            model = net()
        model = convert_linear8bit(model, skip=["4"])
        assert isinstance(model[0], Linear8bitLt) and model[0].weight.is_meta and model[0].weight.dtype == torch.int8
        assert type(model[4]) is torch.nn.Linear
        if load == "to_empty":
            model.to_empty(device="cpu")
            result = model.load_state_dict(sd)
        else:
            result = model.load_state_dict(sd, assign=True)
        assert result.missing_keys == [] and result.unexpected_keys == []
        _same_state(model, ref)
        assert torch.equal(model(x), want)


def test_meta_layers_raise_naming_the_layer_until_loaded():
    # The combinations that cannot run say so, and what to do, instead of reading a meta tensor.
    x = torch.randn(3, 40)
    for make in _META_LAYERS.values():
        m = make("meta")
        name = type(m).__name__
        with pytest.raises(zero8.Zero8ValueError, match=rf"{name}\.weight is on the meta device.*to_empty.*assign=True"):
            m(x)
        # Loading into meta tensors without assign=True is torch's no-op (with its warning): still meta.
        with pytest.warns(UserWarning, match="meta"):
            m.load_state_dict(torch.nn.Linear(40, 24).state_dict())
        with pytest.raises(zero8.Zero8ValueError, match="meta device"):
            m(x)
        with pytest.raises(NotImplementedError, match="to_empty"):
            m.to("cpu")  # torch's own message: there is no data to move
    # Only the bias left on meta (a partial load) is named too.
    m = Linear8bitLt(40, 24, **INT8_INFERENCE)
    m.bias = torch.nn.Parameter(torch.empty(24, device="meta"))
    with pytest.raises(zero8.Zero8ValueError, match=r"Linear8bitLt\.bias is on the meta device"):
        m(x)
    for make in (lambda: Linear8bitLt(8, 4, device="cuda"), lambda: Int8Linear(8, 4, device="cuda")):
        if zero8.build_info()["cuda"]:
            break  # a CUDA build makes them there (tests/python/test_cuda_int8.py)
        with pytest.raises(zero8.Zero8ValueError, match="runs on CPU"):
            make()


_META_INPUTS = [(torch.float32, (2, 7, 40)), (torch.bfloat16, (5, 40)), (torch.float16, (3, 0, 40))]


@pytest.mark.parametrize("how", ["torch.device", "device=", "init_empty_weights"])
@pytest.mark.parametrize("layer", list(_META_LAYERS))
def test_meta_layer_given_a_meta_input_gives_shapes(layer, how):
    # Shape inference on a model built without data (meta forwards, FLOP counting): a meta input gives a
    # meta output, and a backward meta gradients, with the shapes and dtypes the loaded layer gives.
    # Before, the forward raised "is on the meta device ... load the weights".
    torch.manual_seed(44)
    ref = _META_LAYERS[layer](None)
    m = _on_meta(how, _META_LAYERS[layer])
    for dtype, shape in _META_INPUTS:
        x_ref = torch.randn(shape).to(dtype).requires_grad_()
        torch.manual_seed(45)
        y_ref = ref(x_ref)
        y_ref.float().sum().backward()
        x = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
        m.zero_grad(set_to_none=True)
        y = m(x)
        assert y.is_meta and y.shape == y_ref.shape and y.dtype == y_ref.dtype, (dtype, shape)
        y.float().sum().backward()
        assert x.grad.is_meta and x.grad.shape == x_ref.grad.shape and x.grad.dtype == x_ref.grad.dtype
        for (name, p), p_ref in zip(m.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (p_ref.grad is None), name
            if p.grad is not None:
                assert p.grad.is_meta and p.grad.shape == p_ref.grad.shape and p.grad.dtype == p_ref.grad.dtype, name
        ref.zero_grad(set_to_none=True)
        if isinstance(m, Int8Linear):  # what the loaded layer would keep for backward
            assert m.activation_memory() == ref.activation_memory()
    # Given a CPU input, the layer still says it has no data.
    with pytest.raises(zero8.Zero8ValueError, match="is on the meta device.*load the weights"):
        m(torch.randn(3, 40))
    # A CPU layer given a meta input still says the input is not a CPU tensor; a meta input of the wrong
    # size or dtype is refused as a CPU one is.
    with pytest.raises(zero8.Zero8ValueError, match=r"\binput is on device meta"):
        ref(torch.empty(3, 40, device="meta"))
    with pytest.raises(zero8.Zero8ValueError, match=r"\binput has shape \(3, 41\)"):
        m(torch.empty(3, 41, device="meta"))
    with pytest.raises(zero8.Zero8ValueError, match=r"\binput has dtype torch.float64"):
        m(torch.empty(3, 40, dtype=torch.float64, device="meta"))


def test_flop_counter_on_meta_layers_counts_the_float_linear():
    # torch.utils.flop_counter on a meta model: each layer counts as the float linear it computes,
    # 2 * tokens * in * out multiply-adds forward (the int8 kernels run nothing on meta).
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = torch.nn.Sequential(Linear8bitLt(40, 24, **INT8_INFERENCE), torch.nn.ReLU(), Int8Linear(24, 16),
                                    Linear8bitLt(16, 8, has_fp16_weights=True, threshold=6.0))
    x = torch.empty(4, 9, 40, device="meta")
    with FlopCounterMode(display=False) as counter:
        y = model(x)
    assert y.is_meta and y.shape == (4, 9, 8)
    assert counter.get_total_flops() == 2 * 36 * (40 * 24 + 24 * 16 + 16 * 8)


def _counted_flops(model, x, backward):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        y = model(x)
        if backward:
            y.float().sum().backward()
    return counter.get_total_flops(), set(counter.get_flop_counts().get("Global", {}))


@pytest.mark.parametrize("shape", [(6, 40), (2, 3, 40)])
@pytest.mark.parametrize("bias", [True, False])
def test_flop_counter_on_cpu_inputs_counts_the_layers_as_float_linears(shape, bias):
    # torch.utils.flop_counter on real CPU inputs: each int8 product counts 2 * m * n * k, forward and in
    # backward, as torch counts nn.Linear's mm / addmm; quantizing, dequantizing and the epilogue count 0,
    # as torch's elementwise ops (and nn.Linear's bias gradient sum) do. Linear8bitLt with int8 weights has
    # no weight gradient, so it counts as an nn.Linear with a frozen weight; its outlier columns (column 3
    # here, |x| = 40 >= 6) do not count twice. A meta layer given a meta input counts the same.
    tokens = math.prod(shape[:-1])
    layers = {  # name: (make on a device, trains its weight)
        "Int8Linear exact": (lambda device: Int8Linear(40, 24, bias=bias, device=device), True),
        "Int8Linear fast": (lambda device: Int8Linear(40, 24, bias=bias, gemm="fast", device=device), True),
        "Linear8bitLt": (lambda device: Linear8bitLt(40, 24, bias=bias, **INT8_INFERENCE, device=device), False),
        "Linear8bitLt fp16 weights": (lambda device: Linear8bitLt(40, 24, bias=bias, has_fp16_weights=True,
                                                                  threshold=6.0, device=device), True),
    }
    int8_ops = {torch.ops.zero8.int8_block_matmul, torch.ops.zero8.int8_gemm, torch.ops.zero8.llm_int8_matmul,
                torch.ops.aten.mm}  # aten.mm: Linear8bitLt's float straight-through backward
    torch.manual_seed(46)
    x0 = torch.randn(shape)
    x0[..., 3] = 40.0
    for name, (make, trains_weight) in layers.items():
        ref = torch.nn.Linear(40, 24, bias=bias)
        ref.weight.requires_grad_(trains_weight)
        cpu, meta = make(None), make("meta")
        for x_grad in (True, False):
            products = 1 + x_grad + trains_weight
            backward = x_grad or trains_weight or bias  # else nothing in the output needs a gradient
            want = (2 * tokens * 40 * 24, 2 * tokens * 40 * 24 * products)
            x_meta = torch.empty(shape, device="meta", requires_grad=x_grad)
            for model, x in ((ref, x0.clone().requires_grad_(x_grad)), (cpu, x0.clone().requires_grad_(x_grad)),
                             (meta, x_meta)):
                runs = [(False, want[0])] + ([(True, want[1])] if backward else [])
                for with_backward, total in runs:
                    flops, ops = _counted_flops(model, x, with_backward)
                    assert flops == total, (name, model, x_grad, with_backward)
                    assert model is not cpu or ops <= int8_ops, (name, ops)


def test_assign_keeps_the_float32_formats_a_copy_would_give():
    # load_state_dict(assign=True) takes the checkpoint's tensors as they are: a bf16 checkpoint would give
    # Int8Linear a bf16 master weight, and float16 scales would be read as float32 by the kernels.
    torch.manual_seed(43)
    lin = torch.nn.Linear(40, 24)
    m = Int8Linear(40, 24, device="meta")
    m.load_state_dict(lin.to(torch.bfloat16).state_dict(), assign=True)
    assert m.weight.dtype == torch.float32 and m.bias.dtype == torch.float32
    assert torch.equal(m.weight, lin.weight.float())
    sd = Linear8bitLt.from_linear(lin.float()).state_dict()
    sd["weight_scale"] = sd["weight_scale"].half()  # scales stored in float16 (say, a checkpoint cast whole)
    copied = Linear8bitLt(40, 24, **INT8_INFERENCE)
    assigned = Linear8bitLt(40, 24, **INT8_INFERENCE, device="meta")
    copied.load_state_dict(sd)
    assigned.load_state_dict(sd, assign=True)
    assert assigned.weight_scale.dtype == torch.float32
    _same_state(assigned, copied)
    x = torch.randn(4, 40)
    assert torch.equal(assigned(x), copied(x))


# ------------------------------------------------------------------------------------------- autocast

# Tests marked cuda run where zero8 has its CUDA kernels and a GPU is present (conftest.py skips them elsewhere).
DEV = torch.device("cuda", 0)


def _autocast_run(m, x, device_type, dtype, autocast):
    """Output, input gradient and trainable parameters' gradients of m on x: under torch.autocast, or on x cast
    to autocast's dtype (what nn.Linear computes from there); the same stochastic-rounding seeds for both."""
    m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast(device_type, dtype=dtype, enabled=autocast):
        y = m(x if autocast else x.to(dtype))
    torch.manual_seed(51)
    y.float().pow(2).sum().backward()
    return y, x.grad, [p.grad for p in m.parameters() if p.requires_grad]


def _int8_layers(k, n):
    return {"Linear8bitLt": Linear8bitLt.from_linear(torch.nn.Linear(k, n)),
            "Linear8bitLt-fp16-weights": Linear8bitLt(k, n, has_fp16_weights=True, threshold=6.0),
            "Int8Linear": Int8Linear(k, n), "Int8Linear-fast": Int8Linear(k, n, gemm="fast")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layers_under_autocast_compute_as_nn_linear_does_there(dtype):
    # nn.Linear under torch.autocast computes from its input cast to autocast's dtype and returns that dtype;
    # the int8 layers used to ignore autocast and return float32. Now they cast as nn.Linear: the same bits
    # as the layer called on the cast input, forward and backward (the input gradient back in float32).
    torch.manual_seed(50)
    x = outlier_input(16, 256, [5, 77])
    for name, m in _int8_layers(256, 64).items():
        y, gx, gp = _autocast_run(m, x, "cpu", dtype, True)
        want_y, want_gx, want_gp = _autocast_run(m, x, "cpu", dtype, False)
        assert y.dtype == dtype and gx.dtype == torch.float32, name
        assert torch.equal(y, want_y) and torch.isfinite(y).all() and torch.equal(gx, want_gx), name
        assert len(gp) == len(want_gp) > 0 and all(torch.equal(a, b) for a, b in zip(gp, want_gp)), name


def test_outlier_product_is_float32_inside_the_op_under_autocast():
    # LLM.int8's outlier columns are multiplied in float32 inside the op and added by the epilogue, which
    # reads float32. Autocast reaches into the op: the product came out bfloat16 and the epilogue read it as
    # float32 past its end (NaNs, garbage; a crash at 4096 x 1024). The op is not autocast: same bits.
    torch.manual_seed(52)
    m = Linear8bitLt.from_linear(torch.nn.Linear(256, 64))
    x = outlier_input(16, 256, [5, 77])
    args = (m.weight, m.weight_scale, None, 6.0, m.bias, l8._GEMM)
    want = torch.ops.zero8.llm_int8_matmul(x, *args)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            got = torch.ops.zero8.llm_int8_matmul(x, *args)
        assert got.dtype == torch.float32 and torch.equal(got, want), dtype


@pytest.mark.cuda
def test_layers_under_autocast_on_the_gpu():
    torch.manual_seed(53)
    x = outlier_input(40, 256, [5, 77]).to(DEV)
    for name, m in _int8_layers(256, 64).items():
        m = m.to(DEV)
        y, gx, gp = _autocast_run(m, x, "cuda", torch.bfloat16, True)
        want_y, want_gx, want_gp = _autocast_run(m, x, "cuda", torch.bfloat16, False)
        assert y.dtype == torch.bfloat16 and torch.equal(y, want_y) and torch.isfinite(y).all(), name
        assert torch.equal(gx, want_gx), name
        assert all(torch.equal(a, b) for a, b in zip(gp, want_gp)), name


# ---------------------------------------------------------------------- arguments the kernels read raw


def test_primitives_and_ops_refuse_tensors_of_the_wrong_size_or_dtype_naming_them():
    # The kernels read and write through raw pointers: a tensor smaller than the sizes say, or of another
    # dtype, was read or written past its end, without an error (a one-element out ended the process with
    # "double free or corruption"; a two-element or bfloat16 add and one-element scales were read as if whole).
    # Every op now checks each tensor it hands a kernel, called through zero8.nn's primitives or directly.
    torch.manual_seed(54)
    acc = torch.randint(-1000, 1000, (64, 48), dtype=torch.int32)
    rs, cs = torch.rand(64), torch.rand(48)
    x = torch.randn(64, 40)
    q, s = l8.quantize_blocks(x, 32)
    qa, sa = l8.quantize_blocks(torch.randn(40, 50), 32)
    qb, sb = l8.quantize_blocks(torch.randn(30, 50), 32)
    wq, ws = l8.quantize_rows(torch.randn(24, 40))
    ops = torch.ops.zero8
    cases = [
        ("add has shape", lambda: l8.dequantize_matmul(acc, rs, cs, add=torch.zeros(2))),
        ("add has dtype torch.bfloat16", lambda: l8.dequantize_matmul(acc, rs, cs, add=torch.zeros(64, 48).bfloat16())),
        ("row_scale has shape", lambda: l8.dequantize_matmul(acc, torch.ones(1), cs)),
        ("col_scale has shape", lambda: l8.dequantize_matmul(acc, rs, cs[:47])),
        ("row_scale has dtype", lambda: l8.dequantize_matmul(acc, rs.double(), cs)),
        ("row_scale has stride 2", lambda: l8.dequantize_matmul(acc, torch.rand(128)[::2], cs)),
        ("acc has dtype", lambda: l8.dequantize_matmul(acc.long(), rs, cs)),
        ("bias has shape", lambda: l8.dequantize_matmul(acc, rs, cs, bias=torch.zeros(47))),
        ("out has shape", lambda: l8.dequantize_matmul(acc, rs, cs, out=torch.zeros(1))),
        ("out must be contiguous", lambda: l8.dequantize_matmul(acc, rs, cs, out=torch.zeros(48, 64).t())),
        ("out has dtype", lambda: l8.dequantize_matmul(acc, rs, cs, out=torch.zeros(64, 48).bfloat16(),
                                                       accumulate=True)),
        ("pass the float32 out", lambda: l8.dequantize_matmul(acc, rs, cs, accumulate=True)),
        ("row_group must be", lambda: l8.dequantize_matmul(acc, rs, cs, row_group=0)),
        ("out_dtype must be", lambda: l8.dequantize_matmul(acc, rs, cs, out_dtype=torch.float64)),
        ("scale has shape", lambda: l8.dequantize_blocks(q, torch.ones(1), 32)),
        ("scale has dtype", lambda: l8.dequantize_blocks(q, s.double(), 32)),
        ("dtype must be", lambda: l8.dequantize_blocks(q, s, 32, torch.int32)),
        ("inner sizes differ", lambda: l8.int8_mm(wq, qb)),
        ("b has dtype", lambda: l8.int8_mm(wq, wq.float())),
        # The ops themselves, as torch.ops.zero8.* (what a compiled graph calls).
        ("add has shape", lambda: ops.int8_dequantize_matmul(acc, rs, cs, torch.float32, torch.zeros(2), None,
                                                             1, 1, 1, 1)),
        ("row_scale has shape", lambda: ops.int8_dequantize_matmul(acc, torch.ones(1), cs, torch.float32, None,
                                                                   None, 1, 1, 1, 1)),
        ("scale has shape", lambda: ops.int8_dequantize_blocks(q, torch.ones(1), 32, torch.float32)),
        ("col_mask has 3 elements", lambda: ops.int8_quantize_rows(x, torch.zeros(3, dtype=torch.uint8), None)),
        ("seed must be", lambda: ops.int8_quantize_rows(x, None, torch.tensor([1, 2]))),
        ("seed must be", lambda: ops.int8_quantize_cols(x, torch.tensor([1.0]))),
        ("block must be", lambda: ops.int8_quantize_blocks(x, 0, None)),
        ("x has dtype", lambda: ops.int8_quantize_cols(x.double(), None)),
        ("inner sizes differ", lambda: ops.int8_gemm(qa, qb[:, :49], True)),
        ("sa has shape", lambda: ops.int8_block_matmul(qa, sa[:1], qb, sb, 32, torch.float32, None, "zero8")),
        ("same k", lambda: ops.int8_block_matmul(qa.t(), sa.t(), qb.t(), sb.t(), 32, torch.float32, None, "zero8")),
        ("w_scale has shape", lambda: ops.llm_int8_matmul(x, wq, ws[:3], None, 6.0, None, "zero8")),
        ("w_q has dtype", lambda: ops.llm_int8_matmul(x, wq.float(), ws, None, 6.0, None, "zero8")),
        ("w_fp has shape", lambda: ops.llm_int8_matmul(x, wq, ws, torch.zeros(24, 39), 6.0, None, "zero8")),
        ("bias has shape", lambda: ops.llm_int8_matmul(x, wq, ws, None, 6.0, torch.zeros(23), "zero8")),
    ]
    for match, call in cases:
        with pytest.raises(zero8.Zero8ValueError, match=match):
            call()
    # A column of a block-scale matrix, read with its stride (the per-slice path's epilogue), is accepted.
    out = torch.zeros(64, 48)
    l8.dequantize_matmul(acc, s[:, 1], torch.rand(2, 3)[:, 0], out=out, accumulate=True, row_group=32,
                         row_stride=s.shape[1], col_group=32, col_stride=3)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------- reductions past int32


@pytest.mark.parametrize("backend", ["torch", "zero8"])
def test_int8linear_fast_weight_gradient_over_more_tokens_than_int32_can_sum(backend, monkeypatch):
    # gemm="fast" reduces the weight gradient over every token in one int8 GEMM: its int32 sum of products of
    # codes up to 127 overflows past 131071 tokens. torch._int_mm (the CPU's "torch" GEMM, and the GPU's)
    # wrapped around (dW 140000 came out -126288.5) and zero8's CPU GEMM refused k in backward. The reduction
    # is now cut into GEMMs of at most 131071, summed in int64.
    monkeypatch.setattr(l8, "_GEMM", backend)
    m = Int8Linear(16, 8, gemm="fast", bias=False)
    x = torch.ones(140000, 16, requires_grad=True)
    y = m(x)
    y.backward(torch.ones_like(y))
    # Every code is 127 (or, rarely, 126 after stochastic rounding): dW is 140000 to float32 rounding.
    assert torch.allclose(m.weight.grad, torch.full((8, 16), 140000.0), rtol=1e-6, atol=0)
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backend", ["torch", "zero8"])
def test_mm_dequantize_splits_long_reductions_exactly(backend):
    # Past INT8_GEMM_MAX_K the int32 products of parts are summed exactly in int64, then the epilogue's
    # arithmetic (float32 of the sum times the float32 scale product) is done on that sum: the kernel's formula
    # on the exact product, here against an int64 matmul.
    g = torch.Generator().manual_seed(55)
    k = 2 * _ops.INT8_GEMM_MAX_K + 5
    qa = torch.randint(-127, 128, (3, k), generator=g).to(torch.int8)
    qb = torch.randint(-127, 128, (5, k), generator=g).to(torch.int8)
    qa[0], qb[0] = 127, 127  # 127 * 127 * k > 2^31: an int32 sum would wrap
    sa, sb = torch.rand(3, generator=g), torch.rand(5, generator=g)
    exact = qa.long() @ qb.long().t()
    assert exact[0, 0] > 2**31
    want = exact.float() * (sa[:, None] * sb[None, :])
    assert torch.equal(_ops.mm_dequantize(qa, qb, True, sa, sb, torch.float32, None, None, backend), want)
    assert torch.equal(_ops.mm_dequantize(qa, qb.t().contiguous(), False, sa, sb, torch.float32, None, None, backend),
                       want)
    with pytest.raises(zero8.Zero8ValueError, match=f"k = {k} exceeds 131071"):
        l8.int8_mm(qa, qb)


@pytest.mark.cuda
def test_int8linear_fast_weight_gradient_over_many_tokens_on_the_gpu():
    m = Int8Linear(16, 8, gemm="fast", bias=False, device=DEV)
    x = torch.ones(140000, 16, device=DEV, requires_grad=True)
    y = m(x)
    y.backward(torch.ones_like(y))
    assert torch.allclose(m.weight.grad.cpu(), torch.full((8, 16), 140000.0), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------- module semantics


def test_int8linear_warning_is_issued_outside_torch_compile(monkeypatch):
    # The GPU speed warning of gemm="exact" with a block that is not a multiple of 16 was issued inside
    # forward: dynamo cannot trace warnings.warn, so torch.compile(fullgraph=True) failed on a GPU. It is now
    # issued when the layer is made or moved, and by an eager forward, never while compiling. Here the warning
    # is forced on the CPU.
    import warnings

    def warn_always(self, device):
        warnings.warn("slow kernel (test)")

    monkeypatch.setattr(Int8Linear, "_warn_if_slow_on", warn_always)
    with pytest.warns(UserWarning, match="slow kernel"):
        m = Int8Linear(40, 24, block_size=20)
    x = torch.randn(6, 40)
    with pytest.warns(UserWarning, match="slow kernel"):
        want = m(x)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    y = compiled(x.clone().requires_grad_())
    y.sum().backward()
    assert torch.equal(y, want)
    torch._dynamo.reset()


@pytest.mark.cuda
def test_int8linear_compiles_fullgraph_with_the_plain_kernel_on_the_gpu():
    torch._dynamo.reset()
    m = Int8Linear(40, 24, block_size=20, device=DEV)
    x = torch.randn(6, 40, device=DEV, requires_grad=True)
    y = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    y.sum().backward()
    assert y.shape == (6, 24) and x.grad.shape == x.shape
    torch._dynamo.reset()


def test_int8linear_from_linear_keeps_the_linears_device():
    # from_linear built on the default device, not the linear's (a GPU nn.Linear gave a CPU Int8Linear): here
    # a CPU linear under a meta default device gave a meta layer holding nothing.
    torch.manual_seed(56)
    lin = torch.nn.Linear(24, 16)
    with torch.device("meta"):
        m = Int8Linear.from_linear(lin)
    assert m.weight.device.type == "cpu" and m.bias.device.type == "cpu"
    assert torch.equal(m.weight, lin.weight) and torch.equal(m.bias, lin.bias)
    with torch.device("meta"):
        assert Linear8bitLt.from_linear(lin).weight.device.type == "cpu"


@pytest.mark.cuda
def test_from_linear_keeps_a_gpu_linears_device():
    lin = torch.nn.Linear(24, 16, device=DEV)
    for m in (Int8Linear.from_linear(lin), Linear8bitLt.from_linear(lin)):
        assert all(t.device == DEV for t in m.parameters()), type(m).__name__


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double", "to-bfloat16"])
def test_int8linear_dtype_casts_keep_the_float32_master_weight(cast):
    # Int8Linear's weight and bias are float32 master copies: model.half() / .to(torch.bfloat16) used to
    # round them to 16 bits (the optimizer then stepped a bf16 master). Casts now leave them, and their
    # gradients, float32 and unchanged; the layer still takes any float input.
    torch.manual_seed(57)
    m = Int8Linear(40, 24)
    m(torch.randn(3, 40)).sum().backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in m.named_parameters()}
    params = {n: p for n, p in m.named_parameters()}
    m.to(torch.bfloat16) if cast == "to-bfloat16" else getattr(m, cast)()
    for n, p in m.named_parameters():
        assert p is params[n] and p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
        assert torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]), n
    assert m(torch.randn(3, 40, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_linear8bitlt_int8_weights_are_frozen_parameters_that_stay_tied():
    # bitsandbytes keeps its int8 weight as a frozen Parameter (Int8Params); zero8 kept buffers, so (a) DDP,
    # which broadcasts buffers from rank 0 at every forward by default, re-sent the whole frozen model each
    # step, and (b) linears tied by convert_linear8bit came apart on a device move or to_empty (Module._apply
    # replaces each module's buffers; it moves a Parameter in place). Now they are frozen Parameters.
    torch.manual_seed(58)

    def tied():
        net = torch.nn.ModuleDict({"a": torch.nn.Linear(16, 16), "b": torch.nn.Linear(16, 16)})
        net["b"].weight = net["a"].weight
        return convert_linear8bit(net)

    net = tied()
    assert list(net.named_buffers()) == []  # nothing for DDP to broadcast at every forward
    frozen = [(n, p.dtype) for n, p in net.named_parameters() if not p.requires_grad]
    assert frozen == [("a.weight", torch.int8), ("a.weight_scale", torch.float32)]  # tied: listed once
    x = torch.randn(5, 16)
    want = net["b"](x)
    for move in (lambda m: m.half(), lambda m: m._apply(lambda t: t.clone()), lambda m: m.to_empty(device="cpu")):
        sd = copy.deepcopy(net.state_dict())
        move(net)
        a, b = net["a"], net["b"]
        assert a.weight is b.weight and a.weight_scale is b.weight_scale
        assert a.weight.dtype == torch.int8 and a.weight_scale.dtype == torch.float32
        net.float()
        net.load_state_dict(sd)  # (to_empty left garbage)
    assert torch.equal(net["b"](x), want)
    # Optimizers take model.parameters() as before: the frozen int8 tensors get no gradient and are skipped.
    opt = torch.optim.AdamW(net.parameters())
    net["a"](x).sum().backward()
    opt.step()
    assert net["a"].weight.grad is None and net["a"].bias.grad is not None


@pytest.mark.cuda
def test_linear8bitlt_ties_survive_a_move_to_the_gpu():
    net = torch.nn.ModuleDict({"a": torch.nn.Linear(16, 16), "b": torch.nn.Linear(16, 16)})
    net["b"].weight = net["a"].weight
    net = convert_linear8bit(net).to(DEV)
    assert net["a"].weight is net["b"].weight and net["a"].weight_scale is net["b"].weight_scale
    assert net["a"].weight.device == DEV and net["a"].weight_scale.dtype == torch.float32


@pytest.mark.cuda
def test_stochastic_rounding_refuses_cuda_graph_capture():
    # The kernels take the seed as a launch argument read on the host: a captured graph would replay one
    # draw at every step (the same rounding noise each time), so capture is refused by name.
    x = torch.randn(64, 40, device=DEV)
    l8.quantize_rows(x, stochastic=True)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(zero8.Zero8NotSupportedError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            l8.quantize_rows(x, stochastic=True)
