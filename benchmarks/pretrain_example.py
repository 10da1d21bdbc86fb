"""examples/pretrain_gpt.py loaded as a module, for the benchmarks that train its GPT (bench_memory_limit.py,
bench_overlap.py, vs_deepspeed_worker.py). They run as scripts (python3 path, mpirun, zero8-launch, torchrun),
so this directory is first on their sys.path and `from pretrain_example import load_example` finds it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt.py"


def load_example():
    """examples/pretrain_gpt.py as a module: its GPT, corpus, batches, loss and evaluation."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
