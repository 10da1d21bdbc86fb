"""zero8.optim under FSDP2 (``fully_shard``) on K ranks, run by test_optim_fsdp2.py as ``torchrun --nproc_per_node K
python3 -m pytest tests/python/dist/dist_fsdp2.py`` (gloo on the CPU; NCCL on one GPU with ZERO8_FSDP2_DEVICE=cuda).

Every rank trains the same batches, so FSDP2's reduce-scatter hands each rank its shard of the whole gradient
(times K divided by K, which the reference repeats) and the sharded optimizer can be compared bit for bit with
the same optimizer stepping the unsharded model, which every rank runs itself: the parameters and the gathered
states (codes and block scales) must be equal. Checkpoints go through torch.distributed.checkpoint: saved at K
ranks into $ZERO8_FSDP2_CKPT/w<K>, and every checkpoint another world size saved there earlier is loaded here
(resharded) and must continue as the reference does.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zero8
import zero8.optim as zo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mpirun_util
from mpirun_util import init_torch_world  # noqa: E402

DEVICE, RANK, K = init_torch_world("ZERO8_FSDP2_DEVICE")
MESH = init_device_mesh(DEVICE, (K,))
CKPT = Path(os.environ["ZERO8_FSDP2_CKPT"]) if os.environ.get("ZERO8_FSDP2_CKPT") else None
UNALIGNED = "3.weight"  # shape (512, 300): its last dimension is not a multiple of the block, so 32-bit states


def make_model(dtype=torch.float32) -> torch.nn.Sequential:
    """Shapes for each case of the layout: blocks along a last dimension of whole blocks (0, 2), rows that K
    ranks split unevenly, some with none at K = 4 (4: 5 rows), a last dimension of 300 (3: 32-bit states), and
    1-dimensional biases (32-bit below min_8bit_size)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 768), torch.nn.GELU(), torch.nn.Linear(768, 300),
                               torch.nn.Linear(300, 512), torch.nn.Linear(512, 5)).to(DEVICE, dtype)


def sharded(model: torch.nn.Sequential) -> torch.nn.Sequential:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=MESH)
    fully_shard(model, mesh=MESH)
    return model


def make_opt(cls, model, reference: bool = False, **kw):
    opt = cls(model.parameters(), **kw)
    if reference:  # the unsharded reference keeps for this tensor what the sharded optimizer does
        opt.override_config(dict(model.named_parameters())[UNALIGNED], optim_bits=32)
    return opt


