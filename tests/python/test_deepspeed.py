"""zero8's optimizer as DeepSpeed's client optimizer, against the real DeepSpeed and transformers (the test extra):
a tiny GPT-2 from a config, 2 CPU ranks under torchrun (gloo), ZeRO stage 2 in float32. The ranks run
tests/python/deepspeed_worker.py; the checks are here. One module-scoped session runs every launch once
(about a minute of CPU in all):

  np2: zero8 and torch's AdamW from the same start; zero8's checkpoint at step 4 resumed; torch's ZeRO
       checkpoint loaded into zero8.
  np1: universal checkpoints (from zero8's np2 checkpoint, and from torch's) loaded into zero8; the Hugging
       Face Trainer with zero8 through optimizer_cls_and_kwargs.
  np2: the universal checkpoint of np1's zero8 checkpoint (1 -> 2 ranks), and of a zero8 engine checkpoint.
  np2: bfloat16 under ZeRO stage 1: zero8 and torch's AdamW, and the resume.
  np2: ZeRO stage 3 (every parameter cut over the ranks): zero8 and torch's AdamW, the resume, the Trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed", reason="the DeepSpeed tests need the test extra (pip install .[test])")
pytest.importorskip("transformers", reason="the DeepSpeed tests need the test extra (pip install .[test])")

import zero8  # noqa: E402
from mpirun_util import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # conftest.py starts such files first

WORKER = os.path.join(os.path.dirname(__file__), "deepspeed_worker.py")
STEPS, SAVE_AT = 8, 4  # the worker's
# AdamW8bit against torch's AdamW from the same weights and data: the mean loss of the 8 steps agrees within
# this fraction. Measured: about 2e-5 (8-bit states change the update by well under 1% per element).
LOSS_BOUND = 1e-3
# The same in bfloat16 (ZeRO stage 1), where the two runs' weights round differently.
LOSS_BOUND_BF16 = 5e-3
# 8-bit states, bytes per parameter: two codes and a float32 scale per 256-element block of each state.
BYTES_8BIT = 2 + 2 * 4 / 256


def _launch(tmp, nproc: int, out: str, *scenarios: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), WORKER, "--dir", str(tmp), "--out", out, *scenarios]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}")
    with open(out) as f:
        return json.load(f)


def _zero8_engine_export(tmp) -> dict:
    """A zero8 engine checkpoint (1 rank, 2 steps) exported to the universal layout: the largest difference
    between the exported tensors and the engine's masters and decoded states (0: exact)."""
    sys.path.insert(0, os.path.dirname(WORKER))
    import deepspeed_worker as w

    cfg = {"train_micro_batch_size_per_gpu": w.MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2}, "zero8": {"optim_bits": 8, "min_8bit_size": w.MIN_8BIT}}
    engine, _, _, _ = zero8.initialize(model=w.new_model(), config=cfg)
    for step in range(2):
        x = w.batch(step, 0)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    engine.save_checkpoint(tmp / "z8engine")
    zero8.deepspeed.to_universal(tmp / "z8engine", tmp / "uni_engine" / "global_step2")
    uni = zero8.deepspeed.read_checkpoint(tmp / "uni_engine" / "global_step2")
    opt, worst = engine._opt, 0.0
    for i, name in enumerate(engine._param_names):
        g, off, n = opt.param_slot(i)
        master = torch.frombuffer(opt.master_values(g), dtype=torch.float32)[off:off + n]
        worst = max(worst, float((master - uni.params[name]["fp32"].reshape(-1)).abs().max()))
        for which, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
            got = torch.tensor(opt.state_values(g, which))[off:off + n]
            worst = max(worst, float((got - uni.params[name][key].reshape(-1)).abs().max()))
    return {"worst": worst, "step": uni.step, "aliases": "lm_head.weight" in uni.params}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed")
    res = {"np2": _launch(tmp, 2, str(tmp / "np2.json"), "train", "resume", "load_torch")}
    zero8.deepspeed.to_universal(tmp / "zero8_np2" / f"global_step{SAVE_AT}", tmp / "uni2" / f"global_step{SAVE_AT}")
    zero8.deepspeed.to_universal(tmp / "torch_np2" / f"global_step{STEPS}", tmp / "uni_torch" / f"global_step{STEPS}")
    res["np1"] = _launch(tmp, 1, str(tmp / "np1.json"), f"load_universal={tmp / 'uni2' / f'global_step{SAVE_AT}'}",
                         f"load_universal={tmp / 'uni_torch' / f'global_step{STEPS}'}", "hf")
    zero8.deepspeed.to_universal(tmp / "from_uni2_np1" / f"global_step{STEPS + 2}",
                                 tmp / "uni1" / f"global_step{STEPS + 2}")
    res["engine_export"] = _zero8_engine_export(tmp)
    res["np2_from_1"] = _launch(tmp, 2, str(tmp / "np2b.json"),
                                f"load_universal={tmp / 'uni1' / f'global_step{STEPS + 2}'}",
                                f"load_universal={tmp / 'uni_engine' / 'global_step2'}")
    (tmp / "bf16").mkdir()
    res["bf16"] = _launch(tmp / "bf16", 2, str(tmp / "bf16.json"), "--bf16", "--stage", "1", "train", "resume")
    (tmp / "z3").mkdir()
    res["z3"] = _launch(tmp / "z3", 2, str(tmp / "z3.json"), "--stage", "3", "train", "resume", "hf")
    res["tmp"] = tmp
    return res


