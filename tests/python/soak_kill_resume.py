"""Kill-and-resume soak of the pretraining example (examples/pretrain_gpt.py) on 2 ranks: the job is started,
one of its ranks is killed (SIGKILL) at a random moment (during the training steps, or while a checkpoint is
being written), the job ends, every checkpoint left is verified, and the job is started again with --resume
(from `latest`), N times; then the job runs to its end. Passes when:

  - no checkpoint was ever lost or unreadable: after every kill, `zero8-checkpoint verify` passes on every tag
    in the save directory, and `latest` names one of them (once the first save has completed);
  - the end is bit-exact: the losses of every step, the final fp32 weights and the decoded 8-bit optimizer
    states equal those of an uninterrupted run with the same data order.

The model is the example's GPT, shrunk (d_model 64: its matrices keep 8-bit states), with the example's own
config (8-bit AdamW, ZeRO stage 2, int8 gradients, keep_last 2), a checkpoint every few steps, and 1 thread
per rank. tests/python/test_soak.py runs a short form in CI; the longer form is documented in
docs/FAILURES.md:

  python3 tests/python/soak_kill_resume.py --kills 20 --steps 300 --work /tmp/soak
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from mpirun_util import mpi_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
# Staging directories of a save in progress (zero8/include/zero8/checkpoint_format.h, kTmpPrefix).
STAGING_PREFIX = ".tmp-"
RUN_TIMEOUT = 300  # seconds for one job (start-up, training, its end after a kill)


def model_args(steps: int, save_interval: int) -> list[str]:
    return ["--steps", str(steps), "--d_model", "64", "--n_layer", "2", "--n_head", "2", "--seq_len", "32",
            "--batch_size", "8", "--corpus_mb", "0.5", "--eval_seqs", "16", "--eval_interval", "25",
            "--log_interval", "1", "--save_interval", str(save_interval), "--no_progress", "--no_plot"]


def job_env() -> dict:
    return mpi_env(PYTHONWARNINGS="ignore::UserWarning")


def job_cmd(out_dir: Path, args: list[str]) -> list[str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("mpirun not found (scripts/setup.sh installs OpenMPI)")
    return [mpirun, "-np", "2", "--oversubscribe", sys.executable, str(EXAMPLE), *args, "--out_dir", str(out_dir)]


def rank_pids(mpirun_pid: int, out_dir: Path) -> list[int]:
    """The pids of the example's processes that this job (its --out_dir) runs."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if str(EXAMPLE) in cmd and str(out_dir) in cmd and int(d.name) != mpirun_pid:
            pids.append(int(d.name))
    return sorted(pids)


def logged_step(out_dir: Path) -> int:
    """The last step in the CSV log (rank 0 writes a row per step), -1 when none."""
    try:
        lines = (out_dir / "train_log.csv").read_text().splitlines()
    except OSError:
        return -1
    try:
        return int(lines[-1].split(",", 1)[0]) if len(lines) > 1 else -1
    except ValueError:
        return -1


def saving(save_dir: Path) -> bool:
    try:
        return any(p.name.startswith(STAGING_PREFIX) for p in save_dir.iterdir())
    except OSError:
        return False


class Verifier:
    """`zero8-checkpoint verify` on a tag (the tool of ZERO8_BUILD_DIR or build/, else zero8's binding of the
    same C++ check, when the tool was not built)."""

    def __init__(self):
        tool = Path(os.environ.get("ZERO8_BUILD_DIR", ROOT / "build")) / "tools" / "zero8-checkpoint"
        self.tool = tool if tool.is_file() else None

    def problems(self, tag_dir: Path) -> str:
        if self.tool is not None:
            r = subprocess.run([str(self.tool), "verify", str(tag_dir)], capture_output=True, text=True, timeout=120)
            return "" if r.returncode == 0 else (r.stdout + r.stderr).strip()
        import zero8

        r = zero8._C.checkpoint_verify(str(tag_dir))
        return "" if r["ok"] else "; ".join(r["problems"])


