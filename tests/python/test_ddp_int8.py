"""zero8.ddp's int8 gradient hook for DistributedDataParallel on real ranks: dist/dist_ddp.py under torchrun at 2
and 3 ranks over gloo, on one GPU over NCCL, and on 2 ranks sharing one GPU over gloo (NCCL refuses them)."""

from __future__ import annotations

import pytest

from mpirun_util import pytest_under_launcher

pytestmark = pytest.mark.slow  # conftest.py starts such files first


@pytest.mark.parametrize("np", [2, 3])
def test_ddp_int8_gradients_on_ranks(tmp_path, np):
    assert pytest_under_launcher(np, "dist_ddp.py", tmp_path, timeout=300, launcher="torchrun") == 6


@pytest.mark.cuda
def test_ddp_int8_gradients_on_one_gpu(tmp_path):
    assert pytest_under_launcher(1, "dist_ddp.py", tmp_path, timeout=300, launcher="torchrun",
                                 ZERO8_DDP_DEVICE="cuda") == 6


@pytest.mark.cuda
def test_ddp_int8_gradients_on_two_ranks_sharing_a_gpu(tmp_path):
    assert pytest_under_launcher(2, "dist_ddp.py", tmp_path, timeout=300, launcher="torchrun",
                                 ZERO8_DDP_DEVICE="cuda", ZERO8_TORCH_BACKEND="gloo") == 6