@pytest.mark.parametrize("run,bound", [("np2", LOSS_BOUND), ("bf16", LOSS_BOUND_BF16), ("z3", LOSS_BOUND)])
def test_loss_tracks_torch_adamw(runs, run, bound):
    r = runs[run]
    z, t = r["zero8_losses"], r["torch_losses"]
    assert len(z) == len(t) == STEPS and z[0] == t[0]
    assert z[-1] < z[0]  # it learns
    rel = abs(sum(z) - sum(t)) / sum(t)
    print(f"\n{run}: mean loss over {STEPS} steps, AdamW8bit vs torch AdamW: relative difference {rel:.2e}")
    assert rel < bound, (z, t)


@pytest.mark.parametrize("run", ["np2", "bf16", "z3"])
def test_state_bytes_per_rank(runs, run):
    """The 8-bit part: 2.03 bytes per parameter, its elements split over the ranks (each rank holds its
    partition's, none twice); every parameter's rule held on the flat partitions (ZeRO-3's sub-groups too)."""
    layout = runs[run]["layout"]
    assert all(not r["bad"] for r in layout), layout
    if run == "z3":  # sub_group_size cuts the group into partitions stepped one by one
        assert all(r["partitions"] > r["groups"] for r in layout), layout
    total = layout[0]["total8"]
    assert sum(r["n8"] for r in layout) == total
    for r in layout:
        # a parameter cut by a partition boundary adds one block scale per state on each side: under ZeRO 1/2
        # one parameter per boundary, under ZeRO-3 any
        cuts = r["segs8"] if run == "z3" else 1
        assert BYTES_8BIT * r["n8"] <= r["bytes8"] <= BYTES_8BIT * r["n8"] + 16 * cuts
    per_rank = sum(r["bytes8"] for r in layout) / len(layout)
    print(f"\n{run}: 8-bit state bytes per parameter by rank "
          f"{[round(r['bytes8'] / r['n8'], 4) for r in layout]}, elements {[r['n8'] for r in layout]} of {total}; "
          f"mean bytes per rank / (8-bit params / N) = {per_rank / (total / len(layout)):.4f}")
    assert abs(per_rank / (total / len(layout)) - BYTES_8BIT) < 1e-3


@pytest.mark.parametrize("run", ["np2", "bf16", "z3"])
def test_resume_is_exact(runs, run):
    r = runs[run]
    assert r["resume_losses"] == r["zero8_losses"][SAVE_AT:]
    assert r["resume_final"] == r["zero8_final"]


def test_torch_zero_checkpoint_loads_quantized(runs):
    got = runs["np2"]["load_torch"]
    assert got["fp32"] == 0.0
    assert got["exp_avg"] < 0.01 and got["exp_avg_sq"] < 0.01  # 8-bit codes: within 1% of the largest value
    assert got["exp_avg"] > 0 or got["exp_avg_sq"] > 0  # quantized, not kept in float32


def test_universal_checkpoint_equals_the_decoded_states(runs):
    """ds_to_universal's output (through to_universal) holds exactly the decoded 8-bit states of every rank."""
    tmp = runs["tmp"]
    zero = zero8.deepspeed.read_checkpoint(tmp / "zero8_np2" / f"global_step{SAVE_AT}")
    uni = zero8.deepspeed.read_checkpoint(tmp / "uni2" / f"global_step{SAVE_AT}")
    assert zero.kind == "zero" and uni.kind == "universal" and zero.step == uni.step == SAVE_AT
    # ds_to_universal also writes a tied weight under its other name (GPT-2's lm_head.weight)
    assert set(zero.params) <= set(uni.params) and len(uni.params) <= len(zero.params) + 1
    for name, tensors in zero.params.items():
        assert set(tensors) == {"fp32", "exp_avg", "exp_avg_sq"}
        for k, v in tensors.items():
            assert torch.equal(v, uni.params[name][k]), (name, k)
    assert (tmp / "uni2" / "latest_universal").read_text() == f"global_step{SAVE_AT}"


@pytest.mark.parametrize("source,run", [("uni2", "np1"), ("uni_torch", "np1"), ("uni1", "np2_from_1"),
                                        ("uni_engine", "np2_from_1")])
def test_universal_round_trip_across_world_sizes(runs, source, run):
    """2 -> 1 (zero8's and torch's states) and 1 -> 2 ranks, and a zero8 engine checkpoint into DeepSpeed at 2
    ranks: weights exact, states within the codes' error, training goes on."""
    r = runs[run]
    got = r[f"load_universal:{source}"]
    print(f"\n{source} -> {r['world']} rank(s): largest difference fp32 {got['fp32']}, exp_avg {got['exp_avg']:.2e}, "
          f"exp_avg_sq {got['exp_avg_sq']:.2e} (of each parameter's largest value)")
    assert got["fp32"] == 0.0
    assert got["exp_avg"] < 0.01 and got["exp_avg_sq"] < 0.01
    losses = r[f"load_universal:{source}:losses"]
    assert len(losses) == 2 and all(4.0 < x < 5.5 for x in losses)


