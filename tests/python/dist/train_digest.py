"""One short training run of the full 8-bit engine (8-bit states, int8 gradients and parameter updates,
ZeRO-2 with the reductions overlapping backward), for test_torchrun.py to run under mpirun and under
torchrun and compare: rank 0 writes the losses, the weights' SHA-256 and the backend to
$ZERO8_DIGEST_OUT/<name>.json, after checking that every rank holds the same weights.

    python3 train_digest.py NAME [STEPS]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engine_util

import zero8  # noqa: E402
from zero8.engine import world_comm  # noqa: E402
from engine_util import FULL8, config, make_data, make_model, train_engine  # noqa: E402


def main() -> None:
    name, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
    torch.set_num_threads(1)
    engine, _, _, _ = zero8.initialize(model=make_model(0), config=config(zero8=dict(FULL8), zero_optimization={
        "stage": 2, "overlap_comm": True, "reduce_bucket_size": 2048}))
    world = world_comm()
    losses = train_engine(engine, make_data(), steps, 32, rank=world.rank, world=world.size)
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    digests = world.all_gather_bytes(h.digest())
    losses = world.all_reduce_f64(losses, "sum")
    if world.rank == 0:
        out = {"backend": world.backend, "size": world.size, "replicas_equal": len(set(digests)) == 1,
               "digest": h.hexdigest(), "losses": losses}
        Path(os.environ["ZERO8_DIGEST_OUT"], f"{name}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
