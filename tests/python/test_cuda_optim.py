"""zero8.optim on CUDA parameters against the same optimizer on the CPU: every algorithm, 8-bit and 32-bit
states, float32 and bfloat16 parameters (with and without a float32 master), several steps, the same
parameters, codes, scales and masters bit for bit (the fused CUDA step runs the CPU's ZERO8_HD element math,
built with --fmad=false). LAMB and LARS compute their norms on the device, in double, summed in another
order than the CPU's: their trust ratio, rounded once to float, could differ only where that double sum
straddles a float rounding boundary (about 1e-9 per ratio), so they are compared bit for bit too.
Also: states live on the parameter's device and state dicts move between devices as torch.optim's do, the
step runs on the current stream with no host wait, and mixed devices fail naming both tensors.
Marked `cuda`; skipped, saying why, without a CUDA build or a GPU.
"""

from __future__ import annotations

import pytest
import torch

import zero8
from zero8 import optim as zo

from cuda_util import CUDA, DEV, assert_close_to_reference, assert_same_bits, busy

pytestmark = CUDA

# (class, constructor arguments): hyperparameters that exercise every state and term.
ALGOS = [
    (zo.Adam, dict(lr=1e-3, weight_decay=0.01)),
    (zo.AdamW, dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)),
    (zo.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-4, nesterov=True)),
    (zo.Lion, dict(lr=1e-4, weight_decay=0.01)),
    (zo.RMSprop, dict(lr=1e-3, alpha=0.99, weight_decay=1e-4)),
    (zo.Adagrad, dict(lr=1e-2, initial_accumulator_value=0.1, lr_decay=1e-3)),
    (zo.LAMB, dict(lr=1e-3, weight_decay=0.01)),
    (zo.LARS, dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)),
]
ALGO_IDS = [cls.__name__ for cls, _ in ALGOS]
STEPS = 4
# A matrix with a partial last state block (6499 = 25 * 256 + 99), and a vector below min_8bit_size, which
# keeps 32-bit states under an 8-bit optimizer.
SHAPES = [(67, 97), (300,)]


def make_params(dtype: torch.dtype, device) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype).to(device)) for s in SHAPES]


def grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    # Gradients over decades, as real ones are, so blocks get very different scales.
    return [(torch.randn(*s, generator=g) * 10.0 ** torch.randint(-4, 1, s, generator=g)).to(dtype) for s in SHAPES]


def compare_states(opt_d, opt_c, params_d, params_c, what: str) -> None:
    for i, (pd, pc) in enumerate(zip(params_d, params_c)):
        assert_same_bits(pd.detach(), pc.detach(), f"{what}: param {i}")
        sd, sc = opt_d.state[pd], opt_c.state[pc]
        assert sd["step"] == sc["step"]
        assert set(sd) == set(sc), (set(sd), set(sc))
        for key, value in sc.items():
            if isinstance(value, torch.Tensor):
                assert sd[key].device == pd.device, f"{what}: state {key} of param {i} is on {sd[key].device}"
                assert_same_bits(sd[key], value, f"{what}: state {key} of param {i}")


def run_both(cls, kwargs, dtype, steps=STEPS, **opt_kwargs):
    params_c, params_d = make_params(dtype, "cpu"), make_params(dtype, DEV)
    opt_c, opt_d = cls(params_c, **kwargs, **opt_kwargs), cls(params_d, **kwargs, **opt_kwargs)
    for step in range(steps):
        for pc, pd, g in zip(params_c, params_d, grads(step, dtype)):
            pc.grad, pd.grad = g, g.to(DEV)
        opt_c.step()
        opt_d.step()
        compare_states(opt_d, opt_c, params_d, params_c, f"{cls.__name__} step {step + 1}")
    return opt_c, opt_d, params_c, params_d


@pytest.mark.parametrize("cls,kwargs", ALGOS, ids=ALGO_IDS)
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_match_the_cpu(cls, kwargs, bits, dtype):
    opt_c, _, _, _ = run_both(cls, kwargs, dtype, optim_bits=bits)
    want = torch.uint8 if bits == 8 else torch.float32
    assert opt_c.state[next(iter(opt_c.state))]["state1"].dtype == want  # the matrix got the asked-for states


