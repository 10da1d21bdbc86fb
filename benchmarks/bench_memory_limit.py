#!/usr/bin/env python3
"""The largest GPT that trains 10 steps on 2 ranks within a memory limit, for zero8 and for DeepSpeed
ZeRO-2 (issue 31, point 4).

Each system climbs a ladder of GPTs (examples/pretrain_gpt.py's layers in one LayerModule: 8 blocks,
head size 64, width growing by 64) with a binary search: a rung fits when its 2-rank job trains
`--steps` steps without being killed. Then the same search between the last width that fits and the
next, in steps of `--refine` (the head size there: the divisor of the width closest to 64). The job runs in a memory cgroup whose limit is `--limit_gb` for everything it starts
(launcher and ranks: cgroup v2 memory.max, or v1 memory.limit_in_bytes where the memory controller is
on v1, both without swap), created as a child of this process's cgroup (root needed). Without a
writable cgroup, the job runs unlimited and fits when the sum of its ranks' peak RSS is within the
limit. Either way the table shows the ranks' peak RSS.

Both systems train the same model in fp32 from the same seed on the same random byte batches, with
AdamW (DeepSpeed: torch's AdamW, `torch_adam`; zero8: 8-bit states, int8 gradients, its defaults) and
ZeRO stage 2 with the same `--bucket` for reduce_bucket_size and allgather_bucket_size (DeepSpeed's
settings for least memory: overlap_comm off, so one reduction buffer; contiguous_gradients on).
zero8 runs under mpirun (its launcher's engine), DeepSpeed under torchrun with gloo, with
DS_ACCELERATOR=cpu.

    python3 benchmarks/bench_memory_limit.py --limit_gb 3
    bash benchmarks/setup_deepspeed.sh                 # DeepSpeed (pinned there) into this Python

Prints a table and one JSON line (`{"bench": "memory_limit", ...}`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pretrain_example import gloo_rank_exit, load_example

N_LAYER, HEAD_DIM, VOCAB = 8, 64, 256
WIDTHS = [256 + 64 * k for k in range(40)]  # 256 .. 2752


def n_heads(d_model: int) -> int:
    """The head count whose head size is closest to HEAD_DIM (d_model / HEAD_DIM on the ladder's rungs)."""
    return min((h for h in range(1, d_model + 1) if d_model % h == 0), key=lambda h: (abs(d_model / h - HEAD_DIM), h))


def gpt_params(d_model: int, seq_len: int) -> int:
    """Parameters of examples/pretrain_gpt.py's GPT (untied head): per block 12 d^2 + 13 d, the
    embeddings (with StableEmbedding's LayerNorm), the final LayerNorm and the head."""
    d = d_model
    return N_LAYER * (12 * d * d + 13 * d) + VOCAB * d + 2 * d + seq_len * d + 2 * d + VOCAB * d


# ---------------------------------------------------------------------------------------------
# One rank (--worker zero8|deepspeed)
# ---------------------------------------------------------------------------------------------

def peak_rss_bytes() -> int:
    """VmHWM: this process's peak resident set."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def ds_config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket,
                              "overlap_comm": False, "contiguous_gradients": True},
        "steps_per_print": 10**9,
    }


def worker(args) -> int:
    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    ex = load_example()
    layers = ex.gpt_layers(args.d_model, N_LAYER, n_heads(args.d_model), args.seq_len, False)
    model = ex.LayerModule(layers, seed_layers=True, base_seed=args.seed)
    cfg = ds_config(args)
    if args.worker == "zero8":
        import zero8
        from zero8.engine import world_comm

        cfg["zero_optimization"].pop("contiguous_gradients")
        cfg["zero_optimization"]["overlap_comm"] = True  # zero8's default
        cfg["optimizer"]["params"].pop("torch_adam")
        cfg["zero8"] = {}  # zero8's defaults: 8-bit states, int8 gradients (without the section: 32-bit, fp32)
        world = world_comm("auto")
        rank, size = world.rank, world.size
        cfg["train_batch_size"] = args.batch * size
        engine, _, _, _ = zero8.initialize(model=model, model_parameters=ex.param_groups(model), config=cfg)
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=ex.param_groups(model), config=cfg)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    t0 = time.perf_counter()
    loss = None
    for _ in range(args.steps):
        seq = torch.randint(0, VOCAB, (args.batch, args.seq_len + 1), generator=gen)
        loss = ex.lm_loss(engine(seq[:, :-1]), seq[:, 1:])
        engine.backward(loss)
        engine.step()
    out = {"rank": rank, "world": size, "peak_rss": peak_rss_bytes(), "seconds": time.perf_counter() - t0,
           "params": sum(p.numel() for p in model.parameters()), "loss": float(loss.detach())}
    if args.worker == "zero8":
        out["memory"] = engine.memory_stats()
    with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if args.worker == "deepspeed":
        gloo_rank_exit()
    return 0


# ---------------------------------------------------------------------------------------------
# The memory limit
# ---------------------------------------------------------------------------------------------

class Cgroup:
    """A child memory cgroup of this process's own, limited to `limit` bytes without swap; v2 when the
    unified hierarchy has the memory controller, else v1. None from make() when neither is writable."""

    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2

    @staticmethod
    def make(limit: int, name: str) -> "Cgroup | None":
        own = {}
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                own[controllers] = path.lstrip("/")
        base = Path("/sys/fs/cgroup")
        candidates = []
        if (base / "cgroup.controllers").is_file() and "memory" in (base / "cgroup.controllers").read_text().split():
            candidates.append((base / own.get("", ""), True))
        for controllers, path in own.items():
            if "memory" in controllers.split(","):
                candidates.append((base / "memory" / path, False))
        for parent, v2 in candidates:
            try:
                path = parent / name
                path.mkdir()
                cg = Cgroup(path, v2)
                if v2:
                    (path / "memory.max").write_text(str(limit))
                    if (path / "memory.swap.max").exists():
                        (path / "memory.swap.max").write_text("0")
                else:
                    (path / "memory.limit_in_bytes").write_text(str(limit))
                    if (path / "memory.memsw.limit_in_bytes").exists():
                        (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
                return cg
            except OSError:
                try:
                    path.rmdir()
                except OSError:
                    pass
        return None

    def enter(self) -> None:
        """Moves the calling process (a child before exec) into the group; its children follow."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def oom_kills(self) -> int:
        name, key = ("memory.events", "oom_kill") if self.v2 else ("memory.oom_control", "oom_kill")
        try:
            for line in (self.path / name).read_text().splitlines():
                k, v = line.split()
                if k == key:
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

def command(system: str, args, d_model: int, result_dir: str) -> list:
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--d_model", str(d_model),
          "--seq_len", str(args.seq_len), "--batch", str(args.batch), "--steps", str(args.steps),
          "--bucket", str(args.bucket), "--seed", str(args.seed), "--result_dir", result_dir]
    if system == "zero8":
        mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
        return [mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none"] + me
    # torchrun starts the script with its own interpreter: the script and its arguments only.
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(29500 + os.getpid() % 1000)] + me[1:]


