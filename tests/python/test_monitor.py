"""The training monitor (bindings/python/zero8/engine/monitor.py) as DeepSpeed 0.19.8 writes it: the plain engine's
lr (and fp16's loss scale, and with wall_clock_breakdown the step's times) and the pipeline engine's train and
eval losses, at x = global samples after each optimizer step, in DeepSpeed's CSV layout, TensorBoard event
files read back with tensorboard's reader, and an offline wandb run; the errors for a missing package and a bad
section. Multi-rank (only rank 0 writes): tests/python/dist/dist_engine.py.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import sys
import time

import pytest
import torch

import zero8
from engine_util import config, loss_fn, make_data, make_model, micro_batch
from pipe_util import micro_batches, mse, regression_layers
from zero8.pipe import PipelineModule

DATA = make_data()
B, GAS, STEPS = 32, 2, 3
# WarmupLR's linear ramp: the lr differs at every step, so a row written at the wrong step shows.
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 8,
                                         "warmup_type": "linear"}}


def monitored(**sections) -> dict:
    return config(batch=B, gas=GAS, scheduler=WARMUP, **sections)


def train_steps(engine, steps: int = STEPS) -> list[tuple[int, float]]:
    """Trains ``steps`` optimizer steps; returns (global_samples, lr) after each, as the engine reports them."""
    seen = []
    for s in range(steps):
        for k in range(GAS):
            x, y = micro_batch(DATA, s, B, 0, 1, GAS, k)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        seen.append((engine.global_samples, engine.get_lr()[0]))
    return seen


def read_csv(path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(x), float(v)) for x, v in rows[1:]]


def test_csv_rows_are_the_engines_lr_at_global_samples(tmp_path, monkeypatch):
    # output_path "" (the default) is the working directory, job_name defaults to DeepSpeed's.
    monkeypatch.chdir(tmp_path)
    engine, _, _, _ = zero8.initialize(model=make_model(), config=monitored(csv_monitor={"enabled": True}))
    assert engine.monitor.enabled and engine.monitor.writes
    seen = train_steps(engine)
    job = tmp_path / "DeepSpeedJobName"
    assert sorted(os.listdir(job)) == ["Train_Samples_lr.csv"]  # fp32, no wall_clock_breakdown: the lr only
    header, rows = read_csv(job / "Train_Samples_lr.csv")
    assert header == ["step", "lr"]
    assert rows == seen and [x for x, _ in rows] == [B, 2 * B, 3 * B]
    assert len({v for _, v in rows}) == STEPS
    # engine.monitor takes the caller's own events, as DeepSpeed's.
    engine.monitor.write_events([("Train/Samples/my metric", 1.5, engine.global_samples)])
    assert read_csv(job / "Train_Samples_my_metric.csv") == (["step", "my metric"], [(3 * B, 1.5)])
    engine.destroy()
    engine.monitor.write_events([("Train/Samples/lr", 9.0, 999)])  # closed: dropped
    assert read_csv(job / "Train_Samples_lr.csv")[1] == seen


def test_fp16_loss_scale_and_wall_clock_times(tmp_path):
    cfg = monitored(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "fp16"},
                    fp16={"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2},
                    wall_clock_breakdown=True)
    engine, _, _, _ = zero8.initialize(model=make_model(), config=cfg)
    scales = []
    for s in range(STEPS):
        for k in range(GAS):
            x, y = micro_batch(DATA, s, B, 0, 1, GAS, k)
            engine.backward(loss_fn(engine(x.half()), y))
            engine.step()
        scales.append((engine.global_samples, engine.loss_scale))
    engine.destroy()
    job = tmp_path / "fp16"
    times = ["forward", "backward", "backward_inner", "backward_allreduce", "step"]
    assert sorted(os.listdir(job)) == sorted(["Train_Samples_lr.csv", "Train_Samples_loss_scale.csv"] +
                                             [f"Train_Samples_elapsed_time_ms_{t}.csv" for t in times])
    assert read_csv(job / "Train_Samples_loss_scale.csv") == (["step", "loss_scale"], scales)
    assert len({v for _, v in scales}) > 1  # the window of 2 doubles it: the rows follow the scale
    ms = {t: read_csv(job / f"Train_Samples_elapsed_time_ms_{t}.csv") for t in times}
    for t in times:
        assert ms[t][0] == ["step", f"elapsed_time_ms_{t}"]
        assert [x for x, _ in ms[t][1]] == [B, 2 * B, 3 * B] and all(v >= 0 for _, v in ms[t][1])
    # Each step's own time (not a running total): backward is its autograd part plus its reduction.
    for (_, bwd), (_, inner), (_, red) in zip(ms["backward"][1], ms["backward_inner"][1], ms["backward_allreduce"][1]):
        assert bwd == pytest.approx(inner + red, rel=1e-9, abs=1e-9)
    assert all(v > 0 for _, v in ms["forward"][1] + ms["step"][1])


def test_pipeline_writes_its_train_and_eval_losses(tmp_path):
    cfg = monitored(csv_monitor={"enabled": True, "output_path": str(tmp_path)}, wall_clock_breakdown=True)
    model = PipelineModule(regression_layers(), num_stages=1, loss_fn=mse, seed_layers=True, device="cpu")
    engine, _, _, _ = zero8.initialize(model=model, config=cfg)
    losses, lrs = [], []
    for s in range(STEPS):
        losses.append((engine.global_samples + B, float(engine.train_batch(micro_batches(DATA, s, B, 0, 1, GAS)))))
        lrs.append((engine.global_samples, engine.get_lr()[0]))
    # bcast_loss=False: with a monitor DeepSpeed's eval_batch still reduces the loss (and returns it).
    ev = float(engine.eval_batch(micro_batches(DATA, 7, B, 0, 1, GAS), bcast_loss=False))
    engine.destroy()
    job = tmp_path / "DeepSpeedJobName"
    # DeepSpeed's pipeline engine writes no elapsed times, even with wall_clock_breakdown.
    assert sorted(os.listdir(job)) == ["Train_Samples_eval_loss.csv", "Train_Samples_lr.csv",
                                       "Train_Samples_train_loss.csv"]
    assert read_csv(job / "Train_Samples_train_loss.csv") == (["step", "train_loss"], losses)
    assert read_csv(job / "Train_Samples_lr.csv") == (["step", "lr"], lrs)
    assert read_csv(job / "Train_Samples_eval_loss.csv") == (["step", "eval_loss"], [(STEPS * B, ev)])


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="the TensorBoard test needs the test extra (pip install .[test])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = monitored(tensorboard={"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run1"})
    engine, _, _, _ = zero8.initialize(model=make_model(), config=cfg)
    seen = train_steps(engine)
    # Flushed at every step: readable before the engine is closed.
    acc = EventAccumulator(str(tmp_path / "tb" / "run1"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["Train/Samples/lr"]
    got = [(e.step, e.value) for e in acc.Scalars("Train/Samples/lr")]
    # TensorBoard keeps a scalar as float32.
    assert got == [(x, float(torch.tensor(lr, dtype=torch.float32))) for x, lr in seen]
    engine.destroy()


def wandb_history(path: str, wait_s: float = 60.0) -> list[dict]:
    """The history rows of an offline run's .wandb file: wandb's record log (a 7-byte file header, then
    LevelDB-style fragments of 32 KiB blocks, each behind a checksum, length and type) of Record protobufs;
    wandb itself has no reader for it. wandb's service process writes the file: run.finish() can return
    before it has (seen on a loaded machine), so this reads until the run's exit record, its last, is there."""
    deadline = time.monotonic() + wait_s
    while True:
        rows, ended = _wandb_records(path)
        if ended or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def _wandb_records(path: str) -> tuple[list[dict], bool]:
    """(the history rows, whether the exit record was read) of the file as it is now."""
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    block, pos, part, rows, ended = 32768, 7, b"", [], False
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + n > len(data):  # still being written
            break
        part, pos = part + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or its last fragment
            r = wandb_internal_pb2.Record()
            r.ParseFromString(part)
            part = b""
            if r.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
            ended = ended or r.WhichOneof("record_type") == "exit"
    return rows, ended


