#!/usr/bin/env python3
"""Pretrains a small GPT (byte-level, decoder-only) on the Python standard library's source code with
zero8's DeepSpeed-style engine: the example the README's main command runs. One process per rank, started
by zero8-launch, mpirun or plain python (one rank); driven by a DeepSpeed JSON config (examples/configs/).

    zero8-launch --num_procs 2 examples/pretrain_gpt.py --config examples/configs/gpt_zero8_stage2.json \
        --out_dir out/pretrain
    mpirun -np 2 python examples/pretrain_gpt.py --config examples/configs/gpt_zero8_stage2.json
    python examples/pretrain_gpt.py --config examples/configs/gpt_fp32_adamw.json --steps 100
    zero8-launch --num_procs 2 examples/pretrain_gpt.py --device cuda ...   # one rank per GPU (NCCL)
    zero8-launch --num_procs 4 examples/pretrain_gpt.py --pipeline-stages 2   # 2 stages x 2 data-parallel ranks

Data: every *.py file under the running interpreter's standard library (sysconfig's "stdlib" path; no
site-packages, test suites or codec tables), ordered by the SHA-256 of its relative path (a fixed shuffle
that spreads the subset over the whole library), taken until --corpus_mb; the first 95% of those bytes are
the training stream, the files after it the validation stream (disjoint files). Tokens are bytes (vocab
256). The global batch of step s is drawn from a generator seeded by (seed, s) alone, so the data position
is the step number: a resumed run, or a run at another world size, sees the same batches (data-parallel rank r takes
rows [r*m, (r+1)*m) of every global batch, m the per-rank micro-batch).

Model: token embedding zero8.nn.StableEmbedding (layer norm after the lookup, 32-bit optimizer states)
plus a learned position embedding, pre-LN blocks (causal self-attention with torch's
scaled_dot_product_attention, GELU MLP of 4x width), a final layer norm and a linear head. The head is
untied by default (its weight gets 8-bit states like the other matrices, while the embedding keeps the
32-bit states StableEmbedding asks for); --tie_weights shares the embedding matrix (then with 32-bit
states). No dropout: runs are deterministic. The model is written once, as a list of layers (zero8.pipe):
built whole for data parallelism, or with --pipeline-stages S cut into S stages (zero8.pipe.PipelineModule,
balanced by parameter count) that train_batch runs as a 1F1B pipeline, each stage over ranks / S
data-parallel ranks (default config then gpt_zero8_pipe.json: 4 micro-batches per step, ZeRO stage 1).
Each layer is built from its own seed, so both ways start from the same weights.

Device: --device cpu, cuda (this rank's GPU, cuda:LOCAL_RANK: the engine keeps the 8-bit states and every
buffer there and talks over NCCL between ranks, or over MPI staged through host memory where ranks share a
GPU; pipeline stages too) or auto (the default: cuda when zero8 has its CUDA kernels and every local rank
can have a GPU of its own, else cpu). The model is built on the CPU from the seed and
then moved, so both devices start from the same weights.

Output (rank 0): a progress bar (tqdm when installed, else a plain line), a report every
steps_per_print steps (loss, validation loss, tokens/s, optimizer-state bytes, peak memory and bytes sent
per rank), <out_dir>/train_log.csv and, at the end, <out_dir>/loss.png (matplotlib). Checkpoints go to
--save_dir every --save_interval steps, at the end, and when any rank gets SIGTERM, SIGINT (Ctrl-C) or
SIGUSR1 (what OpenMPI's mpirun forwards): the ranks agree at the next step boundary, save together and
exit with status 0 (no CSV row for the stop step: the checkpoint carries the losses of the open report
window). --resume continues from the latest checkpoint (weights, 8-bit states, scheduler, data position,
report window, elapsed time) with the same losses and CSV rows as an uninterrupted run; --resume TAG from
another checkpoint of --save_dir (e.g. global_step200), the CSV rows after it dropped.

Optional packages (PyPI): tqdm for the progress bar, matplotlib for the plot; without them the example
prints a plain progress line and skips the plot.
"""

from __future__ import annotations

import os
import signal

# Stop requests (SIGTERM, Ctrl-C's SIGINT, and SIGUSR1, which OpenMPI's mpirun forwards) are recorded from
# the first moment, before the slow imports: a job stopped during start-up still ends cleanly. The ranks
# agree on them at step boundaries (main), save together and exit; a second Ctrl-C interrupts at once.
_stop_signal = ""


