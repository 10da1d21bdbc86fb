"""zero8.optim on DeepSpeed's flat partitions (zero8.optim.partition), without DeepSpeed: the partition and
each parameter's mapping are built here as DeepSpeed builds them (stage_1_and_2.py: parameters end to end,
cut into equal partitions, ``p._hp_mapping`` with the fragment's addresses), so every rule is checked against
the same optimizer stepping the parameters themselves. tests/python/test_deepspeed.py runs the real engine."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import zero8
from zero8.optim.partition import LAYOUT_KEY


def _address(start, numel):
    return types.SimpleNamespace(start=start, numel=numel)


class _Mapping:
    """DeepSpeed's tensor_fragment as zero8 reads it."""

    def __init__(self, hp_start, lp_start, numel):
        self._hp = _address(hp_start, numel)
        self.lp_fragment_address = _address(lp_start, numel)

    def get_hp_fragment_address(self):
        return self._hp


def _partition(params, world, rank, align=2):
    """This rank's flat fp32 partition of `params` and the mappings DeepSpeed would link (the group padded to a
    multiple of align * world, equal partitions)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    total = -(-flat.numel() // (align * world)) * align * world
    flat = torch.nn.functional.pad(flat, (0, total - flat.numel()))
    size = total // world
    lo, hi = rank * size, (rank + 1) * size
    at = 0
    for p in params:
        a, b = max(lo, at), min(hi, at + p.numel())
        p._hp_mapping = _Mapping(a - lo, a - at, b - a) if a < b else None
        at += p.numel()
    return flat[lo:hi].clone().requires_grad_(True), lo, hi


def _flat_grad(params, grads, lo, hi, total):
    g = torch.cat([x.reshape(-1) for x in grads])
    g = torch.nn.functional.pad(g, (0, total - g.numel()))
    return g[lo:hi].clone()


def _model_params(seed=0):
    torch.manual_seed(seed)
    shapes = [(64, 96), (96,), (300,), (40, 130), (5000,), (7,)]
    return [torch.nn.Parameter(torch.randn(s)) for s in shapes]


def _run(world, steps=3, make=lambda ps: zero8.optim.AdamW8bit(ps, lr=1e-2, min_8bit_size=4096), over=None):
    """Per rank: the optimizer over its partition after `steps` steps; and the reference: the same optimizer
    over the parameters themselves, same gradients."""
    ref_params = _model_params()
    grads = [[torch.randn(p.shape) for p in ref_params] for _ in range(steps)]
    ref = make(ref_params)
    if over:
        over(ref, ref_params)
    for gs in grads:
        for p, g in zip(ref_params, gs):
            p.grad = g.clone()
        ref.step()
    ranks = []
    for rank in range(world):
        params = _model_params()
        opt = make(params)
        if over:
            over(opt, params)
        flat, lo, hi = _partition(params, world, rank)
        total = flat.numel() * world
        opt.param_groups[0]["params"] = [flat]
        for gs in grads:
            flat.grad = _flat_grad(params, gs, lo, hi, total)
            opt.step()
        ranks.append((opt, params, flat, lo, hi))
    return ref, ref_params, ranks


@pytest.mark.parametrize("world", [1, 2, 3])
def test_partition_steps_each_parameter_as_a_whole_one(world):
    """Every element of the partitions equals the reference's parameter: 8-bit blocks on each parameter's grid,
    32-bit states below min_8bit_size, one step count."""
    ref, ref_params, ranks = _run(world)
    whole = torch.cat([p.detach().reshape(-1) for p in ref_params])
    for opt, params, flat, lo, hi in ranks:
        n = min(hi, whole.numel()) - lo
        got = flat.detach()[:max(n, 0)]
        want = whole[lo:lo + max(n, 0)]
        if world == 1:
            assert torch.equal(got, want)
        else:  # a parameter cut between ranks has its cut block scaled on each side
            assert torch.allclose(got, want, rtol=0, atol=2e-3)
        segs = opt.partition_segments(flat)
        for s in segs:
            assert s.bits == (8 if s.param.numel() >= 4096 else 32), s.name


def test_cut_parameter_blocks_follow_the_parameter_grid():
    """At 2 ranks the (40, 130) weight is cut at an element that is no block boundary: the state of every whole
    block equals the reference's bit for bit; the cut block's two halves have a scale each."""
    ref, ref_params, ranks = _run(2, steps=1)
    (opt0, p0, f0, lo0, hi0), (opt1, p1, f1, lo1, hi1) = ranks
    cut = [s for s in opt1.partition_segments(f1) if s.offset > 0]
    assert cut and cut[0].offset % 256 != 0
    seg = cut[0]
    ref_state = ref.state[ref_params[[tuple(q.shape) for q in ref_params].index(tuple(seg.param.shape))]]
    codes = opt1.state[f1]["state1"][seg.first:seg.first + seg.numel]
    ref_codes = ref_state["state1"].reshape(-1)[seg.offset:seg.offset + seg.numel]
    head = (-seg.offset) % 256
    assert torch.equal(codes[head:], ref_codes[head:])
    scales = opt1.state[f1]["absmax1"][seg.scale + 1:seg.scale + seg.num_scales()]
    assert torch.equal(scales, ref_state["absmax1"][seg.offset // 256 + 1:])


TRUST_RATIO = [lambda ps: zero8.optim.LAMB8bit(ps, lr=1e-2, weight_decay=1e-2, min_8bit_size=4096),
               lambda ps: zero8.optim.LARS8bit(ps, lr=1.0, momentum=0.9, weight_decay=1e-3, min_8bit_size=4096)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("make", TRUST_RATIO, ids=["LAMB8bit", "LARS8bit"])
def test_trust_ratio_of_a_cut_parameter_is_one_over_its_fragment(make, world):
    """LAMB and LARS take one trust ratio over each fragment, also over one whose head is a block cut by the
    partition boundary (a scale of its own): every rank's partition and states are, bit for bit, those of the same
    optimizer stepping the whole parameters with the elements of other ranks zeroed (parameter and gradient),
    which add nothing to the norms."""
    steps = 3
    grads = [[torch.randn(p.shape) for p in _model_params()] for _ in range(steps)]
    head_cut = 0
    for rank in range(world):
        params = _model_params()
        opt = make(params)
        flat, lo, hi = _partition(params, world, rank)
        ref_params, masks, at = _model_params(), [], 0
        for q in ref_params:
            index = torch.arange(at, at + q.numel()).reshape(q.shape)
            masks.append((index >= lo) & (index < hi))
            at += q.numel()
            q.data.mul_(masks[-1])
        ref = make(ref_params)
        opt.param_groups[0]["params"] = [flat]
        for gs in grads:
            flat.grad = _flat_grad(params, gs, lo, hi, flat.numel() * world)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the cut parameters' warning
                opt.step()
            for q, g, m in zip(ref_params, gs, masks):
                q.grad = g * m
            ref.step()
        whole = torch.cat([q.detach().reshape(-1) for q in ref_params])
        n = min(hi, whole.numel()) - lo
        assert torch.equal(flat.detach()[:n], whole[lo:lo + n]), f"rank {rank}"
        for seg in opt.partition_segments(flat):
            head_cut += seg.bits == 8 and 0 < (-seg.offset) % seg.block < seg.numel
            if seg.bits == 8:
                block = seg.offset // seg.block
                ref_state = ref.state[ref_params[next(i for i, q in enumerate(params) if q is seg.param)]]
                for i in range(1, opt.num_states + 1):
                    codes = opt.state[flat][f"state{i}"][seg.first:seg.first + seg.numel]
                    scales = opt.state[flat][f"absmax{i}"][seg.scale:seg.scale + seg.num_scales()]
                    assert torch.equal(codes, ref_state[f"state{i}"].reshape(-1)[seg.offset:seg.offset + seg.numel])
                    assert torch.equal(scales, ref_state[f"absmax{i}"][block:block + seg.num_scales()])
    assert head_cut  # the case of two kernel calls per fragment before


def test_lamb_cut_head_block_shares_the_fragment_trust_ratio():
    """The case of the review: a fragment of 4900 elements whose first 156 (the cut head block) are 10 and the
    rest 1, gradients 1, no weight decay: LAMB's first update is m_hat / (sqrt(v_hat) + eps), about 1 per element,
    so every element moves by lr times one ratio, ||w|| / ||u|| over the fragment (2.04), not 10 for the head and 1
    for the rest."""
    n, off = 5000, 100
    p = torch.nn.Parameter(torch.ones(n))
    opt = zero8.optim.LAMB8bit([p], lr=1e-2, min_8bit_size=0, weight_decay=0.0)
    p._hp_mapping = _Mapping(0, off, n - off)
    w = torch.ones(n - off)
    head = (-off) % 256
    w[:head] = 10.0
    flat = w.clone().requires_grad_(True)
    opt.param_groups[0]["params"] = [flat]
    flat.grad = torch.ones(n - off)
    with pytest.warns(UserWarning, match="taken over this rank's fragment") as caught:
        opt.step()
    assert caught[0].filename == __file__  # the caller of step(), past torch's wrappers around it
    assert [(s.offset, s.numel) for s in opt.partition_segments(flat)] == [(off, n - off)]
    u = 1.0 / (1.0 + 1e-8)  # m_hat / (sqrt(v_hat) + eps) of a gradient of 1 at step 1, float64
    ratio = w.double().norm() / (u * (n - off) ** 0.5)
    moved = (w.double() - flat.detach().double()) / 1e-2
    # Float32 rounding of the parameters' update (w - lr * r * u at |w| <= 10) over lr.
    torch.testing.assert_close(moved, torch.full_like(moved, float(ratio) * u), rtol=0, atol=10 * 2**-23 / 1e-2)


def test_overrides_and_names_apply_per_parameter():
    def over(opt, params):
        opt.override_config(params[0], optim_bits=32)  # 6144 elements: 8-bit by size, 32-bit by override
        opt.override_config(params[4], lr=0.0)

    ref, ref_params, ranks = _run(2, over=over)
    for opt, params, flat, lo, hi in ranks:
        for s in opt.partition_segments(flat):
            if s.param is params[0]:
                assert s.bits == 32
            if s.param is params[4]:
                torch.testing.assert_close(flat.detach()[s.start:s.start + s.numel],
                                           ref_params[4].detach().reshape(-1)[s.offset:s.offset + s.numel],
                                           rtol=0, atol=0)


def test_state_dict_round_trip_is_exact_and_loads_torch_states():
    _, _, ranks = _run(2)
    opt, params, flat, lo, hi = ranks[1]
    sd = opt.state_dict()
    assert sd["state"][0][LAYOUT_KEY] == tuple(s.record() for s in opt.partition_segments(flat))
    params2 = _model_params()
    opt2 = zero8.optim.AdamW8bit(params2, lr=1e-2, min_8bit_size=4096)
    flat2, *_ = _partition(params2, 2, 1)
    opt2.param_groups[0]["params"] = [flat2]
    opt2.load_state_dict(sd)
    for k, v in opt.state[flat].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, opt2.state[flat2][k]), k
    # torch's AdamW state of the partition (a ZeRO checkpoint of torch.optim.AdamW): quantized per segment.
    exp_avg = torch.randn(flat.numel()) * 1e-2
    exp_avg_sq = torch.rand(flat.numel()) * 1e-4
    torch_sd = {"state": {0: {"step": torch.tensor(5.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}},
                "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                  "weight_decay": 0.01, "amsgrad": False, "foreach": None, "maximize": False,
                                  "capturable": False, "differentiable": False, "fused": None,
                                  "decoupled_weight_decay": True}]}
    opt2.load_state_dict(torch_sd)
    st = opt2.state[flat2]
    assert st["step"] == 5 and opt2.param_groups[0]["lr"] == 1e-3
    from zero8.optim.partition import decode_partition_state
    m, v = decode_partition_state(st, st[LAYOUT_KEY], flat2.numel(), 2, "test")
    used = torch.zeros(flat2.numel(), dtype=torch.bool)
    for s in opt2.partition_segments(flat2):
        used[s.start:s.start + s.numel] = True
    # 8-bit dynamic codes: within 1% of the largest value (the map's widest gap near its ends is 1/127).
    torch.testing.assert_close(m[used], exp_avg[used], rtol=0, atol=0.01 * float(exp_avg.abs().max()))
    torch.testing.assert_close(v[used], exp_avg_sq[used], rtol=0, atol=0.01 * float(exp_avg_sq.max()))


def test_universal_load_states_are_adopted_at_the_next_step():
    """DeepSpeed's universal load writes exp_avg/exp_avg_sq/step into the partition's state and torch's group
    keys into the group; the next step quantizes them per segment."""
    _, _, ranks = _run(1, steps=1)
    opt, params, flat, lo, hi = ranks[0]
    exp_avg = torch.randn(flat.numel()) * 1e-3
    st = opt.state[flat]
    st["exp_avg"] = exp_avg.clone()
    st["exp_avg_sq"] = torch.rand(flat.numel()) * 1e-6
    st["step"] = 7
    opt.param_groups[0].update(amsgrad=False, foreach=None, zero8_algorithm="adam")
    sd = opt.state_dict()
    assert "exp_avg" not in sd["state"][0] and sd["state"][0]["step"] == 7
    assert "amsgrad" not in opt.param_groups[0]
    opt.param_groups[0]["amsgrad"] = True
    opt.state[flat]["exp_avg"] = exp_avg
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()


def test_master_weights_override_warns_naming_the_tensor():
    params = _model_params()
    opt = zero8.optim.AdamW8bit(params, lr=1e-2)
    opt.set_param_names([(f"layer{i}.w", p) for i, p in enumerate(params)])
    opt.override_config(params[3], master_weights=False)
    flat, lo, hi = _partition(params, 1, 0)
    opt.param_groups[0]["params"] = [flat]
    flat.grad = torch.zeros_like(flat)
    with pytest.warns(UserWarning, match="layer3.w"):
        opt.step()


def test_embedding_rule_of_zero8_deepspeed():
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 100))
    opt = zero8.deepspeed.optimizer(model, "AdamW8bit", lr=1e-3, min_8bit_size=16)
    flat, lo, hi = _partition(list(model.parameters()), 1, 0)
    opt.param_groups[0]["params"] = [flat]
    flat.grad = torch.randn_like(flat)
    opt.step()
    bits = {s.name: s.bits for s in opt.partition_segments(flat)}
    assert bits == {"0.weight": 32, "1.weight": 8, "1.bias": 8}
    opt2 = zero8.deepspeed.optimizer(model, "AdamW8bit", lr=1e-3, min_8bit_size=16, fp32_embeddings=False)
    assert "optim_bits" not in opt2.overrides_for(model[0].weight)


def test_trainer_cls_and_kwargs_take_training_arguments():
    args = types.SimpleNamespace(learning_rate=5e-4, weight_decay=0.1, adam_epsilon=1e-7, adam_beta1=0.8,
                                 adam_beta2=0.95)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10))
    cls, kwargs = zero8.deepspeed.trainer_optimizer_cls_and_kwargs(model, args, lr=1e-3)
    assert kwargs["lr"] == 1e-3 and kwargs["betas"] == (0.8, 0.95) and kwargs["eps"] == 1e-7
    opt = cls([{"params": [model[1].weight], "weight_decay": 0.1},
               {"params": [model[0].weight, model[1].bias], "weight_decay": 0.0}], **kwargs)
    assert isinstance(opt, zero8.optim.AdamW8bit) and type(opt).__name__ == "AdamW8bit"
    assert opt.overrides_for(model[0].weight) == {"optim_bits": 32}


@pytest.mark.cuda
@pytest.mark.parametrize("make", [lambda ps: zero8.optim.AdamW8bit(ps, lr=1e-2, min_8bit_size=4096),
                                  lambda ps: zero8.optim.Lion8bit(ps, lr=1e-3, min_8bit_size=4096)] + TRUST_RATIO,
                         ids=["AdamW8bit", "Lion8bit", "LAMB8bit", "LARS8bit"])
def test_cuda_partition_steps_as_the_cpu_one(make):
    """DeepSpeed on a GPU hands CUDA partitions: every segment steps with the CUDA kernels, its states on the
    partition's device, to the same bits as the CPU partition (8-bit, 32-bit and cut segments at 2 ranks; LAMB and
    LARS through the padded copy of a fragment whose head block is cut, their norms summed on the device in another
    order, as test_cuda_optim.py compares them), and the state dict loads back onto the GPU."""
    from cuda_util import REASON, assert_same_bits
    if REASON is not None:
        pytest.skip(REASON)
    grads = [[torch.randn(p.shape) for p in _model_params()] for _ in range(3)]
    for rank in range(2):
        out = {}
        for dev in ("cpu", "cuda"):
            params = _model_params()
            opt = make(params)
            flat, lo, hi = _partition(params, 2, rank)
            flat = flat.detach().to(dev).requires_grad_(True)
            opt.param_groups[0]["params"] = [flat]
            for gs in grads:
                flat.grad = _flat_grad(params, gs, lo, hi, flat.numel() * 2).to(dev)
                opt.step()
            out[dev] = (opt, flat, params)
        (copt, cflat, _), (gopt, gflat, gparams) = out["cpu"], out["cuda"]
        assert_same_bits(gflat.detach(), cflat.detach(), f"rank {rank} partition")
        for k, v in copt.state[cflat].items():
            if isinstance(v, torch.Tensor):
                assert gopt.state[gflat][k].device.type == "cuda", k
                assert_same_bits(gopt.state[gflat][k], v, f"rank {rank} state {k}")
        sd = gopt.state_dict()
        again = make(gparams)  # the parameters that carry DeepSpeed's mapping into gflat
        again.param_groups[0]["params"] = [gflat]
        again.load_state_dict(sd)
        for k, v in gopt.state[gflat].items():
            if isinstance(v, torch.Tensor):
                assert_same_bits(again.state[gflat][k], v, f"rank {rank} loaded state {k}")


@pytest.mark.cuda
def test_cuda_partition_lamb_cut_fragment_steps_without_a_host_wait():
    """The padded copy of a LAMB fragment whose head block is cut is queued on the step's stream with the kernel:
    a step on a side stream held busy returns before the GPU has run it, and gives the bits of the CPU's."""
    from cuda_util import REASON, assert_same_bits, busy
    if REASON is not None:
        pytest.skip(REASON)
    grads = [[torch.randn(p.shape) for p in _model_params()] for _ in range(2)]
    out = {}
    for dev in ("cpu", "cuda"):
        params = _model_params()
        opt = TRUST_RATIO[0](params)
        flat, lo, hi = _partition(params, 2, 1)
        flat = flat.detach().to(dev).requires_grad_(True)
        opt.param_groups[0]["params"] = [flat]
        assert any(s.head_cut() for s in opt.partition_segments(flat))
        staged = [_flat_grad(params, gs, lo, hi, flat.numel() * 2).to(dev) for gs in grads]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the cut parameters' warning
            flat.grad = staged[0].clone()
            opt.step()  # makes the states
            if dev == "cpu":
                flat.grad = staged[1]
                opt.step()
            else:
                torch.cuda.synchronize()
                s = torch.cuda.Stream()
                busy(s)
                with torch.cuda.stream(s):
                    flat.grad.copy_(staged[1])
                    opt.step()
                    assert not s.query(), "the partition's step waited for the GPU"
                s.synchronize()
        out[dev] = (opt, flat)
    (copt, cflat), (gopt, gflat) = out["cpu"], out["cuda"]
    assert_same_bits(gflat.detach(), cflat.detach(), "partition")
    for k, v in copt.state[cflat].items():
        if isinstance(v, torch.Tensor):
            assert_same_bits(gopt.state[gflat][k], v, f"state {k}")
