"""The side-by-side benchmark against DeepSpeed (benchmarks/bench_vs_deepspeed.py) in its short form, so
that it keeps working: a 0.14 M-parameter GPT, one host, 2 timed steps, 2 interleaved rounds, zero8 and
(when it is installed) DeepSpeed ZeRO-2. No timing is asserted; what is: the table and the JSON line, that
the rounds interleave, that both systems trained the same model on the same data (equal first losses),
the optimizer-state sizes each format implies, the bytes on the loopback against the payload DeepSpeed
must send, and the pieces the full benchmark adds (the DeepSpeed reference choice, the shaped link, the
DeepSpeed version pin). About a minute with DeepSpeed on 2 cores, 20 s without.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # conftest.py starts such files first

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_vs_deepspeed.py"
NETNS = ROOT / "scripts" / "netns_cluster.sh"
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@functools.lru_cache(maxsize=None)
def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_vs_deepspeed", BENCH)
    mod = importlib.util.module_from_spec(spec)
    # registered before it runs: its dataclasses look their module up by name
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_vs_ds")
    # Its own namespace names: test_multinode.py's cluster (z8h) may be up at the same time.
    cmd = [sys.executable, str(BENCH), "--model", "tiny", "--where", "local", "--steps", "2", "--warmup", "1",
           "--repeats", "2", "--ds_grid", "none", "--ds_torch_adamw", "--eager_gather", "--out_dir", str(out), "--netns_prefix", "z8ci",
           "--netns_net", "10.211.0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    assert r.returncode == 0, f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("BENCH_VS_DEEPSPEED "), last
    return r.stdout, json.loads(last.split(" ", 1)[1]), json.loads((out / "results.json").read_text()), out


def test_table_and_json(short_run):
    stdout, compact, full, out = short_run
    assert "== one host, no network" in stdout and "zero8 (default settings)" in stdout
    assert (out / "table.txt").read_text().strip() in stdout
    rows = compact["scenarios"]["local"]["rows"]
    expected = {"zero8", "zero8_eager", "deepspeed_best"} if HAVE_DEEPSPEED else {"zero8", "zero8_eager"}
    assert set(rows) == expected
    if not HAVE_DEEPSPEED:
        assert "setup_deepspeed.sh" in compact["deepspeed_skipped"]
    for role, row in rows.items():
        assert row["runs"] == 2 and row["failed"] == 0, (role, row)
        assert row["step_s_min"] <= row["step_s"] <= row["step_s_max"]
        assert row["tokens_per_s"] == pytest.approx(2 * 4 * 64 / row["step_s"])  # 2 ranks x 4 sequences x 64
        assert row["params"] == compact["params"] == _bench_module().gpt_params(_bench_module().MODELS["tiny"])
        assert row["peak_rss_mb_per_rank"] > 100  # torch alone
        # no launcher binds the ranks (mpirun would, zero8's to one core each): both systems may use every core
        assert row["cpus_per_rank"] == len(os.sched_getaffinity(0)), (role, row["cpus_per_rank"])
        assert 0.0 < row["val_loss"] < 6.0 and 0.0 < row["train_loss"] < 6.0
    # The all-gather inside the step or into the next forward: when it runs, not what it computes.
    assert (rows["zero8_eager"]["train_loss"], rows["zero8_eager"]["val_loss"]) == (
        rows["zero8"]["train_loss"], rows["zero8"]["val_loss"])


def test_rounds_interleave(short_run):
    *_, out = short_run
    runs = sorted(p.name for p in (out / "local").iterdir())
    roles = [re.sub(r"^\d+-round\d-", "", n) for n in runs]
    per_round = ["zero8", "zero8_eager", "deepspeed_best"] if HAVE_DEEPSPEED else ["zero8", "zero8_eager"]
    assert roles == per_round * 2, runs
    assert [int(n.split("-")[1][5:]) for n in runs] == [1] * len(per_round) + [2] * len(per_round)


def test_same_model_and_data(short_run):
    """Same seed, model, batches: the first step's loss (before any update) is the same computation in both."""
    _, compact, *_ = short_run
    rows = compact["scenarios"]["local"]["rows"]
    if not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed (bash benchmarks/setup_deepspeed.sh)")
    assert rows["zero8"]["first_loss"] == pytest.approx(rows["deepspeed_best"]["first_loss"], rel=1e-5)


def test_state_and_bytes(short_run):
    _, compact, full, _ = short_run
    rows = compact["scenarios"]["local"]["rows"]
    n = compact["params"]
    z = rows["zero8"]
    # zero8 counts what it sent: int8 gradient blocks and the parameter all-gather, well under fp32's
    # reduce-scatter + all-gather (4 bytes per parameter per rank and step with 2 ranks).
    assert 0 < z["zero8_bytes_per_rank_step"] < 4 * n
    if full["netns"]:
        assert z["link_bytes_per_rank_step"] < 0.05 * z["zero8_bytes_per_rank_step"]  # shared memory, not lo
    if not HAVE_DEEPSPEED:
        return
    d = rows["deepspeed_best"]
    # DeepSpeed: Adam's two fp32 moments of half the (padded) flat parameters, and a step counter each.
    assert n * 4 <= d["state_bytes_per_rank"] <= n * 4 + 4096
    assert z["state_bytes_per_rank"] < 0.5 * d["state_bytes_per_rank"]
    if full["netns"]:
        # gloo over the namespace's loopback: at least the fp32 gradient half each rank sends and the
        # parameter half it shares (2 bytes per parameter each), plus headers.
        assert 4 * n <= d["link_bytes_per_rank_step"] < 12 * n
    ratios = compact["scenarios"]["local"]["ratios"]
    assert ratios["throughput zero8 / DeepSpeed best"] > 0