def test_wandb_offline_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")  # an offline test sends nothing anywhere
    inits = []
    real_init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kw: inits.append(kw) or real_init(**kw))
    cfg = monitored(wandb={"enabled": True, "project": "zero8-test", "group": "g1", "team": None})
    engine, _, _, _ = zero8.initialize(model=make_model(), config=cfg)
    seen = train_steps(engine)
    engine.destroy()  # finishes the run
    assert inits == [{"project": "zero8-test", "group": "g1", "entity": None}]
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    # One history row per event, at wandb step x.
    rows = wandb_history(files[0])
    assert [(r["_step"], r["Train/Samples/lr"]) for r in rows] == seen


@pytest.mark.parametrize("key,module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_a_missing_package_fails_at_initialize(tmp_path, monkeypatch, key, module):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    cfg = monitored(**{key: {"enabled": True}, "csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    with pytest.raises(zero8.Zero8NotSupportedError,
                       match=rf"<config dict>: {key}.enabled: true needs the {key} package.*"
                             rf"pip install {key}"):
        zero8.initialize(model=make_model(), config=cfg)
    assert not os.listdir(tmp_path)  # nothing written before the error


def test_a_bad_section_names_the_key():
    model = make_model()
    with pytest.raises(zero8.Zero8ValueError,
                       match=r'csv_monitor.ouput_path: unknown key; did you mean "output_path"\?'):
        zero8.initialize(model=model, config=config(csv_monitor={"enabled": True, "ouput_path": "x"}))
    with pytest.raises(zero8.Zero8ValueError, match=r"tensorboard.job_name: expected a string, got 3"):
        zero8.initialize(model=model, config=config(tensorboard={"enabled": True, "job_name": 3}))
    with pytest.raises(zero8.Zero8ValueError, match=r"wandb.enabled: expected a boolean"):
        zero8.initialize(model=model, config=config(wandb={"enabled": "true"}))


def test_only_comet_and_the_profilers_warn(recwarn):
    from zero8.config import load_config

    cfg = load_config(config(tensorboard={"enabled": True}, csv_monitor={"enabled": True}, wandb={"enabled": True},
                             comet={"enabled": True}), warn=False)
    assert len(cfg.warnings) == 1 and cfg.warnings[0].startswith("<config dict>: comet: enabled, but zero8 does not")
    assert (cfg.typed.tensorboard.enabled, cfg.typed.csv_monitor.job_name, cfg.typed.wandb.project) == (
        True, "DeepSpeedJobName", "deepspeed")
