"""For the multi-rank runs of the tests here: each rank writes its pytest outcome to
$ZERO8_DIST_RESULTS/rank<R>.txt ("<exit status> <tests collected> <tests failed>"), which
mpirun_util.py reads instead of parsing the ranks' interleaved output."""

from __future__ import annotations

import os
from pathlib import Path


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("ZERO8_DIST_RESULTS")
    if not out:
        return
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", os.environ.get("RANK", "0")))
    Path(out, f"rank{rank}.txt").write_text(f"{int(exitstatus)} {session.testscollected} {session.testsfailed}\n")
