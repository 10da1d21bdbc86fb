"""Behaviour test of benchmarks/bench_optim.py (not a timing test): a tiny run in a subprocess must print
its table and a final JSON line with one entry per optimizer, each measured or skipped/failed with the
reason, and the measured state sizes must be what each optimizer's state format implies.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_optim.py"
OPTIMIZERS = ["zero8_adamw8bit", "zero8_adamw32bit", "torch_adamw_foreach", "torch_adamw_fused",
              "deepspeed_cpu_adam", "bnb_adamw8bit"]
REQUIRED = {"zero8_adamw8bit", "zero8_adamw32bit", "torch_adamw_foreach", "torch_adamw_fused"}
SIZE = 100_000  # 4096 x 24 matrix + 1696-element tail: exercises the matrix split and the 1-D remainder


def run(*extra, timeout=900):
    # timeout: the first DeepSpeed use JIT-compiles its CPU Adam op with g++ (minutes on 2 cores)
    return subprocess.run([sys.executable, str(SCRIPT), *extra], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def report():
    proc = run("--quick", "--sizes", "1e5", "--repeat", "1", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return proc.stdout, json.loads(lines[-1])


def test_json_has_one_entry_per_optimizer(report):
    _, rep = report
    assert rep["bench"] == "optim_step" and rep["sizes"] == [SIZE] and rep["threads"] == 1
    by_name = {}
    for r in rep["results"]:
        assert r["size"] == SIZE
        assert r["optimizer"] not in by_name, f"duplicate entry for {r['optimizer']}"
        by_name[r["optimizer"]] = r
    assert sorted(by_name) == sorted(OPTIMIZERS)
    for name, r in by_name.items():
        if name in REQUIRED:  # zero8 and torch are dependencies of the package: they must run
            assert r["status"] == "ok", r
        else:  # optional third-party packages: measured, or not with the exact reason recorded
            assert r["status"] in ("ok", "skipped", "failed"), r
            if r["status"] != "ok":
                assert (r.get("reason") or r.get("error") or "").strip(), r


def test_measured_entries_are_consistent(report):
    out, rep = report
    for r in rep["results"]:
        if r["status"] != "ok":
            continue
        name = r["optimizer"]
        assert r["ms_per_step"] > 0 and r["steps_timed"] == 1 and r["finite"], r
        assert r["ns_per_param"] == pytest.approx(r["ms_per_step"] * 1e6 / SIZE, rel=1e-9)
        assert r["ratio_to_zero8_adamw8bit"] > 0
        bpp = r["state_bytes_per_param"]
        if "8bit" in name:
            # two 1-byte codes per element + one float32 scale per 256-element block each (2.03125 B), plus
            # at most two 256-entry float32 maps per tensor (2 tensors: 4 * 1024 B / 1e5 = 0.041 B), plus the
            # 1696-element tail, below min_8bit_size 4096, which keeps float32 states (6 B more per element:
            # 1696 * 6 / 1e5 = 0.102 B)
            assert 2.03125 <= bpp <= 2.03125 + 0.041 + 0.102, (name, bpp)
        else:
            # two float32 moments per element (8 B) plus a scalar step tensor per parameter in torch's
            assert 8.0 <= bpp <= 8.0 + 2 * 8 / SIZE, (name, bpp)
    ref = next(r for r in rep["results"] if r["optimizer"] == "zero8_adamw8bit")
    assert ref["ratio_to_zero8_adamw8bit"] == pytest.approx(1.0)
    # 1e5 parameters fit many times over: every optimizer was timed in the same interleaved rounds.
    assert all(r["interleaved"] for r in rep["results"] if r["status"] == "ok")
    assert "timed in interleaved rounds" in out
    assert "| zero8_adamw8bit" in out and "ms/step" in out  # the readable table is printed


def test_rejects_zero_threads():
    proc = run("--sizes", "1e5", "--threads", "0", timeout=120)
    assert proc.returncode == 2 and "--threads" in proc.stderr


def test_sequential_timing_on_request():
    proc = run("--sizes", "1e5", "--repeat", "2", "--threads", "1", "--sequential",
               "--only", "zero8_adamw8bit", "zero8_adamw32bit", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = json.loads([ln for ln in proc.stdout.splitlines() if ln.strip()][-1])
    assert [r["optimizer"] for r in rep["results"]] == ["zero8_adamw8bit", "zero8_adamw32bit"]
    for r in rep["results"]:
        assert r["status"] == "ok" and r["steps_timed"] == 2 and not r["interleaved"], r
    assert "each optimizer timed alone" in proc.stdout
