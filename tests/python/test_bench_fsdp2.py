"""benchmarks/bench_fsdp2.py --where --hsdp at a tiny size (a behaviour check, not a timing): HSDP on a 2 x 2
mesh of 4 ranks on one host, native against zero8's int8 replicas' all-reduce (alone and with the int8
reduce-scatter), the driver's table, and --codec-calls. Its other modes are run by test_optim_fsdp2.py. About
15 s on 2 cores; no root needed (as root the one-host run is in a network namespace of its own).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from torch.distributed.fsdp import FSDPModule

from mpirun_util import ROOT, torchrun_env

BENCH = ROOT / "benchmarks" / "bench_fsdp2.py"


@pytest.mark.skipif(not hasattr(FSDPModule, "set_all_reduce_hook"),
                    reason="this PyTorch has no FSDPModule.set_all_reduce_hook")
def test_hsdp_wires_train_alike_at_a_quarter_of_the_replicas_bytes(tmp_path):
    """Every wire timed from the same start and batches: the first step's loss the same for all, the int8 wires'
    loss within 1% of native HSDP's at every step, and each int8 exchange about a quarter of the bytes of the
    float32 collective it replaces (the replicas' all-reduce; the reduce-scatter within the shard group)."""
    out = tmp_path / "hsdp.json"
    r = subprocess.run([sys.executable, str(BENCH), "--where", "local", "--hsdp", "--dim", "256", "--layers", "1",
                        "--rounds", "1", "--steps", "2", "--tokens", "16", "--json-out", str(out)],
                       cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    local = json.loads(out.read_text())["scenarios"]["local"]
    assert local["mode"] == "train-hsdp" and local["world"] == 4
    wires = {"fp32": [], "int8_replicas": ["replicas"], "int8_replicas_rs": ["gradients", "replicas"]}
    assert set(local["step_s"]) == set(wires) and all(t > 0 for t in local["step_s"].values())
    for wire, exchanges in wires.items():
        sent = local["exchange_bytes_per_step"][wire]
        assert sorted(sent) == exchanges
        for b in sent.values():
            assert 0.25 < b["int8"] / b["fp32"] < 0.26, (wire, b)
    losses = local["loss_per_step"]
    assert all(len(v) == 4 for v in losses.values())  # the warm-up round's 2 steps and the timed round's
    assert losses["int8_replicas"][0] == pytest.approx(losses["fp32"][0], rel=1e-6)
    assert losses["int8_replicas_rs"][0] == pytest.approx(losses["fp32"][0], rel=1e-6)
    assert losses["fp32"][-1] < losses["fp32"][0]
    assert all(d < 0.01 for d in local["loss_max_rel_diff"].values()), local["loss_max_rel_diff"]
    assert "| local | " in r.stdout and "(no link)" in r.stdout


def test_the_table_gives_ratios_to_float32():
    """The driver's table: speed-ups and the link's bytes as ratios to float32, the loss differences in percent."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_fsdp2_for_test", BENCH)
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(BENCH.parent))
    run = {"step_s": {"fp32": 2.0, "int8_replicas": 1.0}, "speedup": {"int8_replicas": 2.0},
           "link_bytes_per_step": {"fp32": 40e6, "int8_replicas": 10e6}, "loss_max_rel_diff": {"int8_replicas": 0.0012},
           "loss_per_step": {"fp32": [1.0] * 8, "int8_replicas": [1.0] * 8}}
    table = bench.wire_table({"local": dict(run, link_bytes_per_step={"fp32": 0.0, "int8_replicas": 0.0}),
                              "1gbit": dict(run, goodput_gbps=0.96)}).splitlines()
    assert "step, int8 replicas' all-reduce (speed-up)" in table[0] and "over the 8 steps" in table[0]
    assert table[2] == "| local | 2000 ms | 1000 ms (2.00x) | (no link) | 0.12% |"
    assert table[3] == "| 1gbit (0.96 Gbit/s) | 2000 ms | 1000 ms (2.00x) | 40.0 -> 10.0 (0.25x) | 0.12% |"


def test_codec_calls_compares_the_same_bits_both_ways(tmp_path):
    """--codec-calls times an exchange's codec work both ways only after checking that they give the same codes,
    scales, sum and decodes (it exits otherwise), at every rank count and piece size."""
    out = tmp_path / "codec.json"
    r = subprocess.run([sys.executable, str(BENCH), "--codec-calls", "--rounds", "1", "--json-out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    cases = json.loads(out.read_text())["cases"]
    assert sorted(cases) == ["2x4099", "64x1025", "8x4099", "8x65539"]
    for case in cases.values():
        assert case["same_bits"] and all(t > 0 for t in case["us"].values()) and case["speedup"] > 0
    assert "| 64 x 1025 |" in r.stdout