def _request_stop(signum, _frame) -> None:
    global _stop_signal
    if _stop_signal and signum == signal.SIGINT:
        raise KeyboardInterrupt
    _stop_signal = signal.Signals(signum).name


if __name__ == "__main__":
    for _sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(_sig, _request_stop)


def _local_size() -> int:
    for var in ("LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(var, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    return 1


# One share of this machine's cores per local rank, set before torch and zero8 load their thread pools:
# two ranks with a full pool each would fight over the same cores. OMP_NUM_THREADS, when set, wins.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _local_size()))
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import csv  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import zero8  # noqa: E402
from zero8.engine import world_comm  # noqa: E402
from zero8.pipe import LayerModule, LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402

VOCAB = 256
CSV_FIELDS = ["step", "tokens", "loss", "val_loss", "lr", "tokens_per_s", "bytes_sent", "gradient_bytes",
              "state_bytes", "max_rss_mb", "elapsed_s"]
# Directories of the standard library left out of the corpus: installed packages, test suites (data
# files and generated cases more than code) and the codec tables of encodings/ (hex tables).
_CORPUS_SKIP = {"site-packages", "dist-packages", "test", "tests", "encodings", "__pycache__", "idle_test"}


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

class Corpus:
    """The byte streams of the training and validation files (uint8 tensors) and their fingerprint."""

    def __init__(self, max_bytes: int, val_fraction: float = 0.05):
        root = Path(sysconfig.get_paths()["stdlib"])
        files = []
        # The skipped folders are pruned, not walked: site-packages alone (torch...) holds far more files
        # than the standard library.
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [d for d in subfolders if d not in _CORPUS_SKIP]
            for name in names:
                p = Path(folder, name)
                if name.endswith(".py") and p.is_file():
                    rel = p.relative_to(root).as_posix()
                    files.append((hashlib.sha256(rel.encode()).hexdigest(), rel, p))
        files.sort()
        if not files:
            raise RuntimeError(f"no *.py files under the standard library at {root}")
        train, val = [], []
        n_train = n_val = 0
        train_budget, val_budget = int(max_bytes * (1.0 - val_fraction)), int(max_bytes * val_fraction)
        for _, rel, p in files:
            data = p.read_bytes() + b"\n"
            if n_train < train_budget:
                train.append(data)
                n_train += len(data)
            elif n_val < val_budget:
                val.append(data)
                n_val += len(data)
            else:
                break
        if not val:
            raise RuntimeError(f"the standard library at {root} has too little source for "
                               f"--corpus_mb {max_bytes / 1e6}")
        self.root = str(root)
        self.train_files, self.val_files = len(train), len(val)
        train_bytes, val_bytes = b"".join(train), b"".join(val)
        self.fingerprint = hashlib.sha256(train_bytes + b"\0" + val_bytes).hexdigest()[:16]
        self.train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
        self.val = torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8)

    def describe(self) -> str:
        return (f"corpus: {self.root} *.py, {self.train_files} training files ({self.train.numel() / 1e6:.2f} MB), "
                f"{self.val_files} validation files ({self.val.numel() / 1e6:.2f} MB), fingerprint {self.fingerprint}")


def sequences(stream: torch.Tensor, offsets: torch.Tensor, seq_len: int):
    """Inputs and next-byte targets of the sequences starting at offsets."""
    idx = offsets.view(-1, 1) + torch.arange(seq_len + 1).view(1, -1)
    tokens = stream[idx].long()
    return tokens[:, :-1], tokens[:, 1:]


def validation_offsets(corpus: "Corpus", seq_len: int, n: int) -> torch.Tensor:
    """Start offsets of the n validation sequences, evenly spread over the validation stream."""
    return torch.linspace(0, corpus.val.numel() - seq_len - 2, n).long()


