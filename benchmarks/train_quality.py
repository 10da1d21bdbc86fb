#!/usr/bin/env python3
"""Training quality of zero8's 8-bit optimizer and int8 communication: the pretraining example
(examples/pretrain_gpt.py: same model, data, seed, steps and global batch) trained three times,

  (a) fp32:        32-bit AdamW, unsharded (1 process; examples/configs/gpt_fp32_adamw.json)
  (b) zero8:       8-bit AdamW states, int8 gradient reduce-scatter and int8 parameter sync (zero8's
                   defaults), ZeRO stage 2 on 2 ranks (gpt_zero8_stage2.json)
  (c) zero8 fp32p: (b) with an fp32 parameter all-gather instead (gpt_zero8_fp32params.json)

then compares the validation-loss curves: a CSV (step, validation and training loss of each run), a PNG,
a table and a JSON line. Exit status 1 when the final validation loss of (b) or (c) is more than
--tolerance (default 1%) above or below (a)'s.

    python benchmarks/train_quality.py [--out_dir out/train_quality] [--steps N] [--reuse] [-- example args]

The 2-rank runs use zero8-launch when it is installed, else mpirun. --reuse keeps runs whose log is
complete (to redraw the plot). Arguments after `--` go to every run of the example (e.g. a smaller
model: -- --d_model 64 --n_layer 2).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
CONFIGS = ROOT / "examples" / "configs"
# name, label, config, processes
RUNS = [
    ("fp32", "(a) 32-bit AdamW, unsharded, 1 process", "gpt_fp32_adamw.json", 1),
    ("zero8", "(b) 8-bit AdamW + int8 gradients and parameter sync, ZeRO-2, 2 ranks", "gpt_zero8_stage2.json", 2),
    ("zero8_fp32params", "(c) (b) with fp32 parameter sync", "gpt_zero8_fp32params.json", 2),
]


def launcher(np: int) -> list[str]:
    if np == 1:
        return [sys.executable]
    if importlib.util.find_spec("zero8_launch") is not None:
        return [sys.executable, "-m", "zero8_launch", "--num_procs", str(np), "--log_dir"]
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("neither zero8-launch nor mpirun is available for the 2-rank runs")
    return [mpirun, "-np", str(np), sys.executable]


def read_log(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def complete(path: Path, steps: int | None) -> bool:
    if not path.is_file():
        return False
    rows = read_log(path)
    return bool(rows) and rows[-1]["val_loss"] != "" and (steps is None or int(rows[-1]["step"]) == steps)


def run_one(name: str, config: str, np: int, out: Path, steps: int | None, extra: list[str]) -> float:
    run_dir = out / name
    cmd = launcher(np)
    if cmd[-1] == "--log_dir":
        cmd.append(str(run_dir / "logs"))
    cmd += [str(EXAMPLE), "--config", str(CONFIGS / config), "--out_dir", str(run_dir), "--no_progress",
            "--save_interval", "0"]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    cmd += extra
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "passive")
    if np > 1:
        env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
        if os.geteuid() == 0:
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    print(f"--- {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{name}: the example exited with {r.returncode}")
    return time.perf_counter() - t0


def plot(results: dict, png: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, ax_rel) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    base = dict(results["fp32"]["val"])
    for (name, label, _, _), color in zip(RUNS, ("black", "tab:blue", "tab:orange")):
        rows = results[name]
        val = rows["val"]
        ax.plot([s for s, _ in rows["train"]], [v for _, v in rows["train"]], color=color, lw=0.6, alpha=0.35)
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", color=color, ms=3, lw=1.4, label=label)
        if name != "fp32":
            rel = [(s, 100.0 * (v / base[s] - 1.0)) for s, v in val if s in base]
            ax_rel.plot([s for s, _ in rel], [v for _, v in rel], "o-", color=color, ms=3, lw=1.2)
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax_rel.axhline(0.0, color="black", lw=0.8)
    for y in (-1.0, 1.0):
        ax_rel.axhline(y, color="red", lw=0.8, ls="--")
    ax_rel.set_ylabel("val. loss vs (a), %")
    ax_rel.set_xlabel("step (thin lines: training loss)")
    ax_rel.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return True


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", default="out/train_quality")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the configs' 600)")
    p.add_argument("--tolerance", type=float, default=0.01, help="allowed relative final validation-loss gap")
    p.add_argument("--reuse", action="store_true", help="keep runs whose CSV log is complete")
    p.add_argument("--png", default=None, help="plot path (default <out_dir>/train_quality.png)")
    a = p.parse_args(argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    results, seconds = {}, {}
    for name, _, config, np in RUNS:
        log = out / name / "train_log.csv"
        if a.reuse and complete(log, a.steps):
            print(f"--- {name}: reusing {log}")
            seconds[name] = float(read_log(log)[-1]["elapsed_s"])
        else:
            if (out / name).exists():
                shutil.rmtree(out / name)
            seconds[name] = run_one(name, config, np, out, a.steps, extra)
        rows = read_log(log)
        results[name] = {
            "val": [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]],
            "train": [(int(r["step"]), float(r["loss"])) for r in rows if r["loss"]],
            "last": rows[-1],
        }

    # The comparison CSV: one row per logged step.
    steps = sorted({s for r in results.values() for s, _ in r["train"] + r["val"]})
    table_csv = out / "train_quality.csv"
    with open(table_csv, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["step"] + [f"val_loss_{n}" for n, *_ in RUNS] + [f"loss_{n}" for n, *_ in RUNS])
        lookup = {n: (dict(r["val"]), dict(r["train"])) for n, r in results.items()}
        for s in steps:
            w.writerow([s] + [repr(lookup[n][0][s]) if s in lookup[n][0] else "" for n, *_ in RUNS]
                       + [repr(lookup[n][1][s]) if s in lookup[n][1] else "" for n, *_ in RUNS])

    final = {n: r["val"][-1][1] for n, r in results.items()}
    last_step = results["fp32"]["val"][-1][0]
    if any(r["val"][-1][0] != last_step for r in results.values()):
        raise SystemExit(f"the runs ended at different steps: { {n: r['val'][-1][0] for n, r in results.items()} }")
    rel = {n: final[n] / final["fp32"] - 1.0 for n in final}
    ok = all(abs(rel[n]) <= a.tolerance for n in ("zero8", "zero8_fp32params"))

    print(f"\nTraining quality after {last_step} steps (validation loss, nats per byte; tolerance "
          f"{100 * a.tolerance:.1f}% of (a))")
    print(f"{'run':<55}{'final val':>10}{'vs (a)':>9}{'state B/rank':>14}{'sent MB':>10}{'time s':>8}")
    for name, label, _, np in RUNS:
        last = results[name]["last"]
        print(f"{label:<55}{final[name]:>10.4f}{100 * rel[name]:>+8.2f}%{int(last['state_bytes']) // np:>14,}"
              f"{int(last['bytes_sent']) / 1e6:>10.1f}{seconds[name]:>8.0f}")
    png = Path(a.png) if a.png else out / "train_quality.png"
    title = f"pretrain_gpt.py, {last_step} steps: validation loss of (a), (b), (c)"
    drawn = plot(results, png, title)
    print(f"\nCSV: {table_csv}" + (f", plot: {png}" if drawn else " (no plot: matplotlib is not installed)"))
    print("TRAIN_QUALITY " + json.dumps({
        "steps": last_step, "final_val_loss": final, "relative_to_fp32": rel, "tolerance": a.tolerance, "pass": ok,
        "seconds": seconds, "state_bytes": {n: int(r["last"]["state_bytes"]) for n, r in results.items()},
        "bytes_sent": {n: int(r["last"]["bytes_sent"]) for n, r in results.items()}}))
    if not ok:
        print(f"FAIL: a final validation loss of (b) or (c) differs from (a)'s by more than {100 * a.tolerance}%")
        return 1
    print(f"PASS: (b) and (c) are within {100 * a.tolerance}% of (a)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