def first_error(output: str) -> str:
    """The first line that reads as a Python error (the launchers' own reports follow it), with the last
    file its traceback names, else the tail."""
    where = ""
    for line in output.splitlines():
        head = line.split(":", 1)[0].strip()
        if line.lstrip().startswith('File "'):
            where = line.strip() + ": "
        if head.endswith(("Error", "Exception")) and " " not in head:
            return (where + line.strip())[:600]
    return output[-600:]


def run_rung(system: str, args, d_model: int, limit: int, index: int) -> dict:
    """One 2-rank job; {fits, peak_rss (per rank), seconds, why}. A job that fails without the limit
    ending it (no OOM kill: a DeepSpeed rank sometimes aborts with "terminate called without an active
    exception") runs once more, so that a crash does not pass for "does not fit"; the result keeps the
    first failure in "retried_after"."""
    res = run_rung_once(system, args, d_model, limit, index)
    if res["why"].startswith("exit") and not res["oom_kills"]:
        first = res["why"]
        res = run_rung_once(system, args, d_model, limit, index + 1000)  # a cgroup of its own
        res["retried_after"] = first
    return res


def run_rung_once(system: str, args, d_model: int, limit: int, index: int) -> dict:
    result_dir = tempfile.mkdtemp(prefix=f"memlimit_{system}_")
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive", DS_ACCELERATOR="cpu",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONWARNINGS="ignore",
               ZERO8_COMM_TIMEOUT="600")
    cg = None if args.no_cgroup else Cgroup.make(limit, f"zero8-memlimit-{os.getpid()}-{index}")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(command(system, args, d_model, result_dir), env=env, capture_output=True, text=True,
                           timeout=args.timeout, preexec_fn=cg.enter if cg else None)
        rc, tail = r.returncode, first_error(r.stdout + r.stderr)
    except subprocess.TimeoutExpired:
        rc, tail = -1, "timed out"
    seconds = time.perf_counter() - t0
    oom = cg.oom_kills() if cg else 0
    if cg:
        cg.remove()
    ranks = []
    for k in range(2):
        f = Path(result_dir) / f"rank{k}.json"
        if f.is_file():
            ranks.append(json.loads(f.read_text()))
    shutil.rmtree(result_dir, ignore_errors=True)
    peak = [x["peak_rss"] for x in ranks]
    fits = rc == 0 and len(ranks) == 2 and (cg is not None or sum(peak) <= limit)
    why = "" if fits else ("killed at the limit" if oom else
                           "peak RSS above the limit" if rc == 0 and len(ranks) == 2 else f"exit {rc}: {tail}")
    return {"fits": fits, "peak_rss": peak, "seconds": seconds, "why": why, "oom_kills": oom,
            "memory": ranks[0].get("memory") if ranks else None, "cgroup": None if cg is None else
            ("v2" if cg.v2 else "v1")}


