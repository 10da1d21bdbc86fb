"""A rank that dies in the middle of the pipeline schedule (run by test_pipe_dist.py under mpirun -np 4:
2 stages x 2 data-parallel ranks). World rank 3 (stage 1, data-parallel rank 1) kills itself with SIGKILL
in the forward of the second micro-batch of its second batch, while its neighbours wait for it in
send/recv and its data-parallel peer in the gradient reduction. Every other rank must fail with an error
naming it; each writes "<seconds from the death> <its error>" to $ZERO8_PIPE_DIE_OUT/rank<r>.txt.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zero8  # noqa: E402
from zero8.engine import world_comm  # noqa: E402
from zero8.pipe import PipelineModule  # noqa: E402
from engine_util import EXACT, config, make_data  # noqa: E402
from pipe_util import micro_batches, mse, regression_layers  # noqa: E402

torch.set_num_threads(1)
WORLD = world_comm("auto")
OUT = Path(os.environ["ZERO8_PIPE_DIE_OUT"])
STATE = {"batch": 0, "micro": 0}


class DieOnRank3(nn.Module):
    def forward(self, x):
        if WORLD.rank == 3 and STATE["batch"] == 1:
            STATE["micro"] += 1
            if STATE["micro"] == 2:
                (OUT / "death").write_text(f"{time.time()}")
                os.kill(os.getpid(), signal.SIGKILL)
        return x


layers = regression_layers()
layers.insert(5, DieOnRank3())  # on stage 1 (8 layers, uniform)
model = PipelineModule(layers, num_stages=2, loss_fn=mse, partition_method="uniform", seed_layers=True,
                       device="cpu")
engine, _, _, _ = zero8.initialize(model=model, config=config(gas=4, zero8=EXACT))
data = make_data()
try:
    for step in range(3):
        STATE["batch"] = step
        engine.train_batch(micro_batches(data, step, 32, engine._dp.rank, 2, 4))
    message = "no error"
except zero8.Zero8CommError as e:
    message = f"{type(e).__name__}: {e}"
death = OUT / "death"
since = time.time() - float(death.read_text()) if death.exists() else -1.0
(OUT / f"rank{WORLD.rank}.txt").write_text(f"{since:.3f} {message}\n")
sys.exit(1)