def batch_offsets(seed: int, step: int, rows: int, stream_len: int, seq_len: int) -> torch.Tensor:
    """Start offsets of the global batch of step `step`: a function of (seed, step) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, stream_len - seq_len - 1, (rows,), generator=g)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

# The GPT is one list of layers (zero8.pipe): built whole (LayerModule) for the data-parallel engine, or cut
# into consecutive stages (PipelineModule) with --pipeline-stages; each layer is built from its own seed
# (base_seed + its index), so both hold the same weights.

class Embedding(nn.Module):
    """Token embedding (zero8.nn.StableEmbedding: layer norm after the lookup, 32-bit optimizer states)
    plus a learned position embedding."""

    def __init__(self, d_model: int, seq_len: int):
        super().__init__()
        self.tok = zero8.nn.StableEmbedding(VOCAB, d_model)  # keeps its xavier init
        self.pos = nn.Embedding(seq_len, d_model)
        nn.init.normal_(self.pos.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)). GPT-2's initialization: weights
    N(0, 0.02), the residual output projections scaled by 1/sqrt(2 * n_layer) so the residual stream's
    variance does not grow with depth, biases zero."""

    def __init__(self, d_model: int, n_head: int, n_layer: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        for lin in (self.qkv, self.proj, self.fc, self.fc_out):
            std = 0.02 / math.sqrt(2 * n_layer) if lin in (self.proj, self.fc_out) else 0.02
            nn.init.normal_(lin.weight, 0.0, std)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Linear):
    """The output projection to the byte logits, without bias."""

    def __init__(self, d_model: int):
        super().__init__(d_model, VOCAB, bias=False)
        nn.init.normal_(self.weight, 0.0, 0.02)


def tied_head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The head of --tie_weights: the token embedding's matrix."""
    return x @ embedding.tok.weight.t()


def gpt_layers(d_model: int, n_layer: int, n_head: int, seq_len: int, tie_weights: bool) -> list:
    """The GPT as layers: embedding, n_layer blocks, final layer norm, head. The head is untied by default
    (its weight gets 8-bit states like the other matrices, while the embedding keeps the 32-bit states
    StableEmbedding asks for); --tie_weights makes the head reuse the embedding matrix (then with 32-bit
    states; under a pipeline, the first and last stages hold it and keep their copies identical)."""
    if d_model % n_head:
        raise ValueError(f"--d_model {d_model} is not a multiple of --n_head {n_head}")
    if tie_weights:
        embed = TiedLayerSpec("embed", Embedding, d_model, seq_len, tied_weight_attr="tok.weight")
        head = TiedLayerSpec("embed", Embedding, d_model, seq_len, forward_fn=tied_head, tied_weight_attr="tok.weight")
    else:
        embed, head = LayerSpec(Embedding, d_model, seq_len), LayerSpec(Head, d_model)
    return [embed, *[LayerSpec(Block, d_model, n_head, n_layer) for _ in range(n_layer)],
            LayerSpec(nn.LayerNorm, d_model), head]


