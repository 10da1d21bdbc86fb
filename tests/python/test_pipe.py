"""zero8.pipe and the pipeline engine in one process: the 1F1B schedule (every shape simulated against
blocking send/recv), DeepSpeed's partition methods and topology, layer building and seeds, a one-stage
pipeline against the plain engine (bit for bit, 8-bit states included: one stage has the whole model's
layout), the engine's errors and its checkpoints. Multi-rank runs: test_pipe_dist.py.
"""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch
from torch import nn

import zero8
import zero8.engine.device
import zero8.engine.world
from engine_util import EXACT, FULL8, config, make_data
from pipe_util import lm_layers, lm_loss, make_tokens, micro_batches, mse, regression_layers, train_plain
from zero8.config import load_config
from zero8.engine import PipelineEngine
from zero8.engine.pipeline import _to_device
from zero8.engine.training import Zero8Engine
from zero8.engine.world import world_comm
from zero8.pipe import (
    LayerModule,
    LayerSpec,
    PipeDataParallelTopology,
    PipelineError,
    PipelineModule,
    TiedLayerSpec,
    partition_balanced,
    partition_uniform,
)
from zero8.pipe import schedule as sched
from zero8.pipe.p2p import StageLink, Structure

B = 32


# ---- the schedule ----
@pytest.mark.parametrize("stages", range(1, 9))
def test_1f1b_schedule_never_deadlocks_and_runs_every_micro_batch_once(stages):
    for micro in range(1, 13):
        programs = [sched.train_schedule(s, stages, micro) for s in range(stages)]
        sched.simulate(programs, ((0, stages - 1),) if stages > 1 else ())
        sched.simulate([sched.eval_schedule(s, stages, micro) for s in range(stages)])
        for s, prog in enumerate(programs):
            fwd = [i.micro for i in prog if i.kind == sched.FORWARD]
            bwd = [i.micro for i in prog if i.kind == sched.BACKWARD]
            assert fwd == bwd == list(range(micro))
            assert prog[-1] == sched.Instruction(sched.STEP)
            # 1F1B: a stage holds at most stages - s micro-batches' activations at once.
            live, most = 0, 0
            for i in prog:
                live += (i.kind == sched.FORWARD) - (i.kind == sched.BACKWARD)
                most = max(most, live)
            assert most <= min(stages - s, micro)


def test_the_schedule_deadlocks_without_the_parity_order(monkeypatch):
    # The simulator catches what the even/odd ordering prevents: both neighbours sending first.
    monkeypatch.setattr(sched, "_pair", lambda stage, send, recv: [send, recv])
    with pytest.raises(RuntimeError, match="deadlock"):
        sched.simulate([sched.train_schedule(s, 2, 4) for s in range(2)])


# ---- partitions and topology ----
def test_partition_methods_follow_deepspeeds_meaning():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]  # DeepSpeed: the first parts take the remainder
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]
    # Balanced: the largest stage as small as possible, every stage non-empty.
    assert partition_balanced([1, 1, 1, 10, 1, 1], 3) == [0, 3, 4, 6]
    assert partition_balanced([5, 5, 5, 5], 2) == [0, 2, 4]
    parts = partition_balanced([0, 1, 0, 1, 0, 1, 0, 1], 4)
    assert all(b > a for a, b in zip(parts, parts[1:])) and parts[0] == 0 and parts[-1] == 8
    with pytest.raises(ValueError, match="3 layer"):
        partition_balanced([1, 1, 1], 4)


def test_pipe_data_topology_is_stage_major():
    t = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert t.world_size() == 6 and t.get_dim("pipe") == 2 and t.get_dim("data") == 3 and t.get_dim("model") == 0
    assert t.get_rank(pipe=1, data=2) == 5 and t.get_coord(4) == t.ProcessCoord(pipe=1, data=1)
    assert t.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]  # a stage's data-parallel ranks
    assert t.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]  # one pipeline per data-parallel rank
    assert t.filter_match(pipe=0) == [0, 1, 2] and t.get_axis_list("data", 0) == [0, 3]
    with pytest.raises(ValueError, match="outside"):
        t.get_rank(pipe=2, data=0)