def train(model, opt, steps, world: int, dtype=torch.float32, reference: bool = False) -> None:
    """Steps on the same batches on every rank; the unsharded reference's gradient is multiplied and divided by
    the world size as FSDP2's reduce-scatter of K equal gradients computes it (for gloo: a sum then one
    division; exact for 2 and 4, rounded for 3)."""
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(16, 512, generator=g).to(DEVICE, dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        if reference:
            for p in model.parameters():
                p.grad.mul_(world).div_(world)
        opt.step()


def full(t):
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def mismatches(model, opt, ref, ropt) -> list:
    """Names of the parameters whose values, or whose optimizer states gathered, differ from the reference's."""
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        st, rs = opt.state[p], ropt.state[q]
        same = torch.equal(full(p.detach()), q.detach()) and st["step"] == rs["step"]
        for key in ("state1", "state2", "absmax1", "absmax2", "master"):
            if (key in st) != (key in rs):
                same = False
            elif key in st:
                same = same and torch.equal(full(st[key]).reshape(-1), rs[key].reshape(-1))
        if not same:
            bad.append(name)
    return bad


CASES = [(zo.AdamW8bit, {"lr": 1e-2, "min_8bit_size": 1024}, torch.float32),
         (zo.AdamW8bit, {"lr": 1e-2, "min_8bit_size": 1024}, torch.bfloat16),  # float32 masters as DTensors
         (zo.Lion8bit, {"lr": 1e-3, "min_8bit_size": 1024, "block_size": 128}, torch.float32),
         (zo.SGD8bit, {"lr": 1e-2, "momentum": 0.9, "min_8bit_size": 1024}, torch.float32),
         (zo.AdamW32bit, {"lr": 1e-2}, torch.float32)]


@pytest.mark.parametrize("cls, kw, dtype", CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_sharded_steps_equal_the_whole_tensors(cls, kw, dtype):
    """FSDP2's shards step to the bits of the unsharded parameters, the states with them (8-bit ones on the
    parameter's own block grid, so gathered they are the whole tensor's codes and scales); the one tensor
    whose last dimension is not whole blocks keeps 32-bit states and says so."""
    ref, model = make_model(dtype), sharded(make_model(dtype))
    ropt = make_opt(cls, ref, True, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = make_opt(cls, model, **kw)
        train(model, opt, range(3), K, dtype)
    train(ref, ropt, range(3), K, dtype, reference=True)
    assert mismatches(model, opt, ref, ropt) == []
    p = dict(model.named_parameters())
    eight = opt.optim_bits == 8
    assert (opt.state[p["0.weight"]]["state1"].dtype == torch.uint8) == eight
    assert opt.state[p[UNALIGNED]]["state1"].dtype == torch.float32
    assert opt.state[p["0.weight"]]["zero8_block"] == (opt.block_size if eight else 0)
    said = [str(w.message) for w in caught if "keeps 32-bit optimizer states" in str(w.message)]
    assert len(said) == (1 if eight else 0) and "(shape (512, 300))" in said[0] if eight else not said, said


def test_dcp_checkpoints_resume_bit_exactly_at_any_world_size():
    """torch.distributed.checkpoint saves the states sharded (get_state_dict / dcp.save); a load at this world
    size of a checkpoint saved at another (set_state_dict / dcp.load) continues as the unsharded reference
    does, bit for bit."""
    if CKPT is None:
        pytest.skip("ZERO8_FSDP2_CKPT names no checkpoint folder (test_optim_fsdp2.py sets one)")
    kw = {"lr": 1e-2, "min_8bit_size": 1024}
    model = sharded(make_model())
    opt = make_opt(zo.AdamW8bit, model, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, range(3), K)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(CKPT / f"w{K}"))
    dist.barrier()
    bad = {}
    for saved in sorted(CKPT.glob("w*")):
        world = int(saved.name[1:])
        model = sharded(make_model())
        opt = make_opt(zo.AdamW8bit, model, **kw)
        msd, osd = get_state_dict(model, opt)  # its template: states made by one step at lr 0
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(saved))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        ref = make_model()
        ropt = make_opt(zo.AdamW8bit, ref, True, **kw)
        train(ref, ropt, range(3), world, reference=True)
        train(ref, ropt, range(3, 5), K, reference=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train(model, opt, range(3, 5), K)
        bad[world] = mismatches(model, opt, ref, ropt)
    assert len(bad) >= 1 and all(v == [] for v in bad.values()), bad


def test_a_dcp_load_into_another_layout_is_refused_by_name():
    """A checkpoint of 8-bit states loaded where the optimizer keeps 32-bit ones: DCP copies the codes into the
    32-bit states as numbers, and the load names the state and the remedy instead of training on them."""
    if CKPT is None:
        pytest.skip("ZERO8_FSDP2_CKPT names no checkpoint folder (test_optim_fsdp2.py sets one)")
    saved = CKPT / f"w{K}"
    if not saved.exists():
        pytest.skip("runs after test_dcp_checkpoints_resume_bit_exactly_at_any_world_size, which saves")
    model = sharded(make_model())
    opt = zo.AdamW32bit(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(saved))
    with pytest.raises(zero8.Zero8ValueError, match=r"state1 was saved as 8-bit codes in blocks of 256 but arrives "
                                                    r"as torch.float32.*optim_bits, block_size and min_8bit_size"):
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def test_full_state_dicts_move_between_sharded_and_whole_tensors():
    """A full optimizer state dict (StateDictOptions(full_state_dict=True): the states gathered) loads into the
    optimizer of the unsharded model, and the unsharded optimizer's state dict loads into the sharded one
    (each rank cuts its shard), both bit for bit: training goes on as the reference does."""
    kw = {"lr": 1e-2, "min_8bit_size": 1024}
    model = sharded(make_model())
    opt = make_opt(zo.AdamW8bit, model, **kw)
    ref = make_model()
    ropt = make_opt(zo.AdamW8bit, ref, True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, range(3), K)
    train(ref, ropt, range(3), K, reference=True)
    names = [n for n, _ in ref.named_parameters()]
    gathered = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    whole = make_model()
    whole.load_state_dict(ref.state_dict())
    wopt = make_opt(zo.AdamW8bit, whole, True, **kw)
    wopt.load_state_dict({"state": {names.index(k): v for k, v in gathered["state"].items()},
                          "param_groups": [dict(gathered["param_groups"][0], params=list(range(len(names))))]})
    # The other way: the reference's state dict (parameters by index) into a new sharded optimizer, directly
    # and through set_optimizer_state_dict (FQNs, full_state_dict).
    back = sharded(make_model())
    set_model_state_dict(back, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    bopt = make_opt(zo.AdamW8bit, back, **kw)
    bopt.load_state_dict(ropt.state_dict())
    via = sharded(make_model())
    set_model_state_dict(via, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    vopt = make_opt(zo.AdamW8bit, via, **kw)
    fqn_sd = ropt.state_dict()
    fqn_sd = {"state": {names[i]: v for i, v in fqn_sd["state"].items()},
              "param_groups": [dict(fqn_sd["param_groups"][0], params=names)]}
    set_optimizer_state_dict(via, vopt, fqn_sd, options=StateDictOptions(full_state_dict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m, o in ((whole, wopt), (back, bopt), (via, vopt)):
            train(m, o, range(3, 5), K, reference=m is whole)
    train(ref, ropt, range(3, 5), K, reference=True)
    assert mismatches(whole, wopt, ref, ropt) == []
    assert mismatches(back, bopt, ref, ropt) == []
    assert mismatches(via, vopt, ref, ropt) == []


@pytest.mark.parametrize("block", [256, 128])
def test_states_of_another_layout_convert_as_for_whole_tensors(block):
    """A whole-tensor state dict whose blocks are not this optimizer's (another block size; and 8-bit states of
    the (512, 300) weight in flat blocks that straddle its rows, which the sharded optimizer keeps 32-bit) loads
    into the sharded optimizer as into the unsharded one: decoded (locally where the saved blocks lie on the
    rows, else whole) and encoded again, to the same bits."""
    kw = {"lr": 1e-2, "min_8bit_size": 1024}
    ref = make_model()
    ropt = make_opt(zo.AdamW8bit, ref, **kw)  # no override: 8-bit states for all of its 2-d tensors
    train(ref, ropt, range(3), K, reference=True)
    saved = ropt.state_dict()
    model = sharded(make_model())
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    opt = make_opt(zo.AdamW8bit, model, block_size=block, **kw)
    opt.load_state_dict(saved)
    whole = make_model()
    whole.load_state_dict(ref.state_dict())
    wopt = make_opt(zo.AdamW8bit, whole, True, block_size=block, **kw)
    wopt.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, range(3, 5), K)
    train(whole, wopt, range(3, 5), K, reference=True)
    assert mismatches(model, opt, whole, wopt) == []
    assert opt.state[dict(model.named_parameters())[UNALIGNED]]["state1"].dtype == torch.float32


def test_a_torch_adamw_state_loads_quantized():
    """torch.optim.AdamW's state dict (exp_avg, exp_avg_sq of the whole tensors) loads into the sharded 8-bit
    optimizer as into the unsharded one: each rank quantizes its shard, on the parameter's block grid."""
    kw = {"lr": 1e-2, "min_8bit_size": 1024}
    ref = make_model()
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train(ref, topt, range(3), K, reference=True)
    model = sharded(make_model())
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    opt = make_opt(zo.AdamW8bit, model, **kw)
    opt.load_state_dict(topt.state_dict())
    whole = make_model()
    whole.load_state_dict(ref.state_dict())
    wopt = make_opt(zo.AdamW8bit, whole, True, **kw)
    wopt.load_state_dict(topt.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, range(3, 5), K)
    train(whole, wopt, range(3, 5), K, reference=True)
    assert mismatches(model, opt, whole, wopt) == []
    assert opt.state[dict(model.named_parameters())["0.weight"]]["state1"].dtype == torch.uint8


def test_hsdp_on_a_2d_mesh():
    """HSDP (fully_shard on a 2-d mesh: replicated over the first dimension, sharded over the second) gives
    placements (Replicate(), Shard(0)); the states take them too and step to the unsharded bits."""
    mesh = init_device_mesh(DEVICE, (1, K), mesh_dim_names=("replicate", "shard"))
    ref, model = make_model(), make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = {"lr": 1e-2, "min_8bit_size": 1024}
    ropt = make_opt(zo.AdamW8bit, ref, True, **kw)
    opt = make_opt(zo.AdamW8bit, model, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, range(3), K)
    train(ref, ropt, range(3), K, reference=True)
    assert mismatches(model, opt, ref, ropt) == []
    st = opt.state[dict(model.named_parameters())["0.weight"]]
    assert [type(pl).__name__ for pl in st["absmax1"].placements] == ["Replicate", "Shard"]


# ---------------------------------------------------------------------------------------------------
# zero8.fsdp: gradients, parameters and HSDP's replicas in int8 blocks

def fit_a_target(model, steps: int, before_forward=None) -> list:
    """AdamW8bit fitting a fixed linear map on the same batches on every rank; the losses."""
    opt = zo.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=1024)
    g = torch.Generator().manual_seed(11)
    target = torch.nn.Linear(512, 5).to(DEVICE)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            x = torch.randn(32, 512, generator=g).to(DEVICE)
            if before_forward is not None:
                before_forward()
            loss = (model(x).float() - target(x).detach()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def weights_used(layer) -> tuple:
    """Lists that collect the weight `layer` (an FSDP2 module) computes with in each forward and in each backward,
    copied: after FSDP2's own pre-forward and pre-backward gathers, whose hooks were registered first."""
    forward, backward = [], []

    def after_forward(m, args, out) -> None:  # None: the output stays
        out.register_hook(lambda grad: backward.append(m.weight.detach().clone()))

    layer.register_forward_pre_hook(lambda m, args: forward.append(m.weight.detach().clone()))
    layer.register_forward_hook(after_forward)
    return forward, backward


custom_reduce_scatter = pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp.FSDPModule, "set_custom_reduce_scatter"),
    reason=f"this PyTorch ({torch.__version__}) has no FSDPModule.set_custom_reduce_scatter")

def test_int8_reduce_scatter_sends_each_rank_its_pieces_in_8_bit_blocks():
    """Int8ReduceScatter on its own: every rank gets the sum, in rank order, of the other ranks' pieces for it
    encoded and decoded by zero8's codec (computed here from all the inputs), within the codes' error of the
    exact sum; AVG divides it by the ranks; a non-finite value spoils its block only; other ops are refused;
    bfloat16 gradients are summed in float32 and rounded once."""
    from zero8.fsdp import Int8ReduceScatter
    from zero8.functional import dequantize_blockwise, quantize_blockwise
    shard = 5000  # not whole blocks of 2048: each piece's last block is short
    g = torch.Generator().manual_seed(7 + RANK)
    x = (torch.randn(K * shard, generator=g) * torch.logspace(-3, 1, K * shard)).to(DEVICE)
    x[shard * ((RANK + 1) % K) + 4100] = float("inf") if RANK == 0 else 1.0  # rank 0's piece for rank 1 (or 0)
    every = [torch.empty_like(x) for _ in range(K)]
    dist.all_gather(every, x)
    comm = Int8ReduceScatter()
    out = torch.empty(shard, device=DEVICE)
    comm(out, x, dist.group.WORLD, dist.ReduceOp.SUM)
    want = torch.zeros(shard, device=DEVICE)
    for src in range(K):
        piece = every[src][RANK * shard:(RANK + 1) * shard].contiguous()
        codes, qs = quantize_blockwise(piece, blocksize=2048)
        want += dequantize_blockwise(codes, qs)
    exact = sum(e[RANK * shard:(RANK + 1) * shard] for e in every)
    avg = torch.empty(shard, device=DEVICE)
    comm(avg, x, dist.group.WORLD, dist.ReduceOp.AVG)
    spoiled = RANK == 1 % K  # rank 0's infinite element went to rank 1 (to itself on one rank)
    block = torch.zeros(shard, dtype=torch.bool, device=DEVICE)
    block[4096:] = spoiled  # the third block of 2048, the short one (4096..4999)
    assert torch.equal(out, want) or (spoiled and torch.equal(out[~block], want[~block]))
    assert torch.isfinite(out[~block]).all() and (not spoiled or not torch.isfinite(out[block]).any())
    rel = ((out - exact)[~block].norm() / exact[~block].norm()).item()
    assert 0 < rel < 2e-2, rel
    assert torch.allclose(avg[~block], out[~block] / K, rtol=0, atol=0)
    assert comm.calls == 2 and comm.elements == 2 * shard
    assert comm.wire_bytes == 2 * (K - 1) * (shard + 4 * 3) and comm.full_bytes == 2 * (K - 1) * shard * 4
    with pytest.raises(NotImplementedError, match="reduce op .*MAX.*set_force_sum_reduction_for_comms"):
        comm(out, x, dist.group.WORLD, dist.ReduceOp.MAX)
    # bfloat16 gradients (FSDP2's reduce_dtype): the pieces encoded from bfloat16, summed in float32, rounded once.
    xb = x.to(torch.bfloat16)
    every = [torch.empty_like(xb) for _ in range(K)]
    dist.all_gather(every, xb)
    outb = torch.empty(shard, dtype=torch.bfloat16, device=DEVICE)
    comm(outb, xb, dist.group.WORLD, dist.ReduceOp.SUM)
    want = torch.zeros(shard, device=DEVICE)
    for src in range(K):
        codes, qs = quantize_blockwise(every[src][RANK * shard:(RANK + 1) * shard].contiguous(), blocksize=2048)
        want += dequantize_blockwise(codes, absmax=qs.absmax, blocksize=2048)  # float32 values
    assert torch.equal(outb[~block], want.to(torch.bfloat16)[~block])
    assert comm.full_bytes == 2 * (K - 1) * shard * 4 + (K - 1) * shard * 2


@custom_reduce_scatter
def test_fsdp2_trains_with_int8_gradient_reduce_scatter():
    """int8_reduce_scatter on an FSDP2 model: training with 8-bit gradient pieces on the wire follows the float32
    reduce-scatter's (the same start, batches and optimizer), each rank sending about a quarter of the bytes. On
    one rank FSDP2 reduces nothing (it copies the gradients), so the two runs are the same."""
    import zero8.fsdp
    losses, STEPS = {}, 40
    for wire in ("fp32", "int8"):
        model = sharded(make_model())
        comm = zero8.fsdp.int8_reduce_scatter(model) if wire == "int8" else None
        losses[wire] = fit_a_target(model, STEPS)
    first, fp32, int8 = losses["fp32"][0], losses["fp32"][-1], losses["int8"][-1]
    if K == 1:
        assert comm.calls == 0 and losses["int8"] == losses["fp32"]
        return
    fsdp_groups = 5  # the four Linear layers and the root (whose own parameters are none: it still reduces)
    assert comm.calls in (STEPS * 4, STEPS * fsdp_groups), comm.calls
    assert 0.25 < comm.wire_bytes / comm.full_bytes < 0.2506
    print(f"\nloss {first:.4f} -> fp32 wire {fp32:.4f}, int8 wire {int8:.4f}")
    assert losses["int8"][0] == first and fp32 < 0.5 * first and int8 < 0.5 * first
    assert abs(int8 - fp32) < 0.05 * fp32, (fp32, int8)


custom_all_gather = pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp.FSDPModule, "set_custom_all_gather"),
    reason=f"this PyTorch ({torch.__version__}) has no FSDPModule.set_custom_all_gather")


def test_int8_all_gather_gives_every_rank_the_same_decoded_shards():
    """Int8AllGather on its own: every rank gets every rank's input encoded and decoded by zero8's codec (its
    own included, computed here from all the inputs), so all of them hold the same values, within the codes'
    error of the inputs; bfloat16 inputs are decoded into bfloat16; raw bytes (FSDP2's input when a group's
    parameters differ in dtype) are gathered as they are."""
    from zero8.fsdp import Int8AllGather
    from zero8.functional import dequantize_blockwise, quantize_blockwise
    shard = 5000  # not whole blocks of 2048
    g = torch.Generator().manual_seed(3 + RANK)
    x = (torch.randn(shard, generator=g) * torch.logspace(-3, 0, shard)).to(DEVICE)
    every = [torch.empty_like(x) for _ in range(K)]
    dist.all_gather(every, x)
    comm = Int8AllGather()
    out = torch.empty(K * shard, device=DEVICE)
    out[RANK * shard:(RANK + 1) * shard] = x  # FSDP2's input is this rank's slice of the output
    assert comm(out, out[RANK * shard:(RANK + 1) * shard], dist.group.WORLD) is None
    want = torch.cat([dequantize_blockwise(*quantize_blockwise(e, blocksize=2048)) for e in every])
    assert torch.equal(out, want)
    exact = torch.cat(every)
    rel = ((out - exact).norm() / exact.norm()).item()
    assert 0 < rel < 2e-2, rel
    assert comm.calls == 1 and comm.exact_calls == 0 and comm.elements == shard
    assert comm.wire_bytes == (K - 1) * (shard + 4 * 3) and comm.full_bytes == (K - 1) * shard * 4
    outb = torch.empty(K * shard, dtype=torch.bfloat16, device=DEVICE)
    comm(outb, x.to(torch.bfloat16), dist.group.WORLD)
    wantb = torch.cat([dequantize_blockwise(*quantize_blockwise(e.to(torch.bfloat16), blocksize=2048)).float()
                       for e in every])
    assert torch.equal(outb, wantb.to(torch.bfloat16))
    raw = torch.arange(16, dtype=torch.uint8, device=DEVICE) + RANK
    outr = torch.empty(K * 16, dtype=torch.uint8, device=DEVICE)
    comm(outr, raw, dist.group.WORLD)
    assert torch.equal(outr, torch.cat([torch.arange(16, dtype=torch.uint8, device=DEVICE) + r for r in range(K)]))
    assert comm.calls == 3 and comm.exact_calls == 1
    assert comm.full_bytes == (K - 1) * (shard * 4 + shard * 2 + 16)
    with pytest.raises(zero8.Zero8ValueError, match=f"Int8AllGather: the output has {K * shard + 1} elements, "
                                                    f"not {K} ranks x the input's {shard}"):
        comm(torch.empty(K * shard + 1, device=DEVICE), x, dist.group.WORLD)


@custom_all_gather
@custom_reduce_scatter
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-params"])
def test_fsdp2_trains_with_int8_parameters_and_gradients_on_the_wire(param_dtype):
    """int8_all_gather with int8_reduce_scatter: the forward computes with decoded weights, the same on every rank
    and within the codes' error of the exact sharded parameters (which the optimizer steps), and training
    follows FSDP2's own collectives', each rank sending about a quarter of the float32 bytes both ways (half of
    the bfloat16 all-gather's, with mixed precision's bfloat16 param_dtype). On one rank FSDP2 gathers nothing
    (it uses the shard), so the two runs are the same."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    import zero8.fsdp
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    losses, STEPS = {}, 40
    for wire in ("fp32", "int8"):
        model = make_model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=MESH, mp_policy=mp)
        fully_shard(model, mesh=MESH, mp_policy=mp)
        used, used_backward = weights_used(model[0])
        gather = zero8.fsdp.int8_all_gather(model) if wire == "int8" else None
        if wire == "int8":
            zero8.fsdp.int8_reduce_scatter(model)
        exact = []  # the sharded parameter before each forward (one rank: its data, copied)
        losses[wire] = fit_a_target(model, STEPS, lambda: exact.append(model[0].weight.full_tensor().detach().clone()))
    first, fp32, int8 = losses["fp32"][0], losses["fp32"][-1], losses["int8"][-1]
    w_used = used[-1]  # the weight the last forward computed with (in param_dtype)
    exact = exact[-1].to(w_used.dtype)
    if K == 1:
        assert gather.calls == 0 and losses["int8"] == losses["fp32"] and torch.equal(w_used, exact)
        return
    rel = ((w_used.float() - exact.float()).norm() / exact.float().norm()).item()
    assert 0 < rel < 2e-2, rel
    # the backward gathers the same exact shards again: the same codes, the forward's weights
    assert len(used_backward) == len(used) == STEPS and all(map(torch.equal, used, used_backward))
    replicas = [torch.empty_like(w_used) for _ in range(K)]
    dist.all_gather(replicas, w_used)
    assert all(torch.equal(r, w_used) for r in replicas)
    assert gather.calls >= STEPS * 4 and gather.exact_calls == 0, gather.calls  # forward, and backward's again
    assert gather.elements > 0 and gather.full_bytes == (K - 1) * gather.elements * (2 if param_dtype else 4)
    assert 1.0 < gather.wire_bytes / ((K - 1) * gather.elements) < 1.0025  # a byte, and a scale per 2048 elements
    print(f"\nloss {first:.4f} -> FSDP2's collectives {fp32:.4f}, int8 both ways {int8:.4f}")
    assert fp32 < 0.5 * first and int8 < 0.5 * first
    assert abs(int8 - fp32) < 0.05 * fp32, (fp32, int8)


@custom_all_gather
def test_int8_parameters_with_reshard_after_forward_to_fewer_ranks():
    """reshard_after_forward=<ranks>: after the forward FSDP2 keeps shards of the gathered (decoded) weights over a
    smaller group and gathers those for the backward. Int8AllGather moves them exactly, so the backward computes
    with the forward's weights bit for bit (encoded again, on other block boundaries, they would differ); the
    gathers from the sharded parameters stay in int8."""
    import zero8.fsdp
    if K < 4 or K % 2:
        pytest.skip(f"needs an even number of ranks >= 4 (a group of 2 inside the {K}); test_optim_fsdp2.py runs it "
                    f"at 4")
    model = make_model()
    for layer in list(model) + [model]:
        if isinstance(layer, torch.nn.Linear) or layer is model:
            fully_shard(layer, mesh=MESH, reshard_after_forward=2)
    # 2.weight (300 x 768): a rank's shard is not whole blocks, so blocks over the larger post-forward shards fall
    # elsewhere (0.weight's fall on the same boundaries, where encoding decoded values again changes nothing)
    forward, backward = weights_used(model[2])
    gather = zero8.fsdp.int8_all_gather(model)
    zero8.fsdp.int8_reduce_scatter(model)
    losses = fit_a_target(model, 5)
    assert len(forward) == len(backward) == 5 and all(map(torch.equal, forward, backward))
    assert 0 < gather.exact_calls < gather.calls, (gather.exact_calls, gather.calls)
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not hasattr(torch.distributed.fsdp.FSDPModule, "set_all_reduce_hook"),
                    reason=f"this PyTorch ({torch.__version__}) has no FSDPModule.set_all_reduce_hook")
def test_hsdp_with_the_replicas_all_reduce_in_int8():
    """HSDP on a (replicate, shard) mesh, each rank training on batches of its own: FSDP2 over the shard dimension
    with int8_replicate_all_reduce's hook over the replicate one trains as native HSDP (FSDP2's float32
    all-reduce) does, the replicas' shards staying bit for bit equal, at about a quarter of the all-reduce's
    bytes. A model on the 2-d mesh (native HSDP) is refused by name."""
    import zero8.fsdp
    R = 2 if K % 2 == 0 else K
    mesh = init_device_mesh(DEVICE, (R, K // R), mesh_dim_names=("replicate", "shard"))
    losses, STEPS = {}, 30
    for wire in ("native", "int8"):
        model = make_model()
        for layer in list(model) + [model]:
            if isinstance(layer, torch.nn.Linear) or layer is model:
                fully_shard(layer, mesh=mesh if wire == "native" else mesh["shard"])
        if wire == "native":
            with pytest.raises(zero8.Zero8ValueError, match="int8_replicate_all_reduce: parameter '0.weight' is "
                                                            "replicated over a dimension of its mesh"):
                zero8.fsdp.int8_replicate_all_reduce(model, mesh["replicate"].get_group())
        else:
            state = zero8.fsdp.int8_replicate_all_reduce(model, mesh["replicate"].get_group())
        opt = zo.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=1024)
        torch.manual_seed(1)
        target = torch.nn.Linear(512, 5).to(DEVICE)
        losses[wire] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(STEPS):
                x = torch.randn(32, 512, generator=torch.Generator().manual_seed(1000 * step + RANK)).to(DEVICE)
                loss = (model(x) - target(x).detach()).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                t = loss.detach().reshape(1)
                dist.all_reduce(t)
                losses[wire].append(t.item() / K)
    shards = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.empty_like(shards) for _ in range(R)]
    dist.all_gather(replicas, shards, group=mesh["replicate"].get_group())
    assert all(torch.equal(r, shards) for r in replicas)
    first, native, int8 = losses["native"][0], losses["native"][-1], losses["int8"][-1]
    print(f"\nloss {first:.4f} -> native HSDP {native:.4f}, int8 replicas' all-reduce {int8:.4f}")
    assert native < 0.9 * first and abs(int8 - native) < 0.05 * native, (native, int8)
    assert state.calls >= STEPS * 4, state.calls
    if R == 1:  # nothing to average: exact, nothing sent
        assert state.wire_bytes == 0 and losses["int8"] == losses["native"]
    else:
        assert 0.25 < state.wire_bytes / state.full_bytes < 0.2506


def test_int8_comms_need_fsdp_modules():
    import zero8.fsdp
    with pytest.raises(zero8.Zero8ValueError, match="no module of this model is wrapped by FSDP2's fully_shard"):
        zero8.fsdp.int8_reduce_scatter(make_model())
    with pytest.raises(zero8.Zero8ValueError, match="int8_all_gather: no module of this model is wrapped"):
        zero8.fsdp.int8_all_gather(make_model())
    with pytest.raises(zero8.Zero8ValueError, match="int8_replicate_all_reduce: replicate_group is a DeviceMesh, "
                                                    "not a ProcessGroup"):
        zero8.fsdp.int8_replicate_all_reduce(sharded(make_model()), MESH)
    with pytest.raises(zero8.Zero8ValueError, match="block_size must be a power of two in 64..4096, got 1000"):
        zero8.fsdp.Int8ReduceScatter(1000)
    with pytest.raises(zero8.Zero8ValueError, match="Int8AllGather: block_size must be a power of two"):
        zero8.fsdp.Int8AllGather(3)