def test_reference_choice():
    m = _bench_module()
    grid = [m.deepspeed_setting(k, 10_000) for k in m.DS_GRID["small"]]
    on = [s for s in grid if s.knobs["overlap_comm"]]
    off = [s for s in grid if not s.knobs["overlap_comm"]]
    times = {id(s): t for s, t in zip(grid, (3.0, 1.0, 2.0, 4.0))}
    best, ref_off = m.pick_references([(s, times[id(s)]) for s in grid])
    assert best is grid[1] and best in on and ref_off is grid[2] and ref_off in off
    best, ref_off = m.pick_references([(grid[0], 1.0), (grid[1], None), (grid[2], 2.0)])
    assert best is ref_off is grid[0]
    best, ref_off = m.pick_references([(grid[1], 5.0), (grid[3], 4.0)])  # nothing with overlap_comm off ran
    assert best is ref_off is grid[3]
    best, ref_off = m.pick_references([(grid[0], None), (grid[1], None)])  # all failed: the defaults
    assert best is ref_off is grid[0]
    assert grid[0].sections["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert grid[3].sections["zero_optimization"]["reduce_bucket_size"] == 2_500


def test_no_network_reference_of_the_same_rounds():
    # zero8's step on a shaped link is judged against its one-host run in the same interleaved rounds when
    # there is one (the machine drifts between scenarios), else against the local scenario's.
    m = _bench_module()

    def rows(**steps):
        return {role: {"summary": {"step_s": t}} for role, t in steps.items()}

    local = rows(zero8=2.0, zero8_eager=2.0, deepspeed_best=2.5)
    key = "zero8 step / its no-network step"
    assert m.ratios("1gbit", rows(zero8=2.2, zero8_nonet=2.1), local)[key] == pytest.approx(2.2 / 2.1)
    assert m.ratios("1gbit", rows(zero8=2.2), local)[key] == pytest.approx(1.1)
    assert m.ratios("1gbit", rows(zero8_eager=2.4, zero8_nonet=2.1), local)[
        "zero8, overlap_param_gather off step / its no-network step"] == pytest.approx(1.2)


def test_deepspeed_pin_agrees_with_pyproject():
    script = (ROOT / "benchmarks" / "setup_deepspeed.sh").read_text()
    pin = re.search(r"^DEEPSPEED_VERSION=([0-9.]+)$", script, re.M).group(1)
    extra = re.search(r"deepspeed==([0-9.]+)", (ROOT / "pyproject.toml").read_text())
    if extra:
        assert extra.group(1) == pin, "benchmarks/setup_deepspeed.sh and pyproject.toml pin different DeepSpeeds"
    if HAVE_DEEPSPEED:
        import importlib.metadata
        assert importlib.metadata.version("deepspeed") == pin


def test_shape_rejects_a_bad_rate():
    r = subprocess.run(["bash", str(NETNS), "shape", "1gb"], capture_output=True, text=True)
    assert r.returncode != 0 and "give the rate as <N>mbit or <N>gbit" in r.stderr, r.stderr


def test_shape_sets_and_removes_tbf():
    """netns_cluster.sh shape puts a token bucket at the rate on both veth ends, and 'off' removes it."""
    if os.geteuid() != 0 or subprocess.run(["bash", str(NETNS), "check"], capture_output=True).returncode != 0:
        pytest.skip("needs root and network namespaces")
    env = dict(os.environ, ZERO8_NETNS_PREFIX="z8cs", ZERO8_NETNS_NET="10.212.0")
    ns = lambda *a: subprocess.run(["bash", str(NETNS), *a], env=env, capture_output=True, text=True)  # noqa: E731

    def qdisc(host: int) -> str:
        return subprocess.run(["ip", "netns", "exec", f"z8cs{host}", "tc", "qdisc", "show", "dev", f"z8csv{host}"],
                              capture_output=True, text=True, check=True).stdout
    try:
        assert ns("up").returncode == 0
        r = ns("shape", "10gbit")
        assert r.returncode == 0, r.stderr
        for host in (0, 1):
            m = re.search(r"tbf .*rate 10Gbit burst (\d+)b", qdisc(host))
            assert m, qdisc(host)
            # 4 ms at 10 Gbit/s; the kernel stores the bucket in its clock's ticks, so it reads back rounded
            assert int(m.group(1)) == pytest.approx(5_000_000, rel=0.01), qdisc(host)
        assert ns("shape", "off").returncode == 0
        assert all("tbf" not in qdisc(host) for host in (0, 1))
    finally:
        ns("down")
