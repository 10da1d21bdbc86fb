"""Writes tests/data/checkpoints/engine_<version>/: an engine checkpoint that later versions must keep
loading (tests/python/test_engine_checkpoint_compat.py), and expected.pt, the values it holds and those of
one more step with recorded gradients, recorded by the engine that saved it.

    python3 tests/python/data_gen/make_engine_checkpoint.py [OUT_DIR]

Run it by hand with the installed zero8 (scripts/python_setup.sh) when the checkpoint format gets a new
version; never to refresh the data of a released one (that would defeat the test). One rank, a tiny model
whose 64x80 weight (5120 elements) keeps 8-bit AdamW states and whose biases, LayerNorm and 80x8 head
keep 32-bit ones (min_8bit_size 4096), two param groups (weight decay on the matrices only), a frozen
parameter and a buffer (model_rest.safetensors), a config scheduler (WarmupLR), and a client_state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

STEPS = 3  # saved after this many optimizer steps: tag global_step3
BATCH = 4
CLIENT_STATE = {"epoch": 2, "data_position": 1234, "run": {"name": "compat", "seeds": [7, 11]}}
CONFIG = {
    "train_batch_size": BATCH,
    "train_micro_batch_size_per_gpu": BATCH,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                 "warmup_num_steps": 10, "warmup_type": "linear"}},
    "zero_optimization": {"stage": 2},
    "zero8": {"optim_bits": 8, "min_8bit_size": 4096, "int8_gradients": True, "int8_params": False},
    "steps_per_print": 10**6,
    "gradient_clipping": 0.0,  # the checkpoints were made when zero8's default was 0 (DeepSpeed's then)
}


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(64, 80)  # 5120 weights: 8-bit states
        self.norm = torch.nn.LayerNorm(80)
        self.head = torch.nn.Linear(80, 8)   # 640 weights: 32-bit states
        self.frozen = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
        self.register_buffer("shift", torch.zeros(8))

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.body(x)))) + self.frozen + self.shift


def make_model() -> TinyNet:
    torch.manual_seed(1234)
    model = TinyNet()
    with torch.no_grad():
        model.frozen.copy_(torch.linspace(-0.5, 0.5, 8))
        model.shift.copy_(torch.arange(8, dtype=torch.float32) / 16)
    return model


def param_groups(model: TinyNet) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 64, generator=g), torch.randn(BATCH, 8, generator=g)


def train_step(engine, step: int) -> None:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()


def exact_step(engine, grads: dict) -> None:
    """One step whose gradients are exactly ``grads`` (by parameter name): d/dp sum(p * G) = G whatever
    the order of the sums, so the step is the same on every CPU, which a step through the model is not
    (torch's reductions, e.g. LayerNorm's backward, depend on the thread count and the vector width)."""
    trained = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    loss = sum((p * grads[n]).sum() for n, p in trained)
    engine.backward(loss)
    engine.step()


def optimizer_record(engine) -> dict:
    """This rank's fp32 masters and (dequantized) states of both state groups, and the step counters."""
    opt = engine._opt
    record = {"steps": int(opt.steps), "loss_scale": float(opt.loss_scale), "groups": {}}
    for g in range(2):  # 0: 8-bit states, 1: 32-bit states
        if opt.group_numel(g) == 0:
            continue
        record["groups"][g] = {
            "master": torch.frombuffer(bytearray(opt.master_values(g)), dtype=torch.float32),
            "state1": torch.tensor(opt.state_values(g, 1), dtype=torch.float32),
            "state2": torch.tensor(opt.state_values(g, 2), dtype=torch.float32),
        }
    return record


def module_record(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def main(out_dir: Path) -> None:
    import zero8

    model = make_model()
    engine, optimizer, _, scheduler = zero8.initialize(model=model, model_parameters=param_groups(model),
                                                       config=CONFIG)
    for step in range(STEPS):
        train_step(engine, step)
    engine.save_checkpoint(out_dir, client_state=CLIENT_STATE)
    expected = {
        "zero8_version": zero8.__version__,
        "tag": f"global_step{engine.global_steps}",
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
        "lr": engine.get_lr(), "scheduler": scheduler.state_dict(),
        "client_state": CLIENT_STATE, "module": module_record(engine), "optimizer": optimizer_record(engine),
    }
    # One more step from the saved state, with recorded gradients: a load that restored everything takes
    # the same one.
    g = torch.Generator().manual_seed(999)
    expected["next_step_grads"] = {n: torch.randn(p.shape, generator=g)
                                   for n, p in engine.module.named_parameters() if p.requires_grad}
    exact_step(engine, expected["next_step_grads"])
    expected["module_after_next_step"] = module_record(engine)
    expected["lr_after_next_step"] = engine.get_lr()
    torch.save(expected, out_dir / "expected.pt")
    print(f"wrote {out_dir} (zero8 {zero8.__version__}, tag {expected['tag']})")


if __name__ == "__main__":
    import zero8

    root = Path(__file__).resolve().parents[3]
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "tests" / "data" / "checkpoints" / f"engine_{zero8.__version__}"
    if target.exists():
        sys.exit(f"{target} exists; a released checkpoint is not regenerated (remove it by hand if it is new)")
    target.mkdir(parents=True)
    main(target)
