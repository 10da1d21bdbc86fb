"""pytest setup for the zero8 Python tests: they run against the installed package (scripts/python_setup.sh
runs `pip install .`), so a session first checks that the installed Python sources are the ones in
bindings/python/zero8 and stops with the reinstall command when they are not (a stale install would test
old code without saying so). Shared fixtures: the test data directory and small helpers.
"""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

# Passive OpenMP waiting, as the C++ tests do (tests/CMakeLists.txt): spinning worker threads of zero8's
# kernels and torch's would starve each other on a small shared machine. Must precede loading either.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SOURCE_PACKAGE = ROOT / "bindings" / "python" / "zero8"
DATA_DIR = ROOT / "tests" / "data"
REINSTALL = f"bash {ROOT}/scripts/python_setup.sh --test  (or: python3 -m pip install --no-build-isolation '{ROOT}[test]')"


def _stale_files(installed: Path) -> list[str]:
    """Python sources that differ between the source tree and the installed package."""
    if installed.resolve() == SOURCE_PACKAGE.resolve():  # editable install: nothing to compare
        return []
    stale = []
    for src in sorted(SOURCE_PACKAGE.rglob("*.py")):
        rel = src.relative_to(SOURCE_PACKAGE)
        dst = installed / rel
        if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
            stale.append(str(rel))
    return stale


def pytest_configure(config):
    try:
        import zero8
    except ImportError as e:
        pytest.exit(f"zero8 is not installed ({e}); install it with: {REINSTALL}", returncode=4)
    installed = Path(zero8.__file__).resolve().parent
    stale = _stale_files(installed)
    if stale and os.environ.get("ZERO8_ALLOW_STALE") != "1":
        pytest.exit(
            f"the installed zero8 ({installed}) is older than the sources: {', '.join(stale)} differ; "
            f"reinstall with: {REINSTALL}  (ZERO8_ALLOW_STALE=1 runs anyway)",
            returncode=4,
        )


def pytest_collection_modifyitems(config, items):
    """Files marked slow (minutes of multi-rank runs) come first, each file's tests in their order: parallel
    workers (scripts/test.sh: pytest-xdist, whole files) then start the longest early rather than finish on one
    alone. Tests marked cuda skip, with the reason, where there is no CUDA device or zero8 has no CUDA kernels."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    import torch
    import zero8

    if not torch.cuda.is_available():
        why = "no CUDA device on this machine"
    elif not zero8.build_info()["cuda"]:
        why = "zero8 was built without CUDA kernels (pip install . -C cmake.define.ZERO8_CUDA=ON)"
    else:
        return
    for item in cuda_items:
        item.add_marker(pytest.mark.skip(reason=why))


def pytest_report_header(config):
    import zero8

    return f"zero8 {zero8.__version__} from {Path(zero8.__file__).parent}, build {zero8.build_info()}"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA_DIR
