"""Behaviour tests of benchmarks/bench_overlap.py and benchmarks/bench_memory_limit.py (not timing tests):
tiny runs on 2 ranks under mpirun must print their JSON lines with what the engine measured, so the
benchmarks keep working as the engine changes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")


def last_json(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.strip()][-1])


def memory_limit_module():
    """benchmarks/bench_memory_limit.py as a module (its directory holds the imports it needs)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_memory_limit
    finally:
        sys.path.pop(0)
    return bench_memory_limit


def test_overlap_benchmark_reports_both_settings():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_overlap.py"), "--d_model", "64",
                           "--n_layer", "1", "--seq_len", "16", "--batch", "1", "--bucket", "4096", "--steps", "2",
                           "--warmup", "1", "--runs", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = last_json(proc.stdout)
    assert rep["bench"] == "overlap"
    rows = {r["overlap"]: r for r in rep["rows"]}
    assert set(rows) == {"on", "off"}
    assert rows["on"]["threaded"] and not rows["off"]["threaded"]
    for r in rows.values():
        # Every timed step reduces its buckets and gathers its pieces; off, the loop waits for all of it.
        assert r["reductions"] > 0 and r["gathers"] > 0 and r["reduce_seconds"] > 0
    off = rows["off"]
    assert off["reduce_wait_seconds"] == pytest.approx(off["reduce_seconds"])
    assert rows["on"]["reductions"] == off["reductions"]


def test_memory_limit_worker_reports_zero8_memory(tmp_path):
    # One rung's job as the search runs it, without a limit: both ranks write their peak and zero8's
    # memory_stats, whose gradient buffers are the buckets, not the full model.
    mpirun = shutil.which("mpirun")
    cmd = [mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
           str(ROOT / "benchmarks" / "bench_memory_limit.py"), "--worker", "zero8", "--d_model", "128",
           "--seq_len", "16", "--batch", "1", "--steps", "2", "--bucket", "8192", "--seed", "1",
           "--result_dir", str(tmp_path)]
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    gpt_params = memory_limit_module().gpt_params
    assert all(r["params"] == gpt_params(128, 16) and r["peak_rss"] > 0 for r in ranks)
    mem = ranks[0]["memory"]
    assert mem["params"] == ranks[0]["params"]
    assert 0 < mem["grads_peak"] < 4 * mem["params"]  # buckets in flight, not a full fp32 buffer


def test_memory_limit_search_refines_between_rungs(monkeypatch):
    # The ladder's steps of 64 leave a wide bound on the ratio: the search goes on between the last rung
    # that fits and the next one in steps of --refine, and reports the largest width that fits there.
    m = memory_limit_module()
    runs = []

    def fake_rung(system, args, d_model, limit, index):
        runs.append(d_model)
        return {"fits": d_model <= 936, "peak_rss": [1, 1], "seconds": 0.0, "why": "", "oom_kills": 0,
                "memory": None, "cgroup": None}

    monkeypatch.setattr(m, "run_rung", fake_rung)
    args = m.argparse.Namespace(start=None, refine=16, seq_len=64)
    r = m.search("zero8", args, 1 << 30)
    assert r["largest_d_model"] == 928 and r["largest_params"] == m.gpt_params(928, 64)
    assert {896, 960, 928, 944} <= set(runs) and len(runs) == len(set(runs))  # no width run twice
    assert m.search("zero8", m.argparse.Namespace(start=None, refine=0, seq_len=64), 1 << 30)["largest_d_model"] == 896
    # Head sizes: 64 on the ladder, the divisor nearest to 64 between its rungs.
    assert [m.n_heads(d) for d in (640, 896, 912, 928)] == [10, 14, 16, 16]


def test_memory_limit_rung_that_crashes_runs_once_more(monkeypatch):
    # A job that fails without an OOM kill (a DeepSpeed rank's abort) is not "does not fit" on its own
    # word: it runs once more; an OOM kill is final.
    m = memory_limit_module()
    outcomes = []

    def fake_once(system, args, d_model, limit, index):
        why, oom = outcomes.pop(0)
        return {"fits": not why, "peak_rss": [1, 1], "seconds": 0.0, "why": why, "oom_kills": oom,
                "memory": None, "cgroup": "v1"}

    monkeypatch.setattr(m, "run_rung_once", fake_once)
    outcomes[:] = [("exit 1: terminate called without an active exception", 0), ("", 0)]
    r = m.run_rung("deepspeed", None, 448, 1, 0)
    assert r["fits"] and r["retried_after"].startswith("exit 1") and not outcomes
    outcomes[:] = [("killed at the limit", 1)]
    r = m.run_rung("deepspeed", None, 704, 1, 0)
    assert not r["fits"] and "retried_after" not in r and not outcomes
