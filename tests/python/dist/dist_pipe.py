"""The pipeline engine on real processes (run by test_pipe_dist.py as ``mpirun -np 4 python3 -m pytest
tests/python/dist/dist_pipe.py``, then with -np 2 for the checkpoint saved here at another data-parallel
size; the name does not start with test_ so the single-process run does not collect it).

References: the plain engine over the same layers (zero8.pipe.LayerModule, same seeds) and the same
micro-batches, on a data-parallel group of the pipeline's size cut from the world. Exact settings (32-bit
states, fp32 gradients and activations on the wire) must give the same losses and weights bit for bit:
a stage runs the same operations on the same numbers, and an elementwise optimizer step does not depend
on how the stages' flat buffers group the parameters. Assertions come after a test's collectives, so a
failing rank does not leave the others waiting.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engine_util, pipe_util

import zero8  # noqa: E402
from zero8.config import load_config  # noqa: E402
from zero8.engine import world_comm  # noqa: E402
from zero8.engine.training import Zero8Engine  # noqa: E402
from zero8.pipe import LayerModule, LayerSpec, PipeDataParallelTopology, PipelineModule  # noqa: E402
from engine_util import EXACT, FULL8, IN, config, make_data  # noqa: E402
from pipe_util import (  # noqa: E402
    POISON,
    GradPoison,
    digest,
    lm_layers,
    lm_loss,
    make_tokens,
    micro_batches,
    mse,
    regression_layers,
    train_plain,
)

torch.set_num_threads(1)
WORLD = world_comm("auto")
RANK, N = WORLD.rank, WORLD.size
DATA = make_data()
TOKENS = make_tokens()
B = 32
SHARED = Path(os.environ.get("ZERO8_PIPE_SHARED", "/tmp/zero8_pipe_shared"))
four = pytest.mark.skipif(N != 4, reason="needs 4 ranks")
two = pytest.mark.skipif(N != 2, reason="needs 2 ranks")


def all_true(ok: bool) -> bool:
    return WORLD.all_reduce_f64([0.0 if ok else 1.0], "max")[0] == 0.0


def pipeline(layers, loss, stages: int, cfg: dict, **kw):
    # On the CPU also where a GPU is: the references here are CPU engines.
    model = PipelineModule(layers, num_stages=stages, loss_fn=loss, seed_layers=True, device="cpu", **kw)
    engine, _, _, _ = zero8.initialize(model=model, config=cfg)
    return engine


def plain(layers, loss, dp: int, cfg: dict):
    """The plain engine over all the layers, on the data-parallel group of this rank's pipeline position
    (ranks r with the same r // dp: PipeDataParallelTopology's data axis)."""
    comm = WORLD.split(RANK // dp, RANK, "reference")
    model = LayerModule(layers, loss_fn=loss, seed_layers=True)
    engine = Zero8Engine(model, load_config(cfg, dp, rank=RANK, warn=False), comm, WORLD)
    return engine, comm


def train_pipe(engine, data, steps: int, first: int = 0) -> list[float]:
    dp, d = engine.dp_world_size, engine._dp.rank
    return [float(engine.train_batch(micro_batches(data, s, B, d, dp, engine.micro_batches)))
            for s in range(first, first + steps)]


def stage_matches(engine, reference: torch.nn.Module) -> bool:
    """This stage's weights equal the reference model's entries of the same names, bit for bit."""
    ref = reference.state_dict()
    mine = engine.module.state_dict()
    return bool(mine) and all(torch.equal(v, ref[k]) for k, v in mine.items())


@four
def test_topology_is_deepspeeds_pipe_data_order():
    engine = pipeline(regression_layers(), mse, 2, config(gas=2, zero8=EXACT))
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    coord = topo.get_coord(RANK)
    ok = (engine.stage_id == coord.pipe and engine._dp.rank == coord.data
          and list(engine._dp.world_ranks) == topo.get_axis_list("pipe", coord.pipe)
          and list(engine._pipe.world_ranks) == topo.get_axis_list("data", coord.data)
          and engine.dp_world_size == 2 and engine.train_micro_batch_size_per_gpu() == B // 4)
    assert all_true(ok), (RANK, engine.stage_id, engine._dp.world_ranks, engine._pipe.world_ranks)


@four
@pytest.mark.parametrize("stages,gas,stage,queued", [(2, 2, 1, False), (2, 4, 2, False), (4, 4, 1, False),
                                                     (2, 2, 1, True)])
def test_exact_settings_equal_the_plain_engine_bit_for_bit(stages, gas, stage, queued):
    # queued_stage_messages takes the queued calls, which block over MPI as send/recv do (and it says so)
    cfg = config(gas=gas, stage=stage, zero8=dict(EXACT, queued_stage_messages=queued))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = pipeline(regression_layers(), mse, stages, cfg, partition_method="uniform")
    said = any("queued_stage_messages has no effect here" in str(w.message) for w in caught)
    assert said == (queued and RANK == 0), [str(w.message) for w in caught]
    assert engine._link.queued == queued
    losses = train_pipe(engine, DATA, 5)
    dp = N // stages
    ref, comm = plain(regression_layers(), mse, dp, cfg)
    ref_losses = train_plain(ref, DATA, 5, B, mse, RANK % dp, dp, comm)
    same_weights = stage_matches(engine, ref.module)
    assert all_true(losses == ref_losses and same_weights), (RANK, losses, ref_losses, same_weights)
    assert losses[-1] < losses[0]


@four
def test_gradient_clipping_uses_the_norm_of_every_stage():
    cfg = config(gas=2, zero8=EXACT, gradient_clipping=0.05)
    engine = pipeline(regression_layers(), mse, 2, cfg)
    ref, comm = plain(regression_layers(), mse, 2, cfg)
    norms, ref_norms = [], []
    for s in range(3):
        train_pipe(engine, DATA, 1, first=s)
        train_plain(ref, DATA, 1, B, mse, RANK % 2, 2, comm, first=s)
        norms.append(engine.get_global_grad_norm())
        ref_norms.append(ref.get_global_grad_norm())
    # The sum of squares is added up per stage first: another order, so equal to rounding only.
    ok = all(abs(a - b) <= 1e-12 * b for a, b in zip(norms, ref_norms)) and min(ref_norms) > 0.05
    assert all_true(ok), (RANK, norms, ref_norms)


@four
def test_overflow_in_one_stage_skips_the_step_in_every_stage():
    cfg = config(gas=2, zero8=FULL8)
    layers = regression_layers()
    layers.insert(4, GradPoison())  # layer 4: the first of stage 1 (8 layers, uniform); poisons stage 0 only
    engine = pipeline(layers, mse, 2, cfg, partition_method="uniform")
    train_pipe(engine, DATA, 1)
    before = digest(p for p in engine.module.parameters())
    POISON["on"] = True
    try:
        loss = train_pipe(engine, DATA, 1, first=1)
    finally:
        POISON["on"] = False
    after = digest(p for p in engine.module.parameters())
    skipped = engine.skipped_steps == 1 and engine.global_steps == 2 and engine.was_step_skipped()
    train_pipe(engine, DATA, 1, first=2)
    moved = digest(p for p in engine.module.parameters()) != after
    assert all_true(skipped and before == after and moved), (RANK, engine.skipped_steps, loss)


@four
@pytest.mark.parametrize("stages,stage", [(4, 1), (2, 2)])
def test_tied_embedding_and_head_stay_identical_across_stages(stages, stage):
    cfg = config(gas=2, stage=stage, zero8=EXACT)
    # 8 layers, uniform: the embedding on stage 0, the last stage a norm and the tied head.
    engine = pipeline(lm_layers(5), lm_loss, stages, cfg, partition_method="uniform")
    losses = train_pipe(engine, TOKENS, 6)
    # This pipeline's first and last stage hold the tie: their copies must be the same bytes.
    holder = engine.stage_id in (0, stages - 1)
    tied = engine.module.tied_modules["embed"].weight if holder else None
    holders = engine._pipe.all_gather_bytes(digest([tied]) if holder else b"")
    identical = holders[0] == holders[-1] and holders[0] != b""
    dp = N // stages
    ref, comm = plain(lm_layers(5), lm_loss, dp, cfg)
    ref_losses = train_plain(ref, TOKENS, 6, B, lm_loss, RANK % dp, dp, comm)
    ref_tied = ref.module.tied_modules["embed"].weight
    # The tie's gradient is the sum of its two uses' in another order than one backward adds them
    # (each use summed over the micro-batches first): fp32 rounding, which Adam's normalized steps
    # carry to about 1e-6 of a weight over these steps.
    diff = float((tied - ref_tied).detach().abs().max()) if holder else 0.0
    close = diff <= 1e-5 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses))
    assert all_true(identical and close), (RANK, losses, ref_losses, diff)
    assert losses[-1] < losses[0]


@four
def test_8bit_states_and_int8_gradients_stay_as_close_as_the_plain_engine():
    """8-bit states and int8 gradients quantize blocks of the stage's flat buffers, which group other
    neighbours than the whole model's: not bit-exact. Tolerance: the pipeline's distance to the exact run
    is at most twice the plain engine's own (the same quantization noise, grouped differently)."""
    full = config(gas=2, zero8=dict(FULL8, min_8bit_size=256))
    exact = config(gas=2, zero8=EXACT)
    pipe8 = train_pipe(pipeline(regression_layers(), mse, 2, full), DATA, 8)
    ref, comm = plain(regression_layers(), mse, 2, full)
    plain8 = train_plain(ref, DATA, 8, B, mse, RANK % 2, 2, comm)
    ref_exact, comm_exact = plain(regression_layers(), mse, 2, exact)
    exact_losses = train_plain(ref_exact, DATA, 8, B, mse, RANK % 2, 2, comm_exact)
    plain_dev = max(abs(a - b) for a, b in zip(plain8, exact_losses))
    pipe_dev = max(abs(a - b) for a, b in zip(pipe8, exact_losses))
    assert all_true(0 < plain_dev and pipe_dev <= 2 * plain_dev), (RANK, pipe_dev, plain_dev)


@four
@pytest.mark.parametrize("stages", [2, 4])
def test_int8_activations_quarter_the_bytes_and_keep_the_loss(stages):
    """int8 activations and activation gradients: bytes per boundary <= 0.26 x fp32 (codes plus one float
    per 2048-element block: 0.2505, a little more for a 64-wide boundary's 256 elements). The loss stays
    within 1% of fp32 activations' at every step: each int8 round trip moves an activation by at most half
    a code step of the dynamic map at its block's scale, and the loss feels the average of those moves
    (measured: 0.06% at 2 stages, 0.2% at 4)."""
    gas = 4
    runs = {}
    for int8 in (False, True):
        cfg = config(gas=gas, lr=3e-4, zero8=dict(EXACT, int8_activations=int8))
        engine = pipeline(regression_layers(hidden=1024), mse, stages, cfg, partition_method="uniform")
        runs[int8] = (train_pipe(engine, DATA, 6), engine.boundary_stats())
    (fp, fp_bytes), (q, q_bytes) = runs[False], runs[True]
    ratios = [b["bytes"] / f["bytes"] for b, f in zip(q_bytes, fp_bytes)]
    fp32_equal = all(f["bytes"] == f["fp32_bytes"] == b["fp32_bytes"] for b, f in zip(q_bytes, fp_bytes))
    close = all(abs(a - b) <= 0.01 * b for a, b in zip(q, fp)) and q != fp
    ok = len(ratios) == stages - 1 and all(r <= 0.26 for r in ratios) and fp32_equal and close
    assert all_true(ok), (RANK, ratios, fp, q)


@four
def test_eval_batch_equals_the_plain_engines_loss():
    cfg = config(gas=2, zero8=EXACT)
    engine = pipeline(regression_layers(), mse, 2, cfg)
    train_pipe(engine, DATA, 2)
    # 4 micro-batches of 4 rows where training had 2 of 8: the shapes are agreed again for this batch.
    value = engine.eval_batch(micro_batches(DATA, 9, B, engine._dp.rank, 2, 4), num_micro_batches=4)
    ref, comm = plain(regression_layers(), mse, 2, cfg)
    train_plain(ref, DATA, 2, B, mse, RANK % 2, 2, comm)
    ref.eval()
    with torch.no_grad():
        total = sum(float(mse(ref(x), y).double()) for x, y in micro_batches(DATA, 9, B, RANK % 2, 2, 4)) / 4
    expected = float(torch.tensor(sum(comm.all_reduce_f64([total], "sum")) / 2, dtype=torch.float32))
    assert all_true(float(value) == expected), (RANK, float(value), expected)


@four
def test_checkpoint_resumes_bit_exactly_and_reloads_elsewhere(tmp_path_factory):
    cfg = config(gas=2, zero8=dict(FULL8, min_8bit_size=256))
    d = tmp_path_factory.mktemp("pipe_ckpt") if RANK == 0 else None
    d = Path(WORLD.broadcast_bytes(str(d).encode() if d else b"", 0).decode())
    a = pipeline(regression_layers(), mse, 2, cfg)
    train_pipe(a, DATA, 3)
    a.save_checkpoint(d)
    saved = digest(a.module.parameters())
    cont = train_pipe(a, DATA, 3, first=3)
    b = pipeline(regression_layers(), mse, 2, cfg)
    path, _ = b.load_checkpoint(d)
    loaded = digest(b.module.parameters()) == saved and b.global_steps == 3
    resumed = train_pipe(b, DATA, 3, first=3)
    same = resumed == cont and digest(b.module.parameters()) == digest(a.module.parameters())
    layout = sorted(os.listdir(d / "global_step3"))
    # Another pipeline degree: the optimizer states are refused naming both; the weights load.
    c = pipeline(regression_layers(), mse, 4, cfg)
    try:
        c.load_checkpoint(d)
        refused = ""
    except ValueError as e:
        refused = str(e)
    c.load_checkpoint(d, load_module_only=True)
    ref = LayerModule(regression_layers(), seed_layers=True)
    ref_sd = {k: v for k, v in ref.state_dict().items()}
    for k, v in ref_sd.items():  # the saved weights, from the layer files of every stage
        layer = int(k.split(".")[0])
        ref_sd[k] = torch.load(d / "global_step3" / f"layer_{layer:02d}-model_states.pt")[k.split(".", 1)[1]]
    weights_only = all(torch.equal(v, ref_sd[k]) for k, v in c.module.state_dict().items())
    # For the 2-rank run: the checkpoint and what the weights were when it was saved.
    if RANK == 0:
        SHARED.mkdir(parents=True, exist_ok=True)
        shutil.copytree(d, SHARED, dirs_exist_ok=True)
        (SHARED / "expected.json").write_text(json.dumps({"continued": cont}))
    WORLD.barrier()
    ok = (loaded and same and "2 stages" in refused and "4" in refused and weights_only
          and {"pipeline.json", "stage_00", "stage_01", "layer_00-model_states.pt"} <= set(layout))
    assert all_true(ok), (RANK, loaded, same, refused, weights_only, layout, resumed, cont)


@four
def test_bad_configurations_name_the_problem():
    errors = {}
    for name, make in {
        "stages": lambda: PipelineModule(regression_layers(), num_stages=3, loss_fn=mse),
        "layers": lambda: PipelineModule(regression_layers()[:3], num_stages=4, loss_fn=mse),
        "batch": lambda: pipeline(regression_layers(), mse, 2, config(batch=30, gas=4, zero8=EXACT)),
        "partition": lambda: PipelineModule(regression_layers(), num_stages=2, partition_method="type:Conv"),
    }.items():
        try:
            make()
            errors[name] = ""
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    ok = ("num_stages (3) must divide the world size (4)" in errors["stages"]
          and "4 stages but only 3 layer(s)" in errors["layers"]
          and "train_batch_size" in errors["batch"]
          and "no layer's class name matches" in errors["partition"])
    assert all_true(ok), (RANK, errors)


@two
def test_a_checkpoint_of_2_data_parallel_ranks_loads_on_1():
    cfg = config(gas=2, zero8=dict(FULL8, min_8bit_size=256))
    engine = pipeline(regression_layers(), mse, 2, cfg)
    engine.load_checkpoint(SHARED)
    ref = LayerModule(regression_layers(), seed_layers=True)
    sd = ref.state_dict()
    ok = True
    for k, v in engine.module.state_dict().items():
        layer = int(k.split(".")[0])
        saved = torch.load(SHARED / "global_step3" / f"layer_{layer:02d}-model_states.pt")[k.split(".", 1)[1]]
        ok = ok and torch.equal(v, saved) and k in sd
    expected = json.loads((SHARED / "expected.json").read_text())["continued"]
    # One data-parallel rank now takes the whole batch: int8 gradients are cut into other blocks, so the
    # continuation follows the 2-rank one to the int8 wire's error only.
    cont = train_pipe(engine, DATA, 3, first=3)
    close = all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(cont, expected))
    assert all_true(ok and engine.global_steps == 6 and close), (RANK, cont, expected)