@pytest.mark.parametrize("cls,kwargs", [ALGOS[1], ALGOS[6]], ids=["AdamW", "LAMB"])
def test_bf16_without_master_weights_matches_the_cpu(cls, kwargs):
    run_both(cls, kwargs, torch.bfloat16, optim_bits=8, master_weights=False)


def test_block_size_and_strided_parameters_match_the_cpu():
    # A transposed (strided) parameter is stepped through a contiguous copy on both sides, and copied back.
    g = torch.Generator().manual_seed(1)
    base = torch.randn(96, 80, generator=g)
    pc = torch.nn.Parameter(base.clone().t())
    pd = torch.nn.Parameter(base.to(DEV).t())
    opt_c, opt_d = zo.AdamW8bit([pc], block_size=1024), zo.AdamW8bit([pd], block_size=1024)
    for _ in range(3):
        grad = torch.randn(96, 80, generator=g).t()
        pc.grad, pd.grad = grad, grad.to(DEV)
        opt_c.step()
        opt_d.step()
    assert pd.stride() == pc.stride()
    compare_states(opt_d, opt_c, [pd], [pc], "strided AdamW8bit")


def test_state_dict_moves_between_devices():
    # CUDA -> CPU -> CUDA as torch.optim: a state dict loads onto each parameter's device, and training goes
    # on with the same bits wherever it is loaded.
    cls, kwargs = ALGOS[1]
    opt_c, opt_d, params_c, params_d = run_both(cls, kwargs, torch.bfloat16, steps=2, optim_bits=8)
    saved = opt_d.state_dict()
    params_c2 = [torch.nn.Parameter(p.detach().cpu().clone()) for p in params_d]
    opt_c2 = cls(params_c2, **kwargs, optim_bits=8)
    opt_c2.load_state_dict(saved)
    for p in params_c2:
        assert all(t.device.type == "cpu" for t in opt_c2.state[p].values() if isinstance(t, torch.Tensor))
    compare_states(opt_c2, opt_c, params_c2, params_c, "loaded on the CPU")
    params_d2 = [torch.nn.Parameter(p.detach().to(DEV, copy=True)) for p in params_c2]
    opt_d2 = cls(params_d2, **kwargs, optim_bits=8)
    opt_d2.load_state_dict(opt_c2.state_dict())
    for step in range(2, 4):
        gs = grads(step, torch.bfloat16)
        for group in (params_c, params_d, params_c2, params_d2):
            for p, g in zip(group, gs):
                p.grad = g.to(p.device)
        for opt in (opt_c, opt_d, opt_c2, opt_d2):
            opt.step()
        compare_states(opt_d2, opt_c, params_d2, params_c, f"reloaded on CUDA, step {step + 1}")
        compare_states(opt_c2, opt_c, params_c2, params_c, f"reloaded on the CPU, step {step + 1}")


def test_states_on_another_device_are_refused_until_moved():
    p = torch.nn.Parameter(torch.randn(64, 80))
    opt = zo.AdamW8bit([p])
    p.grad = torch.randn(64, 80)
    opt.step()  # states on the CPU
    p.data = p.data.to(DEV)
    p.grad = p.grad.to(DEV)
    with pytest.raises(zero8.Zero8ValueError, match=r"state 'state1' of param_groups\[0\]\['params'\]\[0\] is on "
                                                    r"cpu but the parameter is on cuda:\d"):
        opt.step()
    opt.load_state_dict(opt.state_dict())  # places each state on its parameter's device
    assert opt.state[p]["state1"].device == p.device
    opt.step()


def test_mixed_parameter_and_gradient_devices_name_both():
    p = torch.nn.Parameter(torch.zeros(64, device=DEV))
    p.grad = torch.ones(64, device=DEV)
    p.data = torch.zeros(64)  # .data may change device; the gradient stays on the GPU
    opt = zo.Adam8bit([p])
    with pytest.raises(zero8.Zero8ValueError, match=r"\['params'\]\[0\]\.grad is on cuda:\d but "
                                                    r"param_groups\[0\]\['params'\]\[0\] is on cpu"):
        opt.step()