def test_partition_method_type_balances_the_matching_layers():
    layers = [LayerSpec(nn.Embedding, 8, 4), *[LayerSpec(nn.Linear, 4, 4) for _ in range(4)], LayerSpec(nn.LayerNorm, 4)]
    m = PipelineModule(layers, num_stages=1, partition_method="type:linear")
    assert m.parts == [0, 6] and m.stage_id == 0 and m.num_pipeline_stages() == 1
    with pytest.raises(ValueError, match="no layer's class name matches"):
        PipelineModule(layers, num_stages=1, partition_method="type:Conv2d")
    with pytest.raises(ValueError, match="not one of"):
        PipelineModule(layers, num_stages=1, partition_method="best")


# ---- building layers ----
def test_layer_module_and_a_one_stage_pipeline_build_the_same_model():
    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    a = LayerModule(lm_layers(), loss_fn=lm_loss, seed_layers=True)
    after = torch.rand(3)
    assert torch.equal(before, after)  # seeded building leaves the caller's RNG stream alone
    b = PipelineModule(lm_layers(), num_stages=1, loss_fn=lm_loss, seed_layers=True, device="cpu")
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "tied_modules.embed.weight" in sa and "1.fc.weight" in sa
    # The tied module is one module, used by the first and the last layer.
    assert a.forward_funcs[0] is a.tied_modules["embed"] and a.forward_funcs[-1].func.__name__ == "tied_head"
    x, y = make_tokens()
    assert torch.isfinite(lm_loss(a(x[:4]), y[:4]))


def test_tied_weight_attr_must_name_parameters_and_specs_must_be_modules():
    with pytest.raises(ValueError, match="tied_weight_attr"):
        LayerModule([TiedLayerSpec("e", nn.Embedding, 4, 4, tied_weight_attr="bias")])
    with pytest.raises(TypeError, match="not a torch.nn.Module class"):
        LayerSpec(lambda: None)
    with pytest.raises(ValueError, match="num_stages or topology"):
        PipelineModule(regression_layers())
    with pytest.raises(ValueError, match="must divide the world size"):
        PipelineModule(regression_layers(), num_stages=2)  # one process here
    with pytest.raises(ValueError, match="2 stages but only 1 layer"):
        PipelineModule(regression_layers()[:1], num_stages=2)
    with pytest.raises(ValueError, match=r"stage 0 \(layers 0..1\) holds no trainable parameters"):
        zero8.initialize(model=PipelineModule([nn.Tanh(), nn.Tanh()], num_stages=1), config=config(zero8=EXACT))