def test_reentrant_activation_checkpointing_at_2_stages_trains_as_without():
    """A reentrant checkpoint segment's output has a graph only when one of its inputs requires grad: the
    first stage's floating inputs and every floating activation received are made to, as in DeepSpeed.
    Without that no stage gets gradients; with it, the same numbers as without checkpointing."""
    cfg = config(gas=2, zero8=EXACT)
    reentrant = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    plain_run = pipeline(regression_layers(), mse, 2, cfg, partition_method="uniform")
    ckpt = pipeline(regression_layers(), mse, 2, cfg, partition_method="uniform", activation_checkpoint_interval=1,
                    activation_checkpoint_func=reentrant)
    a, b = train_pipe(plain_run, DATA, 3), train_pipe(ckpt, DATA, 3)
    same = a == b and digest(plain_run.module.parameters()) == digest(ckpt.module.parameters())
    assert all_true(same), (RANK, a, b)


class Pair(nn.Module):
    """A last layer with two outputs: the float32 input and a bfloat16 copy."""

    def forward(self, x):
        return x, x.to(torch.bfloat16)


def test_eval_batch_averages_tuple_outputs_over_micro_batches_and_ranks():
    """compute_loss=False, reduce_output "avg": per tensor of the last stage's outputs, the mean over the
    micro-batches and the data-parallel ranks (the sum over the ranks on the device), in the tensor's
    dtype. Reference: the whole model's outputs for every rank's micro-batches, averaged in float64; the
    engine sums 4 micro-batches then the ranks in float32, so within (4 + dp) float32 roundings of the
    largest output, plus the final bfloat16 rounding for the copy."""
    layers = [*regression_layers(), LayerSpec(Pair)]  # 8 layers, uniform: Pair on stage 1
    engine = pipeline(layers, None, 2, config(gas=2, zero8=EXACT), partition_method="uniform")
    dp, d = engine.dp_world_size, engine._dp.rank
    out = engine.eval_batch(micro_batches(DATA, 3, B, d, dp, 4), compute_loss=False, num_micro_batches=4)
    ref = LayerModule(layers, seed_layers=True)
    with torch.no_grad():
        runs = [ref(x) for r in range(dp) for x, _ in micro_batches(DATA, 3, B, r, dp, 4)]
    want = [sum(o[i].double() for o in runs) / len(runs) for i in (0, 1)]
    if engine.is_last_stage():
        largest = max(float(o[0].abs().max()) for o in runs)
        bound = (4 + dp) * torch.finfo(torch.float32).eps * largest
        kinds = isinstance(out, tuple) and [t.dtype for t in out] == [torch.float32, torch.bfloat16]
        err = [float((t.double() - w).abs().max()) for t, w in zip(out, want)]
        bf16_rounding = torch.finfo(torch.bfloat16).eps * float(want[1].abs().max())
        ok = kinds and err[0] <= bound and err[1] <= bound + bf16_rounding
    else:
        ok, err, bound = out is None, None, None
    assert all_true(ok), (RANK, err, bound)


