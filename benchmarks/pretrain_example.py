"""examples/pretrain_gpt.py loaded as a module, for the benchmarks that train its GPT (bench_memory_limit.py,
bench_overlap.py, vs_deepspeed_worker.py). They run as scripts (python3 path, mpirun, zero8-launch, torchrun),
so this directory is first on their sys.path and `from pretrain_example import load_example` finds it.
Also how their ranks on torch.distributed end (gloo_rank_exit: DeepSpeed's, bench_fsdp2.py's and
tests/python/deepspeed_worker.py's).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt.py"


def load_example():
    """examples/pretrain_gpt.py as a module: its GPT, corpus, batches, loss and evaluation."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gloo_rank_exit() -> None:
    """Ends a rank of a torch.distributed job (DeepSpeed's, FSDP2's, DDP's) once its result is written. Such
    a rank on CPU sometimes aborts while the interpreter exits ("terminate called without an active exception": a gloo worker thread
    frees a finished collective's tensor, whose Python object needs the GIL, and exits the thread through
    C++ code that may not throw), after its work and its result; its launcher then reports the run as
    failed. So once every rank is past its write (a barrier), the rank leaves without running
    those destructors. Not for zero8's ranks: mpirun expects them to reach MPI_Finalize."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
