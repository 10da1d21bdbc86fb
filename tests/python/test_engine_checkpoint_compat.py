"""Engine checkpoints written by earlier zero8 versions keep loading: each tests/data/checkpoints/engine_<version>/
was saved by that version's engine (tests/python/data_gen/make_engine_checkpoint.py, which also recorded
expected.pt from the live engine), and the current engine must restore from it the weights, the fp32
masters and optimizer states of both state groups, the LR scheduler, the client state and the counters, bit
for bit, and then take the same next step the saving engine took (with recorded gradients: zero8's step
is the same on every CPU, torch's forward and backward are not).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import zero8
from data_gen import make_engine_checkpoint as gen
from zero8.engine import MODEL_STATES_FILE

CHECKPOINTS = sorted((Path(__file__).resolve().parents[1] / "data" / "checkpoints").glob("engine_*"))


def assert_tensors_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs"


@pytest.mark.parametrize("saved", CHECKPOINTS, ids=lambda p: p.name)
def test_a_checkpoint_of_an_earlier_version_loads_exactly(saved, tmp_path):
    expected = torch.load(saved / "expected.pt", weights_only=True)
    load_dir = tmp_path / saved.name  # a copy, so that nothing the load does can touch the repository's data
    shutil.copytree(saved, load_dir, ignore=shutil.ignore_patterns("expected.pt"))

    model = gen.make_model()
    with torch.no_grad():  # other values everywhere, the frozen parameter and the buffer too
        for t in list(model.parameters()) + list(model.buffers()):
            t.fill_(0.25)
    engine, _, _, scheduler = zero8.initialize(model=model, model_parameters=gen.param_groups(model),
                                               config=gen.CONFIG)
    assert engine.global_steps == 0 and scheduler.state_dict() != expected["scheduler"]

    path, client_state = engine.load_checkpoint(load_dir)

    assert path == str(load_dir / expected["tag"] / MODEL_STATES_FILE)
    for key, value in expected["client_state"].items():
        assert client_state[key] == value, key
    for counter in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
        assert getattr(engine, counter) == expected[counter], counter
    assert scheduler.state_dict() == expected["scheduler"]
    assert engine.get_lr() == expected["lr"]
    assert_tensors_equal(engine.module.state_dict(), expected["module"], "weights")
    got, want = gen.optimizer_record(engine), expected["optimizer"]
    assert (got["steps"], got["loss_scale"]) == (want["steps"], want["loss_scale"])
    assert sorted(got["groups"]) == sorted(want["groups"]) == [0, 1]  # 8-bit and 32-bit states
    for g in want["groups"]:
        assert_tensors_equal(got["groups"][g], want["groups"][g], f"optimizer state group {g}")

    gen.exact_step(engine, expected["next_step_grads"])
    assert_tensors_equal(engine.module.state_dict(), expected["module_after_next_step"], "weights after the next step")
    assert engine.get_lr() == expected["lr_after_next_step"]
    engine.destroy()


def test_the_compatibility_data_is_there():
    # A glob that finds nothing would make the test above pass vacuously.
    assert CHECKPOINTS, "tests/data/checkpoints/engine_* is missing"
    for saved in CHECKPOINTS:
        assert (saved / "expected.pt").is_file() and (saved / "latest").is_file(), saved