def param_groups(model: nn.Module) -> list[dict]:
    """GPT-2 practice: weight decay on the matrices and embeddings (the config's weight_decay), none on
    biases and LayerNorm gains."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "name": "decay"}, {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1), reduction=reduction)


# ---------------------------------------------------------------------------------------------
# Run-time helpers
# ---------------------------------------------------------------------------------------------

class Progress:
    """Rank 0's output: a progress bar (tqdm when installed, else a carriage-return line; none with
    --no_progress) and the report lines, printed above the bar."""

    def __init__(self, rank0: bool, bar: bool, start: int, total: int):
        self.rank0, self.enabled, self.total, self.bar = rank0, rank0 and bar, total, None
        self._last = 0.0
        if not self.enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stdout,
                        mininterval=0.5 if sys.stdout.isatty() else 5.0)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f}, {tokens_per_s:,.0f} tok/s", refresh=False)
            self.bar.update(1)
        elif time.monotonic() - self._last > 0.5 or step == self.total:
            self._last = time.monotonic()
            print(f"\rstep {step}/{self.total} loss {loss:.3f} {tokens_per_s:,.0f} tok/s", end="", flush=True)

    def write(self, msg: str) -> None:
        if not self.rank0:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stdout)
        else:
            print(("\r" if self._last else "") + msg, flush=True)
            self._last = 0.0
        sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self._last:
            print(flush=True)


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0
    return f"{n:.2f} GB"


def load_config(path: str, steps: int | None, batch_size: int | None, gas: int | None) -> tuple[dict, int, int]:
    """The DeepSpeed config as a dict, with --steps written into the schedule's total_num_steps,
    --batch_size into train_batch_size and --gradient_accumulation_steps; steps_per_print is taken for
    this script's own report (the engine's line is turned off: it would break the progress bar).
    Returns (config, steps, report period)."""
    with open(path, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{e.lineno}:{e.colno}: not plain JSON ({e.msg})") from None
    sched = cfg.get("scheduler", {}).get("params", {})
    if steps is None:
        steps = int(sched.get("total_num_steps", 0) or 0)
        if steps <= 0:
            raise SystemExit(f"{path}: no scheduler.params.total_num_steps; pass --steps")
    elif "total_num_steps" in sched:
        sched["total_num_steps"] = steps
        sched["warmup_num_steps"] = min(int(sched.get("warmup_num_steps", 0)), max(1, steps // 5))
    if batch_size is not None:
        cfg["train_batch_size"] = batch_size
        cfg.pop("train_micro_batch_size_per_gpu", None)
    if gas is not None:
        cfg["gradient_accumulation_steps"] = gas
        cfg.pop("train_micro_batch_size_per_gpu", None)
    report = int(cfg.get("steps_per_print", 10))
    cfg["steps_per_print"] = 1 << 62
    return cfg, steps, report


def read_csv_rows(path: Path, up_to_step: int) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return [r for r in csv.DictReader(f) if int(r["step"]) <= up_to_step]


def write_plot(csv_path: Path, png_path: Path, title: str) -> bool:
    """Training and validation loss against steps (and the lr below). False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r["loss"]]
    step = [int(r["step"]) for r in train]
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(step, [float(r["loss"]) for r in train], label="training loss", lw=1.2)
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5, ms=3)
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    ax_lr.plot(step, [float(r["lr"]) for r in train], color="gray", lw=1)
    ax_lr.set_ylabel("lr")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="DeepSpeed JSON config (examples/configs/; default gpt_zero8_stage2.json, or "
                        "gpt_zero8_pipe.json with --pipeline-stages above 1)")
    p.add_argument("--out_dir", default="out/pretrain", help="CSV log, plot, and checkpoints by default")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps, >= 1 (default: the config's scheduler total_num_steps; also sets it)")
    p.add_argument("--batch_size", type=int, default=None,
                   help="global batch in sequences, >= 1 (config's by default)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=None,
                   help="micro-batches per step and rank, >= 1 (config's by default)")
    p.add_argument("--seq_len", type=int, default=128, help="context in bytes, >= 1")
    p.add_argument("--d_model", type=int, default=128, help="width, >= 1 and a multiple of --n_head")
    p.add_argument("--n_layer", type=int, default=4, help="transformer blocks, >= 1")
    p.add_argument("--n_head", type=int, default=4, help="attention heads, >= 1")
    p.add_argument("--tie_weights", action="store_true", help="share the embedding matrix with the head")
    p.add_argument("--pipeline-stages", "--pipeline_stages", dest="pipeline_stages", type=int, default=1,
                   help="pipeline stages, >= 1, dividing the number of ranks (1: data parallelism only; above 1: "
                        "the layers cut into that many stages, each run by ranks / stages data-parallel ranks)")
    p.add_argument("--corpus_mb", type=float, default=4.0, help="MB of standard-library source used, > 0")
    p.add_argument("--seed", type=int, default=1234, help="model initialization and batch sampling")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to train: cuda (this rank's GPU), cpu, or auto (cuda when every local rank can "
                        "have a GPU, default)")
    p.add_argument("--eval_interval", type=int, default=50, help="steps between validation losses, >= 1")
    p.add_argument("--eval_seqs", type=int, default=128,
                   help="validation sequences, >= 1 (fixed, spread evenly)")
    p.add_argument("--log_interval", type=int, default=None,
                   help="report/CSV period in steps, >= 1 (config's steps_per_print by default)")
    p.add_argument("--save_dir", default=None, help="checkpoint directory (default <out_dir>/checkpoints)")
    p.add_argument("--save_interval", type=int, default=100, help="steps between checkpoints; 0: only at the end")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="TAG",
                   help="continue from a checkpoint in --save_dir: the one its 'latest' names (no TAG, or "
                        "'latest'), or TAG (e.g. global_step200)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--no_plot", action="store_true", help="no PNG at the end")
    p.add_argument("--step_sleep", type=float, default=0.0,
                   help="seconds to sleep after every step, >= 0 (tests and demos: time to send a signal)")
    args = p.parse_args(argv)
    # Values that would otherwise end in a bare traceback (a division by zero in evaluate, a modulo by
    # zero in the loop, a KeyError in the engine) or be taken silently with another meaning.
    at_least = {"steps": 1, "batch_size": 1, "gradient_accumulation_steps": 1, "seq_len": 1, "d_model": 1,
                "n_layer": 1, "n_head": 1, "pipeline_stages": 1, "eval_interval": 1, "eval_seqs": 1, "log_interval": 1,
                "save_interval": 0, "step_sleep": 0}
    for name, low in at_least.items():
        value = getattr(args, name)
        if value is not None and not value >= low:
            p.error(f"--{name} {value} must be at least {low}")
    if not args.corpus_mb > 0:
        p.error(f"--corpus_mb {args.corpus_mb} must be above 0")
    if args.d_model % args.n_head:
        p.error(f"--d_model {args.d_model} is not a multiple of --n_head {args.n_head}")
    if args.pipeline_stages > args.n_layer + 3:
        p.error(f"--pipeline-stages {args.pipeline_stages}: the GPT has only {args.n_layer + 3} layers (--n_layer "
                f"blocks, the embedding, the final norm and the head)")
    if args.config is None:
        name = "gpt_zero8_pipe.json" if args.pipeline_stages > 1 else "gpt_zero8_stage2.json"
        args.config = str(Path(__file__).resolve().parent / "configs" / name)
    return args