def test_a_pipeline_module_makes_the_world_for_this_ranks_gpu_and_moves_there(monkeypatch):
    """Where a GPU is, the world is asked for with the rank's device, as zero8.init_distributed() does (NCCL
    where each rank has a GPU), not for the host, which initialize would get back for the GPU model; the
    stage goes to that device, as DeepSpeed's PipelineModule moves itself to cuda:LOCAL_RANK. Stood in for:
    the GPU by the meta device (a module moves there without one), the world by a recorder."""
    asked = []
    real = zero8.engine.world.world_comm

    def recorder(backend="auto", device=None, **kw):
        asked.append((backend, device))
        return real(backend, **kw)

    monkeypatch.setattr(zero8.engine.world, "world_comm", recorder)
    monkeypatch.setattr(zero8._tensors, "CUDA_BUILT", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(zero8.engine.device, "local_device", lambda: torch.device("meta"))
    gpu = PipelineModule(regression_layers(), num_stages=1, loss_fn=mse)
    cpu = PipelineModule(regression_layers(), num_stages=1, loss_fn=mse, device="cpu")
    assert asked == [("auto", torch.device("meta")), ("auto", torch.device("cpu"))]
    assert {p.device.type for p in gpu.parameters()} == {"meta"}
    assert {p.device.type for p in cpu.parameters()} == {"cpu"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    PipelineModule(regression_layers(), num_stages=1, loss_fn=mse)
    assert asked[-1] == ("auto", torch.device("cpu"))


def test_micro_batches_keep_their_structure_on_the_stages_device():
    """Inputs and labels go to the stage's device as they came: tensors, tuples and lists of them, other values
    left as they are (the CPU here; on a GPU the next test)."""
    x, y = torch.randn(3, 4), torch.arange(5)
    got = _to_device((x, [y, 7], "tag"), torch.device("cpu"))
    assert isinstance(got, tuple) and isinstance(got[1], list) and got[1][1] == 7 and got[2] == "tag"
    assert torch.equal(got[0], x) and torch.equal(got[1][0], y)


@pytest.mark.cuda
def test_micro_batches_reach_the_gpu_without_the_host_waiting_for_its_kernels():
    """A stage's micro-batch goes to its GPU while the kernels queued before it still run: from pageable memory
    CUDA would sync the stream first and the host would wait for them. Pageable and pinned inputs both, with
    their values, a pinned one's even when its owner refills it at once (the transfer reads a copy)."""
    from cuda_util import busy

    device = torch.device("cuda", torch.cuda.current_device())
    x, y = torch.randn(1000), torch.arange(10).pin_memory()
    stream = torch.cuda.current_stream(device)
    busy(stream, 500)
    want_y = y.clone()
    got = _to_device((x, [y, 3]), device)
    assert not stream.query(), "the host waited for the queued kernels"
    y.fill_(-1)  # a prefetching loader refilling its pinned buffer
    assert got[0].device == device and got[1][0].device == device and got[1][1] == 3
    assert torch.equal(got[0].cpu(), x) and torch.equal(got[1][0].cpu(), want_y)


# ---- the engine in one process ----
def _plain(layers, loss, cfg):
    model = LayerModule(layers, loss_fn=loss, seed_layers=True)
    comm = world_comm("auto").split(0, 0, "reference")
    return Zero8Engine(model, load_config(cfg, 1, warn=False), comm, world_comm("auto")), comm


def _pipe(layers, loss, cfg, **kw):
    # On the CPU also where a GPU is: the references here are CPU engines.
    model = PipelineModule(layers, num_stages=1, loss_fn=loss, seed_layers=True, device="cpu", **kw)
    engine, _, _, _ = zero8.initialize(model=model, config=cfg)
    return engine


def _train(engine, data, steps, first=0):
    return [float(engine.train_batch(micro_batches(data, s, B, 0, 1, engine.micro_batches)))
            for s in range(first, first + steps)]


@pytest.mark.parametrize("z8,stage", [(EXACT, 1), (FULL8, 2), (dict(FULL8, min_8bit_size=64), 1)])
def test_one_stage_pipeline_equals_the_plain_engine_bit_for_bit(z8, stage):
    data = make_data()
    cfg = config(gas=4, stage=stage, zero8=z8, gradient_clipping=1.0)
    engine = _pipe(regression_layers(), mse, cfg)
    assert isinstance(engine, PipelineEngine) and engine.is_first_stage() and engine.is_last_stage()
    losses = _train(engine, data, 4)
    ref, comm = _plain(regression_layers(), mse, cfg)
    ref_losses = train_plain(ref, data, 4, B, mse, 0, 1, comm)
    assert losses == ref_losses and losses[-1] < losses[0]
    sd, ref_sd = engine.module.state_dict(), ref.module.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in sd.items())
    assert engine.get_global_grad_norm() == ref.get_global_grad_norm()
    assert engine.global_steps == 4 and engine.micro_steps == 16


def test_activation_checkpointing_changes_nothing():
    data = make_data()
    cfg = config(gas=2, zero8=EXACT)
    plain_run = _train(_pipe(regression_layers(), mse, cfg), data, 3)
    ckpt_run = _train(_pipe(regression_layers(), mse, cfg, activation_checkpoint_interval=2), data, 3)
    assert plain_run == ckpt_run


def test_reentrant_activation_checkpointing_trains_as_without():
    """A reentrant checkpoint segment's output has a graph only when one of its inputs requires grad: the
    first stage's floating inputs are made to (detached copies: the caller's tensors keep their flags), as
    DeepSpeed's engine does. Without that the stage's parameters get no gradient."""
    data = make_data()
    cfg = config(gas=2, zero8=EXACT)
    reentrant = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    plain = _pipe(regression_layers(), mse, cfg)
    ckpt = _pipe(regression_layers(), mse, cfg, activation_checkpoint_interval=2, activation_checkpoint_func=reentrant)
    assert _train(ckpt, data, 3) == _train(plain, data, 3)
    assert ckpt.module.reentrant_checkpointing() and not plain.module.reentrant_checkpointing()
    ref = plain.module.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in ckpt.module.state_dict().items())
    assert not data[0].requires_grad


def test_the_first_stage_moves_the_inputs_and_the_last_the_labels(monkeypatch):
    """As DeepSpeed's: batch[0] goes to the device on the first stage only, batch[1] on the last only (the
    other part may be anything). One stage is made to play stage 0 and stage 1 of 2, on the meta device,
    where moving a CPU tensor shows."""
    engine = _pipe(regression_layers(), mse, config(gas=2, zero8=EXACT))
    x, y = next(micro_batches(make_data(), 0, B, 0, 1, 2))
    monkeypatch.setattr(engine, "_device", torch.device("meta"))
    monkeypatch.setattr(engine, "num_stages", 2)
    got = []
    for stage in (0, 1):
        monkeypatch.setattr(engine, "stage_id", stage)
        engine.data_iterator = iter([(x, y)])
        got.append(engine._next_batch(0))
    (x0, y0), (x1, y1) = got
    assert x0.device.type == "meta" and y0 is y
    assert x1 is x and y1.device.type == "meta"