@pytest.mark.parametrize("cls,kwargs", [ALGOS[1], ALGOS[6], ALGOS[7]], ids=["AdamW", "LAMB", "LARS"])
def test_step_runs_on_the_current_stream_without_a_host_wait(cls, kwargs):
    # LAMB and LARS included: their norms and trust ratio stay on the device.
    params_c, params_d = make_params(torch.bfloat16, "cpu"), make_params(torch.bfloat16, DEV)
    opt_c, opt_d = cls(params_c, **kwargs, optim_bits=8), cls(params_d, **kwargs, optim_bits=8)
    for step in range(2):
        for p, g in zip(params_c, grads(step, torch.bfloat16)):
            p.grad = g
        opt_c.step()
    # On the GPU the first step as usual (it makes the states), the second on a side stream whose
    # gradients are ready only after a busy wait: a step on another stream would read the old ones.
    for p, g in zip(params_d, grads(0, torch.bfloat16)):
        p.grad = g.to(DEV)
    opt_d.step()
    staged = [g.to(DEV) for g in grads(1, torch.bfloat16)]
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    busy(s)
    with torch.cuda.stream(s):
        for p, g in zip(params_d, staged):
            p.grad.copy_(g)
        opt_d.step()
        assert not s.query(), f"{cls.__name__}.step waited for the GPU"
    s.synchronize()
    compare_states(opt_d, opt_c, params_d, params_c, f"{cls.__name__} on a side stream")


@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_step_refuses_cuda_graph_capture(first):
    # Captured, the step would replay with this step's count and lr (host values in the kernel's arguments), and a
    # first step waits for copies to the GPU: refused before anything is queued, the optimizer unchanged, and the
    # capture (of nothing) ends cleanly.
    params = make_params(torch.float32, DEV)
    opt = zo.AdamW(params, lr=1e-3, optim_bits=8)
    for p, g in zip(params, grads(0, torch.float32)):
        p.grad = g.to(DEV)
    if not first:
        opt.step()
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in params]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(zero8.Zero8NotSupportedError, match=r"AdamW\.step\(\) was called during CUDA graph capture"):
        with torch.cuda.graph(graph):
            opt.step()
    assert not torch.cuda.is_current_stream_capturing()
    for p, b in zip(params, before):
        assert_same_bits(p.detach(), b, "a parameter after the refused step")
        assert opt.state[p].get("step", 0) == (0 if first else 1)
    opt.step()  # outside the graph, as the message says
    assert all(opt.state[p]["step"] == (1 if first else 2) for p in params)


def test_stable_embedding_on_the_gpu():
    # The lookup and the layer norm are torch's (reductions in another order on the GPU: compared with a
    # float64 reference), and the weight keeps 32-bit optimizer states, on the GPU.
    torch.manual_seed(0)
    emb_c = zero8.nn.StableEmbedding(1000, 64)
    emb_d = zero8.nn.StableEmbedding(1000, 64).to(DEV)
    emb_d.load_state_dict(emb_c.state_dict())
    idx = torch.randint(0, 1000, (32, 16), generator=torch.Generator().manual_seed(1))
    out_c, out_d = emb_c(idx), emb_d(idx.to(DEV))
    w64 = emb_c.weight.detach().double().requires_grad_()
    ref = torch.nn.functional.layer_norm(torch.nn.functional.embedding(idx, w64), (64,),
                                         emb_c.norm.weight.detach().double(), emb_c.norm.bias.detach().double())
    assert_close_to_reference(out_d, out_c, ref, "StableEmbedding forward")
    for out in (out_c, out_d, ref):
        out.square().mean().backward()
    assert_close_to_reference(emb_d.weight.grad, emb_c.weight.grad, w64.grad, "StableEmbedding weight gradient")
    opt_d = zo.Adam8bit(emb_d.parameters())
    opt_d.step()
    state = opt_d.state[emb_d.weight]
    assert state["state1"].dtype == torch.float32 and state["state1"].device == emb_d.weight.device
