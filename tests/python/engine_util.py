"""Shared pieces of the engine tests (tests/python/test_engine*.py and the multi-rank tests under
tests/python/dist/): a small real model, a deterministic regression data set, a DeepSpeed config
builder, and the single-process torch reference runs the engine is compared against.

Global batch of step s: rows [s*B, (s+1)*B) of the data (mod its size). Rank r of N with gradient
accumulation G takes, for micro-batch k, rows r*m*G + k*m ... of it (m = B / (N*G)), so the union of
every rank's micro-batches is exactly the reference's batch.
"""

from __future__ import annotations

import torch

DATA_ROWS = 512
IN, H1, H2 = 32, 128, 64  # Linear(32,128): 4096 weights -> the 8-bit group at min_8bit_size 4096


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, H1), torch.nn.Tanh(), torch.nn.Linear(H1, H2), torch.nn.Tanh(), torch.nn.Linear(H2, 1)
    )


def make_data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(DATA_ROWS, IN, generator=g)
    y = torch.sin(x[:, :3].sum(1, keepdim=True)) + 0.1 * x[:, 3:4]
    return x, y


def global_batch(data, step: int, batch: int):
    x, y = data
    idx = torch.arange(step * batch, (step + 1) * batch) % x.shape[0]
    return x[idx], y[idx]


def micro_batch(data, step: int, batch: int, rank: int, world: int, gas: int, k: int):
    x, y = global_batch(data, step, batch)
    m = batch // (world * gas)
    lo = (rank * gas + k) * m
    return x[lo:lo + m], y[lo:lo + m]


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y.to(out.dtype))


def config(batch: int = 32, gas: int = 1, lr: float = 3e-3, weight_decay: float = 0.01, stage: int = 2,
           zero8: dict | None = None, **extra) -> dict:
    cfg = {
        "train_batch_size": batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }
    if zero8 is not None:
        cfg["zero8"] = zero8
    cfg.update(extra)
    return cfg


# zero8 with 32-bit states and fp32 gradients on the wire: the arithmetic of torch's AdamW.
EXACT = {"optim_bits": 32, "int8_gradients": False}
# The full zero8 configuration: 8-bit states, int8 gradients and int8 parameter updates.
FULL8 = {"optim_bits": 8, "int8_gradients": True, "int8_params": True}


def train_engine(engine, data, steps: int, batch: int, rank: int = 0, world: int = 1, dtype=torch.float32):
    """Train through the engine; returns the per-step mean loss of this rank's micro-batches."""
    gas = engine.gradient_accumulation_steps()
    losses = []
    for s in range(steps):
        total = 0.0
        for k in range(gas):
            x, y = micro_batch(data, s, batch, rank, world, gas, k)
            loss = loss_fn(engine(x.to(dtype)), y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        losses.append(total)
    return losses


def train_torch(model, data, steps: int, batch: int, lr: float = 3e-3, weight_decay: float = 0.01,
                clip: float = 0.0, dtype=torch.float32, opt_cls=None, **opt_kw):
    """The single-process reference: torch.optim.AdamW (or opt_cls) on the whole global batch."""
    model = model.to(dtype)
    opt_cls = opt_cls or torch.optim.AdamW
    opt = opt_cls(model.parameters(), lr=lr, weight_decay=weight_decay, **opt_kw)
    losses = []
    for s in range(steps):
        x, y = global_batch(data, s, batch)
        loss = loss_fn(model(x.to(dtype)), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return model, losses


def fp32_baseline_error(data, steps: int, batch: int, **kw) -> tuple[torch.nn.Module, float]:
    """torch's fp32 AdamW run and its own error: the largest parameter difference to the same run in
    float64. The engine with exact arithmetic settings may differ from torch's fp32 run by rounding
    only, so tolerances are multiples of this."""
    m32, _ = train_torch(make_model(), data, steps, batch, **kw)
    m64, _ = train_torch(make_model(), data, steps, batch, dtype=torch.float64, **kw)
    return m32, max_param_diff(m32, m64)


def reference(data, steps: int, batch: int) -> dict:
    """What the engine tests compare with: torch AdamW's fp32 run on the global batches (final weights
    and per-step losses) and its fp32 error. Saved by test_engine_dist.py for the ranks it starts, so
    they need not each repeat it (torch.optim's first use costs seconds per process)."""
    ref, err = fp32_baseline_error(data, steps, batch)
    _, losses = train_torch(make_model(), data, steps, batch)
    return {"steps": steps, "batch": batch, "state": ref.state_dict(), "losses": losses, "err": err}


def reference_model(ref: dict) -> torch.nn.Module:
    model = make_model()
    model.load_state_dict(ref["state"])
    return model


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p.detach().double() - q.detach().double()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p.detach(), q.detach()) for p, q in zip(a.parameters(), b.parameters()))


def clone_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def mean_tail(losses, n: int = 10) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)

