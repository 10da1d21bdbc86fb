"""Shared pieces of the engine tests (tests/python/test_engine*.py and the multi-rank tests under
tests/python/dist/): a small real model, a deterministic regression data set, a DeepSpeed config
builder, and the single-process torch reference runs the engine is compared against.

Global batch of step s: rows [s*B, (s+1)*B) of the data (mod its size). Rank r of N with gradient
accumulation G takes, for micro-batch k, rows r*m*G + k*m ... of it (m = B / (N*G)), so the union of
every rank's micro-batches is exactly the reference's batch.
"""

from __future__ import annotations

import copy

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
           zero8: dict | None = None, gradient_clipping: float = 0.0, **extra) -> dict:
    """A DeepSpeed config for the engine tests; clipping off unless asked for (DeepSpeed's default, and so
    zero8's, is 1.0), so that runs compare with torch's optimizers as they are."""
    cfg = {
        "train_batch_size": batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        "gradient_clipping": gradient_clipping,
    }
    if zero8 is not None:
        cfg["zero8"] = zero8
    cfg.update(extra)
    return cfg


# zero8 with 32-bit states and fp32 communication both ways: the arithmetic of torch's AdamW.
EXACT = {"optim_bits": 32, "int8_gradients": False, "int8_params": False}
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



# ---- exact gradients: the same bits on every device (the CUDA engine against the CPU one) ----

# name -> shape: w and w2 in the 8-bit group (min_8bit_size 4096), b and ln in the fp32 group.
EXACT_GRAD_SHAPES = {"w": (64, 80), "w2": (5000,), "b": (80,), "ln": (37,)}
# Engine settings the device tests run: fp32 and bf16, stage 1 (with accumulation) and 2, the full int8
# configuration with error feedback, 32-bit states, and fp16 loss scaling with an overflow skipped.
EXACT_COMBOS = {
    "fp32_stage2_int8_ef": dict(stage=2, zero8={**FULL8, "error_feedback": True}),
    "fp32_stage1_gas2": dict(stage=1, gas=2, zero8=FULL8),
    "bf16_stage2_int8": dict(stage=2, zero8=FULL8, bf16={"enabled": True}),
    "bf16_stage1_32bit": dict(stage=1, gas=2, zero8=EXACT, bf16={"enabled": True}),
    "fp16_stage2_overflow": dict(stage=2, zero8=FULL8, inf_step=1,
                                 fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}),
}


class ExactGradModel(torch.nn.Module):
    """A model whose loss has known gradients: loss = sum over its parameters p of (p * c_p).sum(), so p's
    gradient is c_p (times the loss scale) on any device, exactly: c_p are multiples of 2^-10 below 1/8,
    which float32, bfloat16 and float16 hold exactly. A real model's backward rounds differently on a GPU
    and a CPU; with these gradients the CUDA engine and the CPU engine must hold the same bits."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, shape in EXACT_GRAD_SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=g) * 0.1))

    def forward(self, step: int, rank: int, micro: int = 0, inf: bool = False) -> torch.Tensor:
        loss = None
        for i, (name, p) in enumerate(self.named_parameters()):
            c = exact_grad(p.shape, step, rank, micro, i)
            if inf and name == "w":
                c[0, 0] = float("inf")
            term = (p * c.to(p.device, p.dtype)).sum()
            loss = term if loss is None else loss + term.to(loss.dtype)
        return loss


def exact_grad(shape, step: int, rank: int, micro: int, param: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(((step * 64 + rank) * 8 + micro) * 16 + param)
    return torch.randint(-127, 128, tuple(shape), generator=g).float() / 1024


def exact_config(combo: str, world: int) -> dict:
    """The DeepSpeed config of ``combo`` for ``world`` ranks, one sample per micro-batch (a copy: callers
    may add keys)."""
    kw = copy.deepcopy(EXACT_COMBOS[combo])
    kw.pop("inf_step", None)
    gas = kw.pop("gas", 1)
    return config(batch=world * gas, gas=gas, lr=1e-2, **kw)


def exact_train(engine, combo: str, first: int, steps: int, rank: int) -> None:
    """Steps [first, first + steps) of ``combo`` with its exact gradients (on rank 0, an Inf at its inf_step)."""
    inf_step = EXACT_COMBOS[combo].get("inf_step", -1)
    for s in range(first, first + steps):
        for k in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(s, rank, k, inf=s == inf_step and rank == 0 and k == 0))
            engine.step()


def engine_dump(engine) -> dict:
    """Everything of this rank that the next steps depend on, on the CPU: every part of the sharded optimizer
    (working copy, masters, codes and scales or fp32 states, residuals) as bytes, the model's weights, the
    counters and the loss scale."""
    opt = engine._opt
    names = ("working", "master", "codes1", "absmax1", "codes2", "absmax2", "state1", "state2", "residual")
    parts = {(g, part): opt.copy_to_host(g, part) for g in range(2) for part in names}
    weights = {n: p.detach().to("cpu").clone() for n, p in engine.module.named_parameters()}
    return {"parts": parts, "weights": weights, "steps": (engine.global_steps, engine.skipped_steps),
            "loss_scale": float(engine.loss_scale)}


def dump_diff(a: dict, b: dict) -> list[str]:
    """What differs between two engine_dump()s, in bits; [] when nothing does."""
    out = [f"part {k}" for k in a["parts"] if a["parts"][k] != b["parts"].get(k)]
    for n, t in a["weights"].items():
        u = b["weights"].get(n)
        if u is None or t.dtype != u.dtype or not torch.equal(t.view(torch.uint8), u.view(torch.uint8)):
            out.append(f"weight {n}")
    if a["steps"] != b["steps"]:
        out.append(f"counters {a['steps']} vs {b['steps']}")
    if a["loss_scale"] != b["loss_scale"]:
        out.append(f"loss scale {a['loss_scale']} vs {b['loss_scale']}")
    return out
