"""Shared pieces of the launcher tests (tests/python/test_launch.py, test_multinode.py): running
zero8-launch as a user does (`python -m zero8_launch`, the installed package), reading what the rank
scripts printed, and checking that the installed launcher is the one in launcher/zero8_launch.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LAUNCH_DIR = Path(__file__).resolve().parent
SOURCE_LAUNCHER = ROOT / "launcher" / "zero8_launch"
RANK_ENV = LAUNCH_DIR / "rank_env.py"
TRAIN_JOB = LAUNCH_DIR / "train_job.py"
REINSTALL = f"bash {ROOT}/scripts/python_setup.sh --test"



def established_tcp(netns: str | None = None) -> list[dict]:
    """The established TCP connections of a network namespace (this process's if None), from `ss -tinp`:
    each {'local': 'addr:port', 'peer': 'addr:port', 'pids': the processes holding it, 'sent': bytes_sent}."""
    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["ss", "-tinpH", "state", "established"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    out = []
    for block in re.split(r"\n(?=\S)", text) if text else []:  # a connection's line, then its info line
        f = block.split()
        sent = re.search(r"bytes_sent:(\d+)", block)
        out.append({"local": f[2], "peer": f[3], "pids": {int(x) for x in re.findall(r"pid=(\d+)", block)},
                    "sent": int(sent.group(1)) if sent else 0})
    return out

def installed_problem() -> str | None:
    """Why the installed zero8_launch cannot be tested (missing, or older than the sources), or None."""
    try:
        import zero8_launch
    except ImportError as e:
        return f"zero8_launch is not installed ({e}); install with: {REINSTALL}"
    installed = Path(zero8_launch.__file__).resolve().parent
    if installed == SOURCE_LAUNCHER.resolve() or os.environ.get("ZERO8_ALLOW_STALE") == "1":
        return None
    sources = sorted(p.relative_to(SOURCE_LAUNCHER) for p in SOURCE_LAUNCHER.rglob("*.py"))
    stale = [str(p) for p in sources
             if not (installed / p).exists() or not filecmp.cmp(SOURCE_LAUNCHER / p, installed / p, shallow=False)]
    if stale:
        return (f"the installed zero8_launch ({installed}) differs from launcher/zero8_launch: {', '.join(stale)}; "
                f"reinstall with: {REINSTALL} (ZERO8_ALLOW_STALE=1 runs anyway)")
    return None


def mpirun() -> str | None:
    return shutil.which("mpirun")


def job_env(**extra) -> dict:
    """The environment the launcher tests run zero8-launch in: one torch thread per rank, passive OpenMP
    waits (ranks share 2 cores), OpenMPI allowed as root (the launcher adds --allow-run-as-root itself;
    mpirun's children need nothing)."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ZERO8_COMM_TIMEOUT": "60"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "zero8_launch"] + [str(a) for a in args]


def launch(args: list[str], env: dict | None = None, timeout: float = 120.0, cwd: str | None = None
           ) -> subprocess.CompletedProcess:
    return subprocess.run(launch_cmd(args), env=env if env is not None else job_env(), capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def env_lines(stdout: str) -> dict[int, dict]:
    """rank_env.py's 'ENV {...}' lines (as forwarded: '[rankN] ENV {...}') -> {N: variables}."""
    out = {}
    for m in re.finditer(r"^\[rank(\d+)\] ENV (\{.*\})$", stdout, re.M):
        out[int(m.group(1))] = json.loads(m.group(2))
    return out
