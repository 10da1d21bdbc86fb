"""Runs the multi-rank engine tests (tests/python/dist/dist_engine.py) under mpirun with 2 and 4 ranks and
under torchrun with 2 (the tcp backend), as real processes, and checks that every rank passed every test (mpirun_util.py: how).
"""

from __future__ import annotations

import pytest
import torch

from engine_util import make_data, reference
from mpirun_util import pytest_under_launcher

pytestmark = pytest.mark.slow  # conftest.py starts such files first


@pytest.fixture(scope="module")
def reference_file(tmp_path_factory):
    """torch AdamW's reference run, computed once for every rank (dist_engine.py's STEPS and B)."""
    path = tmp_path_factory.mktemp("engine_ref") / "reference.pt"
    torch.save(reference(make_data(), 30, 32), path)
    return path


@pytest.mark.parametrize("launcher, np", [("mpirun", 2), ("mpirun", 4), ("torchrun", 2)])
def test_engine_on_ranks(launcher, np, reference_file, tmp_path):
    """The same tests under torchrun run over the tcp backend (no MPI), and give the same bits: the
    reductions fold in rank order on both."""
    collected = pytest_under_launcher(np, "dist_engine.py", tmp_path, launcher=launcher,
                                      ZERO8_ENGINE_REF=reference_file)
    assert collected >= 10, collected