def pick_device(choice: str) -> torch.device:
    """--device: cuda is this rank's GPU (zero8.engine.local_device(): cuda:LOCAL_RANK); auto takes it when
    zero8 has its CUDA kernels and there are as many GPUs as local ranks (NCCL needs one per rank; with
    --device cuda, ranks that share a GPU talk over MPI, staged through host memory)."""
    if choice == "cpu":
        return torch.device("cpu")
    usable = torch.cuda.is_available() and zero8.build_info()["cuda"]
    if choice == "auto":
        return zero8.engine.local_device() if usable and torch.cuda.device_count() >= _local_size() else \
            torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); use "
                         "--device cpu")
    if not zero8.build_info()["cuda"]:
        raise SystemExit("--device cuda: this zero8 was built without CUDA (zero8.build_info()['cuda'] is "
                         "False); reinstall it with its CUDA kernels, or use --device cpu")
    return zero8.engine.local_device()


def evaluate(engine, corpus: Corpus, offsets: torch.Tensor, seq_len: int, rank: int, world: int, comm,
             micro: int) -> float:
    """Mean validation loss per byte over the fixed sequences; rank r takes sequences r, r+world, ..."""
    engine.eval()
    total = count = 0.0
    mine = offsets[rank::world]
    with torch.no_grad():
        for i in range(0, mine.numel(), micro):
            x, y = (t.to(engine.device) for t in sequences(corpus.val, mine[i:i + micro], seq_len))
            total += float(lm_loss(engine(x), y, reduction="sum"))
            count += y.numel()
    engine.train()
    total, count = comm.all_reduce_f64([total, count], "sum") if world > 1 else (total, count)
    return total / count


