#!/usr/bin/env python3
"""Writes the GPU check's report.md and report.json from what scripts/gpu_check.sh left in its work directory,
and copies the stage logs beside them (at most 8 files in all). Standard library only: it also runs where
nothing but python3 is known to be installed. Called after every stage, so a report exists whatever happens.

    python3 scripts/gpu_check_report.py --work WORK --out OUT

WORK/results holds: env.txt (key=value), stages.jsonl (one record per stage: name, status ok|failed|timeout|
skipped, rc, seconds, log, note), ctest.xml and pytest.xml (JUnit), bench_<name>.json (the last line of a
zero8-bench run), bench_python.json (benchmarks/bench_gpu.py --json-out); WORK/logs/<stage>.log the stage
logs; WORK/example/train_log.csv the pretraining run's log. docs/BENCHMARKS.md ("GPU check") documents
report.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# Targets of the zero8-bench figures (bench_gpu.py states its own in its rows): (stage, JSON key) ->
# (label, unit, comparison, bound). From the GPU issue; the CPU tables of docs/BENCHMARKS.md use the same.
CPP_FIGURES = [
    ("bench_bandwidth", "gbps", "device-to-device copy", "GB/s", None, None),
    ("bench_codec", "gbps", "quantize + dequantize (block 256, f32)", "GB/s", None, None),
    ("bench_codec", "ratio_to_copy", "quantize + dequantize / copy bandwidth", "x", ">=", 0.70),
    ("bench_codec_2048", "gbps", "quantize + dequantize (block 2048, the gradients' wire block)", "GB/s", None, None),
    ("bench_codec_2048", "ratio_to_copy", "quantize + dequantize / copy bandwidth, block 2048", "x", ">=", 0.70),
    ("bench_codec", "ratio_to_copy_warp", "quantize + dequantize / copy bandwidth, warp kernels", "x", ">=", 0.70),
    ("bench_codec_2048", "ratio_to_copy_warp", "quantize + dequantize / copy bandwidth, block 2048, warp kernels",
     "x", ">=", 0.70),
    ("bench_optimizer_1e8", "ns_per_param_8bit", "8-bit AdamW step, 1e8 params", "ns/param", None, None),
    ("bench_optimizer_1e8", "ns_per_param_32bit", "32-bit AdamW step, 1e8 params", "ns/param", None, None),
    ("bench_optimizer_1e8", "speedup_8_vs_32", "8-bit step speed / 32-bit step, 1e8 params", "x", None, None),
    ("bench_optimizer_1e8", "gbps_effective_8bit", "8-bit step effective bandwidth, 1e8 params", "GB/s", None, None),
    ("bench_optimizer_1e8", "ns_per_param_8bit_warp", "8-bit AdamW step, warp kernels, 1e8 params", "ns/param", None,
     None),
    ("bench_optimizer_1e9", "ns_per_param_8bit", "8-bit AdamW step, 1e9 params", "ns/param", None, None),
    ("bench_optimizer_1e9", "ns_per_param_32bit", "32-bit AdamW step, 1e9 params", "ns/param", None, None),
    ("bench_optimizer_1e9", "speedup_8_vs_32", "8-bit step speed / 32-bit step, 1e9 params", "x", ">=", 1.5),
    ("bench_optimizer_1e9", "ns_per_param_8bit_warp", "8-bit AdamW step, warp kernels, 1e9 params", "ns/param", None,
     None),
    ("bench_optimizer_1e9", "speedup_8warp_vs_32", "8-bit step speed, warp kernels / 32-bit step, 1e9 params", "x",
     ">=", 1.5),
    ("bench_optimizer_1e9", "speedup_warp_vs_block", "8-bit step speed, warp kernels / block kernels, 1e9 params", "x",
     None, None),
    ("bench_optimizer_1e9", "moved_bytes_per_param_8bit", "8-bit step bytes moved per param", "B", None, None),
    ("bench_optimizer_1e9", "gbps_effective_8bit", "8-bit step effective bandwidth, 1e9 params", "GB/s", None, None),
    ("bench_optimizer_1e9", "gbps_effective_32bit", "32-bit step effective bandwidth, 1e9 params", "GB/s", None, None),
]
# Which stage logs go into which file of the output directory (the device tool brings back at most 8 files).
LOG_GROUPS = {
    "build.log": ["gpu", "deps", "configure", "build", "python_build"],
    "tests.log": ["ctest_cuda", "memcheck", "racecheck", "pytest_cuda"],
    "bench.log": ["bench_bandwidth", "bench_codec", "bench_codec_2048", "bench_optimizer_1e8", "bench_optimizer_1e9",
                  "bench_python", "profile"],
    "example.log": ["example"],
}
MAX_LOG_BYTES = 4 << 20
TAIL_LINES = 40


def read_env(path: Path) -> dict:
    env = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            key, sep, value = line.partition("=")
            if sep:
                env[key] = value
    return env


def read_stages(path: Path) -> list:
    stages = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if line.strip():
                try:
                    stages.append(json.loads(line))
                except json.JSONDecodeError:
                    stages.append({"name": "?", "status": "failed", "rc": -1, "seconds": 0,
                                   "note": f"unreadable stage record: {line[:200]}"})
    # A stage recorded twice (a rerun in one work directory) counts once: the last record.
    last = {}
    for s in stages:
        last[s.get("name")] = s
    return list(last.values())


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 64 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


# --- tests --------------------------------------------------------------------------------------------

_GTEST = re.compile(r"^\[ +(OK|SKIPPED|FAILED) +\] ([A-Za-z_][\w/.]*\.[\w/]+)(?: \(\d+ ms\))?\s*$")
_GTEST_RUN = re.compile(r"^\[ RUN +\] (\S+)\s*$")


# Terminal colours, raw or as CTest's JUnit writer spells the escape character.
_COLOUR = re.compile(r"(?:\x1b|\[NON-XML-CHAR-0x1B\])\[[0-9;]*m")


def gtest_cases(output: str) -> dict:
    """GoogleTest cases in a test's output: name -> (status, reason). A run under mpirun prints rank 0's."""
    cases, current, lines = {}, None, []
    for line in _COLOUR.sub("", output).splitlines():
        m = _GTEST_RUN.match(line)
        if m:
            current, lines = m.group(1), []
            continue
        m = _GTEST.match(line)
        if m:
            status = {"OK": "passed", "SKIPPED": "skipped", "FAILED": "failed"}[m.group(1)]
            name = m.group(2)
            if name == current:
                reason = " ".join(x.strip() for x in lines if x.strip() and not re.search(r":\d+: Skipped$", x))
                cases[name] = (status, reason[:300])
                current = None
            elif name not in cases:  # the closing summary's list, for a case whose run line was not seen
                cases[name] = (status, "")
            continue
        if current:
            lines.append(line)
    return cases


def skip_reason(output: str) -> str:
    """Why a test that CTest skipped by its output did not run: the line that says so."""
    lines = [x.strip() for x in _COLOUR.sub("", output).splitlines() if x.strip()]
    if any("0 tests from 0 test suites ran" in x for x in lines):
        return "no GoogleTest case matches its filter"
    said = [x for x in lines if re.search(r"\b(no|not|without|cannot|skip\w*)\b", x, re.I)]
    return (said or lines or [""])[-1]


def junit(path: Path) -> dict | None:
    """passed/failed/skipped from a JUnit file (ctest's or pytest's), with names and skip reasons."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"unreadable {path.name}: {e}"}
    res = {"passed": 0, "failed": 0, "skipped": 0, "failed_names": [], "skipped_tests": [],
           "cases": {"passed": 0, "failed": 0, "skipped": 0, "failed_names": [], "skipped_tests": []}}
    for tc in root.iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        full = f"{cls}::{name}" if cls and not name.startswith(cls) and "." in cls else name
        failure = tc.find("failure")
        if failure is None:
            failure = tc.find("error")
        skipped = tc.find("skipped")
        out = tc.findtext("system-out") or ""
        if failure is not None or tc.get("status") == "fail":
            res["failed"] += 1
            msg = (failure.get("message") if failure is not None else "") or ""
            res["failed_names"].append(full + (f" ({msg[:200]})" if msg and msg != "Failed" else ""))
        elif skipped is not None or tc.get("status") == "notrun":
            res["skipped"] += 1
            reason = (skipped.get("message") if skipped is not None else "") or ""
            if reason in ("", "SKIP_REGULAR_EXPRESSION_MATCHED"):  # CTest's words: the output says why
                reason = skip_reason(out) or reason
            res["skipped_tests"].append({"name": full, "reason": reason[:300]})
        else:
            res["passed"] += 1
        for case, (status, reason) in gtest_cases(out).items():
            c = res["cases"]
            c[status] += 1
            where = case if case == name else f"{case} ({name})"  # a case of a multi-case run names the run
            if status == "failed":
                c["failed_names"].append(where)
            elif status == "skipped":
                c["skipped_tests"].append({"name": where, "reason": reason})
    if sum(res["cases"][k] for k in ("passed", "failed", "skipped")) == 0:
        del res["cases"]
    return res


