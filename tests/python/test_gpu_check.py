"""The GPU check (scripts/gpu_check.sh) and the GPU benchmark (benchmarks/bench_gpu.py) on a machine without a
GPU, as CI runs: the scripts parse (and pass shellcheck where it is installed), the report generator turns
fabricated stage results into the report the docs describe, the check stops with its reason when there is no
GPU, bad arguments are refused before anything is built, and the packaging half of the pipeline (prepare,
unpack with the system's copies hidden, relocate OpenMPI, configure) works: about a minute. The build half
compiles zero8 twice with nvcc (about 7 minutes from scratch on 2 cores), which CI's own build already
covers; the whole pipeline is run by hand, as docs/BENCHMARKS.md ("GPU check") says:

    bash scripts/gpu_check.sh --prepare .gpu-deps
    bash tests/gpu_check/hide_system_deps.sh .gpu-deps -- \\
        bash scripts/gpu_check.sh --quick --no-gpu-ok --deps .gpu-deps --out /tmp/gc --budget 7200
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "gpu_check.sh"
REPORT = ROOT / "scripts" / "gpu_check_report.py"
HIDE = ROOT / "tests" / "gpu_check" / "hide_system_deps.sh"
BENCH = ROOT / "benchmarks" / "bench_gpu.py"


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


@pytest.mark.parametrize("script", [CHECK, HIDE])
def test_scripts_parse(script):
    r = run(["bash", "-n", str(script)])
    assert r.returncode == 0, r.stderr
    if shutil.which("shellcheck"):
        r = run(["shellcheck", "-S", "warning", str(script)])
        assert r.returncode == 0, r.stdout + r.stderr


def installed(pkg: str) -> bool:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return r.stdout == "install ok installed"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not installed("libxxhash-dev"),
                    reason="needs root, unshare and Debian's libxxhash-dev installed")
def test_hide_system_deps_hides_the_packages_of_a_deps_dir(tmp_path):
    """The harness that proves the prepared packages suffice: inside it, the files of every package named
    by a .deb in the directory are gone (here a stand-in .deb named libxxhash-dev), the rest is there."""
    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text("Package: libxxhash-dev\nVersion: 0.0\nArchitecture: all\n"
                                            "Maintainer: zero8 tests <none@example.invalid>\nDescription: stand-in\n")
    deps = tmp_path / "deps"
    deps.mkdir()
    r = run(["dpkg-deb", "--build", str(pkg), str(deps / "libxxhash-dev.deb")])
    assert r.returncode == 0, r.stderr
    r = run(["bash", str(HIDE), str(deps), "--", "bash", "-c",
             "test ! -e /usr/include/xxhash.h && test -e /usr/include/stdio.h"])
    if r.returncode != 0 and "overlay" in r.stderr:
        pytest.skip(f"no overlay mounts here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.exists("/usr/include/xxhash.h")  # outside the harness nothing changed


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("apt-get")
                    or not installed("libopenmpi-dev"),
                    reason="needs root, unshare, apt-get and this machine's own OpenMPI to hide")
def test_prepared_packages_suffice_without_the_system_ones(tmp_path):
    """The packaging half of the check, as on the GPU machine: --prepare fetches the .debs (or the repository's
    .gpu-deps/ is used when prepared), then with this machine's own copies hidden the check unpacks them,
    relocates OpenMPI (mpirun starts 2 ranks) and configures zero8 with CUDA, MPI and NCCL against them.
    The build half is the build CI does anyway."""
    deps = ROOT / ".gpu-deps"
    if not (deps / "manifest.txt").exists():
        deps = tmp_path / "deps"
        r = run(["bash", str(CHECK), "--prepare", str(deps)])
        if r.returncode != 0 and re.search(r"Could not resolve|Failed to fetch|Temporary failure", r.stdout + r.stderr):
            pytest.skip(f"Debian's package registry is not reachable: {(r.stdout + r.stderr).strip()[-300:]}")
        assert r.returncode == 0, r.stdout + r.stderr
    out, work = tmp_path / "out", tmp_path / "work"
    r = run(["bash", str(HIDE), str(deps), "--", "bash", str(CHECK), "--quick", "--no-gpu-ok", "--deps", str(deps),
             "--out", str(out), "--work", str(work), "--stop-after", "configure"])
    if r.returncode != 0 and "overlay" in r.stderr and not (out / "report.json").exists():
        pytest.skip(f"no overlay mounts here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stdout + r.stderr + (out / "report.md").read_text()
    rep = json.loads((out / "report.json").read_text())
    assert [(s["name"], s["status"]) for s in rep["stages"]] == [("gpu", "skipped"), ("deps", "ok"),
                                                                 ("configure", "ok")]
    ranks = (work / "logs" / "deps.log").read_text().split("--- mpirun -np 2")[1].splitlines()[1:]
    assert sorted(x for x in ranks if x.strip().isdigit()) == ["0", "1"], ranks
    conf = (work / "logs" / "configure.log").read_text()
    assert f"Found GTest: {work}/deps/" in conf and f"Found nlohmann_json: {work}/deps/" in conf
    assert "CUDA=1" in conf and "MPI=1" in conf


# --- the report from fabricated results -------------------------------------------------------------------

CTEST_XML = """<?xml version="1.0" encoding="UTF-8"?>
<testsuite name="Linux" tests="5" failures="1" disabled="0" skipped="2" hostname="" time="3" timestamp="">
  <testcase name="CodecCuda.EncodeEqualsReference" classname="CodecCuda.EncodeEqualsReference" time="0.2" status="run">
    <system-out>[ RUN      ] CodecCuda.EncodeEqualsReference
