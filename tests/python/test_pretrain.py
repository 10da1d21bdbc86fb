"""End-to-end tests of the pretraining example (examples/pretrain_gpt.py) with a tiny GPT: it trains on 1
and 2 processes (mpirun), writes its CSV log and PNG plot, a 2-rank run reproduces the 1-process run bit
for bit, and SIGTERM to one rank mid-run makes every rank save a checkpoint and exit cleanly, after which
--resume continues with exactly the losses of an uninterrupted run. All runs use the exact config
(examples/configs/gpt_fp32_adamw.json: 32-bit AdamW states, fp32 gradients on the wire) and one thread
per process, so every difference would be a real one. Also, on one process: option values out of range
are argparse errors, --resume with nothing to train fails, a stopped and resumed run writes the CSV rows of
an uninterrupted one, --resume TAG continues from an earlier checkpoint, and config warnings and errors name
the file.
"""

from __future__ import annotations

import csv
import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mpirun_util import mpi_env, mpirun_or_skip

pytestmark = pytest.mark.slow  # conftest.py starts such files first

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
CONFIG = ROOT / "examples" / "configs" / "gpt_fp32_adamw.json"
STEPS = 60
# A tiny model and data (about 6 k parameters... 0.3 s of training per run): the runs are start-up bound. On
# the CPU also where a GPU is (--device auto would take it): the bit-for-bit comparisons are the CPU's.
TINY = ["--steps", str(STEPS), "--d_model", "32", "--n_layer", "1", "--n_head", "2", "--seq_len", "32",
        "--batch_size", "8", "--corpus_mb", "0.5", "--eval_seqs", "32", "--eval_interval", "20",
        "--log_interval", "1", "--save_interval", "0", "--config", str(CONFIG), "--device", "cpu"]
TIMEOUT = 240


def _env() -> dict:
    # One thread everywhere (mpi_env's OMP_NUM_THREADS=1): with more, torch's reductions (the reported mean
    # loss) may split their sums differently in a 1-process and a 2-process run.
    return mpi_env(PYTHONWARNINGS="ignore::UserWarning")


def _cmd(np: int, out_dir: Path, *extra: str) -> list[str]:
    py = [sys.executable, str(EXAMPLE), *TINY, "--out_dir", str(out_dir), *extra]
    return py if np == 1 else [mpirun_or_skip(), "-np", str(np), "--oversubscribe", *py]