def search(system: str, args, limit: int) -> dict:
    """Binary search over WIDTHS for the last rung that fits (fitting is monotone in the model's size),
    then over the widths between it and the next rung in steps of args.refine."""
    tried = {}
    lo, hi = ladder_search(system, args, limit, WIDTHS, tried,
                           args.start if args.start is not None else len(WIDTHS) // 3)
    best = WIDTHS[lo] if lo >= 0 else None
    if best is not None and hi < len(WIDTHS) and 0 < args.refine < WIDTHS[hi] - best:
        fine = [best] + list(range(best + args.refine, WIDTHS[hi], args.refine)) + [WIDTHS[hi]]
        flo, _ = ladder_search(system, args, limit, fine, tried, (len(fine) - 1) // 2, known=(0, len(fine) - 1))
        best = fine[flo]
    return {"largest_d_model": best, "largest_params": gpt_params(best, args.seq_len) if best else 0,
            "ceiling_reached": lo == len(WIDTHS) - 1,
            "tried": {str(d): v for d, v in sorted(tried.items())}}


def ladder_search(system: str, args, limit: int, widths: list, tried: dict, start: int,
                  known: tuple | None = None) -> tuple[int, int]:
    """(lo, hi): widths[lo] fits (-1: none), widths[hi] does not (len: beyond the list); known: a (lo, hi)
    already established."""
    lo, hi = known if known else (-1, len(widths))
    probe = min(max(start, lo + 1), hi - 1) if hi - lo > 1 else lo
    while hi - lo > 1:
        d = widths[probe]
        res = run_rung(system, args, d, limit, len(tried))
        tried[d] = res
        print(f"  {system:9s} d_model {d:5d} ({gpt_params(d, args.seq_len) / 1e6:7.1f}M params): "
              f"{'fits' if res['fits'] else 'does not fit'}; peak RSS per rank "
              f"{', '.join(f'{p / 2**30:.2f}' for p in res['peak_rss']) or '-'} GiB, {res['seconds']:.0f} s"
              f"{'' if res['fits'] else '; ' + res['why'][:200]}"
              f"{'; after a failure not at the limit: ' + res['retried_after'][:200] if 'retried_after' in res else ''}",
              flush=True)
        if res["fits"]:
            lo = probe
        else:
            hi = probe
        probe = (lo + hi) // 2 if hi - lo > 1 else probe
        if hi == len(widths) and res["fits"]:
            probe = min(len(widths) - 1, probe + max(1, (len(widths) - probe) // 2))
    return lo, hi


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit_gb", type=float, default=3.0, help="memory limit of the 2-rank job, GiB")
    p.add_argument("--systems", default="zero8,deepspeed", help="comma-separated: zero8, deepspeed")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--bucket", type=int, default=1 << 22,
                   help="reduce_bucket_size and allgather_bucket_size (elements), both systems")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start", type=int, default=None, help="first rung to try (index into the width ladder)")
    p.add_argument("--refine", type=int, default=16,
                   help="then search the widths between the last rung that fits and the next in these steps "
                        "(0: no)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    p.add_argument("--no_cgroup", action="store_true", help="measure peak RSS against the limit instead")
    p.add_argument("--worker", choices=["zero8", "deepspeed"], help=argparse.SUPPRESS)
    p.add_argument("--d_model", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result_dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in ("zero8", "deepspeed"):
            p.error(f"--systems: unknown system {s!r} (zero8, deepspeed)")
    if "deepspeed" in systems and importlib.util.find_spec("deepspeed") is None:
        print("deepspeed is not installed: run `bash benchmarks/setup_deepspeed.sh` (it pins the version)",
              file=sys.stderr)
        return 2
    if "zero8" in systems and not (shutil.which("mpirun") or shutil.which("mpiexec")):
        print("mpirun not found (scripts/setup.sh installs OpenMPI)", file=sys.stderr)
        return 2
    limit = int(args.limit_gb * 2**30)
    print(f"memory limit {args.limit_gb:g} GiB for 2 ranks; GPT {N_LAYER} blocks, head size {HEAD_DIM} "
          f"(refined widths: the nearest that divides them), "
          f"seq_len {args.seq_len}, batch {args.batch} per rank, {args.steps} steps, buckets {args.bucket}", flush=True)
    results = {s: search(s, args, limit) for s in systems}
    print()
    print(f"| system | largest GPT that trains {args.steps} steps in {args.limit_gb:g} GiB (2 ranks) | parameters | "
          f"peak RSS per rank at that size (GiB) |")
    print("|---|---|---|---|")
    for s, r in results.items():
        d = r["largest_d_model"]
        peak = r["tried"][str(d)]["peak_rss"] if d else []
        print(f"| {s} | {'none' if d is None else f'd_model {d}, {N_LAYER} blocks'}"
              f"{' (the ladder ends here)' if r['ceiling_reached'] else ''} | {r['largest_params'] / 1e6:.1f}M | "
              f"{', '.join(f'{x / 2**30:.2f}' for x in peak) or '-'} |")
    if len(results) == 2 and results["deepspeed"]["largest_params"]:
        ratio = results["zero8"]["largest_params"] / results["deepspeed"]["largest_params"]
        print(f"\nzero8 / DeepSpeed parameters: {ratio:.2f}x")
    cg = next((v["cgroup"] for r in results.values() for v in r["tried"].values()), None)
    print(json.dumps({"bench": "memory_limit", "limit_bytes": limit, "cgroup": cg, "steps": args.steps,
                      "seq_len": args.seq_len, "batch": args.batch, "bucket": args.bucket, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