_FIRST_INPUTS: list = []


class _Unpack(nn.Module):
    """A first layer taking its inputs as (x,), noting the type they came as."""

    def forward(self, inputs):
        _FIRST_INPUTS.append(type(inputs))
        return inputs[0]


def test_batch_fn_and_inputs_handed_as_a_list_are_deepspeeds():
    """set_batch_fn (Megatron-DeepSpeed's get_batch_pipe turns its dict of tokens into (inputs, labels)) runs
    on each micro-batch of train_batch and eval_batch; inputs that a DataLoader hands as a list reach the
    first layer as a tuple, as in DeepSpeed."""
    data = make_data()
    cfg = config(gas=2, zero8=EXACT)
    layers = [LayerSpec(_Unpack), *regression_layers()]
    ref, engine = _pipe(layers, mse, cfg), _pipe(layers, mse, cfg)

    def dicts(s, gas=2):
        return iter([{"x": x, "y": y} for x, y in micro_batches(data, s, B, 0, 1, gas)])

    def lists(s, gas=2):  # as a DataLoader collates ((x,), y)
        return iter([[[x], y] for x, y in micro_batches(data, s, B, 0, 1, gas)])

    _FIRST_INPUTS.clear()
    want = [float(ref.train_batch(lists(s))) for s in range(2)]
    assert set(_FIRST_INPUTS) == {tuple}
    engine.set_batch_fn(lambda d: ([d["x"]], d["y"]))
    assert [float(engine.train_batch(dicts(s))) for s in range(2)] == want
    assert float(engine.eval_batch(dicts(5))) == float(ref.eval_batch(lists(5)))
    engine.set_batch_fn(None)
    with pytest.raises(ValueError, match=r"micro-batch 0 is a dict; a pipeline micro-batch is \(inputs, labels\)"):
        engine.train_batch(dicts(0))
    with pytest.raises(TypeError, match="callable"):
        engine.set_batch_fn(3)


def test_reset_activation_shape_and_set_has_attention_mask_are_deepspeeds():
    """reset_activation_shape (curriculum learning calls it before the sequence length changes) has nothing
    to reset: each batch agrees on its shapes again. has_attention_mask is kept for scripts that read it;
    a bool mask crosses a boundary as it is either way (dist_pipe.py)."""
    data = make_data()
    engine = _pipe(regression_layers(), mse, config(gas=2, zero8=EXACT))
    assert engine.has_attention_mask is False
    engine.set_has_attention_mask(True)
    assert engine.has_attention_mask is True
    with pytest.raises(TypeError, match="must be a bool"):
        engine.set_has_attention_mask(1)
    engine.train_batch(micro_batches(data, 0, B, 0, 1, 2))
    engine.reset_activation_shape()
    assert torch.isfinite(engine.eval_batch(micro_batches(data, 1, B, 0, 1, 4), num_micro_batches=4))


def test_the_pipeline_engine_trains_through_train_batch_only():
    engine = _pipe(regression_layers(), mse, config(gas=2, zero8=EXACT))
    x, y = next(micro_batches(make_data(), 0, B, 0, 1, 2))
    for call in (lambda: engine(x), lambda: engine.backward(torch.tensor(1.0)), lambda: engine.step()):
        with pytest.raises(PipelineError, match="train_batch"):
            call()
    with torch.no_grad(), pytest.raises(RuntimeError, match="gradients enabled"):
        engine.train_batch(micro_batches(make_data(), 0, B, 0, 1, 2))
    with pytest.raises(ValueError, match=r"\(inputs, labels\)"):
        engine.train_batch(iter([x, x]))
    with pytest.raises(StopIteration, match="ended at micro-batch 1 of 2"):
        engine.train_batch(iter([(x, y)]))