def _run(np: int, out_dir: Path, *extra: str) -> str:
    r = subprocess.run(_cmd(np, out_dir, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=TIMEOUT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{np}-process run exited with {r.returncode}:\n{out[-5000:]}"
    return out


def _rows(out_dir: Path) -> list[dict]:
    with open(out_dir / "train_log.csv", newline="") as f:
        return list(csv.DictReader(f))


def _losses(rows: list[dict]) -> list[tuple[int, str, str]]:
    # The CSV holds repr() of the float64 values: string equality is bit equality.
    return [(int(r["step"]), r["loss"], r["val_loss"]) for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 1-process run with 2 accumulated micro-batches (the same micro-batches a 2-rank run has, with
    the progress bar and the plot), and one uninterrupted 2-rank run."""
    base = tmp_path_factory.mktemp("pretrain")
    t0 = time.monotonic()
    one_out = _run(1, base / "one", "--gradient_accumulation_steps", "2")
    two_out = _run(2, base / "two", "--no_progress", "--no_plot")
    print(f"reference runs: {time.monotonic() - t0:.1f} s")
    return {"base": base, "one": base / "one", "two": base / "two", "one_out": one_out, "two_out": two_out}


def test_trains_and_writes_log_and_plot(runs):
    rows = _rows(runs["one"])
    assert [int(r["step"]) for r in rows] == list(range(0, STEPS + 1))  # step 0: the untrained model
    assert rows[0]["loss"] == "" and abs(float(rows[0]["val_loss"]) - math.log(256)) < 0.5, rows[0]
    rows = rows[1:]
    for key in ("tokens", "tokens_per_s", "state_bytes", "max_rss_mb"):
        assert all(float(r[key]) > 0 for r in rows), key
    # The lr each step applied: the linear warmup from 0 (DeepSpeed's WarmupCosineLR) up to the config's.
    lrs = [float(r["lr"]) for r in rows]
    assert lrs[0] == 0.0 and 0.99 * 2e-3 < max(lrs) <= 2e-3 and lrs[-1] < 0.2 * 2e-3, lrs
    png = runs["one"] / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "loss.png is not a PNG"
    assert (runs["one"] / "checkpoints" / "latest").read_text().strip() == f"global_step{STEPS}"
    # Learning: the validation loss must fall from the uniform model's ln(256) at least halfway to the
    # corpus' unigram entropy H1 (what a model that learned only byte frequencies reaches), and the
    # training loss of the last steps must be below that of the first ones.
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import pretrain_gpt
    finally:
        sys.path.pop(0)
    import torch

    counts = torch.bincount(pretrain_gpt.Corpus(int(0.5e6)).train.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    h1 = float(-(p * p.log()).sum())
    val = [float(r["val_loss"]) for r in _rows(runs["one"]) if r["val_loss"]]
    assert len(val) == STEPS // 20 + 1
    assert val[-1] < (math.log(256) + h1) / 2, (val, h1)
    assert val == sorted(val, reverse=True), val
    loss = [float(r["loss"]) for r in rows]
    assert sum(loss[-5:]) < sum(loss[:5]) - 5 * 1.0, loss


def test_two_ranks_match_one_process(runs):
    # Rank r of 2 takes rows [4r, 4r+4) of every global batch of 8: the same micro-batches (same shapes,
    # so the same forward and backward arithmetic) as the 1-process run's two accumulated ones. The
    # engine averages the 2 ranks' fp32 gradients as (g0 + g1) / 2 and the 1-process run accumulates
    # g0/2 + g1/2; scaling by 1/2 is exact in binary floating point, so the sums are identical and the
    # training losses must agree bit for bit.
    one, two = _rows(runs["one"]), _rows(runs["two"])
    assert [(s, l) for s, l, _ in _losses(one)] == [(s, l) for s, l, _ in _losses(two)]
    # Validation losses: the same weights, but each rank sums its own share of the sequences in fp32
    # (32 tokens x up to 4 sequences per sum), so the totals may differ by fp32 reassociation: relative
    # error at most ~128 * 2^-24 < 1e-5.
    v1 = [float(r["val_loss"]) for r in one if r["val_loss"]]
    v2 = [float(r["val_loss"]) for r in two if r["val_loss"]]
    assert len(v1) == len(v2) > 0
    for a, b in zip(v1, v2):
        assert abs(a - b) <= 1e-5 * abs(a), (v1, v2)
    assert "2 rank(s)" in runs["two_out"] and "1 rank(s)" in runs["one_out"]


def test_pipeline_of_two_stages_trains_the_same_model(runs, tmp_path):
    # --pipeline-stages 2 on 2 ranks: the GPT's layers cut into 2 stages, one data-parallel rank each, fed
    # the 1-process run's two accumulated micro-batches. Each stage runs the same arithmetic on the same
    # numbers, and the exact config's optimizer is elementwise, so training is the same bit for bit; the
    # reported loss is train_batch's float32 mean (DeepSpeed's), the 1-process run's is the float64 one.
    out = _run(2, tmp_path, "--no_progress", "--no_plot", "--gradient_accumulation_steps", "2",
               "--pipeline-stages", "2")
    one, pipe = _rows(runs["one"]), _rows(tmp_path)
    assert [r["step"] for r in one] == [r["step"] for r in pipe]
    f32 = [struct.unpack("f", struct.pack("f", float(r["loss"])))[0] for r in one if r["loss"]]
    assert f32 == [float(r["loss"]) for r in pipe if r["loss"]]
    # Validation: the pipeline's eval_batch averages the micro-batches' mean losses in another order.
    for a, b in zip([r for r in one if r["val_loss"]], [r for r in pipe if r["val_loss"]]):
        assert abs(float(a["val_loss"]) - float(b["val_loss"])) <= 1e-5 * float(a["val_loss"]), (a, b)
    assert "(2 pipeline stages x 1 data-parallel ranks)" in out and "stages 0-1" in out, out


def _rank_pids(mpirun_pid: int) -> dict[int, int]:
    """{MPI rank: pid} of the example's processes started by this mpirun."""
    ranks = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if str(EXAMPLE) not in (d / "cmdline").read_bytes().decode(errors="replace"):
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except OSError:
            continue
        if env.get("OMPI_COMM_WORLD_RANK", "").isdigit() and _ancestor(int(d.name), mpirun_pid):
            ranks[int(env["OMPI_COMM_WORLD_RANK"])] = int(d.name)
    return ranks


def _ancestor(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def test_sigterm_saves_and_resume_continues_exactly(runs):
    out_dir = runs["base"] / "stopped"
    # Slowed down (0.1 s per step) so the signal arrives mid-run; the arithmetic is unchanged.
    proc = subprocess.Popen(_cmd(2, out_dir, "--no_progress", "--no_plot", "--step_sleep", "0.1"), cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        csv_path = out_dir / "train_log.csv"
        while time.monotonic() < deadline and proc.poll() is None:
            if csv_path.is_file() and len(csv_path.read_text().splitlines()) > 5:  # header + 5 steps
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it could be signalled:\n{proc.communicate()[0][-4000:]}"
        pids = _rank_pids(proc.pid)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGTERM)  # one rank only: the ranks must agree to stop together
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"exit {proc.returncode} after SIGTERM:\n{out[-5000:]}"
    assert "stopped by a signal on another rank after step" in out or "stopped by SIGTERM after step" in out, out
    tag = (out_dir / "checkpoints" / "latest").read_text().strip()
    stopped = int(tag.removeprefix("global_step"))
    assert 5 <= stopped < STEPS, tag
    assert [int(r["step"]) for r in _rows(out_dir)] == list(range(0, stopped + 1))

    resumed_out = _run(2, out_dir, "--no_progress", "--no_plot", "--resume")
    assert f"resumed at step {stopped}" in resumed_out, resumed_out
    # Bit-exact continuation: weights, fp32 states, scheduler position and data position restored.
    assert _losses(_rows(out_dir)) == _losses(_rows(runs["two"]))


def _example_module():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import pretrain_gpt
    finally:
        sys.path.pop(0)
    return pretrain_gpt


@pytest.mark.parametrize("option, value", [
    ("--steps", "0"), ("--batch_size", "0"), ("--gradient_accumulation_steps", "0"), ("--seq_len", "0"),
    ("--d_model", "0"), ("--n_layer", "0"), ("--n_head", "0"), ("--corpus_mb", "0"), ("--eval_interval", "0"),
    ("--eval_seqs", "0"), ("--log_interval", "0"), ("--log_interval", "-1"), ("--save_interval", "-1"),
    ("--step_sleep", "-1"),
])
def test_option_values_out_of_range_are_named(option, value, capsys):
    # Each used to end in a traceback (division or modulo by zero, a KeyError in the engine) or be taken
    # with another meaning (--log_interval 0: the config's period; -1: every step).
    with pytest.raises(SystemExit) as e:
        _example_module().parse_args(["--config", str(CONFIG), option, value])
    assert e.value.code == 2
    assert f"{option} {float(value) if option in ('--corpus_mb', '--step_sleep') else value}" in capsys.readouterr().err


def test_option_values_at_the_bounds_are_taken():
    args = _example_module().parse_args(["--config", str(CONFIG), "--save_interval", "0", "--step_sleep", "0",
                                         "--log_interval", "1", "--d_model", "6", "--n_head", "3"])
    assert (args.save_interval, args.step_sleep, args.log_interval) == (0, 0.0, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: test_engine_cuda.py runs --device cuda")
def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    out = _run_fails(1, tmp_path, "--device", "cuda", "--no_progress", "--no_plot")
    assert "--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); use --device cpu" in out
    assert "Traceback" not in out, out
    assert _example_module().pick_device("auto") == torch.device("cpu")  # auto falls back to the CPU


def _run_fails(np: int, out_dir: Path, *extra: str) -> str:
    r = subprocess.run(_cmd(np, out_dir, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode != 0, f"the run succeeded:\n{(r.stdout + r.stderr)[-3000:]}"
    return r.stdout + r.stderr


def test_resume_with_steps_not_above_the_checkpoint_is_an_error(tmp_path):
    # It used to save the checkpoint's step again and print "done" with a NaN validation loss.
    _run(1, tmp_path, "--steps", "3", "--no_progress", "--no_plot")
    for steps in ("3", "2"):
        out = _run_fails(1, tmp_path, "--steps", steps, "--no_progress", "--no_plot", "--resume")
        assert (f"--resume: the checkpoint in {tmp_path / 'checkpoints'} is at step 3, not below --steps {steps}: "
                f"nothing to train; raise --steps") in out, out
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step3"


def test_interrupted_and_resumed_log_matches_uninterrupted(tmp_path):
    # A report every 3 steps and a stop between reports: the resumed run's first row must average the
    # whole window (the steps before the stop too), and the stop writes no row of its own.
    steps = ["--steps", "12", "--log_interval", "3", "--no_progress", "--no_plot"]
    _run(1, tmp_path / "whole", *steps)
    out_dir = tmp_path / "stopped"
    proc = subprocess.Popen(_cmd(1, out_dir, *steps, "--step_sleep", "0.3"), cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        csv_path = out_dir / "train_log.csv"
        while time.monotonic() < deadline and proc.poll() is None:
            if csv_path.is_file() and len(csv_path.read_text().splitlines()) > 2:  # header, steps 0 and 3
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it could be signalled:\n{proc.communicate()[0][-4000:]}"
        os.kill(proc.pid, signal.SIGTERM)  # during step 4's sleep, most likely
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"exit {proc.returncode} after SIGTERM:\n{out[-5000:]}"
    stopped = int((out_dir / "checkpoints" / "latest").read_text().strip().removeprefix("global_step"))
    assert 3 < stopped < 12, stopped
    assert [int(r["step"]) for r in _rows(out_dir)] == [0, 3] + ([6] if stopped >= 6 else []) + (
        [9] if stopped >= 9 else [])
    out = _run(1, out_dir, *steps, "--resume")
    assert f"done: {12 - stopped} steps (from step {stopped}) in " in out, out
    resumed, whole = _rows(out_dir), _rows(tmp_path / "whole")
    assert _losses(resumed) == _losses(whole), (stopped, _losses(resumed), _losses(whole))
    assert [r["lr"] for r in resumed] == [r["lr"] for r in whole]
    elapsed = [float(r["elapsed_s"]) for r in resumed]
    assert elapsed == sorted(elapsed) and elapsed[-1] >= 0.3 * stopped, elapsed  # continues the stopped run's


def test_resume_from_an_earlier_tag(tmp_path):
    # --resume could only take the checkpoint `latest` names. With a tag, the run goes on from that one:
    # the same losses as an uninterrupted run, the CSV rows after the tag replaced.
    steps = ["--steps", "9", "--save_interval", "3", "--no_progress", "--no_plot"]
    _run(1, tmp_path / "whole", *steps)
    whole = _rows(tmp_path / "whole")
    out = _run(1, tmp_path / "whole", *steps, "--resume", "global_step3")
    assert "resumed at step 3" in out and "done: 6 steps (from step 3) in " in out, out
    assert _losses(_rows(tmp_path / "whole")) == _losses(whole)
    # No TAG, or "latest": the checkpoint latest names (step 9 of 9 here: nothing left to train).
    for resume in (["--resume"], ["--resume", "latest"]):
        out = _run_fails(1, tmp_path / "whole", *steps, *resume)
        assert "is at step 9, not below --steps 9" in out, out
    # A tag that is not there: the engine's error, naming it and the directory, without a traceback.
    out = _run_fails(1, tmp_path / "whole", *steps, "--resume", "global_step4")
    assert f"--resume global_step4: {tmp_path / 'whole' / 'checkpoints' / 'global_step4'}: missing: tag " \
           f"'global_step4' is not in {tmp_path / 'whole' / 'checkpoints'}" in out, out
    assert "Traceback" not in out, out


def test_config_warnings_and_errors_name_the_file(tmp_path):
    # The example passes the engine a dict (the config with its overrides), which the engine names
    # "<config dict>"; the example puts the file's name back, in warnings and errors.
    import json

    cfg = json.loads(CONFIG.read_text())
    cfg["my_setting"] = 1
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(cfg))
    tiny = [a if a != str(CONFIG) else str(path) for a in TINY]
    env = {**_env(), "PYTHONWARNINGS": "default"}
    r = subprocess.run([sys.executable, str(EXAMPLE), *tiny, "--steps", "1", "--no_progress", "--no_plot",
                        "--out_dir", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{path}: my_setting: unknown key, ignored" in r.stderr, r.stderr
    assert "<config dict>" not in r.stderr, r.stderr
    # A misspelt key inside a section zero8 reads is an error (it would run with the default of the key
    # meant), with the key meant.
    cfg = json.loads(CONFIG.read_text())
    cfg["zero_optimization"]["reduce_bucket_sise"] = 1
    path.write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, str(EXAMPLE), *tiny, "--steps", "1", "--no_progress", "--no_plot",
                        "--out_dir", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f'{path}: zero_optimization.reduce_bucket_sise: unknown key; did you mean "reduce_bucket_size"?' \
        in r.stderr, r.stderr
    assert "<config dict>" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    # 8 sequences do not split into 3 accumulated micro-batches: the engine's error, without a traceback.
    out = _run_fails(1, tmp_path / "out", "--gradient_accumulation_steps", "3")
    assert f"{CONFIG}: train_batch_size: 8 is not divisible by gradient_accumulation_steps 3" in out, out
    assert "(the config as changed by --steps 60, --batch_size 8, --gradient_accumulation_steps 3)" in out, out
    assert "Traceback" not in out, out


