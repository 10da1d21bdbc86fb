"""The device options of zero8._C's sharded optimizer and communicator: ShardConfig.memory and .stream,
Communicator.stream, the checkpoint copies (part_bytes, copy_to_host, copy_from_host) on either memory,
and the errors a device request gives without CUDA (this build or this machine). On a GPU with a CUDA
build, a device optimizer steps as the host one does, bit for bit, through its zero-copy device views.
"""

from __future__ import annotations

import pytest
import torch

import zero8
from zero8 import _C

SPECS = [("w", [64, 80]), ("b", [80]), ("w2", [5000])]
PARTS = ["working", "master", "codes1", "absmax1", "codes2", "absmax2", "state1", "state2", "residual"]


def config(**kw) -> _C.ShardConfig:
    cfg = _C.ShardConfig(algo=_C.Algo.adamw, bits=8, stage=2, reduce_bucket_size=4096, error_feedback=True, **kw)
    cfg.hyper.lr = 1e-2
    return cfg


def optimizer(cfg: _C.ShardConfig) -> _C.ShardedOptimizer:
    return _C.ShardedOptimizer([_C.ParamSpec(n, s) for n, s in SPECS], cfg, _C.comm_create("single"))


def cuda_usable() -> bool:
    return bool(_C.build_info()["cuda"]) and torch.cuda.is_available()


def test_config_fields_round_trip():
    cfg = config()
    assert cfg.memory == "host" and cfg.stream == 0
    cfg.memory, cfg.stream = "device", 12345
    assert (cfg.memory, cfg.stream) == ("device", 12345)
    assert "memory='device'" in repr(cfg) and "stream=12345" in repr(cfg)
    with pytest.raises(zero8.Zero8ValueError, match="'memory'"):
        cfg.memory = "gpu"


def test_host_memory_refuses_a_stream():
    with pytest.raises(zero8.Zero8ValueError, match="invalid argument 'stream'"):
        optimizer(config(stream=1))


@pytest.mark.skipif(cuda_usable(), reason="CUDA is usable here: test_device_optimizer_equals_host covers it")
def test_device_requests_without_cuda_say_why():
    with pytest.raises(zero8.Zero8NotSupportedError, match=r"ShardedOptimizer \(ShardConfig::memory = device\)"):
        optimizer(config(memory="device"))
    c = _C.comm_create("single")
    assert c.stream == 0
    c.stream = 0
    with pytest.raises(zero8.Zero8NotSupportedError, match="Communicator::set_stream"):
        c.stream = 1


def test_checkpoint_copies_of_a_host_optimizer():
    opt = optimizer(config())
    assert opt.part_bytes(0, "codes1") == opt.part_range(0)[1]
    assert opt.part_bytes(0, "state1") == 0 and opt.part_bytes(1, "codes1") == 0
    # error_feedback is on, but one rank quantizes no gradients and keeps no residual (sharded.h, WirePlan).
    assert opt.part_bytes(0, "residual") == 0 and opt.copy_to_host(0, "residual") == b""
    assert opt.wire == {"gradients": "f32", "int8_params": False, "error_feedback": False}
    master = opt.copy_to_host(0, "master")
    assert master == bytes(opt.master_values(0))
    changed = bytes((b + 1) % 256 for b in master)
    opt.copy_from_host(0, "master", changed)
    assert bytes(opt.master_values(0)) == changed
    with pytest.raises(zero8.Zero8ValueError, match="'data'"):
        opt.copy_from_host(0, "master", changed[:-4])
    with pytest.raises(zero8.Zero8ValueError, match="unknown part 'moment'"):
        opt.part_bytes(0, "moment")
    with pytest.raises(zero8.Zero8ValueError, match="device_buffer is for a device optimizer"):
        opt.device_buffer("working", 0)


def fill(opt, views_of, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for i, (_, shape) in enumerate(SPECS):
        group, offset, numel = opt.param_slot(i)
        views_of(group)[offset:offset + numel] = (torch.randn(numel, generator=g) * 0.1).to(views_of(group).device)


def test_buffer_views_export_through_dlpack_keeping_their_owner_alive():
    """A DeviceBufferView is what torch.from_dlpack wraps a device optimizer's buffer with (the engine's
    parameters are such views): checked here over host memory, where no GPU is. The tensor is the buffer itself
    (the same bytes, written through), holds the view's owner while it lives, and lets go of it when freed, as
    does a capsule nobody consumed."""
    import sys

    class Owner:  # what keeps the memory valid (the optimizer, for its device buffers)
        def __init__(self):
            self.memory = torch.arange(16, dtype=torch.float32)

    owner = Owner()
    base = sys.getrefcount(owner)
    view = _C._host_buffer_view(owner, owner.memory.data_ptr(), 64)
    assert (view.nbytes, view.ptr, view.device, view.__dlpack_device__()) == (64, owner.memory.data_ptr(), -1, (1, 0))
    t = torch.from_dlpack(view)
    assert (t.dtype, tuple(t.shape), t.data_ptr()) == (torch.uint8, (64,), owner.memory.data_ptr())
    t.view(torch.float32)[3] = -1.0
    assert owner.memory[3].item() == -1.0 and torch.equal(t.view(torch.float32), owner.memory)
    del view
    assert sys.getrefcount(owner) == base + 1  # the tensor's reference
    del t
    assert sys.getrefcount(owner) == base
    capsule = _C._host_buffer_view(owner, owner.memory.data_ptr(), 64).__dlpack__(stream=None)
    assert sys.getrefcount(owner) == base + 1
    del capsule
    assert sys.getrefcount(owner) == base
    with pytest.raises(zero8.Zero8ValueError, match="nbytes"):
        _C._host_buffer_view(owner, owner.memory.data_ptr(), -1)


@pytest.mark.cuda  # scripts/gpu_check.sh selects the GPU tests with -m cuda
@pytest.mark.skipif(not cuda_usable(), reason="needs a CUDA build of zero8 and a GPU")
def test_device_optimizer_equals_host():
    stream = torch.cuda.Stream()
    host = optimizer(config())
    dev = optimizer(config(memory="device", stream=stream.cuda_stream))
    hw = [torch.frombuffer(host.working_buffer(g), dtype=torch.float32) for g in range(_C.NUM_GROUPS)]
    hg = [torch.frombuffer(host.grad_buffer(g), dtype=torch.float32) for g in range(_C.NUM_GROUPS)]
    dw = [torch.from_dlpack(dev.device_buffer("working", g)).view(torch.float32)
          for g in range(_C.NUM_GROUPS)]
    dg = [torch.from_dlpack(dev.device_buffer("grad", g)).view(torch.float32)
          for g in range(_C.NUM_GROUPS)]
    with torch.cuda.stream(stream):
        fill(host, lambda g: hw[g], 1)
        fill(dev, lambda g: dw[g], 1)
        host.init()
        dev.init()
        for step in range(3):
            fill(host, lambda g: hg[g], 10 + step)
            fill(dev, lambda g: dg[g], 10 + step)
            for i in reversed(range(len(SPECS))):
                host.grad_ready(i)
                dev.grad_ready(i)
            host.backward_end(True)
            dev.backward_end(True)
            assert host.step() == dev.step()
    for g in range(_C.NUM_GROUPS):
        for part in PARTS:
            assert host.copy_to_host(g, part) == dev.copy_to_host(g, part), (g, part)
    with pytest.raises(zero8.Zero8ValueError, match="working_buffer: this optimizer's buffers are device memory"):
        dev.working_buffer(0)
