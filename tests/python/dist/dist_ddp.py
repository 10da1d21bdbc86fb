"""zero8.ddp's int8 gradient hook for DistributedDataParallel on K ranks, run by test_ddp_int8.py as ``torchrun
--nproc_per_node K python3 -m pytest tests/python/dist/dist_ddp.py`` (gloo on the CPU; with ZERO8_DDP_DEVICE=cuda
NCCL on one GPU, or gloo on ranks sharing one with ZERO8_TORCH_BACKEND=gloo). Each rank trains on batches of its
own; the replicas must stay bit for bit equal."""

from __future__ import annotations

import sys
import threading
import time
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zero8
import zero8.ddp
import zero8.functional
import zero8.optim as zo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mpirun_util
from mpirun_util import init_torch_world  # noqa: E402

DEVICE, RANK, K = init_torch_world("ZERO8_DDP_DEVICE")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 768), torch.nn.GELU(), torch.nn.Linear(768, 300),
                               torch.nn.Linear(300, 5)).to(DEVICE)


def train(model, opt, steps: int, target: torch.nn.Module, first_grads: list | None = None) -> list[float]:
    """`steps` steps on each rank's own batches; the losses averaged over the ranks. `first_grads`: gets the
    parameters' gradients of the first step."""
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            x = batch(step)
            loss = (model(x) - target(x).detach()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if step == 0 and first_grads is not None:
                first_grads.extend(p.grad.detach().clone() for p in model.parameters())
            opt.step()
            t = loss.detach().reshape(1)
            dist.all_reduce(t)
            losses.append(t.item() / K)
    return losses


def wrap(model):
    return DDP(model, device_ids=[torch.cuda.current_device()] if DEVICE == "cuda" else None,
               bucket_cap_mb=0.25)  # several buckets


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + RANK)  # each rank its own data
    return torch.randn(32, 512, generator=g).to(DEVICE)


def test_int8_gradients_average_the_ranks_and_keep_replicas_equal():
    """The hook's gradients: within the codes' error of DDP's own average, the same on every rank (all decode
    the same codes), a quarter of the bytes; training follows DDP's float32 all-reduce, the replicas' weights
    staying bit for bit equal."""
    torch.manual_seed(1)  # the same target on every rank and in every run
    target = torch.nn.Linear(512, 5).to(DEVICE)
    runs, STEPS = {}, 30
    for wire in ("fp32", "int8"):
        model = wrap(make_model())
        state = zero8.ddp.int8_gradients(model) if wire == "int8" else None
        opt = zo.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=1024)
        first_grads = []
        losses = train(model, opt, STEPS, target, first_grads)
        runs[wire] = (model, state, losses, first_grads)
    model, state, losses, grads = runs["int8"]
    _, _, ref_losses, ref_grads = runs["fp32"]
    rel = max(((g - r).norm() / r.norm()).item() for g, r in zip(grads, ref_grads))
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(weights) for _ in range(K)]
    dist.all_gather(every, weights)
    assert all(torch.equal(w, weights) for w in every)
    if K == 1:  # nothing to average, nothing sent: exact
        assert rel == 0 and state.wire_bytes == state.full_bytes == 0
        return
    assert 0 < rel < 5e-2, rel  # two 8-bit codes per element (a rank's piece, then the average); measured 3%
    # more than one bucket per step (DDP rebuilds its buckets after the first step)
    assert state.calls > STEPS and state.elements == STEPS * sum(p.numel() for p in model.parameters())
    assert 0.25 < state.wire_bytes / state.full_bytes < 0.2506
    print(f"\nloss {ref_losses[0]:.4f} -> float32 all-reduce {ref_losses[-1]:.4f}, int8 {losses[-1]:.4f}")
    assert ref_losses[-1] < 0.9 * ref_losses[0] and losses[-1] < 0.9 * losses[0]
    assert abs(losses[-1] - ref_losses[-1]) < 0.05 * ref_losses[-1], (losses[-1], ref_losses[-1])


@pytest.mark.skipif(DEVICE != "cuda" or K == 1, reason="the side stream is for GPU buckets exchanged between ranks")
def test_on_a_gpu_the_exchange_on_its_side_stream_gives_the_same_bits():
    """With overlap (the default) each bucket's exchange runs on the hook's side stream while the backward goes
    on; ordered by events alone, it must give what the exchange on the backward's own stream gives, bit for bit,
    over steps whose later buckets' gradients are computed while earlier ones are exchanged."""
    torch.manual_seed(1)
    target = torch.nn.Linear(512, 5).to(DEVICE)
    runs = {}
    for overlap in (False, True):
        model = wrap(make_model())
        state = zero8.ddp.int8_gradients(model, overlap=overlap)
        opt = zo.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=1024)
        losses = train(model, opt, 10, target)
        runs[overlap] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses, state)
    assert runs[True][2]._streams and not runs[False][2]._streams  # the side stream was used, and only with overlap
    assert runs[True][1] == runs[False][1]
    assert torch.equal(runs[True][0], runs[False][0])


