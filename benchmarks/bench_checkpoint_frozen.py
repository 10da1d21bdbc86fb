"""The cost of a large frozen tensor in engine checkpoints, as in a LoRA-style job: a frozen embedding of
--mb megabytes (float32) and a small trained adapter. Times save_checkpoint and load_checkpoint and
measures each one's peak resident memory above what the process held before it (sampled every 2 ms from
/proc/self/statm, so a short spike may be missed by up to that much): all of it (RSS), and its anonymous
part, the memory the process allocated, without the pages of files it maps (which are the page cache,
shared by the ranks of a machine and dropped under memory pressure). --cold evicts the tag's files from
the page cache before each load (posix_fadvise DONTNEED by rank 0), so the load reads them from the disk.
Prints a table and a final JSON line.

    python benchmarks/bench_checkpoint_frozen.py --mb 300 [--cold]
    mpirun -np 2 python benchmarks/bench_checkpoint_frozen.py --mb 300 --dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time

import torch

import zero8
from zero8.engine import world_comm

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> tuple[int, int]:
    """Resident bytes: all, and anonymous (resident minus the file-backed and shared pages)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    resident, shared = int(fields[1]) * _PAGE, int(fields[2]) * _PAGE
    return resident, resident - shared


class PeakRss:
    """Peak resident bytes above the level at entry (all, and anonymous), sampled in a thread while the
    block runs."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._take()
            time.sleep(0.002)

    def _take(self) -> None:
        now = rss()
        self.peak = (max(self.peak[0], now[0]), max(self.peak[1], now[1]))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._take()
        self.above = self.peak[0] - self.base[0]
        self.anon_above = self.peak[1] - self.base[1]


def evict(tag_dir: str) -> None:
    """The files of a saved tag out of the page cache (they are synced: the save fsyncs them)."""
    for name in os.listdir(tag_dir):
        fd = os.open(os.path.join(tag_dir, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Lora(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, rank: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.embed.weight.requires_grad_(False)
        self.down = torch.nn.Linear(dim, rank, bias=False)
        self.up = torch.nn.Linear(rank, dim, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return h + self.up(self.down(h))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=300.0, help="size of the frozen embedding (MB, float32)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one, removed)")
    ap.add_argument("--repeat", type=int, default=3, help="saves and loads; the fastest of each is reported")
    ap.add_argument("--cold", action="store_true", help="load from the disk, not from the page cache")
    args = ap.parse_args()
    torch.manual_seed(0)
    vocab = int(args.mb * 1e6 / 4 / args.dim)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
           "zero8": {"enabled": True}, "steps_per_print": 1 << 30}
    engine, _, _, _ = zero8.initialize(model=Lora(vocab, args.dim, 8), config=cfg)
    ids = torch.randint(0, vocab, (4, 16))
    engine.backward(engine(ids).square().mean())
    engine.step()
    rank0 = engine.global_rank == 0
    own_dir = args.dir is None
    root = tempfile.mkdtemp(prefix="zero8-bench-ckpt-") if own_dir and rank0 else args.dir
    if own_dir and engine.world_size > 1:  # every rank must use rank 0's directory
        root = world_comm().all_gather_bytes((root or "").encode())[0].decode()
    def measured(call) -> tuple:
        """(seconds, peak RSS above the start in MB, its anonymous part in MB) of one call."""
        t0 = time.perf_counter()
        with PeakRss() as m:
            call()
        return time.perf_counter() - t0, m.above / 1e6, m.anon_above / 1e6

    saves, loads = [], []
    try:
        for i in range(args.repeat):
            saves.append(measured(lambda: engine.save_checkpoint(root, tag=f"t{i}")))
            if args.cold and rank0:  # the other ranks wait for rank 0 inside the load
                evict(os.path.join(root, f"t{i}"))
            loads.append(measured(lambda: engine.load_checkpoint(root, tag=f"t{i}")))
    finally:
        if own_dir and rank0:
            shutil.rmtree(root, ignore_errors=True)
    (save_s, save_mb, save_anon_mb), (load_s, load_mb, load_anon_mb) = zip(*saves), zip(*loads)
    frozen_mb = engine.module.embed.weight.numel() * 4 / 1e6
    result = {"rank": engine.global_rank, "world": engine.world_size, "frozen_mb": round(frozen_mb, 1),
              "cold": args.cold,
              "save_s": round(min(save_s), 3), "save_peak_rss_mb": round(min(save_mb), 1),
              "save_peak_anon_mb": round(min(save_anon_mb), 1),
              "load_s": round(min(load_s), 3), "load_peak_rss_mb": round(min(load_mb), 1),
              "load_peak_anon_mb": round(min(load_anon_mb), 1)}
    print(f"rank {result['rank']}/{result['world']}: frozen {frozen_mb:.0f} MB | save {result['save_s']:.3f} s, "
          f"peak RSS +{result['save_peak_rss_mb']:.0f} MB (anonymous +{result['save_peak_anon_mb']:.0f} MB) | "
          f"load {result['load_s']:.3f} s, peak RSS +{result['load_peak_rss_mb']:.0f} MB (anonymous "
          f"+{result['load_peak_anon_mb']:.0f} MB){' from the disk' if args.cold else ''} (best of {args.repeat})",
          flush=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