def test_batch_size_setters_change_the_schedule_and_manual_boundaries_are_refused():
    """set_train_batch_size changes train_batch()'s micro-batch count (a batch ramp-up), with the bits of a
    pipeline configured that way; the accumulation is train_batch()'s, so a manual boundary and
    managed_gradient_accumulation false are refused, as DeepSpeed's pipeline engine refuses them."""
    data = make_data()
    ramped = _pipe(regression_layers(), mse, config(batch=32, gas=2, zero8=EXACT))
    ramped.set_train_batch_size(64)
    assert ramped.micro_batches == 4 and ramped.get_batch_info() == (64, 16, 4)
    direct = _pipe(regression_layers(), mse, config(batch=64, gas=4, zero8=EXACT))
    losses = [[float(e.train_batch(micro_batches(data, s, 64, 0, 1, 4))) for s in range(2)]
              for e in (ramped, direct)]
    assert losses[0] == losses[1]
    assert all(torch.equal(v, direct.module.state_dict()[k]) for k, v in ramped.module.state_dict().items())
    ramped.set_train_micro_batch_size(8)
    assert (ramped.micro_batch_size, ramped.micro_batches) == (8, 4) and ramped.train_batch_size() == 32
    with pytest.raises(PipelineError, match="set_train_batch_size"):
        ramped.set_gradient_accumulation_boundary(True)
    with pytest.raises(PipelineError, match="set_train_batch_size"):
        ramped.coalesce_grad_reduction()
    with pytest.raises(zero8.Zero8NotSupportedError, match="managed_gradient_accumulation: false"):
        _pipe(regression_layers(), mse, config(zero8=EXACT, managed_gradient_accumulation=False))


def test_the_plain_engine_points_pipeline_calls_to_a_pipeline_module():
    ref, _ = _plain(regression_layers(), mse, config(zero8=EXACT))
    with pytest.raises(zero8.Zero8NotSupportedError, match="PipelineModule"):
        ref.train_batch(iter([]))