def test_the_exchange_codes_each_piece_and_sums_the_pieces_in_rank_order():
    """Every value of the average, as the exchange is defined, with zero8.functional's public codec: the bucket
    cut into one piece per rank (the last padded with zeros), each rank's piece j coded in blocks of its own
    (these pieces end mid-block), rank j summing their decodes in rank order, dividing by the ranks and coding
    the result once more, which every rank decodes."""
    block, numel = 64, 1000 + 7 * K

    def bucket(rank: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(50 + rank)) * (rank + 1)

    def coded(x: torch.Tensor) -> torch.Tensor:
        return zero8.functional.dequantize_blockwise(*zero8.functional.quantize_blockwise(x, blocksize=block))

    flat = bucket(RANK).to(DEVICE)
    zero8.ddp.Int8AllReduce(block_size=block).average(flat)
    if K == 1:
        assert torch.equal(flat.cpu(), bucket(0))
        return
    piece = -(-numel // K)
    assert piece % block, "the pieces must end mid-block"
    pieces = [torch.cat([bucket(r), torch.zeros(K * piece - numel)]).reshape(K, piece) for r in range(K)]
    want = []
    for j in range(K):
        total = coded(pieces[0][j])
        for r in range(1, K):
            total = total + coded(pieces[r][j])
        want.append(coded(total / K))
    assert torch.equal(flat.cpu(), torch.cat(want)[:numel])


def test_a_non_finite_gradient_stays_non_finite():
    """A rank's Inf gradient element spoils its block on every rank (a GradScaler sees it) and nothing else."""
    state = zero8.ddp.Int8AllReduce()
    flat = torch.linspace(-1, 1, 10000).to(DEVICE) * (RANK + 1)
    if RANK == 0:
        flat[7000] = float("inf")
    state.average(flat)
    idx = (~torch.isfinite(flat)).nonzero().reshape(-1)  # the same on every rank: they decode the same codes
    assert idx.numel() > 0 and idx.min().item() <= 7000 <= idx.max().item() and idx.max() - idx.min() < 2048


@pytest.mark.skipif(dist.get_backend() != "gloo", reason="over NCCL the exchange leaves its tensors to it")
def test_an_exchange_returns_once_no_other_thread_holds_its_tensors(monkeypatch):
    """gloo's worker thread drops a finished collective's tensors a moment after the wait returns; freed there, a
    tensor's Python object needs the GIL, which aborts a process whose interpreter is exiting. So an exchange
    returns only once the tensors it handed out are free: here each collective's tensors are held by another
    thread for 0.2 s after it returns, as a slow worker would."""
    handed = []

    def held_late(real):
        def collective(*tensors, **kw):
            out = real(*tensors, **kw)
            handed.extend(weakref.ref(t) for t in tensors)
            # Thread.run drops its target's arguments once the target has returned
            threading.Thread(target=lambda held: time.sleep(0.2), args=(tensors,), daemon=True).start()
            return out
        return collective

    monkeypatch.setattr(dist, "all_to_all_single", held_late(dist.all_to_all_single))
    monkeypatch.setattr(dist, "all_gather_into_tensor", held_late(dist.all_gather_into_tensor))
    flat = torch.linspace(-1, 1, 5000).to(DEVICE) * (RANK + 1)
    zero8.ddp.Int8AllReduce().average(flat)
    # the reduce-scatter's codes and scales, sent and received, and the all-gather's (one rank: no exchange)
    assert len(handed) == (0 if K == 1 else 8)
    assert all(r() is None for r in handed), [r() is not None for r in handed]


def test_bad_arguments_are_named():
    with pytest.raises(zero8.Zero8ValueError, match="int8_gradients: the model is a Sequential, not a "
                                                    "DistributedDataParallel"):
        zero8.ddp.int8_gradients(make_model())
    with pytest.raises(zero8.Zero8ValueError, match="block_size must be a power of two in 64..4096, got 100"):
        zero8.ddp.Int8AllReduce(block_size=100)
    with pytest.raises(zero8.Zero8ValueError, match="Int8AllReduce: overlap must be True or False, got 1"):
        zero8.ddp.Int8AllReduce(overlap=1)
