"""Shared pieces of the pipeline tests (tests/python/test_pipe*.py and tests/python/dist/dist_pipe.py): the
engine tests' regression model as a layer list, a small language model whose input embedding and output
head are one tied module, and their data: micro-batch k of data-parallel rank d of step s is the same
rows for the pipeline engine and for the plain engine over the same layers (engine_util.micro_batch).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from engine_util import IN, micro_batch
from zero8.pipe import LayerSpec, TiedLayerSpec

VOCAB, SEQ, WIDTH = 64, 8, 32


def regression_layers(hidden: int = 128) -> list:
    """engine_util.make_model's network, one more hidden layer: 7 layers, so up to 7 stages."""
    return [LayerSpec(nn.Linear, IN, hidden), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, hidden, hidden),
            LayerSpec(nn.Tanh), LayerSpec(nn.Linear, hidden, 64), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 64, 1)]


def mse(out, y):
    return torch.nn.functional.mse_loss(out, y.to(out.dtype))


class Residual(nn.Module):
    """x + W2 gelu(W1 ln(x)): a transformer block's MLP half."""

    def __init__(self, width: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln(x))))


def tied_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output head reusing the input embedding's matrix (GPT-2's tying)."""
    return x @ embedding.weight.t()


def lm_layers(blocks: int = 4) -> list:
    """Embedding (tied), residual blocks, a final norm and the tied head: blocks + 3 layers."""
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH),
            *[LayerSpec(Residual, WIDTH) for _ in range(blocks)],
            LayerSpec(nn.LayerNorm, WIDTH),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=tied_head)]


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_tokens(rows: int = 512, seed: int = 3):
    """Sequences with structure (each token a function of the previous two), as (inputs, targets)."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.zeros(rows, SEQ + 1, dtype=torch.long)
    seqs[:, :2] = torch.randint(0, VOCAB, (rows, 2), generator=g)
    for t in range(2, SEQ + 1):
        seqs[:, t] = (seqs[:, t - 1] * 3 + seqs[:, t - 2] + (torch.rand(rows, generator=g) < 0.1).long()) % VOCAB
    return seqs[:, :-1], seqs[:, 1:]


def digest(tensors) -> bytes:
    """One hash of the tensors' bytes, on any device: equal digests, the same bits (what the multi-rank
    tests compare between stages and runs)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def micro_batches(data, step: int, batch: int, dp_rank: int, dp: int, gas: int):
    """The (inputs, labels) micro-batches of one data-parallel rank for one step (a pipeline's data_iter)."""
    for k in range(gas):
        yield micro_batch(data, step, batch, dp_rank, dp, gas, k)


def train_plain(engine, data, steps: int, batch: int, loss, dp_rank: int, dp: int, dp_comm, first: int = 0) -> list[float]:
    """The plain engine over the same micro-batches (steps first, first + 1, ...); returns each step's loss
    as train_batch reports it (the mean over micro-batches, then over the data-parallel ranks)."""
    gas = engine.gradient_accumulation_steps()
    out = []
    for s in range(first, first + steps):
        total = 0.0
        for x, y in micro_batches(data, s, batch, dp_rank, dp, gas):
            value = loss(engine(x), y)
            engine.backward(value)
            engine.step()
            total += float(value.detach().double())
        mean = total / gas
        if dp > 1:
            mean = sum(dp_comm.all_reduce_f64([mean], "sum")) / dp
        out.append(float(torch.tensor(mean, dtype=torch.float32)))
    return out


# While POISON["on"], GradPoison passes non-finite gradients back (the forward is the identity): an
# overflow in the stages before it only.
POISON = {"on": False}


class _Poison(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf") if POISON["on"] else grad


class GradPoison(nn.Module):
    def forward(self, x):
        return _Poison.apply(x)