def check_save_dir(save_dir: Path, verifier: Verifier, saved_before: bool) -> tuple[list[str], str]:
    """(the tags in save_dir, the problems found: a tag that fails verify, `latest` missing once a save
    completed, or naming no tag)."""
    if not save_dir.is_dir():
        return [], "no save directory" if saved_before else ""
    tags = sorted(p.name for p in save_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    problems = [f"{t}: {verifier.problems(save_dir / t)}" for t in tags]
    problems = [p for p in problems if not p.endswith(": ")]
    latest = save_dir / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        if name not in tags:
            problems.append(f"latest names {name!r}, not one of the tags {tags}")
    elif saved_before or tags:
        problems.append(f"no latest file (tags: {tags})")
    return tags, "; ".join(problems)


def losses(out_dir: Path) -> list[tuple[str, str, str]]:
    with open(out_dir / "train_log.csv", newline="") as f:  # repr() of float64 values: bit equality
        return [(r["step"], r["loss"], r["val_loss"]) for r in csv.DictReader(f)]


def final_state(save_dir: Path, tag: str, work: Path) -> dict:
    """The final fp32 masters (consolidated, zero8-checkpoint to-fp32's export) and the decoded optimizer
    states (the universal export), by name."""
    import torch
    import zero8
    from safetensors.torch import load_file

    fp32 = work / f"{save_dir.parent.name}_fp32.safetensors"
    zero8._C.checkpoint_export_fp32(str(save_dir / tag), str(fp32), True)
    uni = work / f"{save_dir.parent.name}_universal" / tag
    zero8.deepspeed.to_universal(save_dir / tag, uni)
    states = zero8.deepspeed.read_checkpoint(uni)
    out = {f"fp32/{k}": v for k, v in load_file(str(fp32)).items()}
    for name, entry in states.params.items():
        out.update({f"{key}/{name}": torch.as_tensor(v) for key, v in entry.items()})
    out["step"] = torch.tensor(states.step)
    return out


def run_to_end(out_dir: Path, args: list[str], resume: bool) -> subprocess.CompletedProcess:
    r = subprocess.run(job_cmd(out_dir, args + (["--resume"] if resume else [])), cwd=ROOT, env=job_env(),
                       capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if r.returncode != 0:
        raise AssertionError(f"run exited with {r.returncode}:\n{(r.stdout + r.stderr)[-5000:]}")
    return r


def soak(work: Path, kills: int, steps: int, save_interval: int, seed: int, log=print) -> dict:
    """Runs the soak in `work` (emptied first); returns its figures, raises AssertionError on a failure."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rng = random.Random(seed)
    args = model_args(steps, save_interval)
    verifier = Verifier()
    t0 = time.monotonic()
    run_to_end(work / "ref", args, resume=False)
    ref_s = time.monotonic() - t0
    log(f"soak: uninterrupted run: {ref_s:.1f} s")

    out_dir = work / "soak"
    save_dir = out_dir / "checkpoints"
    events, lost_steps, checks = [], 0, 0
    for i in range(kills):
        resume = (save_dir / "latest").is_file()
        start_step = int((save_dir / "latest").read_text().strip().removeprefix("global_step")) if resume else 0
        if start_step >= steps:
            break
        # A step to kill at (or after which to catch a save), a few saves after the resumed one, so that the
        # kills spread over the run, and early enough that the job is still running after a save or two
        # missed (a save can end between two looks); the start: anywhere in its first seconds (imports, the
        # load of the checkpoint), after both ranks exist, which is all that is left near the end.
        room = steps - 3 * save_interval - start_step
        moment = rng.choice(("step", "save", "save", "start")) if room > 1 else "start"
        target = start_step + 1 + rng.randrange(max(1, min(room - 1, 4 * save_interval)))
        start_delay = rng.uniform(0.0, 3.0)
        proc = subprocess.Popen(job_cmd(out_dir, args + (["--resume"] if resume else [])), cwd=ROOT,
                                env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killed, how = None, ""
        try:
            started = time.monotonic()
            while proc.poll() is None and time.monotonic() < started + RUN_TIMEOUT:
                step = logged_step(out_dir)
                if moment == "start":
                    hit = time.monotonic() > started + start_delay
                elif moment == "save":  # or at a step, when saves were missed until close to the end
                    hit = step >= target and (saving(save_dir) or step >= target + 2 * save_interval)
                else:
                    hit = step >= target
                if hit:
                    if moment != "start":
                        time.sleep(rng.uniform(0.0, 0.01))  # anywhere in the step, or in the save
                    pids = rank_pids(proc.pid, out_dir)
                    if len(pids) == 2:
                        killed = rng.randrange(2)
                        now = logged_step(out_dir)
                        how = (f"during a save after step {now}" if saving(save_dir) else
                               f"{time.monotonic() - started:.1f} s after its start" if moment == "start" else
                               f"at step {now}")
                        os.kill(pids[killed], signal.SIGKILL)
                        break
                time.sleep(0.001)
            out, _ = proc.communicate(timeout=RUN_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if killed is None:
            raise AssertionError(f"kill {i + 1}: the job ended (exit {proc.returncode}) before the kill "
                                 f"({moment}, step {target}):\n{out[-3000:]}")
        tags, problems = check_save_dir(save_dir, verifier, saved_before=resume)
        checks += len(tags)
        latest = (save_dir / "latest").read_text().strip() if (save_dir / "latest").is_file() else "-"
        reached = logged_step(out_dir)
        resumed_at = int(latest.removeprefix("global_step")) if latest != "-" else 0
        lost_steps += max(0, reached - resumed_at)
        events.append({"kill": i + 1, "rank": killed, "moment": moment, "when": how, "exit": proc.returncode,
                       "latest": latest, "tags": tags})
        log(f"soak: kill {i + 1}/{kills}: rank {killed} {how} (mpirun exit {proc.returncode}); tags {tags}, "
            f"latest {latest}; verify: {problems or 'all good'}")
        if problems:
            raise AssertionError(f"kill {i + 1} ({how}): {problems}\n{out[-3000:]}")
        if proc.returncode == 0:
            raise AssertionError(f"kill {i + 1} ({how}): the job exited 0 after losing a rank:\n{out[-3000:]}")
    run_to_end(out_dir, args, resume=(save_dir / "latest").is_file())
    tags, problems = check_save_dir(save_dir, verifier, saved_before=True)
    if problems:
        raise AssertionError(f"after the last run: {problems}")

    got, want = losses(out_dir), losses(work / "ref")
    if got != want:
        diff = next(i for i in range(max(len(got), len(want))) if got[i:i + 1] != want[i:i + 1])
        raise AssertionError(f"the losses differ from the uninterrupted run's from row {diff}: {got[diff:diff + 3]} "
                             f"vs {want[diff:diff + 3]}")
    import torch

    tag = f"global_step{steps}"
    a, b = final_state(save_dir, tag, work), final_state(work / "ref" / "checkpoints", tag, work)
    if a.keys() != b.keys():
        raise AssertionError(f"final states: names differ: {sorted(a.keys() ^ b.keys())}")
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    if differ:
        raise AssertionError(f"final states differ from the uninterrupted run's in {differ}")
    figures = {"kills": len(events), "during_save": sum("save" in e["when"] for e in events),
               "at_start": sum("start" in e["when"] for e in events),
               "steps": steps, "steps_redone": lost_steps, "tags_verified": checks + len(tags),
               "tensors_compared": len(a), "seconds": round(time.monotonic() - t0, 1),
               "uninterrupted_seconds": round(ref_s, 1), "events": events}
    log(f"soak: passed: {figures['kills']} kills ({figures['during_save']} during a save, {figures['at_start']} "
        f"at the start), {lost_steps} steps "
        f"redone, {figures['tags_verified']} tag verifications, losses of {len(got)} rows and {len(a)} final "
        f"tensors bit-equal to the uninterrupted run, {figures['seconds']} s")
    return figures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="rank kills before the run to the end")
    p.add_argument("--steps", type=int, default=300, help="training steps of the job")
    p.add_argument("--save_interval", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0, help="the kills' moments and ranks")
    p.add_argument("--work", default="/tmp/zero8-soak", help="work directory (emptied first)")
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args(argv)
    figures = soak(Path(args.work), args.kills, args.steps, args.save_interval, args.seed)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    print(json.dumps({k: v for k, v in figures.items() if k != "events"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
