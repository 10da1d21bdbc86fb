"""zero8 in FSDP2 jobs on real ranks: zero8.optim's optimizers on FSDP2's sharded parameters (DTensors;
zero8/optim/dtensor.py) and zero8.fsdp's int8 exchanges (gradients, parameters, HSDP's replicas),
dist/dist_fsdp2.py under torchrun at 2 ranks, then at 3 (uneven shards; the checkpoints of 2 ranks loaded at 3)
over gloo (its one test that needs 4 ranks at 4), and on one GPU over NCCL; benchmarks/bench_fsdp2.py's modes at
a tiny size. The single-process checks (refusals, messages) are in test_optim.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from torch.distributed.fsdp import FSDPModule

from mpirun_util import ROOT, pytest_under_launcher, torchrun_cmd, torchrun_env

pytestmark = pytest.mark.slow  # conftest.py starts such files first


def test_fsdp2_on_2_then_3_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    collected = {}
    for np in (2, 3):
        collected[np] = pytest_under_launcher(np, "dist_fsdp2.py", tmp_path / f"np{np}", timeout=420,
                                              launcher="torchrun", ZERO8_FSDP2_CKPT=str(ckpt))
    assert collected == {2: 20, 3: 20}
    assert sorted(p.name for p in ckpt.iterdir()) == ["w2", "w3"]


def test_fsdp2_int8_parameters_resharded_after_forward_to_2_of_4_ranks(tmp_path):
    """The one test of dist_fsdp2.py that needs 4 ranks: reshard_after_forward=2 (a post-forward group smaller than
    the shard group, which 2 or 3 ranks cannot have)."""
    assert pytest_under_launcher(4, "dist_fsdp2.py", tmp_path, timeout=300, launcher="torchrun",
                                 select="reshard_after_forward_to_fewer_ranks") == 1


@pytest.mark.cuda
def test_fsdp2_on_one_gpu(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert pytest_under_launcher(1, "dist_fsdp2.py", tmp_path / "np1", timeout=300, launcher="torchrun",
                                 ZERO8_FSDP2_CKPT=str(ckpt), ZERO8_FSDP2_DEVICE="cuda") == 20


def test_the_benchmark_runs_and_reports(tmp_path):
    """benchmarks/bench_fsdp2.py at a tiny size (a behaviour check, not a timing): its JSON has every optimizer,
    and the 8-bit states take about a quarter of torch's bytes."""
    out = tmp_path / "bench.json"
    r = subprocess.run(torchrun_cmd(2) + [str(ROOT / "benchmarks" / "bench_fsdp2.py"), "--dim", "256", "--layers", "1",
                                          "--rounds", "1", "--json-out", str(out)],
                       cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    report = json.loads(out.read_text())
    rows = {row["optimizer"]: row for row in report["rows"]}
    assert set(rows) == {"zero8 AdamW8bit", "torch AdamW (foreach)", "torch AdamW (fused)"}
    assert report["world"] == 2 and report["params"] == 2 * 256 * 1024 + 1024 + 256
    ratio = rows["zero8 AdamW8bit"]["state_bytes_per_rank"] / rows["torch AdamW (fused)"]["state_bytes_per_rank"]
    assert 0.25 < ratio < 0.27, ratio  # 2.03 of 8 bytes per parameter, the biases' 8 bytes besides
    assert all(row["step_ms"] > 0 for row in rows.values())


@pytest.mark.skipif(not hasattr(FSDPModule, "set_custom_all_gather"),
                    reason="this PyTorch has no FSDPModule.set_custom_all_gather")
@pytest.mark.parametrize("ddp", [False, True], ids=["fsdp2", "ddp"])
def test_the_wire_benchmark_runs_and_reports(tmp_path, ddp):
    """benchmarks/bench_fsdp2.py --where local (the driver, which starts --train under torchrun) at a tiny size,
    for FSDP2 (float32, int8 gradients, int8 gradients and parameters) and for DDP (float32, int8): every wire
    timed, and each int8 exchange sent about a quarter of the bytes of the float32 collective it replaces."""
    out = tmp_path / "wire.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fsdp2.py"), "--where", "local", "--dim", "256",
                        "--layers", "1", "--rounds", "1", "--steps", "1", "--tokens", "16", "--json-out", str(out)]
                       + (["--ddp"] if ddp else []),
                       cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    local = json.loads(out.read_text())["scenarios"]["local"]
    assert local["mode"] == ("train-ddp" if ddp else "train")
    wires = {"fp32": [], "int8": ["gradients"]} if ddp else \
        {"fp32": [], "int8": ["gradients"], "int8_params": ["gradients", "parameters"]}
    assert set(local["step_s"]) == set(wires) and all(t > 0 for t in local["step_s"].values())
    assert set(local["speedup"]) == set(wires) - {"fp32"}
    for wire, exchanges in wires.items():
        sent = local["exchange_bytes_per_step"][wire]
        assert sorted(sent) == exchanges
        for b in sent.values():
            assert 0.25 < b["int8"] / b["fp32"] < 0.26, (wire, b)
    assert "| local |" in r.stdout


@pytest.mark.skipif(not hasattr(FSDPModule, "set_custom_all_gather"),
                    reason="this PyTorch has no FSDPModule.set_custom_all_gather")
def test_the_quality_benchmark_runs_and_reports(tmp_path):
    """benchmarks/bench_fsdp2.py --quality for a few steps: the example's GPT trained with each wire from the same
    start and batches, a finite validation loss for each, the differences to float32's reported."""
    out = tmp_path / "quality.json"
    r = subprocess.run(torchrun_cmd(2) + [str(ROOT / "benchmarks" / "bench_fsdp2.py"), "--quality", "--quality-steps",
                                          "3", "--json-out", str(out)],
                       cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "quality" and report["steps"] == 3 and report["world"] == 2
    losses = {w: v["1234"] for w, v in report["val_loss"].items()}
    assert set(losses) == {"fp32", "int8", "int8_params"}
    assert all(3.0 < v < 6.0 for v in losses.values()), losses  # ln(256) = 5.5 at the start
    assert report["mean_rel_diff"]["fp32"] == 0
    assert abs(report["mean_rel_diff"]["int8_params"] - (losses["int8_params"] / losses["fp32"] - 1)) < 1e-9
    assert "| int8 gradients and parameters |" in r.stdout