def evaluate_pipeline(engine, corpus: Corpus, offsets: torch.Tensor, seq_len: int, micro: int) -> float:
    """The same mean validation loss per byte through the pipeline's eval_batch: data-parallel rank d takes
    sequences d, d + dp, ... (as many on every rank), as micro-batches of equal size, so the mean of their
    mean losses is the mean per byte."""
    dp, d = engine.dp_world_size, engine.grid.get_data_parallel_rank()
    mine = offsets[d::dp][: offsets.numel() // dp]
    size = micro if mine.numel() % micro == 0 else 1
    batches = (sequences(corpus.val, mine[i:i + size], seq_len) for i in range(0, mine.numel(), size))
    return float(engine.eval_batch(batches, num_micro_batches=mine.numel() // size))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    comm = world_comm(device=device)  # NCCL for a GPU run of several ranks
    rank, world = comm.rank, comm.size
    if __name__ != "__main__":  # main() called from another script: handle the stop signals here
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, _request_stop)
    out_dir = Path(args.out_dir)
    save_dir = Path(args.save_dir) if args.save_dir else out_dir / "checkpoints"
    csv_path, png_path = out_dir / "train_log.csv", out_dir / "loss.png"
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    cfg, steps, report = load_config(args.config, args.steps, args.batch_size,
                                      args.gradient_accumulation_steps)
    log_interval = args.log_interval or report

    corpus = Corpus(int(args.corpus_mb * 1e6))
    layers = gpt_layers(args.d_model, args.n_layer, args.n_head, args.seq_len, args.tie_weights)
    pipelined = args.pipeline_stages > 1
    try:
        model = (PipelineModule(layers, num_stages=args.pipeline_stages, loss_fn=lm_loss, seed_layers=True,
                                base_seed=args.seed, device=device) if pipelined
                 else LayerModule(layers, seed_layers=True, base_seed=args.seed))
    except zero8.Zero8ValueError as e:
        raise SystemExit(f"--pipeline-stages {args.pipeline_stages}: {e}") from None
    model = model.to(device)
    if pipelined:
        # The whole model's size, whatever this rank builds. On the meta device: no memory, but the first
        # meta build imports torch's meta kernels (seconds), so only where this rank holds a part.
        with torch.device("meta"):
            n_params = sum(p.numel() for p in LayerModule(layers).parameters())
    else:
        n_params = sum(p.numel() for p in model.parameters())
    # The engine gets the config as a dict (with this script's overrides), so its warnings and errors start
    # with "<config dict>": they are given the file's name instead, as docs/CONFIG.md shows them.
    def named(msg: str) -> str:
        return args.config + msg[len("<config dict>"):] if msg.startswith("<config dict>") else msg

    with warnings.catch_warnings(record=True) as config_warnings:
        warnings.simplefilter("ignore" if rank != 0 else "default")  # config warnings once, from rank 0
        try:
            engine, optimizer, _, _ = zero8.initialize(model=model, model_parameters=param_groups(model),
                                                       config=cfg)
        except zero8.Zero8ValueError as e:
            overrides = [f"--{name} {getattr(args, name)}" for name in ("steps", "batch_size",
                         "gradient_accumulation_steps") if getattr(args, name) is not None]
            raise SystemExit(named(str(e)) + (f" (the config as changed by {', '.join(overrides)})" if overrides
                                              else "")) from None
    for w in config_warnings:
        warnings.warn_explicit(named(str(w.message)), w.category, w.filename, w.lineno)
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    batch = engine.train_batch_size()
    tokens_per_step = batch * args.seq_len
    # This rank's share of each global batch: its data-parallel rank's rows (a pipeline's first and last
    # stages read them; the stages between them need no data).
    dp, dp_rank = (engine.dp_world_size, engine.grid.get_data_parallel_rank()) if pipelined else (world, rank)

    start, log_state = 0, {}
    if args.resume is not None:
        tag = None if args.resume == "latest" else args.resume  # "latest" is never a tag's name
        try:
            path, client = engine.load_checkpoint(save_dir, tag=tag)
        except (zero8.Zero8IOError, zero8.Zero8ValueError) as e:  # no such tag, a bad name, a damaged file
            raise SystemExit(f"--resume {args.resume}: {e}") from None
        if path is None:
            raise SystemExit(f"--resume: no checkpoint in {save_dir} (no 'latest' file)")
        data = (client or {}).get("data", {})
        if data.get("corpus") != corpus.fingerprint or data.get("seed") != args.seed:
            raise SystemExit(
                f"--resume: {path} was trained on corpus {data.get('corpus')} with seed {data.get('seed')}, this run "
                f"has corpus {corpus.fingerprint} (another Python's standard library?) and seed {args.seed}")
        start = int(data["next_step"])
        if start != engine.global_steps:
            raise SystemExit(f"--resume: data position {start} != engine step {engine.global_steps} in {path}")
        if start >= steps:
            raise SystemExit(f"--resume: the checkpoint in {save_dir} is at step {start}, not below --steps {steps}: "
                             f"nothing to train; raise --steps")
        # The report window open at the checkpoint and the run time so far (absent from checkpoints of
        # older versions of this script: then the window restarts), so the CSV continues as if unbroken.
        log_state = (client or {}).get("log", {})

    # Per-rank facts, gathered for the report (memory and state bytes differ by partition).
    state_bytes = int(engine.memory_stats()["state"])
    val_offsets = validation_offsets(corpus, args.seq_len, args.eval_seqs)

    rows = read_csv_rows(csv_path, start) if (rank == 0 and args.resume is not None) else []
    if rank == 0:
        with open(csv_path, "w", newline="", encoding="utf-8") as f:  # rows after the checkpoint are dropped
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            w.writeheader()
            w.writerows(rows)
        z8 = cfg.get("zero8", {})
        print(corpus.describe())
        print(f"model: GPT d_model={args.d_model} n_layer={args.n_layer} n_head={args.n_head} seq_len={args.seq_len} "
              f"{'tied' if args.tie_weights else 'untied'} head, {n_params:,} parameters; param groups"
              f"{' of stage 0' if pipelined else ''}: "
              + ", ".join(f"{g['name']} {sum(p.numel() for p in g['params']):,} (weight decay {g['weight_decay']:g})"
                          for g in optimizer.param_groups))
        print(f"run: {world} rank(s)"
              + (f" ({args.pipeline_stages} pipeline stages x {dp} data-parallel ranks)" if pipelined else "")
              + f", {steps} steps of {batch} sequences ({tokens_per_step} tokens; micro-batch "
              f"{micro} x {gas} {'micro-batches per pipeline' if pipelined else 'accumulation per rank'}), config "
              f"{args.config} (zero8 "
              f"{'on' if z8 and z8.get('enabled', True) else 'off'}), "
              f"{os.environ.get('OMP_NUM_THREADS')} thread(s)/rank, {device} ({comm.backend})"
              + (f", resumed at step {start}" if start else ""), flush=True)

    progress = Progress(rank == 0, not args.no_progress, start, steps)
    t_run = time.perf_counter()
    elapsed_before = float(log_state.get("elapsed_s", 0.0))  # run time before the resume
    timer = {"t": t_run, "tokens": start * tokens_per_step}
    saved_step = -1

    def log_row(step: int, loss: float | None, val: float | None, lr: float | None, report: bool) -> None:
        """One CSV row (collective: gathers every rank's counters) and, when `report`, the report line."""
        now = time.perf_counter()
        tok_s = (step * tokens_per_step - timer["tokens"]) / max(now - timer["t"], 1e-9)
        timer["t"], timer["tokens"] = now, step * tokens_per_step
        cs = engine.comm_stats()
        sent = cs["bytes"] + cs.get("pipeline", {}).get("pipe_group_bytes", 0)
        mem = engine.memory_stats()  # on a GPU: the optimizer's buffers beside torch's peak (activations...)
        gpu_peak = mem["total"] + mem["torch_max_allocated"] if device.type == "cuda" else 0
        mine = json.dumps([sent, cs["gradient_bytes"], state_bytes, max_rss_mb(), gpu_peak]).encode()
        per_rank = [json.loads(b) for b in comm.all_gather_bytes(mine)] if world > 1 else [json.loads(mine)]
        if rank != 0:
            return
        row = {"step": step, "tokens": step * tokens_per_step, "loss": "" if loss is None else repr(loss),
               "val_loss": "" if val is None else repr(val), "lr": "" if lr is None else repr(lr),
               "tokens_per_s": f"{tok_s:.1f}" if loss is not None else "", "bytes_sent": sum(r[0] for r in per_rank),
               "gradient_bytes": sum(r[1] for r in per_rank), "state_bytes": sum(r[2] for r in per_rank),
               "max_rss_mb": f"{max(r[3] for r in per_rank):.1f}",
               "elapsed_s": f"{elapsed_before + now - t_run:.2f}"}
        with open(csv_path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=CSV_FIELDS).writerow(row)
        if report:
            progress.write(
                f"step {step}/{steps} | loss {'-' if loss is None else f'{loss:.4f}'} | "
                f"val {'-' if val is None else f'{val:.4f}'} | lr {'-' if lr is None else f'{lr:.2e}'} | "
                f"{'-' if loss is None else f'{tok_s:,.0f}'} tok/s | "
                f"state/rank {' '.join(fmt_bytes(r[2]) for r in per_rank)} | peak RSS/rank "
                f"{' '.join(f'{r[3]:.0f}MB' for r in per_rank)} | "
                + (f"peak GPU/rank {' '.join(fmt_bytes(r[4]) for r in per_rank)} | " if device.type == "cuda" else "")
                + f"sent/rank {' '.join(fmt_bytes(r[0]) for r in per_rank)}")

    def save(step_done: int) -> None:
        nonlocal saved_step
        if saved_step == step_done:
            return
        engine.save_checkpoint(save_dir, client_state={"data": {
            "next_step": step_done, "seed": args.seed, "corpus": corpus.fingerprint,
            "tokens": step_done * tokens_per_step, "seq_len": args.seq_len, "batch": batch}, "log": {
            "loss_sum": loss_sum, "loss_n": loss_n, "elapsed_s": elapsed_before + time.perf_counter() - t_run}})
        saved_step = step_done
        if rank == 0:
            progress.write(f"checkpoint saved: step {step_done} in {save_dir}")

    def validation_loss() -> float:
        if pipelined:
            return evaluate_pipeline(engine, corpus, val_offsets, args.seq_len, micro)
        return evaluate(engine, corpus, val_offsets, args.seq_len, rank, world, comm, micro)

    last_val = float("nan")
    if start == 0:  # the untrained model's validation loss (about ln 256 = 5.55)
        last_val = validation_loss()
        log_row(0, None, last_val, None, report=True)

    step, stopped_by = start, ""
    # The training losses of the steps since the last CSV row: saved with a checkpoint, so a resumed run
    # writes the same averages as an uninterrupted one.
    loss_sum, loss_n = float(log_state.get("loss_sum", 0.0)), int(log_state.get("loss_n", 0))
    while step < steps:
        # The global batch of this step; this rank's micro-batches are its rows.
        offsets = batch_offsets(args.seed, step, batch, corpus.train.numel(), args.seq_len)
        step_lr = engine.get_lr()[0]  # the lr this step applies
        micro_batches = (tuple(t.to(device) for t in sequences(corpus.train, offsets[lo:lo + micro], args.seq_len))
                         for lo in range(dp_rank * gas * micro, (dp_rank + 1) * gas * micro, micro))
        if pipelined:  # the global batch's mean loss, on every rank
            batch_loss = float(engine.train_batch(micro_batches))
        else:
            local = 0.0
            for x, y in micro_batches:
                loss = lm_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                local += float(loss.detach())
        step += 1
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)
        # One small collective per step: the mean loss of the global batch, and whether any rank was asked
        # to stop (so all of them save at this same boundary).
        if world > 1:
            total, stops = comm.all_reduce_f64([0.0 if pipelined else local, 1.0 if _stop_signal else 0.0], "sum")
        else:
            total, stops = (0.0 if pipelined else local), 1.0 if _stop_signal else 0.0
        step_loss = batch_loss if pipelined else total / (gas * world)
        loss_sum += step_loss
        loss_n += 1
        progress.update(step, step_loss, (step * tokens_per_step - timer["tokens"]) /
                        max(time.perf_counter() - timer["t"], 1e-9))

        evaluated = step % args.eval_interval == 0 or step == steps
        if evaluated:
            last_val = validation_loss()
        # No row of its own at a stop: the checkpoint carries the open window to the resumed run.
        if step % log_interval == 0 or evaluated or step == steps:
            log_row(step, loss_sum / loss_n, last_val if evaluated else None, step_lr,
                    report=step % log_interval == 0 or step == steps)
            loss_sum, loss_n = 0.0, 0
        if stops:
            stopped_by = _stop_signal or "a signal on another rank"
            break
        if args.save_interval and step % args.save_interval == 0 and step < steps:
            save(step)

    save(step)
    progress.close()
    elapsed = time.perf_counter() - t_run
    boundaries = engine.boundary_stats() if pipelined else []  # collective over each pipeline
    if rank == 0:
        if stopped_by:
            print(f"stopped by {stopped_by} after step {step}: checkpoint saved in {save_dir}; "
                  f"continue with --resume", flush=True)
        else:
            print(f"done: {step - start} steps{f' (from step {start})' if start else ''} in {elapsed:.1f} s "
                  f"({(step - start) * tokens_per_step / elapsed:,.0f} tokens/s); "
                  f"final validation loss {last_val:.4f}", flush=True)
        for b in boundaries:
            print(f"stages {b['boundary'][0]}-{b['boundary'][1]} (pipeline of data-parallel rank 0): "
                  f"{fmt_bytes(b['activation_bytes'])} of activations, {fmt_bytes(b['gradient_bytes'])} of their "
                  f"gradients ({b['bytes'] / b['fp32_bytes']:.4f} of fp32)", flush=True)
        if not args.no_plot:
            title = f"{Path(args.config).name}, {world} rank(s), {n_params:,} parameters"
            if write_plot(csv_path, png_path, title):
                print(f"log: {csv_path}, plot: {png_path}", flush=True)
            else:
                print(f"log: {csv_path} (no plot: matplotlib is not installed; pip install matplotlib)", flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