[       OK ] CodecCuda.EncodeEqualsReference (150 ms)
[  PASSED  ] 1 test.
</system-out>
  </testcase>
  <testcase name="OptimCuda.StepEqualsCpuReferenceBitwise" classname="OptimCuda.StepEqualsCpuReferenceBitwise"
            time="0.1" status="fail">
    <failure message="Failed"/>
    <system-out>[ RUN      ] OptimCuda.StepEqualsCpuReferenceBitwise
test_optim_cuda.cpp:150: Failure
parameter, step 2
[  FAILED  ] OptimCuda.StepEqualsCpuReferenceBitwise (12 ms)
</system-out>
  </testcase>
  <testcase name="test_dist_comm_cuda_np1" classname="test_dist_comm_cuda_np1" time="1.5" status="run">
    <system-out>[NON-XML-CHAR-0x1B][0;32m[ RUN      ] [NON-XML-CHAR-0x1B][mDistNccl.WithoutDeviceTheFactorySaysWhy
dist/test_comm_nccl.cpp:45: Skipped
a CUDA device is present: covered by DistNccl.CollectivesOnDeviceBuffers
[NON-XML-CHAR-0x1B][0;32m[  SKIPPED ] [NON-XML-CHAR-0x1B][mDistNccl.WithoutDeviceTheFactorySaysWhy (0 ms)
[ RUN      ] DistNccl.CollectivesOnDeviceBuffers
[       OK ] DistNccl.CollectivesOnDeviceBuffers (900 ms)
[  PASSED  ] 1 test.
[  SKIPPED ] 1 test, listed below:
[  SKIPPED ] DistNccl.WithoutDeviceTheFactorySaysWhy
</system-out>
  </testcase>
  <testcase name="test_dist_sharded_cuda_np1" classname="test_dist_sharded_cuda_np1" time="0.9" status="notrun">
    <skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>
    <system-out>Note: Google Test filter = *Cuda*:*Nccl*
[==========] Running 0 tests from 0 test suites.
[==========] 0 tests from 0 test suites ran. (0 ms total)
[  PASSED  ] 0 tests.
</system-out>
  </testcase>
  <testcase name="bench_cli_cuda_codec" classname="bench_cli_cuda_codec" time="0.1" status="notrun">
    <skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>
    <system-out>zero8-bench: --device cuda: no usable CUDA device (no CUDA-capable device is detected)</system-out>
  </testcase>
</testsuite>
"""

PYTEST_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
skipped="1" tests="3"><testcase classname="tests.python.test_optim" name="test_adamw8bit_cuda_matches_cpu" time="0.5"/>
<testcase classname="tests.python.test_optim" name="test_lion8bit_cuda_matches_cpu" time="0.4"><failure
message="AssertionError: codes differ">trace</failure></testcase><testcase classname="tests.python.test_int8"
name="test_int8linear_cuda" time="0.0"><skipped type="pytest.skip" message="needs 2 GPUs">skip</skipped></testcase>
</testsuite></testsuites>
"""


def stage(name, status, rc=0, seconds=1, note=""):
    return json.dumps({"name": name, "status": status, "rc": rc, "seconds": seconds, "log": f"logs/{name}.log",
                       "note": note})


def fabricate(work: Path, no_gpu: bool = False) -> None:
    (work / "results").mkdir(parents=True)
    (work / "logs").mkdir()
    (work / "example").mkdir()
    (work / "results" / "env.txt").write_text(
        f"gpu={'none (nvidia-smi not found)' if no_gpu else 'NVIDIA H200'}\ndriver=580.159.03\nno_gpu={int(no_gpu)}\n"
        f"no_gpu_ok={int(no_gpu)}\n"
        "mode=full\ncommit=0123abcd\ntorch=2.11.0+cu130 CUDA 13.0 device available: True\n")
    stages = [stage("gpu", "ok"), stage("deps", "ok", seconds=4), stage("configure", "ok", seconds=20),
              stage("build", "ok", seconds=80), stage("python_build", "ok", seconds=95),
              stage("ctest_cuda", "failed", rc=8, seconds=40),
              stage("pytest_cuda", "failed", rc=1, seconds=30),
              stage("bench_bandwidth", "ok"), stage("bench_codec", "ok"), stage("bench_codec_2048", "ok"),
              stage("bench_optimizer_1e8", "ok"),
              stage("bench_optimizer_1e9", "timeout", rc=124, seconds=150, note="stopped after its limit of 150 s"),
              stage("bench_python", "ok", seconds=100), stage("example", "ok", seconds=60)]
    (work / "results" / "stages.jsonl").write_text("\n".join(stages) + "\n")
    for name in ("deps", "configure", "build", "python_build", "ctest_cuda", "pytest_cuda", "bench_codec",
                 "bench_optimizer_1e9", "example"):
        lines = [f"{name} line {i}" for i in range(100)]
        (work / "logs" / f"{name}.log").write_text("\n".join(lines) + f"\nlast words of {name}\n")
    (work / "logs" / "example.log").write_text(
        "step 200/200 loss 2.1\ndone: 200 steps in 41.5 s (98,700 tokens/s); final validation loss 2.3000\n")
    (work / "results" / "ctest.xml").write_text(CTEST_XML)
    (work / "results" / "pytest.xml").write_text(PYTEST_XML)
    (work / "results" / "bench_bandwidth.json").write_text(json.dumps({"bench": "bandwidth", "gbps": 4300.0}) + "\n")
    # A ratio over a zero timing: zero8-bench writes null (JSON has no inf).
    (work / "results" / "bench_optimizer_1e8.json").write_text(json.dumps(
        {"bench": "optimizer", "ns_per_param_8bit": 0.0, "ns_per_param_32bit": 0.008, "speedup_8_vs_32": None,
         "gbps_effective_8bit": None}) + "\n")
    (work / "results" / "bench_codec.json").write_text(
        json.dumps({"bench": "codec", "gbps": 2800.0, "ratio_to_copy": 0.65}) + "\n")
    (work / "results" / "bench_codec_2048.json").write_text(
        json.dumps({"bench": "codec", "block": 2048, "gbps": 3100.0, "ratio_to_copy": 0.72}) + "\n")
    (work / "results" / "bench_python.json").write_text(json.dumps({"bench": "gpu", "rows": [
        {"group": "optim", "figure": "AdamW8bit speed / torch fused AdamW, 1e9 params", "value": 1.62, "unit": "x",
         "target": ">= 1.5", "met": True, "error": None},
        {"group": "linear", "figure": "Int8Linear(exact) forward+backward speed / bf16 nn.Linear, 4096x16384, 8192 tokens",
         "value": None, "unit": "x", "target": ">= 1.3", "met": None,
         "error": "not available: Int8Linear(gemm='exact') on CUDA: Zero8ValueError: runs on CPU"}]}) + "\n")
    (work / "example" / "train_log.csv").write_text(
        "step,tokens,loss,val_loss,lr,tokens_per_s\n50,204800,4.1,4.0,0.002,95000\n100,409600,3.0,,0.002,99000\n"
        "150,614400,2.5,2.6,0.002,101000\n200,819200,2.1,2.3,0.002,100000\n")


def make_report(tmp_path: Path, no_gpu: bool = False):
    work, out = tmp_path / "work", tmp_path / "out"
    fabricate(work, no_gpu)
    r = run([sys.executable, str(REPORT), "--work", str(work), "--out", str(out)])
    assert r.returncode == 0, r.stderr
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), out


def test_report_counts_stages_tests_and_logs(tmp_path):
    rep, md, out = make_report(tmp_path)
    assert rep["verdict"] == "failed" and not rep["no_gpu"]
    assert md.startswith("# zero8 GPU check: FAILED (3 of 14 stages failed)")
    status = {s["name"]: s["status"] for s in rep["stages"]}
    assert status["bench_optimizer_1e9"] == "timeout" and status["build"] == "ok"
    tails = {s["name"]: s.get("log_tail") for s in rep["stages"]}
    assert tails["ctest_cuda"].endswith("last words of ctest_cuda") and tails["ctest_cuda"].count("\n") == 39
    assert tails["build"] is None  # only failed stages carry their log's tail
    assert "stopped after its limit of 150 s" in md
    # ctest entries, and the GoogleTest cases inside them (the dist run holds a pass and a skip).
    c = rep["tests"]["ctest_cuda"]
    assert (c["passed"], c["failed"], c["skipped"]) == (2, 1, 2)
    assert c["failed_names"] == ["OptimCuda.StepEqualsCpuReferenceBitwise"]
    # CTest's own words for a skip by output are replaced by the output's.
    assert c["skipped_tests"] == [
        {"name": "test_dist_sharded_cuda_np1", "reason": "no GoogleTest case matches its filter"},
        {"name": "bench_cli_cuda_codec",
         "reason": "zero8-bench: --device cuda: no usable CUDA device (no CUDA-capable device is detected)"}]
    cases = c["cases"]  # colours stripped; a case of a multi-case run names the run
    assert (cases["passed"], cases["failed"], cases["skipped"]) == (2, 1, 1)
    assert cases["skipped_tests"] == [{"name": "DistNccl.WithoutDeviceTheFactorySaysWhy (test_dist_comm_cuda_np1)",
                                       "reason": "a CUDA device is present: covered by DistNccl.CollectivesOnDeviceBuffers"}]
    p = rep["tests"]["pytest_cuda"]
    assert (p["passed"], p["failed"], p["skipped"]) == (1, 1, 1)
    assert p["failed_names"] == ["tests.python.test_optim::test_lion8bit_cuda_matches_cpu (AssertionError: codes differ)"]
    assert p["skipped_tests"] == [{"name": "tests.python.test_int8::test_int8linear_cuda", "reason": "needs 2 GPUs"}]
    assert "`DistNccl.WithoutDeviceTheFactorySaysWhy (test_dist_comm_cuda_np1)`: a CUDA device is present" in md
    # At most 8 files, the logs grouped.
    files = sorted(f.name for f in out.iterdir())
    assert files == sorted(rep["files"]) and len(files) <= 8
    assert "===== configure =====" in (out / "build.log").read_text()
    assert "last words of pytest_cuda" in (out / "tests.log").read_text()


def test_report_states_every_figure_with_its_target(tmp_path):
    rep, md, _ = make_report(tmp_path)
    rows = {(r["source"], r["figure"]): r for r in rep["benchmarks"]}
    codec = rows[("zero8-bench (bench_codec)", "quantize + dequantize / copy bandwidth")]
    assert (codec["value"], codec["target"], codec["met"]) == (0.65, ">= 0.7", False)
    codec2048 = rows[("zero8-bench (bench_codec_2048)", "quantize + dequantize / copy bandwidth, block 2048")]
    assert (codec2048["value"], codec2048["target"], codec2048["met"]) == (0.72, ">= 0.7", True)
    bw = rows[("zero8-bench (bench_bandwidth)", "device-to-device copy")]
    assert (bw["value"], bw["target"], bw["met"]) == (4300.0, None, None)
    # The 1e9 run timed out: its figures say why they are missing.
    opt9 = rows[("zero8-bench (bench_optimizer_1e9)", "8-bit step speed / 32-bit step, 1e9 params")]
    assert opt9["value"] is None and opt9["target"] == ">= 1.5"
    assert opt9["error"] == "not measured: stopped after its limit of 150 s"
    opt8 = rows[("zero8-bench (bench_optimizer_1e8)", "8-bit step speed / 32-bit step, 1e8 params")]
    assert opt8["value"] is None and opt8["met"] is None
    assert opt8["error"].startswith("not a finite number (zero8-bench writes null")
    py = [r for r in rep["benchmarks"] if r["source"] == "bench_gpu.py"]
    assert py[0]["met"] is True and py[1]["error"].startswith("not available: Int8Linear")
    assert "| bench_gpu.py | AdamW8bit speed / torch fused AdamW, 1e9 params | 1.62 | x | >= 1.5 | yes |" in md
    assert "| 0.65 | x | >= 0.7 | **no** |" in md
    ex = rep["example"]
    assert (ex["steps"], ex["loss_first"], ex["loss_last"]) == (200, 4.1, 2.1)
    assert (ex["val_loss_first"], ex["val_loss_last"], ex["val_loss_falls"]) == (4.0, 2.3, True)
    assert (ex["tokens_per_s"], ex["run_seconds"]) == (98700.0, 41.5)
    assert "- validation loss 4 -> 2.3 (falls)" in md


def test_report_says_plainly_that_no_gpu_was_present(tmp_path):
    rep, md, _ = make_report(tmp_path, no_gpu=True)
    assert rep["no_gpu"] is True
    assert "**No GPU was present on this machine**" in md and "This is not a GPU result." in md


def test_report_reads_keys_that_zero8_bench_writes():
    """Every zero8-bench figure the report lists is a key the --device cuda JSON lines have (a renamed key
    would otherwise show as missing only on the GPU machine)."""
    sys.path.insert(0, str(REPORT.parent))
    try:
        import gpu_check_report
    finally:
        sys.path.pop(0)
    source = (ROOT / "benchmarks" / "zero8_bench.cpp").read_text()
    cuda_part = source[source.index("int cmd_bandwidth_cuda"):]
    for stage, key, *_ in gpu_check_report.CPP_FIGURES:
        assert f'.num("{key}"' in cuda_part, (stage, key)


def test_report_needs_a_work_directory(tmp_path):
    r = run([sys.executable, str(REPORT), "--work", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")])
    assert r.returncode == 2 and "not a gpu_check.sh work directory" in r.stderr


# --- the check's front door -----------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--frobnicate"], "unknown argument '--frobnicate'"),
    (["--deps", "/nonexistent/deps"], "--deps /nonexistent/deps: no such directory"),
    (["--budget", "5"], "--budget needs a number of seconds >= 60, got '5'"),
    (["--jobs", "0"], "--jobs needs a positive integer, got '0'"),
    (["--cuda-arch", "sm_90"], "--cuda-arch must look like 90 or 80;90, got 'sm_90'"),
    (["--stop-after", "tests"], "--stop-after takes deps, configure or build, got 'tests'"),
    (["--prepare"], "--prepare needs a directory"),
])
def test_check_refuses_bad_arguments(tmp_path, args, message):
    r = run(["bash", str(CHECK), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w"), *args])
    assert r.returncode == 2
    assert f"gpu_check: {message}" in r.stderr
    assert not (tmp_path / "w").exists()  # refused before anything was made


def test_check_deps_dir_needs_debs(tmp_path):
    (tmp_path / "deps").mkdir()
    r = run(["bash", str(CHECK), "--deps", str(tmp_path / "deps"), "--out", str(tmp_path / "out")])
    assert r.returncode == 2 and "holds no .deb files (make it with --prepare)" in r.stderr


def test_help():
    r = run(["bash", str(CHECK), "--help"])
    assert r.returncode == 0 and r.stdout.startswith("usage: scripts/gpu_check.sh --prepare DIR")


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU")
def test_check_without_gpu_stops_and_reports_why(tmp_path):
    out = tmp_path / "out"
    r = run(["bash", str(CHECK), "--quick", "--out", str(out), "--work", str(tmp_path / "w")])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "gpu_check: no GPU on this machine" in r.stderr and "--no-gpu-ok" in r.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["no_gpu"] is True and rep["verdict"] == "failed"
    assert [s["name"] for s in rep["stages"]] == ["gpu"]  # nothing was built
    assert "the check stopped before building" in (out / "report.md").read_text()
    assert "run with --no-gpu-ok" in rep["stages"][0]["note"]


# --- benchmarks/bench_gpu.py ------------------------------------------------------------------------------

def test_bench_gpu_arguments():
    r = run([sys.executable, str(BENCH), "--help"])
    assert r.returncode == 0 and "--optim-numel" in r.stdout
    for args, message in [(["--tokens", "0"], "must be a positive integer, got '0'"),
                          (["--shapes", "4096"], "a shape is IN x OUT"),
                          (["--only", "gemm"], "invalid choice: 'gemm'"),
                          (["--optim-numel", "1.5"], "must be a positive integer, got '1.5'"),
                          (["--engine-model", "2048"], "a shape is IN x OUT"),
                          (["--engine-tokens", "0"], "must be a positive integer, got '0'")]:
        r = run([sys.executable, str(BENCH), *args])
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


def test_bench_gpu_engine_comparison_trains_both_systems_on_the_cpu():
    """The engine comparison's two training steps (PyTorch AMP and zero8's engine), built as bench_gpu builds
    them, small and on the CPU: both train the same model (the loss falls from the same start)."""
    import torch

    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    made = bench.engine_steps(torch, torch.device("cpu"), 32, 2, 64)
    assert not isinstance(made["zero8"], str), made["zero8"]
    for name in ("torch", "zero8"):
        step = made[name][0]
        losses = [float(step()) for _ in range(6)]
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], (name, losses)


def test_bench_gpu_wire_rows_on_the_cpu():
    """The wire group's rows, built as on a GPU but on the CPU: per case the per-piece time and the speed-up of
    one call for all pieces (bench_fsdp2.py's cases, whose both ways it checks give the same bits)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    b = bench.Bench(bench.parse_args(["--only", "wire"]), None)
    bench.bench_wire(b, device="cpu")
    assert len(b.rows) == 8 and all(r["group"] == "wire" and r["error"] is None and r["value"] > 0 for r in b.rows)
    assert [r["unit"] for r in b.rows] == ["us", "x"] * 4
    assert "64 ranks x 1025 elements" in b.rows[-1]["figure"]


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU")
def test_bench_gpu_without_gpu_says_so(tmp_path):
    r = run([sys.executable, str(BENCH), "--json-out", str(tmp_path / "b.json")])
    assert r.returncode == 1
    assert "bench_gpu: no CUDA device" in r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line == json.loads((tmp_path / "b.json").read_text())
    assert line["error"].startswith("no CUDA device")


@pytest.mark.cuda
def test_bench_gpu_small_run_on_device(tmp_path):
    """On a GPU: every comparison of a small run gives its baseline's time, and zero8's rows a figure or the
    reason it is not available; targets are only judged on measured figures."""
    r = run([sys.executable, str(BENCH), "--optim-numel", "300000", "--tensor-numel", "65536", "--shapes", "256x512",
             "--tokens", "128", "--engine-model", "256x2", "--engine-tokens", "128", "--repeat", "2", "--warmup", "1",
             "--json-out", str(tmp_path / "b.json")],
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    base = [x for x in rows if x["figure"].startswith(("torch AdamW", "bf16 nn.Linear", "PyTorch AMP"))]
    assert len(base) == 4 and all(x["value"] > 0 and x["error"] is None for x in base)
    for x in rows:
        assert (x["value"] is not None) != (x["error"] is not None), x
        assert x["met"] is None or x["value"] is not None


def test_check_records_the_compute_mode_and_warns_of_an_exclusive_one(tmp_path):
    """An exclusive compute mode would fail every test where 2 ranks share the GPU: the check says so at the
    start and the report's machine table names the mode (a stand-in nvidia-smi; stops after the deps stage)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$*" in\n  *query-gpu*) echo "NVIDIA H200, 580.159.04, 9.0, 143771 MiB, '
                   'Exclusive_Process" ;;\n  *) echo "GPU 0: NVIDIA H200" ;;\nesac\n')
    smi.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    r = run(["bash", str(CHECK), "--quick", "--stop-after", "deps", "--out", str(out), "--work", str(tmp_path / "w")],
            env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compute mode 'Exclusive_Process': the tests where 2 ranks share the GPU will fail" in r.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["env"]["compute_mode"] == "Exclusive_Process" and rep["env"]["gpu"] == "NVIDIA H200"
    assert [s["name"] for s in rep["stages"]] == ["gpu", "deps"]  # stopped after deps, nothing built


FAKE_GTEST = """echo "[==========] Running 1 test from 1 test suite."
echo "[  PASSED  ] 1 test."
"""


def run_stage_alone(tmp_path, stage: str, fn: str, tools: dict, files: dict, exports: dict = None):
    """Runs one stage of gpu_check.sh (sourced: its run_stage called alone) in tmp_path/w with stand-ins:
    `tools` ({name: shell body}) on a PATH of their own, `files` ({path under the build folder: shell
    body}) as executables, `exports` ({variable: value}) set for it. Returns (exit code, the stage's record,
    its log)."""
    work, build, bin_dir = tmp_path / "w", tmp_path / "w" / "build", tmp_path / "bin"
    for d in (work / "results", work / "logs", bin_dir):
        d.mkdir(parents=True, exist_ok=True)
    for path, body in [(bin_dir / name, body) for name, body in tools.items()] + \
            [(build / rel, body) for rel, body in files.items()]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n" + body + "\n")
        path.chmod(0o755)
    (work / "deps_env.sh").write_text("")
    script = f"""
source {CHECK}
WORK={work} BUILD={build} DEPS_ENV={work}/deps_env.sh NVCC= BUDGET=560 DEADLINE=$(($(date +%s) + 300))
STAGES={work}/results/stages.jsonl
export WORK BUILD DEPS_ENV NVCC
{"".join(f"export {k}={v}{chr(10)}" for k, v in (exports or {}).items())}run_stage {stage} 60 "{fn}"
"""
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    r = run(["bash", "-c", script], env=env)
    assert r.stderr == "", r.stderr
    rec = json.loads((work / "results" / "stages.jsonl").read_text().splitlines()[-1])
    return r.returncode, rec, (work / "logs" / f"{stage}.log").read_text()


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("case", ["clean", "errors", "device_not_supported", "no_sanitizer"])
def test_sanitizer_stages(tmp_path, case, tool):
    """The memcheck and racecheck stages (gpu_check.sh sourced, its run_stage called alone) with stand-ins for
    the test executables and compute-sanitizer: ok when the tool finds nothing, failed with its summary when
    it finds errors, skipped with the reason when the sanitizer refuses the device or is missing."""
    summary = {"memcheck": "ERROR SUMMARY: 2 errors",
               "racecheck": "RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)"}[tool]
    sanitizer = {
        "clean": f'[ "$2" = {tool} ] || exit 9; shift 4; "$@"; echo "========= ERROR SUMMARY: 0 errors"',
        "errors": f'[ "$2" = {tool} ] || exit 9; shift 4; "$@"; '
                  f'echo "========= Invalid __shared__ write of size 4 bytes"; echo "========= {summary}"; exit 7',
        "device_not_supported": 'echo "========= Error: Device not supported"; exit 1',
    }
    # called as: compute-sanitizer --tool TOOL --error-exitcode 7 EXE --gtest_filter=F
    tools = {"compute-sanitizer": sanitizer[case]} if case in sanitizer else {}
    tests = {f"tests/{exe}": FAKE_GTEST for exe in ("test_codec_cuda", "test_optim_cuda", "test_int8_cuda")}
    rc, rec, log = run_stage_alone(tmp_path, tool, f"st_sanitize {tool}", tools, tests)
    if case == "clean":
        assert rc == 0 and rec["status"] == "ok", (rec, log)
        assert log.count(f"$ compute-sanitizer --tool {tool}") == 3
    elif case == "errors":
        assert rc != 0 and rec["status"] == "failed", (rec, log)
        assert f"{tool}: test_codec_cuda --gtest_filter=CodecCuda.*: exit 7 (========= {summary})" in rec["note"]
    elif case == "device_not_supported":  # (run_stage's status is 1 for anything but ok)
        assert rec["status"] == "skipped", (rec, log)
        assert rec["note"].startswith(
            "compute-sanitizer cannot check this device: ========= Error: Device not supported")
    else:
        assert rec["status"] == "skipped", (rec, log)
        assert rec["note"] == "compute-sanitizer not found"


@pytest.mark.parametrize("case", ["profiled", "no_counter_access", "no_ncu"])
def test_profile_stage(tmp_path, case):
    """The profile stage (Nsight Compute on the warp kernels and the int8 product) with stand-ins for
    zero8-bench, python and ncu: ok with both benchmark commands and bench_gpu.py profiled, skipped with the
    reason when ncu may not read the counters or is missing."""
    ncu = {  # called as: ncu --kernel-name K --launch-skip 2 --launch-count 2 --section S (x4) BENCH ARGS...,
        # or ncu --kernel-name K --launch-count 5 --section S (x5) PYTHON bench_gpu.py ARGS...
        "profiled": 'shift 14; echo "  optim_step_warp_kernel  DRAM Throughput 80 %"; "$@"',
        "no_counter_access": 'echo "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission"; exit 1',
    }
    tools = {"ncu": ncu[case]} if case in ncu else {}
    tools["python-stand-in"] = 'echo "python $*"'
    # zero8 installed (SITE/zero8) and a python stand-in, for the int8 product's profile under bench_gpu.py.
    site, py = tmp_path / "site", tmp_path / "bin" / "python-stand-in"
    (site / "zero8").mkdir(parents=True)
    rc, rec, log = run_stage_alone(tmp_path, "profile", "st_profile", tools,
                                   {"benchmarks/zero8-bench": 'echo "bench $*"'},
                                   {"SITE": site, "PY": py, "ROOT": ROOT})
    if case == "profiled":
        assert rc == 0 and rec["status"] == "ok", (rec, log)
        assert "bench optimizer --numel 1e8 --repeat 3 --device cuda" in log
        assert "bench codec --numel 1e8 --repeat 3 --device cuda" in log
        assert (f"python {ROOT}/benchmarks/bench_gpu.py --only linear --shapes 4096x16384 --tokens 8192 --repeat 1 "
                "--warmup 1") in log
        assert log.count("DRAM Throughput") == 3
    elif case == "no_counter_access":
        assert rec["status"] == "skipped", (rec, log)
        assert rec["note"].startswith("ncu cannot profile here: ==ERROR== ERR_NVGPUCTRPERM")
    else:
        assert rec["status"] == "skipped", (rec, log)
        assert rec["note"] == "ncu (Nsight Compute) not found"