def test_zero8_engine_checkpoint_exports_to_universal(runs):
    """zero8's engine checkpoint in DeepSpeed's universal layout: masters and decoded 8-bit states exactly, the
    tied weight under both names."""
    r = runs["engine_export"]
    assert r == {"worst": 0.0, "step": 2, "aliases": True}


def test_zero3_checkpoint_of_zero8_gives_its_weights_to_zero_to_fp32(runs):
    """DeepSpeed's zero_to_fp32 reads a ZeRO-3 checkpoint whose optimizer was zero8's: the fp32 weights the
    resumed engine started from. zero8.deepspeed's converters, which map ZeRO stage 1/2 partitions, refuse it by
    name."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    ckpt = runs["tmp"] / "z3" / "zero8_np2"
    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=f"global_step{SAVE_AT}")
    start = runs["z3"]["resume_start"]
    assert {n: float(sd[n].detach().double().norm()) for n in start} == start
    for convert in (zero8.deepspeed.read_checkpoint, lambda d: zero8.deepspeed.to_universal(d, runs["tmp"] / "z3u")):
        with pytest.raises(zero8.Zero8ValueError, match="a DeepSpeed ZeRO-3 checkpoint; .* reads ZeRO stage 1/2"):
            convert(ckpt / f"global_step{SAVE_AT}")


@pytest.mark.parametrize("run", ["np1", "z3"])
def test_hugging_face_trainer_under_deepspeed(runs, run):
    """The Trainer with zero8's optimizer (optimizer_cls_and_kwargs) under ZeRO-2 on 1 rank and ZeRO-3 on 2: the
    per-parameter rules hold on DeepSpeed's partitions."""
    hf = runs[run]["hf"]
    assert hf["class"] == "zero8.deepspeed.optimizer.AdamW8bit"
    assert hf["groups"] == 2  # the Trainer's weight-decay groups
    assert hf["bits"]["transformer.wte.weight"] == 32 and hf["bits"]["transformer.wpe.weight"] == 32
    assert hf["bits"]["transformer.h.0.mlp.c_fc.weight"] == 8
    assert hf["bits"]["transformer.h.0.ln_1.weight"] == 32  # below min_8bit_size
    assert 4.0 < hf["loss"] < 5.5


def test_zero8_engine_resumes_a_deepspeed_zero2_checkpoint_of_adamw(runs):
    """A run moved mid-training: DeepSpeed's ZeRO-2 checkpoint of torch's AdamW (2 ranks) resumed by
    zero8.initialize's engine (1 rank) with 8-bit states: masters exact, states within the codes' error,
    step and counters carried over, and the next loss is the checkpoint's weights' loss."""
    sys.path.insert(0, os.path.dirname(WORKER))
    import deepspeed_worker as w

    tmp = runs["tmp"]
    tag_dir = tmp / "torch_np2" / f"global_step{STEPS}"
    states = zero8.deepspeed.read_checkpoint(tag_dir)
    model = w.new_model()
    cfg = {"train_micro_batch_size_per_gpu": w.MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2}, "zero8": {"optim_bits": 8, "min_8bit_size": w.MIN_8BIT}}
    engine, _, _, _ = zero8.initialize(model=model, config=cfg)
    with pytest.warns(UserWarning, match="DeepSpeed zero checkpoint"):
        path, client = engine.load_checkpoint(tmp / "torch_np2", tag=f"global_step{STEPS}")
    assert path.endswith("mp_rank_00_model_states.pt") and engine.global_steps == STEPS
    opt = engine._opt
    assert opt.steps == STEPS
    tied = {"transformer.wte.weight": "lm_head.weight"}  # DeepSpeed names GPT-2's tied weight by its last name
    for i, name in enumerate(engine._param_names):
        name = name if name in states.params else tied[name]
        g, off, n = opt.param_slot(i)
        master = torch.frombuffer(opt.master_values(g), dtype=torch.float32)[off:off + n]
        assert torch.equal(master, states.params[name]["fp32"].reshape(-1)), name
        for which, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
            got = torch.tensor(opt.state_values(g, which))[off:off + n]
            ref = states.params[name][key].reshape(-1)
            assert float((got - ref).abs().max()) <= 0.01 * float(ref.abs().max()), (name, key)
    assert opt.part_bytes(0, "codes1") > 0  # 8-bit states
    reference = w.new_model()
    reference.load_state_dict(states.model_states["module"])  # float32 training: the weights are the masters
    x = w.batch(STEPS, 0)
    loss = engine(input_ids=x, labels=x).loss
    with torch.no_grad():
        assert float(loss.detach()) == float(reference(input_ids=x, labels=x).loss)
    engine.backward(loss)
    engine.step()
    assert opt.steps == STEPS + 1
