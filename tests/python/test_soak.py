"""The short form of the kill-and-resume soak (tests/python/soak_kill_resume.py): the pretraining example on 2
ranks, one rank killed with SIGKILL at random moments (steps, saves, the start) and the job resumed from
`latest` each time; every checkpoint left must verify, and the end must equal an uninterrupted run bit for
bit. The long form and its figures: docs/FAILURES.md.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import zero8

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak_kill_resume  # noqa: E402

pytestmark = pytest.mark.slow  # conftest.py starts such files first

KILLS, STEPS, SAVE_INTERVAL = 3, 40, 5


def test_kills_at_random_moments_lose_no_checkpoint_and_resume_bit_exactly(tmp_path):
    if not zero8.build_info()["mpi"]:
        pytest.skip("zero8 was built without MPI: no multi-rank backend")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (scripts/setup.sh installs OpenMPI)")
    figures = soak_kill_resume.soak(tmp_path / "soak", kills=KILLS, steps=STEPS, save_interval=SAVE_INTERVAL,
                                    seed=1)
    assert figures["kills"] == KILLS
    assert figures["tags_verified"] >= KILLS
    assert figures["tensors_compared"] > 0