# --- benchmarks ---------------------------------------------------------------------------------------

def load_json(path: Path):
    if not path.exists() or not path.read_text().strip():
        return None
    try:
        return json.loads(path.read_text().strip().splitlines()[-1])
    except json.JSONDecodeError as e:
        return {"error": f"unreadable {path.name}: {e}"}


def met(value, cmp, bound):
    if cmp is None or not isinstance(value, (int, float)):
        return None
    return value >= bound if cmp == ">=" else value <= bound


def benchmarks(results: Path, stages: dict) -> list:
    rows = []
    for stage, key, label, unit, cmp, bound in CPP_FIGURES:
        data = load_json(results / f"{stage}.json")
        value, error = None, None
        if data is None:
            st = stages.get(stage)
            error = ("not measured: " + (st.get("note") or st.get("status", "")) if st else "not measured")
        elif "error" in data:
            error = data["error"]
        else:
            value = data.get(key)
            if key in data and value is None:
                error = f"not a finite number (zero8-bench writes null for inf or nan; key {key})"
            elif value is None:
                error = f"not in the zero8-bench output (key {key})"
        rows.append({"source": f"zero8-bench ({stage})", "figure": label, "value": value, "unit": unit,
                     "target": f"{cmp} {bound}" if cmp else None, "met": met(value, cmp, bound), "error": error})
    data = load_json(results / "bench_python.json")
    if data is None:
        st = stages.get("bench_python")
        rows.append({"source": "bench_gpu.py", "figure": "all rows", "value": None, "unit": None, "target": None,
                     "met": None, "error": "not measured: " + ((st.get("note") or st.get("status")) if st else "not run")})
    elif "error" in data:
        rows.append({"source": "bench_gpu.py", "figure": "all rows", "value": None, "unit": None, "target": None,
                     "met": None, "error": data["error"]})
    else:
        for r in data.get("rows", []):
            rows.append({"source": "bench_gpu.py", "figure": r.get("figure"), "value": r.get("value"),
                         "unit": r.get("unit"), "target": r.get("target"), "met": r.get("met"),
                         "error": r.get("error")})
    return rows


