#!/usr/bin/env python3
"""zero8 against DeepSpeed ZeRO-2, side by side: the pretraining example's GPT (examples/pretrain_gpt.py:
model, corpus, batches, loss) trained with the same seed, micro-batch, optimizer and schedule by both, on
2 ranks, on one host (no network: each system's compute-only bound) and on two "hosts" joined by a link
rate-shaped with tc (network namespaces and a veth pair, scripts/netns_cluster.sh; one rank per host).

    bash benchmarks/setup_deepspeed.sh          # DeepSpeed from PyPI into this Python (once)
    python benchmarks/bench_vs_deepspeed.py [--model gpt38m] [--where local,1gbit,10gbit] [--repeats 2]

Per scenario, DeepSpeed's settings (overlap_comm, reduce_scatter, bucket sizes) are searched first with
short runs and the fastest becomes the anchor, with the fastest of those with overlap_comm off beside it;
then zero8 (its default settings) and those DeepSpeed settings run in interleaved rounds (A B C A B C),
so the machine's noise shows as each row's range. zero8 runs under zero8-launch (mpirun; across the hosts
from a hostfile), DeepSpeed under torchrun with gloo (MASTER_ADDR the first host's address).

Reported per configuration: step time (median and range over the rounds), tokens/s, optimizer-state bytes
per rank, peak RSS per rank, bytes per rank and step counted on the link (the veth's counters in each
rank's namespace; on one host the namespace's loopback, which DeepSpeed's gloo uses and zero8's shared
memory does not), bytes per rank and step counted by zero8 itself, the seconds zero8 spent inside
collectives, and the training loss of the last step and the validation loss. Then ratios: zero8's
throughput over each DeepSpeed reference, and each system's shaped step over its own no-network step.
The table goes to stdout and <out_dir>/table.txt, everything to <out_dir>/results.json, and the last
line printed is one JSON object (BENCH_VS_DEEPSPEED {...}).

The namespaces need root; without it only --where local runs, in this machine's network namespace, and
the link column is empty. Everything the benchmark creates (namespaces, veth, tc qdiscs, processes in
them) is removed at the end, also after an error or Ctrl-C; traffic stays on loopback and the veth.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "vs_deepspeed_worker.py"
NETNS = ROOT / "scripts" / "netns_cluster.sh"

# GPT shapes (examples/pretrain_gpt.py's GPT, byte vocabulary): parameters, then what they are for.
MODELS = {
    "tiny": dict(d_model=64, n_layer=2, n_head=4, seq_len=64, micro_batch=4),      # 0.14 M: CI
    "small": dict(d_model=128, n_layer=4, n_head=4, seq_len=128, micro_batch=8),   # 0.86 M: the README's run
    "gpt11m": dict(d_model=384, n_layer=6, n_head=6, seq_len=128, micro_batch=8),  # 10.8 M
    "gpt38m": dict(d_model=512, n_layer=12, n_head=8, seq_len=128, micro_batch=8),  # 38.1 M: the case
}
# Where the ranks run: one host (no network), or two hosts over a veth shaped to a rate.
SCENARIOS = {
    "local": ("one host, no network", None),
    "1gbit": ("two hosts, 1 Gbit/s link", "1gbit"),
    "10gbit": ("two hosts, 10 Gbit/s link", "10gbit"),
}
# DeepSpeed ZeRO-2 settings searched per scenario: its defaults first, then each knob that changes how
# the gradients travel (overlap_comm, reduce_scatter against all-reduce, buckets smaller than the model).
DS_GRID = {
    "full": [dict(overlap_comm=o, reduce_scatter=r, bucket=b)
             for b in ("default", "quarter") for o in (False, True) for r in (True, False)],
    "small": [dict(overlap_comm=False, reduce_scatter=True, bucket="default"),
              dict(overlap_comm=True, reduce_scatter=True, bucket="default"),
              dict(overlap_comm=False, reduce_scatter=False, bucket="default"),
              dict(overlap_comm=True, reduce_scatter=True, bucket="quarter")],
    "none": [dict(overlap_comm=False, reduce_scatter=True, bucket="default")],
}
DS_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size and allgather_bucket_size
PORT_BASE = 29610


# ---------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------

def base_config(model: dict, total_steps: int) -> dict:
    """What both systems share: the example's optimizer, schedule and clipping, the micro-batch."""
    return {
        "train_micro_batch_size_per_gpu": model["micro_batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": total_steps, "warmup_num_steps": max(1, total_steps // 5),
                                 "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 40,
        "wall_clock_breakdown": False,
    }


@dataclass
class Setting:
    """One system with one set of settings: its label, and the config sections it adds to the base."""
    system: str
    label: str
    sections: dict
    knobs: dict = field(default_factory=dict)

    def config(self, base: dict) -> dict:
        return {**base, **json.loads(json.dumps(self.sections))}


def zero8_default() -> Setting:
    # zero8's defaults: nothing but the stage and an empty zero8 section (config.cpp fills in the rest).
    return Setting("zero8", "zero8 (default settings)", {"zero_optimization": {"stage": 2}, "zero8": {}})


def zero8_nonet() -> Setting:
    # zero8's defaults with both ranks on one host, run in a shaped scenario's rounds: its no-network step
    # measured beside the shaped runs.
    return Setting("zero8", ROLE_NAMES["zero8_nonet"], zero8_default().sections)


def zero8_eager_gather() -> Setting:
    # zero8's defaults but zero8.overlap_param_gather off: engine.step() returns with the all-gather done,
    # to show what moving it into the next forward hides.
    return Setting("zero8", ROLE_NAMES["zero8_eager"],
                   {"zero_optimization": {"stage": 2}, "zero8": {"overlap_param_gather": False}})


def deepspeed_setting(knobs: dict, n_params: int) -> Setting:
    bucket = DS_DEFAULT_BUCKET if knobs["bucket"] == "default" else max(1, n_params // 4)
    zero = {"stage": 2, "overlap_comm": knobs["overlap_comm"], "reduce_scatter": knobs["reduce_scatter"],
            "contiguous_gradients": True, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    label = (f"DeepSpeed overlap_comm={'on' if knobs['overlap_comm'] else 'off'} "
             f"reduce_scatter={'on' if knobs['reduce_scatter'] else 'off'} bucket={bucket:.0e}")
    return Setting("deepspeed", label, {"zero_optimization": zero}, knobs)


def gpt_params(model: dict) -> int:
    d, n, t = model["d_model"], model["n_layer"], model["seq_len"]
    # per block: 2 LayerNorms, qkv, proj, fc, fc_out; plus token (with its LayerNorm) and position
    # embeddings, the final LayerNorm and the untied head (examples/pretrain_gpt.py)
    return n * (12 * d * d + 13 * d) + 256 * d + 2 * d + t * d + 2 * d + 256 * d


# ---------------------------------------------------------------------------------------------
# The hosts
# ---------------------------------------------------------------------------------------------

class Hosts:
    """Two network namespaces joined by a veth (scripts/netns_cluster.sh), or, without root, this
    machine's own namespace for the one-host runs. Held under the script's lock, removed by close()."""

    def __init__(self, prefix: str, net: str, use_netns: bool):
        self.prefix, self.net, self.use_netns = prefix, net, use_netns
        self.env = dict(os.environ, ZERO8_NETNS_PREFIX=prefix, ZERO8_NETNS_NET=net)
        self.names = (f"{prefix}0", f"{prefix}1")
        self.addrs = (f"{net}.1", f"{net}.2")
        self.veths = (f"{prefix}v0", f"{prefix}v1")
        self.lock = None
        self.shaped = None

    def netns(self, *args: str, check: bool = True) -> str:
        r = subprocess.run(["bash", str(NETNS), *args], env=self.env, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"netns_cluster.sh {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def open(self) -> None:
        if not self.use_netns:
            return
        self.lock = open(f"/run/lock/zero8-netns-{self.prefix}.lock", "w")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"the namespaces {self.names[0]}/{self.names[1]} are in use by another run (lock "
                             f"/run/lock/zero8-netns-{self.prefix}.lock); wait, or pass --netns_prefix") from None
        self.netns("up")

    def close(self) -> None:
        if self.lock is None:
            return
        self.netns("down", check=False)
        self.lock.close()
        self.lock = None

    def shape(self, rate: str | None) -> None:
        if self.use_netns and rate != self.shaped:
            self.netns("shape", rate or "off")
            self.shaped = rate

    def on(self, host: int, cmd: list[str]) -> list[str]:
        """cmd run on host 0 or 1 (in its namespace), or here without namespaces."""
        if not self.use_netns:
            return cmd
        return ["bash", str(NETNS), "exec", self.names[host]] + cmd

    def hostfile(self, path: Path) -> Path:
        path.write_text(self.netns("hostfile", "1"))
        return path

    def goodput_gbps(self, seconds: float = 1.0) -> float:
        """TCP goodput from host 1 to host 0 over the link as shaped now (one stream, `seconds` long)."""
        port = PORT_BASE - 1
        recv = ("import socket,sys,time\n"
                f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{self.addrs[0]}',{port}))\n"
                "s.listen(1);print('ready',flush=True);c,_=s.accept();n=0;t0=None\n"
                "while True:\n b=c.recv(1<<20)\n if not b: break\n t0=t0 or time.perf_counter();n+=len(b)\n"
                "print(n*8/(time.perf_counter()-t0)/1e9)\n")
        send = ("import socket,time\n"
                f"s=socket.create_connection(('{self.addrs[0]}',{port}));b=b'\\0'*(1<<20);t=time.perf_counter()\n"
                f"while time.perf_counter()-t<{seconds}: s.sendall(b)\n"
                "s.close()\n")
        rp = subprocess.Popen(self.on(0, [sys.executable, "-c", recv]), env=self.env, stdout=subprocess.PIPE,
                              text=True)
        try:
            rp.stdout.readline()
            subprocess.run(self.on(1, [sys.executable, "-c", send]), env=self.env, check=True, timeout=60)
            out, _ = rp.communicate(timeout=60)
            return float(out.strip())
        finally:
            if rp.poll() is None:
                rp.kill()


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------

def torch_extensions_dir() -> str:
    """Where DeepSpeed JIT-builds its CPU ops: TORCH_EXTENSIONS_DIR when set, else a directory of this
    Python environment's own. torch's shared default (~/.cache/torch_extensions) is rebuilt in turn by every
    environment with another DeepSpeed, and a build killed half-way leaves a lock file that makes every
    later load wait forever."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return str(Path.home() / ".cache" / "zero8-bench" / f"torch_extensions-{key}")


def rank_env(hosts: Hosts, threads: int) -> dict:
    env = dict(hosts.env)  # with the namespace names, which the rsh agent of mpirun needs too
    env.update({"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "passive", "DS_ACCELERATOR": "cpu",
                "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "ERROR",
                "TORCH_EXTENSIONS_DIR": torch_extensions_dir()})
    return env


def prepare_deepspeed(torch_adamw: bool) -> str | None:
    """Builds the CPU ops DeepSpeed's ranks load (its shared-memory collectives, and its fused Adam unless
    torch's AdamW replaces it) once, in one process, before any run: ranks then only load them, and no
    run's time limit can cut a build short. Returns why it failed, or None."""
    ops = ("ShareMemCommBuilder",) + (() if torch_adamw else ("FusedAdamBuilder",))
    code = ("from deepspeed.accelerator import get_accelerator as a\n"
            f"for op in {ops!r}:\n"
            "    b = a().create_op_builder(op)\n"
            "    if b is not None: b.load(verbose=False)\n")
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore", TORCH_EXTENSIONS_DIR=torch_extensions_dir())
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        return f"building DeepSpeed's CPU ops failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
    return None


def run_procs(cmds: list[list[str]], envs: list[dict], log: Path, timeout: float) -> int:
    """Starts every command (each in its own session), waits for all; when one fails or the time is up,
    ends the others' process groups. Returns the first non-zero exit code (124 on timeout), else 0."""
    procs = []
    with open(log, "w") as f:
        for cmd, env in zip(cmds, envs):
            f.write("$ " + " ".join(map(str, cmd)) + "\n")
            f.flush()
            procs.append(subprocess.Popen([str(c) for c in cmd], env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline, rc = time.monotonic() + timeout, 0
        try:
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    rc = rc or next((p.returncode for p in procs if p.returncode not in (None, 0)), 124)
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    return rc or next((p.returncode for p in procs if p.returncode), 0)


# A DeepSpeed rank on CPU sometimes aborts with this (std::terminate in C++, more under load; never in a
# zero8 run). Seen at interpreter exit, which the worker now skips (pretrain_example.gloo_rank_exit);
# should it come earlier, it is not what the benchmark measures: such a run gets one more try, which its
# result records ("retried_after").
DS_ABORT = "terminate called without an active exception"


def run_one(hosts: Hosts, scenario: str, setting: Setting, base: dict, model: dict, steps: int, warmup: int,
            run_dir: Path, port: int, timeout: float, seed: int, torch_adamw: bool) -> dict:
    """One run; its result (the worker's JSON plus the per-rank link bytes this scenario counts) or
    {"error": ...}."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "config.json"
    cfg.write_text(json.dumps(setting.config(base), indent=1))
    out = run_dir / "result.json"
    out.unlink(missing_ok=True)
    worker = [WORKER, "--system", setting.system, "--config", cfg, "--out", out, "--steps", str(steps),
              "--warmup", str(warmup), "--seed", str(seed)]
    for k in ("d_model", "n_layer", "n_head", "seq_len", "micro_batch"):
        worker += [f"--{k}", str(model[k])]
    if torch_adamw and setting.system == "deepspeed":
        worker.append("--torch_adamw")
    two_hosts = SCENARIOS[scenario][1] is not None
    py = sys.executable
    if setting.system == "zero8":
        # Unbound, as torchrun leaves DeepSpeed's ranks: mpirun would bind each rank to a core, and with
        # one slot per namespace both "hosts" bind theirs to core 0 of the one machine they share.
        launch = [py, "-m", "zero8_launch", "--log_dir", run_dir / "logs", "--no_prefix",
                  "--launcher_args", "--bind-to none"]
        if two_hosts:
            launch += ["--hostfile", hosts.hostfile(run_dir / "hostfile"), "--net_if", f"{hosts.net}.0/24"]
        else:
            launch += ["--num_procs", "2"]
        cmds, envs = [hosts.on(0, launch + worker)], [rank_env(hosts, 1)]
    elif two_hosts:
        cmds, envs = [], []
        for node in (0, 1):
            cmds.append(hosts.on(node, [py, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                                        str(node), "--nproc_per_node", "1", "--master_addr", hosts.addrs[0],
                                        "--master_port", str(port)] + worker))
            envs.append(dict(rank_env(hosts, 1), GLOO_SOCKET_IFNAME=hosts.veths[node]))
    else:
        cmds = [hosts.on(0, [py, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                             "127.0.0.1", "--master_port", str(port)] + worker)]
        envs = [dict(rank_env(hosts, 1), GLOO_SOCKET_IFNAME="lo")]
    t0 = time.monotonic()
    rc = run_procs(cmds, envs, run_dir / "run.log", timeout)
    if rc != 0 or not out.exists():
        tail = (run_dir / "run.log").read_text(errors="replace").strip().splitlines()[-6:]
        return {"error": f"exit code {rc}" + ("" if out.exists() else ", no result") + f" (log: {run_dir / 'run.log'})",
                "log_tail": tail}
    r = json.loads(out.read_text())
    r["wall_s"] = time.monotonic() - t0
    # Bytes on the link per rank and step: each rank's veth (two hosts), or the one host's loopback shared
    # by its ranks (inside its own namespace; none outside one, where others use the loopback too).
    if two_hosts and hosts.use_netns:
        per_rank = [rk["links"].get(hosts.veths[i], [0, 0])[0] for i, rk in enumerate(r["ranks"])]
        r["link_bytes_per_rank_step"] = statistics.mean(per_rank) / r["steps"]
    elif hosts.use_netns:
        r["link_bytes_per_rank_step"] = r["ranks"][0]["links"].get("lo", [0, 0])[0] / r["world"] / r["steps"]
    else:
        r["link_bytes_per_rank_step"] = None
    z = [rk["zero8"] for rk in r["ranks"] if rk["zero8"]]
    r["zero8_bytes_per_rank_step"] = statistics.mean(x["bytes"] for x in z) / r["steps"] if z else None
    r["zero8_comm_s_per_step"] = statistics.mean(x["seconds"] for x in z) / r["steps"] if z else None
    return r


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

# Issue 31's targets, on a GPT of 30-60 M parameters: (scenario, ratio, bound, "max" or "min").
TARGETS = [
    ("1gbit", "zero8 step / its no-network step", 1.10, "max"),
    ("1gbit", "throughput zero8 / DeepSpeed best", 1.35, "min"),
    ("1gbit", "throughput zero8 / DeepSpeed overlap_comm off", 1.80, "min"),
    ("10gbit", "zero8 step / its no-network step", 1.05, "max"),
]
ROLE_NAMES = {"zero8": "zero8", "zero8_eager": "zero8, overlap_param_gather off",
              "zero8_nonet": "zero8 (default settings), one host, in these rounds", "deepspeed_best": "DeepSpeed best",
              "deepspeed_overlap_off": "DeepSpeed overlap_comm off"}


def pick_references(searched: list[tuple[Setting, float | None]]) -> tuple[Setting, Setting]:
    """DeepSpeed's references from the search (setting, seconds per step or None when it failed): the
    fastest, and the fastest with overlap_comm off (which may be the same). With no successful run, the
    first setting (DeepSpeed's defaults) stands for both."""
    timed = [(s, t) for s, t in searched if t]
    if not timed:
        return searched[0][0], searched[0][0]
    best = min(timed, key=lambda x: x[1])[0]
    off = [(s, t) for s, t in timed if not s.knobs["overlap_comm"]]
    return best, (min(off, key=lambda x: x[1])[0] if off else best)


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run", "runs": len(runs)}
    step = [r["seconds_per_step"] for r in ok]
    med = statistics.median(step)
    last = ok[-1]

    def mean_of(key):
        vals = [r[key] for r in ok if r.get(key) is not None]
        return statistics.mean(vals) if vals else None

    return {
        "runs": len(runs), "failed": len(runs) - len(ok), "retried": sum("retried_after" in r for r in runs),
        "step_s": med, "step_s_min": min(step),
        "step_s_max": max(step), "tokens_per_s": last["tokens_per_step"] / med,
        "state_bytes_per_rank": max(rk["state_bytes"] for rk in last["ranks"]),
        "peak_rss_mb_per_rank": max(rk["max_rss_mb"] for r in ok for rk in r["ranks"]),
        "cpus_per_rank": min(rk.get("cpus", 0) for r in ok for rk in r["ranks"]),
        "link_bytes_per_rank_step": mean_of("link_bytes_per_rank_step"),
        "zero8_bytes_per_rank_step": mean_of("zero8_bytes_per_rank_step"),
        "zero8_comm_s_per_step": mean_of("zero8_comm_s_per_step"),
        "first_loss": last["first_loss"], "train_loss": last["train_loss"], "val_loss": last["val_loss"],
        "params": last["params"],
    }


def ratios(scen: str, rows: dict, local_rows: dict | None) -> dict:
    """zero8 against each DeepSpeed reference, and (shaped links) each row against its no-network run."""
    out = {}
    z = rows.get("zero8", {}).get("summary", {})
    for role in ("deepspeed_best", "deepspeed_overlap_off"):
        d = rows.get(role, {}).get("summary", {})
        if "step_s" not in d:
            continue
        name = ROLE_NAMES[role]
        ze = rows.get("zero8_eager", {}).get("summary", {})
        if "step_s" in ze:
            out[f"throughput {ROLE_NAMES['zero8_eager']} / {name}"] = d["step_s"] / ze["step_s"]
        if "step_s" not in z:
            continue
        out[f"throughput zero8 / {name}"] = d["step_s"] / z["step_s"]
        if role == "deepspeed_best":
            if SCENARIOS[scen][1] and z["link_bytes_per_rank_step"] and d["link_bytes_per_rank_step"]:
                out[f"link bytes zero8 / {name}"] = z["link_bytes_per_rank_step"] / d["link_bytes_per_rank_step"]
            elif z["zero8_bytes_per_rank_step"] and d["link_bytes_per_rank_step"]:
                # one host: zero8 uses shared memory, so its own count against DeepSpeed's loopback bytes
                out[f"bytes zero8 (own count) / {name} (loopback)"] = (
                    z["zero8_bytes_per_rank_step"] / d["link_bytes_per_rank_step"])
            out[f"state bytes zero8 / {name}"] = z["state_bytes_per_rank"] / d["state_bytes_per_rank"]
            out[f"peak RSS zero8 / {name}"] = z["peak_rss_mb_per_rank"] / d["peak_rss_mb_per_rank"]
    # Each system's compute-only bound is its run on one host: DeepSpeed's best and zero8 without the overlap
    # in the local scenario; zero8's defaults on one host in the same interleaved rounds (zero8_nonet), so
    # that the machine's drift between scenarios does not enter the ratio the targets judge.
    for role in ("zero8", "zero8_eager", "deepspeed_best") if local_rows else ():
        own = local_rows.get(role, {}).get("summary", {})
        if role == "zero8" and "step_s" in rows.get("zero8_nonet", {}).get("summary", {}):
            own = rows["zero8_nonet"]["summary"]
        s = rows.get(role, {}).get("summary", {})
        if "step_s" in s and "step_s" in own:
            out[f"{ROLE_NAMES[role]} step / its no-network step"] = s["step_s"] / own["step_s"]
    return out


def targets(scenarios: dict) -> list[dict]:
    out = []
    for scen, name, bound, kind in TARGETS:
        value = scenarios.get(scen, {}).get("ratios", {}).get(name)
        if value is not None:
            out.append({"scenario": scen, "ratio": name, "value": value, "target": bound, "kind": kind,
                        "met": value <= bound if kind == "max" else value >= bound})
    return out


def fmt_mb(b) -> str:
    return "-" if b is None else f"{b / 1e6:.2f}"


def table(results: dict) -> str:
    lines = [f"zero8 vs DeepSpeed ZeRO-2: examples/pretrain_gpt.py's GPT, {results['params'] / 1e6:.2f} M parameters "
             f"({results['model']}), 2 ranks, {results['steps']} timed steps after {results['warmup']} untimed, "
             f"{results['repeats']} interleaved rounds; DeepSpeed {results['deepspeed_version']} with "
             f"{results['ds_optimizer']} optimizer; {results['cpu']}, load {results['load_before'][0]:.1f} at the start"]
    for scen, res in results["scenarios"].items():
        gp = res.get("goodput_gbps")
        lines.append(f"\n== {SCENARIOS[scen][0]}" + (f" (one TCP stream: {gp:.2f} Gbit/s)" if gp else ""))
        lines.append(f"{'configuration':<60}{'step ms':>8}{'range':>12}{'tokens/s':>9}{'state MB':>9}{'RSS MB':>7}"
                     f"{'link MB':>8}{'zero8 MB':>9}{'comm ms':>8}{'train':>7}{'val':>7}")
        for role, entry in res["rows"].items():
            s = entry["summary"]
            name = entry["label"][:59]
            if "error" in s:
                lines.append(f"{name:<60}failed: {s['error']}")
                continue
            comm = "-" if s["zero8_comm_s_per_step"] is None else f"{1e3 * s['zero8_comm_s_per_step']:.0f}"
            spread = f"{1e3 * s['step_s_min']:.0f}-{1e3 * s['step_s_max']:.0f}"
            lines.append(
                f"{name:<60}{1e3 * s['step_s']:>8.0f}{spread:>12}{s['tokens_per_s']:>9,.0f}"
                f"{s['state_bytes_per_rank'] / 1e6:>9.2f}{s['peak_rss_mb_per_rank']:>7.0f}"
                f"{fmt_mb(s['link_bytes_per_rank_step']):>8}{fmt_mb(s['zero8_bytes_per_rank_step']):>9}{comm:>8}"
                f"{s['train_loss']:>7.3f}{s['val_loss']:>7.3f}")
        if res.get("search"):
            lines.append(f"  DeepSpeed settings searched ({results['search_steps']} timed steps each): " + "; ".join(
                f"{x['label'].replace('DeepSpeed ', '')} "
                + (f"{1e3 * x['step_s']:.0f} ms" if x.get("step_s") else "failed") for x in res["search"]))
        for k, v in res.get("ratios", {}).items():
            lines.append(f"  {k}: {v:.3f}")
    if results.get("targets"):
        lines.append("\ntargets (issue 31, for 30-60 M parameters): " + "; ".join(
            f"{t['scenario']} {t['ratio']} {t['value']:.3f} ({'<=' if t['kind'] == 'max' else '>='} {t['target']}: "
            f"{'met' if t['met'] else 'NOT met'})" for t in results["targets"]))
    lines.append("\nstep ms: median over the rounds of the mean step time (range: min-max); state MB: optimizer state "
                 "per rank; RSS MB: peak per rank; link MB: bytes sent per rank and step on the link (two hosts: the "
                 "veth; one host: the loopback, which only gloo uses, / 2); zero8 MB: zero8's own count of the same; "
                 "comm ms: zero8's time inside collectives per step; train: loss of the last step's global batch; "
                 "val: validation loss at the end")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def deepspeed_problem() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return f"deepspeed is not installed for {sys.executable}: run bash benchmarks/setup_deepspeed.sh"
    return None


def netns_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    r = subprocess.run(["bash", str(NETNS), "check"], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr or r.stdout).strip()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", choices=MODELS, default="gpt38m", help="GPT size (default gpt38m, 38 M parameters)")
    p.add_argument("--where", default="local,1gbit,10gbit",
                   help=f"scenarios, comma-separated, from {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--systems", default="zero8,deepspeed", help="zero8, deepspeed or both (default)")
    p.add_argument("--eager_gather", action="store_true",
                   help="also run zero8 with zero8.overlap_param_gather off (the all-gather inside engine.step())")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--ds_grid", choices=DS_GRID, default="small",
                   help="DeepSpeed settings searched per scenario: small (4, default), full (8), none (defaults)")
    p.add_argument("--ds_torch_adamw", action="store_true",
                   help="DeepSpeed with torch.optim.AdamW as its client optimizer instead of the fused Adam it builds "
                        "from the config (no op to compile: for quick checks)")
    p.add_argument("--search_steps", type=int, default=3, help="timed steps of a search run (default 3)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out_dir", default="out/bench_vs_deepspeed")
    p.add_argument("--run_timeout", type=float, default=0.0,
                   help="seconds one run may take (default: 900 plus 30 per step)")
    p.add_argument("--netns_prefix", default="z8b", help="namespace names (default z8b: z8b0, z8b1)")
    p.add_argument("--netns_net", default="10.209.0", help="the link's /24, first three octets (default 10.209.0)")
    a = p.parse_args(argv)
    a.where = [w.strip() for w in a.where.split(",") if w.strip()]
    bad = [w for w in a.where if w not in SCENARIOS]
    if bad or not a.where:
        p.error(f"--where {','.join(bad) or '(empty)'}: choose from {', '.join(SCENARIOS)}")
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if not a.systems or any(s not in ("zero8", "deepspeed") for s in a.systems):
        p.error(f"--systems {','.join(a.systems)}: zero8, deepspeed or both")
    for name, low in (("steps", 1), ("warmup", 0), ("repeats", 1), ("search_steps", 1)):
        if getattr(a, name) < low:
            p.error(f"--{name} {getattr(a, name)} must be at least {low}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    model = MODELS[a.model]
    out_dir = Path(a.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    ns_problem = netns_problem()
    shaped = [w for w in a.where if SCENARIOS[w][1]]
    if ns_problem and shaped:
        raise SystemExit(f"--where {','.join(shaped)} needs two network namespaces: {ns_problem}")
    ds_problem = deepspeed_problem() if "deepspeed" in a.systems else None
    if not ds_problem and "deepspeed" in a.systems:
        print(f"bench_vs_deepspeed: DeepSpeed's CPU ops, into {torch_extensions_dir()} (minutes the first time) ...",
              flush=True)
        ds_problem = prepare_deepspeed(a.ds_torch_adamw)
    if ds_problem:
        print(f"bench_vs_deepspeed: DeepSpeed rows skipped: {ds_problem}", flush=True)
    n_params = gpt_params(model)
    timeout = a.run_timeout or 900 + 30 * (a.warmup + max(a.steps, a.search_steps))

    hosts = Hosts(a.netns_prefix, a.netns_net, use_netns=ns_problem is None)
    # SIGTERM ends the benchmark as Ctrl-C does: through the finally below, which removes the namespaces.
    signal.signal(signal.SIGTERM, _interrupt)
    results = {"bench": "vs_deepspeed", "model": a.model, "shape": model, "params": n_params, "steps": a.steps,
               "warmup": a.warmup, "repeats": a.repeats, "ds_grid": a.ds_grid, "search_steps": a.search_steps,
               "ds_optimizer": "torch.optim.AdamW" if a.ds_torch_adamw else "its own (from the config)",
               "deepspeed_version": _installed("deepspeed"),
               "netns": hosts.use_netns, "deepspeed_skipped": ds_problem, "cpu": _cpu_name(),
               "load_before": os.getloadavg(), "scenarios": {}}
    counter = [0]

    def go(scen: str, setting: Setting, steps: int, tag: str, where: str | None = None) -> dict:
        # where: the scenario the run uses (default scen; "local" for zero8_nonet inside a shaped one)
        def attempt(run_dir: Path) -> dict:
            counter[0] += 1  # a port of its own
            return run_one(hosts, where or scen, setting, base_config(model, a.warmup + steps), model, steps,
                           a.warmup, run_dir, PORT_BASE + counter[0] % 200, timeout, a.seed, a.ds_torch_adamw)

        d = out_dir / scen / f"{counter[0] + 1:03d}-{tag}"
        print(f"[{scen}] {setting.label} ({tag}) ...", end=" ", flush=True)
        r = attempt(d)
        if setting.system == "deepspeed" and "error" in r and DS_ABORT in (d / "run.log").read_text(errors="replace"):
            print(f"DeepSpeed aborted ({DS_ABORT!r}), once more ...", end=" ", flush=True)
            first = r["error"]
            r = attempt(d / "retry")
            r["retried_after"] = first
        print("failed: " + r["error"] if "error" in r else f"{1e3 * r['seconds_per_step']:.0f} ms/step", flush=True)
        for ln in r.get("log_tail", []):
            print("    " + ln, flush=True)
        return r

    try:
        hosts.open()
        for scen in a.where:
            hosts.shape(SCENARIOS[scen][1])
            res = {"rows": {}, "search": []}
            if SCENARIOS[scen][1]:
                res["goodput_gbps"] = hosts.goodput_gbps()
                print(f"[{scen}] link: {res['goodput_gbps']:.2f} Gbit/s TCP goodput", flush=True)
            entries = [("zero8", zero8_default())] if "zero8" in a.systems else []
            if "zero8" in a.systems and SCENARIOS[scen][1]:
                entries.append(("zero8_nonet", zero8_nonet()))
            if "zero8" in a.systems and a.eager_gather:
                entries.append(("zero8_eager", zero8_eager_gather()))
            if "deepspeed" in a.systems and not ds_problem:
                grid = [deepspeed_setting(k, n_params) for k in DS_GRID[a.ds_grid]]
                searched = [(grid[0], None)]
                if len(grid) > 1:
                    searched = [(s, go(scen, s, a.search_steps, "search").get("seconds_per_step")) for s in grid]
                    res["search"] = [{"label": s.label, "knobs": s.knobs, "step_s": t} for s, t in searched]
                best, off = pick_references(searched)
                entries.append(("deepspeed_best", best))
                if off is not best:
                    entries.append(("deepspeed_overlap_off", off))
            runs = {role: [] for role, _ in entries}
            for rnd in range(a.repeats):  # interleaved: A B C A B C
                for role, s in entries:
                    where = "local" if role == "zero8_nonet" else None
                    runs[role].append(go(scen, s, a.steps, f"round{rnd + 1}-{role}", where))
            for role, s in entries:
                res["rows"][role] = {"label": s.label, "config": s.config(base_config(model, a.warmup + a.steps)),
                                     "summary": summarize(runs[role]), "runs": runs[role]}
            if "deepspeed_best" in res["rows"] and "deepspeed_overlap_off" not in res["rows"]:
                res["overlap_off_is_best"] = True
            results["scenarios"][scen] = res
    except KeyboardInterrupt:
        print("\nbench_vs_deepspeed: interrupted; removing the namespaces", file=sys.stderr)
        return 130
    finally:
        hosts.close()
    local = results["scenarios"].get("local", {}).get("rows")
    for scen, res in results["scenarios"].items():
        rows = dict(res["rows"])
        if res.get("overlap_off_is_best"):
            rows["deepspeed_overlap_off"] = rows["deepspeed_best"]
        res["ratios"] = ratios(scen, rows, local if scen != "local" else None)
    results["targets"] = targets(results["scenarios"])
    results["load_after"] = os.getloadavg()
    text = table(results)
    print(text)
    (out_dir / "table.txt").write_text(text + "\n")
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nresults: {out_dir / 'results.json'}; per-run logs and configs under {out_dir}/<scenario>/")
    compact = {"model": a.model, "params": n_params, "deepspeed_skipped": ds_problem, "targets": results["targets"],
               "scenarios": {scen: {"goodput_gbps": res.get("goodput_gbps"), "ratios": res["ratios"],
                                    "rows": {role: {"label": e["label"], **e["summary"]}
                                             for role, e in res["rows"].items()}}
                             for scen, res in results["scenarios"].items()}}
    print("BENCH_VS_DEEPSPEED " + json.dumps(compact))
    failed = [f"{scen}/{role}" for scen, res in results["scenarios"].items() for role, e in res["rows"].items()
              if "error" in e["summary"]]
    if failed:
        print(f"bench_vs_deepspeed: every run of {', '.join(failed)} failed", file=sys.stderr)
        return 1
    return 0


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _installed(dist: str) -> str | None:
    import importlib.metadata
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
