"""The guard of the deferred parameter all-gather (zero8/engine/gather.py), without communication: after
arm(), the first touch of each parameter, wherever it happens, waits for that parameter's piece (recorded
by a stand-in engine) and makes it a plain Parameter again; parameters nobody touched stay armed. The real
gather on several ranks: tests/python/dist/dist_engine.py."""

from __future__ import annotations

import copy
import io
import pickle
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from zero8.engine import gather


class Recorder:
    """The engine's side of the guard: which parameter indices were waited for, in order."""

    def __init__(self):
        self.waited = []

    def _wait_param(self, i: int) -> None:
        self.waited.append(i)


class Parent(torch.nn.Module):
    """A parent that reads its child's weight outside the child's forward (a sliced position table)."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Embedding(16, 4)
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.proj(x + self.pos.weight[: x.shape[0]])


def armed(model):
    params = list(model.parameters())
    engine = Recorder()
    cls = gather.gathering_class(engine, params)
    gather.arm(params, cls)
    return engine, params


def plain(p) -> bool:
    return type(p) is torch.nn.Parameter


def test_arm_keeps_the_tensor_and_its_parameter_identity():
    model = Parent()
    before = [(id(p), p.data_ptr(), p.requires_grad) for p in model.parameters()]
    _, params = armed(model)
    assert all(isinstance(p, torch.nn.Parameter) and not plain(p) for p in params)
    assert [id(p) for p in model.parameters()] == [b[0] for b in before]
    gather.disarm(params)
    assert all(plain(p) for p in params)
    assert [(id(p), p.data_ptr(), p.requires_grad) for p in params] == before


def test_a_forward_waits_for_each_parameter_at_its_first_use():
    model = Parent()
    engine, params = armed(model)
    y = model(torch.randn(5, 4))
    # pos.weight (index 0) is read by the parent before proj runs: waited first, then proj's weight and bias
    assert engine.waited == [0, 1, 2]
    assert all(plain(p) for p in params)
    y.sum().backward()
    assert all(p.grad is not None and type(p.grad) is torch.Tensor for p in params)
    model(torch.randn(5, 4))
    assert engine.waited == [0, 1, 2]  # plain again: no more waits


@pytest.mark.parametrize("read", [
    lambda p: p.data.clone(),
    lambda p: p.detach().norm(),
    lambda p: p[0],
    lambda p: p.shape,
    lambda p: p.sum().item(),
    lambda p: torch.zeros_like(p).add_(p, alpha=0.1),  # an EMA's update
    lambda p: torch._foreach_norm([p]),
    lambda p: repr(p),
], ids=["data", "detach", "index", "shape", "item", "ema", "foreach", "repr"])
def test_any_read_outside_a_forward_waits_for_just_that_parameter(read):
    model = Parent()
    engine, params = armed(model)
    read(model.proj.weight)
    assert engine.waited == [1]
    assert plain(model.proj.weight) and not plain(model.pos.weight) and not plain(model.proj.bias)


def test_state_dict_save_deepcopy_and_pickle_wait_and_give_plain_parameters():
    model = Parent()
    engine, params = armed(model)
    sd = model.state_dict()
    assert sorted(engine.waited) == [0, 1, 2] and all(type(v) is torch.Tensor for v in sd.values())
    engine, params = armed(model)
    torch.save(model, io.BytesIO())
    assert sorted(engine.waited) == [0, 1, 2]
    engine, params = armed(model)
    twin = copy.deepcopy(model)
    assert sorted(engine.waited) == [0, 1, 2]
    twin(torch.randn(2, 4))  # a copy knows no piece to wait for: it settles without a wait
    assert all(plain(p) for p in twin.parameters()) and sorted(engine.waited) == [0, 1, 2]
    engine, params = armed(model)
    back = pickle.loads(pickle.dumps(model.proj.weight))
    assert plain(back) and engine.waited == [1]


def test_a_parameter_outliving_its_engine_settles_without_waiting():
    model = Parent()
    engine, params = armed(model)
    del engine
    model(torch.randn(3, 4))
    assert all(plain(p) for p in params)


def test_only_plain_parameters_are_armed():
    class Marked(torch.nn.Parameter):
        pass

    lin = torch.nn.Linear(2, 2)
    lin.weight = Marked(lin.weight.detach())
    params = list(lin.parameters())
    assert gather.unguardable(params) == [0]
    gather.arm(params, gather.gathering_class(Recorder(), params))
    assert type(lin.weight) is Marked and not plain(lin.bias)


def test_functional_calls_with_keyword_tensors_wait_too():
    model = Parent()
    engine, params = armed(model)
    F.linear(torch.randn(1, 4), weight=model.proj.weight, bias=model.proj.bias)
    assert engine.waited == [1, 2]


def test_a_second_thread_touching_a_parameter_while_the_first_waits_waits_too():
    class Slow(Recorder):
        def __init__(self):
            super().__init__()
            self.go = threading.Event()

        def _wait_param(self, i: int) -> None:
            self.waited.append(i)
            assert self.go.wait(30)

    model = Parent()
    params = list(model.parameters())
    engine = Slow()
    gather.arm(params, gather.gathering_class(engine, params))
    first = threading.Thread(target=lambda: model.proj.weight.sum())
    first.start()
    while not engine.waited:
        time.sleep(0.001)
    second = threading.Thread(target=lambda: model.proj.weight.sum())
    second.start()
    while len(engine.waited) < 2 and second.is_alive():
        time.sleep(0.001)
    engine.go.set()
    first.join()
    second.join()
    assert engine.waited == [1, 1] and plain(model.proj.weight)


def test_a_compiled_module_waits_and_gives_the_eager_result():
    # torch.compile: the compiled call waits for every parameter it uses, computes what eager does (one
    # more graph for the swapped class), and the parameters end plain.
    model = Parent()
    compiled = torch.compile(model)
    x = torch.randn(5, 4)
    want = model(x)
    for _ in range(3):
        engine, params = armed(model)
        got = compiled(x)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6) and sorted(set(engine.waited)) == [0, 1, 2]
        assert all(plain(p) for p in params)