class MaskedLinear(nn.Module):
    """(hidden, bool mask) -> (Linear(hidden), mask): a layer of a model whose activations carry a mask."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, inputs):
        h, mask = inputs
        return self.fc(h), mask


class MaskedTanh(nn.Module):
    def forward(self, inputs):
        h, mask = inputs
        return torch.tanh(h) * mask, mask


class MaskedHead(nn.Module):
    def __init__(self, n_in: int):
        super().__init__()
        self.fc = nn.Linear(n_in, 1)

    def forward(self, inputs):
        return self.fc(inputs[0])


def masked_layers() -> list:
    """5 layers, uniform at 2 stages: (hidden, bool mask) crosses the boundary."""
    return [LayerSpec(MaskedLinear, IN, 64), LayerSpec(MaskedTanh), LayerSpec(MaskedLinear, 64, 64),
            LayerSpec(MaskedTanh), LayerSpec(MaskedHead, 64)]


def test_a_megatron_style_batch_fn_list_inputs_and_a_bool_mask_at_2_stages():
    """As Megatron-DeepSpeed drives the engine: set_batch_fn turns the loader's dict into (inputs, labels),
    the inputs a list (the first layer gets a tuple), a bool attention mask crosses the boundary with
    set_has_attention_mask (no cast, no gradient). Each stage reads only its part: the other is a meta
    tensor, which moving to the stage's device would fail on. The same numbers as plain tuples."""
    cfg = config(gas=2, zero8=EXACT)
    unread = torch.empty(0, device="meta")

    def batches(s, engine, as_dict):
        dp, d = engine.dp_world_size, engine._dp.rank
        for x, y in micro_batches(DATA, s, B, d, dp, 2):
            mask = (x[:, :1] > -1.0) & (torch.arange(64) % 4 != 0)
            yield {"x": x, "mask": mask, "y": y} if as_dict else ((x, mask), y)

    ref = pipeline(masked_layers(), mse, 2, cfg, partition_method="uniform")
    want = [float(ref.train_batch(batches(s, ref, False))) for s in range(3)]
    engine = pipeline(masked_layers(), mse, 2, cfg, partition_method="uniform")
    engine.set_has_attention_mask(True)
    engine.set_batch_fn(lambda b: [[b["x"], b["mask"]] if engine.is_first_stage() else unread,
                                   b["y"] if engine.is_last_stage() else unread])
    got = [float(engine.train_batch(batches(s, engine, True))) for s in range(3)]
    same = got == want and digest(engine.module.parameters()) == digest(ref.module.parameters())
    assert all_true(same), (RANK, got, want)