def test_int8_activations_key_is_parsed_and_typos_are_named():
    cfg = load_config(config(zero8={"int8_activations": True}), 1, warn=False)
    assert cfg.typed.zero8.int8_activations and not load_config(config(), 1, warn=False).typed.zero8.int8_activations
    assert json.loads(cfg.json)["zero8"]["int8_activations"] is True
    with pytest.raises(zero8.Zero8ValueError, match='zero8.int8_activation: unknown key; did you mean "int8_activations"'):
        load_config(config(zero8={"int8_activation": True}), 1)
    with pytest.raises(ValueError, match="int8_activations"):
        load_config(config(zero8={"int8_activations": 1}), 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero8.initialize(model=LayerModule(regression_layers()), config=config(zero8={"int8_activations": True}))
    assert any("int8_activations" in str(w.message) and "PipelineModule" in str(w.message) for w in caught)


def test_queued_stage_messages_key_is_parsed_and_the_plain_engine_says_it_does_nothing():
    cfg = load_config(config(zero8={"queued_stage_messages": True}), 1, warn=False)
    assert cfg.typed.zero8.queued_stage_messages and json.loads(cfg.json)["zero8"]["queued_stage_messages"] is True
    assert not load_config(config(), 1, warn=False).typed.zero8.queued_stage_messages
    with pytest.raises(ValueError, match="queued_stage_messages"):
        load_config(config(zero8={"queued_stage_messages": "yes"}), 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero8.initialize(model=LayerModule(regression_layers()), config=config(zero8={"queued_stage_messages": True}))
    assert any("queued_stage_messages has no effect here" in str(w.message) and "PipelineModule" in str(w.message)
               for w in caught)


def test_eval_batch_gives_the_mean_loss_and_the_last_outputs():
    data = make_data()
    engine = _pipe(regression_layers(), mse, config(gas=2, zero8=EXACT))
    batches = list(micro_batches(data, 0, B, 0, 1, 2))
    loss, logits = engine.eval_batch(iter(batches), return_logits=True)
    with torch.no_grad():
        expected = sum(float(mse(engine.module(x), y).double()) for x, y in batches) / 2
        last = engine.module(batches[-1][0])
    assert float(loss) == float(torch.tensor(expected, dtype=torch.float32)) and torch.equal(logits, last)
    per_micro = engine.eval_batch(iter(batches), reduce_output=None)
    assert len(per_micro) == 2 and engine.global_steps == 0 and not engine.module.training


class _Pair(nn.Module):
    """A last layer with two outputs: the float32 input and a bfloat16 copy."""

    def forward(self, x):
        return x, x.to(torch.bfloat16)


def test_eval_batch_averages_outputs_per_tensor_in_their_dtype():
    """compute_loss=False with reduce_output "avg": each tensor of the outputs (a tuple's too) is averaged
    over the micro-batches where it is (on a GPU, the device; the data-parallel mean too, dist_pipe.py),
    summed in float32 and returned in its own dtype, as DeepSpeed's _reduce_outputs keeps it."""
    data = make_data()
    batches = list(micro_batches(data, 0, B, 0, 1, 2))
    engine = _pipe([*regression_layers(), LayerSpec(_Pair)], None, config(gas=2, zero8=EXACT))
    out = engine.eval_batch(iter(batches), compute_loss=False)
    with torch.no_grad():
        runs = [engine.module(x) for x, _ in batches]
    want = ((runs[0][0] + runs[1][0]) / 2, ((runs[0][1].float() + runs[1][1].float()) / 2).to(torch.bfloat16))
    assert isinstance(out, tuple) and [t.dtype for t in out] == [torch.float32, torch.bfloat16]
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    one = _pipe(regression_layers(), mse, config(gas=2, zero8=EXACT)).eval_batch(iter(batches), compute_loss=False)
    assert isinstance(one, torch.Tensor) and one.shape == (B // 2, 1) and one.dtype == torch.float32
    with pytest.raises(ValueError, match=r"output 1 of micro-batch 0 is str; the average needs tensors"):
        _pipe([*regression_layers(), lambda x: (x, "text")], None, config(gas=2, zero8=EXACT)).eval_batch(
            iter(batches), compute_loss=False)


def test_structure_of_the_messages_round_trips():
    s = Structure.of((torch.zeros(2, 3, requires_grad=True), torch.ones(4, dtype=torch.long)), "output")
    assert Structure.from_bytes(s.to_bytes()) == s and s.tensors[0].grad and not s.tensors[1].grad
    assert s.describe() == "(float32[2, 3], int64[4])"
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        Structure.of({"x": torch.zeros(1)}, "stage 0 output")


def test_an_output_on_another_device_than_the_stage_is_refused_before_sending():
    link = StageLink(world_comm("auto"), stage=0, stages=2, int8=False, wire_block=2048)
    out = (torch.zeros(2), torch.empty(3, device="meta"))
    with pytest.raises(zero8.Zero8ValueError, match=r"stage 0: element 1 of micro-batch 0's output is on meta, the "
                                                    r"stage on cpu; a stage sends tensors of its own device"):
        link.send_activations(out, 0)
    assert link.activations.messages == 0 and link._sent is None


def test_checkpoint_of_a_pipeline_resumes_bit_exactly(tmp_path):
    data = make_data()
    cfg = config(gas=2, zero8=dict(FULL8, min_8bit_size=64))
    a = _pipe(regression_layers(), mse, cfg)
    _train(a, data, 2)
    a.save_checkpoint(tmp_path, client_state={"epoch": 7})
    cont = _train(a, data, 2, first=2)
    b = _pipe(regression_layers(), mse, cfg)
    path, client = b.load_checkpoint(tmp_path)
    assert client["epoch"] == 7 and b.global_steps == 2
    assert _train(b, data, 2, first=2) == cont
    tag = tmp_path / "global_step2"
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert {"pipeline.json", "stage_00", *(f"layer_{i:02d}-model_states.pt" for i in (0, 2, 4, 6))} <= {
        p.name for p in tag.iterdir()}
    assert not any(p.name.startswith(".tmp-pipe-") for p in tmp_path.iterdir())
    assert zero8._C.checkpoint_verify(str(tag / "stage_00" / "global_step2"))["ok"]
    # The plain engine's checkpoints are not a pipeline's, and the other way round.
    ref, _ = _plain(regression_layers(), mse, cfg)
    ref.save_checkpoint(tmp_path / "plain")
    with pytest.raises(ValueError, match="plain engine"):
        b.load_checkpoint(tmp_path / "plain")


def test_weights_only_load_reads_the_layer_files(tmp_path):
    data = make_data()
    cfg = config(gas=2, zero8=EXACT)
    a = _pipe(regression_layers(), mse, cfg)
    _train(a, data, 2)
    a.save_checkpoint(tmp_path)
    b = _pipe(regression_layers(), mse, config(gas=2, zero8=EXACT, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    b.load_checkpoint(tmp_path, load_optimizer_states=False)
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa) and b.global_steps == 2
    c = _pipe(regression_layers(), mse, cfg)
    c.load_checkpoint(tmp_path, load_module_only=True)
    assert c.global_steps == 0 and all(torch.equal(v, sa[k]) for k, v in c.module.state_dict().items())
    (tmp_path / "global_step2" / "layer_02-model_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match="layer_02"):
        c.load_checkpoint(tmp_path, load_module_only=True)
