"""What loading a checkpoint may do: the engine's load_checkpoint and zero8.deepspeed read .pt files weights-only
(tensors and plain values, and DeepSpeed's own checkpoint classes), so a checkpoint from elsewhere cannot run code
when loaded; an object that needs full unpickling fails naming the file, the object and the option that allows it
(load_checkpoint(allow_pickle=True), zero8.checkpoint.allow_pickle, read_checkpoint/to_universal(allow_pickle=True)).

The forged file here is a real one: save_checkpoint pickles a client_state object whose unpickling calls a function
(as a planted payload would), with every checksum of the manifest right, so only the unpickler stands in its way.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch

import zero8
from engine_util import EXACT, config, make_data, make_model, params_equal, train_engine
from zero8.engine import MODEL_STATES_FILE

torch.set_num_threads(1)
DATA = make_data()
B = 32


def _touch(path: str) -> str:
    """What the payload runs when unpickled: a file appears (the test's proof that code ran)."""
    Path(path).write_text("ran")
    return "payload"


class Payload:
    """Pickles as a call of _touch(marker): unpickling it runs that call."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


class Note:
    """A plain custom class in client_state, as a training script may save one."""

    def __init__(self, text: str):
        self.text = text


def _saved(tmp_path: Path, client_state: dict, cfg_zero8: dict | None = None):
    model = make_model()
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=cfg_zero8 or EXACT))
    train_engine(engine, DATA, 2, B)
    engine.save_checkpoint(tmp_path / "ckpt", client_state=client_state)
    return model


def test_a_pickled_payload_does_not_run_on_load(tmp_path):
    marker = tmp_path / "ran"
    _saved(tmp_path, {"epoch": 3, "note": Payload(marker)})
    assert not marker.exists()
    engine, _, _, _ = zero8.initialize(model=make_model(1), config=config(zero8=EXACT))
    before = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.raises(zero8.Zero8ValueError) as e:
        engine.load_checkpoint(tmp_path / "ckpt")
    msg = str(e.value)
    path = tmp_path / "ckpt" / "global_step2" / MODEL_STATES_FILE
    assert str(path) in msg and f"{__name__}._touch" in msg, msg
    assert "allow_pickle=True" in msg and "zero8.checkpoint.allow_pickle" in msg, msg
    assert not marker.exists(), "the payload ran"
    # Nothing was loaded.
    assert engine.global_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_allow_pickle_loads_custom_objects_by_argument_or_config(tmp_path):
    model = _saved(tmp_path, {"epoch": 3, "note": Note("hello")})
    engine, _, _, _ = zero8.initialize(model=make_model(1), config=config(zero8=EXACT))
    with pytest.raises(zero8.Zero8ValueError, match=rf"holds the object {__name__}\.Note, .*allow_pickle=True"):
        engine.load_checkpoint(tmp_path / "ckpt")
    _, client = engine.load_checkpoint(tmp_path / "ckpt", allow_pickle=True)
    assert client["note"].text == "hello" and client["epoch"] == 3 and params_equal(engine.module, model)

    trusting = dict(EXACT, checkpoint={"allow_pickle": True})
    engine, _, _, _ = zero8.initialize(model=make_model(1), config=config(zero8=trusting))
    assert engine.zero8_config.typed.zero8.checkpoint_allow_pickle
    _, client = engine.load_checkpoint(tmp_path / "ckpt")
    assert client["note"].text == "hello" and params_equal(engine.module, model)
    # The argument wins over the config.
    engine, _, _, _ = zero8.initialize(model=make_model(1), config=config(zero8=trusting))
    with pytest.raises(zero8.Zero8ValueError, match="Note"):
        engine.load_checkpoint(tmp_path / "ckpt", allow_pickle=False)


def test_the_engines_own_checkpoints_load_weights_only(tmp_path):
    # Everything the engine writes (module, counters, config, a torch LR scheduler's state with its Counter)
    # and plain client_state values (tensors, tuples, OrderedDicts, big ints) need no unpickling of code.
    model = make_model()
    engine, _, _, _ = zero8.initialize(
        model=model, config=config(zero8=EXACT),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5], gamma=0.1))
    train_engine(engine, DATA, 2, B)
    client = {"rng": torch.tensor([1, 2]), "shape": (4, 2), "seen": 2**70,
              "order": collections.OrderedDict(b=1, a=2), "plain": {"epoch": 3, "lrs": [0.1, None]}}
    engine.save_checkpoint(tmp_path, client_state=client)
    path = tmp_path / "global_step2" / MODEL_STATES_FILE
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == []
    e2, _, _, _ = zero8.initialize(
        model=make_model(1), config=config(zero8=EXACT),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5], gamma=0.1))
    _, got = e2.load_checkpoint(tmp_path)
    assert repr({k: got[k] for k in client}) == repr(client) and params_equal(e2.module, model)


def test_load_module_only_reads_weights_only_too(tmp_path):
    marker = tmp_path / "ran"
    _saved(tmp_path, {"note": Payload(marker)})
    engine, _, _, _ = zero8.initialize(model=make_model(1), config=config(zero8=EXACT))
    with pytest.raises(zero8.Zero8ValueError, match="_touch"):
        engine.load_checkpoint(tmp_path / "ckpt", load_module_only=True)
    assert not marker.exists()


def test_deepspeed_files_read_weights_only(tmp_path):
    # zero8.deepspeed reads a DeepSpeed checkpoint's files (here its model-states file, through the export of a
    # zero8 engine checkpoint, which reads it the same way) weights-only unless allowed.
    marker = tmp_path / "ran"
    _saved(tmp_path, {"note": Payload(marker)})
    with pytest.raises(zero8.Zero8ValueError, match=r"_touch.*allow_pickle=True \(to read_checkpoint, to_universal"):
        zero8.deepspeed.to_universal(tmp_path / "ckpt", tmp_path / "uni" / "global_step2")
    assert not marker.exists()
    zero8.deepspeed.to_universal(tmp_path / "ckpt", tmp_path / "uni2" / "global_step2", allow_pickle=True)
    assert marker.exists()  # what allow_pickle means


def test_deepspeed_checkpoint_classes_are_allowed(tmp_path):
    # DeepSpeed's optimizer files pickle its loss scaler, ZeRO stage enum and fragment addresses: those are
    # rebuilt from their fields (no code of the file runs), so DeepSpeed checkpoints need no allow_pickle.
    pytest.importorskip("deepspeed", reason="needs DeepSpeed (pip install .[test])")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from zero8.deepspeed.universal import _load

    path = tmp_path / "optim_states.pt"
    saved = {"loss_scaler": LossScaler(1.0), "dynamic": DynamicLossScaler(init_scale=2.0**8, scale_window=1000, min_scale=1.0, delayed_shift=2,
                                              consecutive_hysteresis=False),
             "zero_stage": ZeroStageEnum.gradients, "map": [{"w": fragment_address(numel=4, start=0)}],
             "t": torch.ones(3)}
    torch.save(saved, path)
    got = _load(str(path), allow_pickle=False)
    assert got["loss_scaler"].cur_scale == 1.0 and got["dynamic"].cur_scale == 2.0**8
    assert got["zero_stage"] is ZeroStageEnum.gradients and got["map"][0]["w"] == fragment_address(4, 0)
    torch.save({"other": Note("x")}, path)
    with pytest.raises(zero8.Zero8ValueError, match=rf"{path}: holds the object {__name__}\.Note"):
        _load(str(path), allow_pickle=False)


def test_config_key_is_checked(tmp_path):
    cfg = config(zero8=dict(EXACT, checkpoint={"allow_pickle": "yes"}))
    with pytest.raises(zero8.Zero8ValueError, match=r"zero8\.checkpoint\.allow_pickle"):
        zero8.initialize(model=make_model(), config=cfg)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config(zero8=EXACT)))
    assert not zero8.config.load_config(str(path)).typed.zero8.checkpoint_allow_pickle