# --- the pretraining run ------------------------------------------------------------------------------

def example_summary(work: Path, stages: dict) -> dict | None:
    st = stages.get("example")
    if st is None:
        return None
    out = {"status": st.get("status")}
    csv_path = work / "example" / "train_log.csv"
    if csv_path.exists():
        with open(csv_path, newline="") as f:
            rows = list(csv.DictReader(f))

        def col(name):
            vals = []
            for r in rows:
                try:
                    vals.append((int(r["step"]), float(r[name])))
                except (KeyError, TypeError, ValueError):
                    pass
            return vals

        loss, val, tps = col("loss"), col("val_loss"), col("tokens_per_s")
        if loss:
            out.update(steps=loss[-1][0], loss_first=loss[0][1], loss_last=loss[-1][1],
                       loss_min=min(v for _, v in loss), loss_curve=[[s, round(v, 4)] for s, v in loss])
        if val:
            out.update(val_loss_first=val[0][1], val_loss_last=val[-1][1], val_loss_falls=val[-1][1] < val[0][1])
        if tps:
            out["tokens_per_s_median"] = statistics.median(v for _, v in tps)
    m = re.search(r"done: (\d+) steps.* in ([\d.]+) s \(([\d,]+) tokens/s\)", tail(work / "logs" / "example.log", 200))
    if m:
        out.update(run_seconds=float(m.group(2)), tokens_per_s=float(m.group(3).replace(",", "")))
    return out


# --- output -------------------------------------------------------------------------------------------

def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    return str(v)


def test_lines(title: str, r: dict | None) -> list:
    if r is None:
        return [f"**{title}**: not run", ""]
    if "error" in r:
        return [f"**{title}**: {r['error']}", ""]
    lines = [f"**{title}**: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"]
    c = r.get("cases")
    if c:
        lines[0] += f" (GoogleTest cases inside: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped)"
    lines.append("")
    failed = r["failed_names"] + (c["failed_names"] if c else [])
    if failed:
        lines += ["Failed:", ""] + [f"- `{n}`" for n in failed] + [""]
    # A ctest entry that is one GoogleTest case is listed once, as the case (its reason is GoogleTest's).
    cases = {s["name"] for s in c["skipped_tests"]} if c else set()
    skipped = (c["skipped_tests"] if c else []) + [s for s in r["skipped_tests"] if s["name"] not in cases]
    if skipped:
        lines += ["Skipped:", ""] + [f"- `{s['name']}`: {s['reason'] or '(no reason given)'}" for s in skipped[:60]]
        if len(skipped) > 60:
            lines.append(f"- ... and {len(skipped) - 60} more (report.json has them all)")
        lines.append("")
    return lines


def copy_logs(work: Path, out: Path, stages: list) -> list:
    names = [s["name"] for s in stages]
    written = []
    for fname, group in LOG_GROUPS.items():
        parts = []
        for name in group + ([n for n in names if n not in sum(LOG_GROUPS.values(), [])] if fname == "build.log" else []):
            p = work / "logs" / f"{name}.log"
            if p.exists():
                parts.append(f"===== {name} =====\n" + p.read_text(errors="replace"))
        target = out / fname
        if not parts:
            target.unlink(missing_ok=True)
            continue
        text = "\n".join(parts).encode()
        if len(text) > MAX_LOG_BYTES:  # keep the start and most of the end
            text = text[: MAX_LOG_BYTES // 4] + b"\n\n[... cut ...]\n\n" + text[-(MAX_LOG_BYTES * 3 // 4):]
        target.write_bytes(text)
        written.append(fname)
    csv_path = work / "example" / "train_log.csv"
    if csv_path.exists():
        (out / "train_log.csv").write_bytes(csv_path.read_bytes())
        written.append("train_log.csv")
    else:
        (out / "train_log.csv").unlink(missing_ok=True)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, type=Path, help="scripts/gpu_check.sh's work directory")
    ap.add_argument("--out", required=True, type=Path, help="where report.md, report.json and the logs go")
    a = ap.parse_args(argv)
    results = a.work / "results"
    if not results.is_dir():
        print(f"gpu_check_report: {results} does not exist (not a gpu_check.sh work directory)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    env = read_env(results / "env.txt")
    stages = read_stages(results / "stages.jsonl")
    by_name = {s.get("name"): s for s in stages}
    no_gpu = env.get("no_gpu") == "1"
    failed = [s for s in stages if s.get("status") in ("failed", "timeout")]
    for s in failed:
        s["log_tail"] = tail(a.work / "logs" / f"{s['name']}.log")
    tests = {"ctest_cuda": junit(results / "ctest.xml"), "pytest_cuda": junit(results / "pytest.xml")}
    bench = benchmarks(results, by_name)
    example = example_summary(a.work, by_name)
    verdict = "failed" if failed else "passed"
    report = {"verdict": verdict, "no_gpu": no_gpu, "env": env, "stages": stages, "tests": tests,
              "benchmarks": bench, "example": example}
    report["files"] = ["report.md", "report.json"] + copy_logs(a.work, a.out, stages)
    (a.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")

    md = [f"# zero8 GPU check: {verdict.upper()}"
          + (f" ({len(failed)} of {len(stages)} stages failed)" if failed else f" ({len(stages)} stages)"), ""]
    if no_gpu and env.get("no_gpu_ok") == "1":
        md += ["**No GPU was present on this machine**: the pipeline ran with --no-gpu-ok, the CUDA tests skipped "
               "and nothing was measured. This is not a GPU result.", ""]
    elif no_gpu:
        md += ["**No GPU was present on this machine**: the check stopped before building (--no-gpu-ok runs the "
               "pipeline without one).", ""]
    md += ["## Machine", "", "| | |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in env.items()] + [""]
    md += ["## Stages", "", "| stage | status | seconds | note |", "|---|---|---|---|"]
    md += [f"| {s.get('name')} | {s.get('status')} | {s.get('seconds')} | {s.get('note') or ''} |" for s in stages]
    md += ["", "## CUDA tests", ""]
    md += test_lines("C++ (ctest -L cuda)", tests["ctest_cuda"])
    md += test_lines("Python (pytest -m cuda)", tests["pytest_cuda"])
    md += ["## Benchmarks", "", "| source | figure | value | unit | target | met |", "|---|---|---|---|---|---|"]
    for r in bench:
        value = fmt(r["value"]) if r.get("error") is None else r["error"]
        metcell = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        md.append(f"| {r['source']} | {r['figure']} | {value} | {r.get('unit') or ''} | {r.get('target') or ''} | {metcell} |")
    md.append("")
    if example:
        md += ["## Pretraining run (examples/pretrain_gpt.py --device cuda --steps 200)", ""]
        n = len(md)
        if "loss_first" in example:
            md.append(f"- training loss {fmt(example['loss_first'])} -> {fmt(example['loss_last'])} "
                      f"(min {fmt(example['loss_min'])}) over {example['steps']} steps")
        if "val_loss_first" in example:
            md.append(f"- validation loss {fmt(example['val_loss_first'])} -> {fmt(example['val_loss_last'])}"
                      f" ({'falls' if example['val_loss_falls'] else '**does not fall**'})")
        if "tokens_per_s" in example:
            md.append(f"- {fmt(example['tokens_per_s'])} tokens/s over the run ({fmt(example['run_seconds'])} s)")
        elif "tokens_per_s_median" in example:
            md.append(f"- {fmt(example['tokens_per_s_median'])} tokens/s (median of the logged windows)")
        if len(md) == n:
            md.append(f"- no training log ({example['status']})")
        md.append("")
    if failed:
        md += ["## Logs of the failed stages (last lines)", ""]
        for s in failed:
            md += [f"### {s['name']} ({s['status']}, exit {s.get('rc')})", "", "```", s["log_tail"], "```", ""]
    md += ["Files: " + ", ".join(report["files"]), ""]
    (a.out / "report.md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
