"""zero8.utils.zero_to_fp32, DeepSpeed's deepspeed.utils.zero_to_fp32 functions over zero8 checkpoints: the
state_dict they give is the engine's (trained weights bit for bit its fp32 masters, the rest exactly, every
key), loads strictly into a fresh model, follows `latest` or the tag asked for, names what is missing, and
convert writes a safetensors file atomically. The export itself is tested in test_engine.py (to-fp32);
the 2-rank case in dist/dist_engine.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch

import zero8
from engine_util import EXACT, config
from test_engine import _check_full_state_dict, _safetensors_read, _tied_lm_checkpoint, _TiedLM
from zero8.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

torch.set_num_threads(1)


def _masters(engine) -> dict:
    """The engine's fp32 master of every trained parameter, by name (one rank: its partition is all)."""
    opt = engine._opt
    out = {}
    for i, (name, p) in enumerate(zip(engine._param_names, engine._params)):
        group, offset, numel = opt.param_slot(i)
        begin, _ = opt.part_range(group)
        flat = torch.frombuffer(bytearray(opt.master_values(group)), dtype=torch.float32)
        out[name] = flat[offset - begin:offset - begin + numel].reshape(p.shape)
    return out


def _train(engine, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 16, (4, 6), generator=g)
        logits = engine(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 16).float(), ids[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()


def _files(d) -> list:
    return sorted(os.listdir(d))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_state_dict_is_the_engine_s_masters_and_module(tmp_path, dtype):
    engine, model, tag_dir = _tied_lm_checkpoint(tmp_path / "ckpt", dtype)
    before = _files(tmp_path / "ckpt")
    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")  # tag None: `latest` names "t"
    # Every key in state_dict order, loading strictly; frozen weight and buffers exact, floats as fp32.
    _check_full_state_dict(sd, model, dtype)
    # The trained weights are the masters bit for bit (under bf16 the module holds their rounding).
    masters = _masters(engine)
    assert set(masters) == {"embed.weight", "norm.weight", "norm.bias"}
    for name, m in masters.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], m), name
    assert torch.equal(sd["head.weight"], masters["embed.weight"])  # the tied name too
    if dtype == "bf16":
        assert not torch.equal(masters["embed.weight"].to(torch.bfloat16).float(), masters["embed.weight"])
    # The same tensors as the export tool's file, and on the CPU; the temporary file is gone.
    out = tmp_path / "export.safetensors"
    zero8._C.checkpoint_export_fp32(str(tag_dir), str(out))
    want = _safetensors_read(out)
    assert list(sd) == list(want)
    for k, v in want.items():
        assert sd[k].device.type == "cpu" and sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    assert _files(tmp_path / "ckpt") == before


def test_load_state_dict_into_a_fresh_model(tmp_path):
    engine, model, _ = _tied_lm_checkpoint(tmp_path / "ckpt", "bf16")
    masters = _masters(engine)
    fresh = _TiedLM(7)
    assert not torch.equal(fresh.embed.weight, masters["embed.weight"])
    got = load_state_dict_from_zero_checkpoint(fresh, tmp_path / "ckpt", strict=True)
    assert got is fresh  # DeepSpeed returns the model it was given, moved to the CPU
    assert torch.equal(got.embed.weight, masters["embed.weight"]) and got.head.weight is got.embed.weight
    assert torch.equal(got.norm.weight, masters["norm.weight"]) and torch.equal(got.norm.bias, masters["norm.bias"])
    for k in ("pos.weight", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked", "position_ids"):
        assert torch.equal(got.state_dict()[k], model.state_dict()[k].to(got.state_dict()[k].dtype)), k
    # strict is passed through: a model with a buffer the checkpoint lacks loads only without it.
    other = _TiedLM(8)
    other.register_buffer("extra", torch.full((2,), 3.0))
    with pytest.raises(RuntimeError, match="Missing key.*extra"):
        load_state_dict_from_zero_checkpoint(other, tmp_path / "ckpt", strict=True)
    got = load_state_dict_from_zero_checkpoint(other, tmp_path / "ckpt")  # strict=False, as DeepSpeed
    assert torch.equal(got.embed.weight, masters["embed.weight"]) and torch.equal(got.extra, torch.full((2,), 3.0))


def test_tag_selection_and_latest(tmp_path):
    ckpt = tmp_path / "ckpt"
    engine, _, _, _ = zero8.initialize(model=_TiedLM(0), config=config(batch=4, zero8=EXACT))
    saved = {}
    for tag, steps, latest in (("a", 1, True), ("b", 2, False)):
        _train(engine, steps, seed=len(saved))
        engine.save_checkpoint(ckpt, tag=tag, save_latest=latest)
        saved[tag] = _masters(engine)
    assert (ckpt / "latest").read_text().strip() == "a"
    assert not torch.equal(saved["a"]["embed.weight"], saved["b"]["embed.weight"])
    for tag, want_tag in ((None, "a"), ("a", "a"), ("b", "b")):
        sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=tag)
        for name, m in saved[want_tag].items():
            assert torch.equal(sd[name], m), (tag, name)
    engine.save_checkpoint(ckpt, tag="b")  # the same weights as b; latest now names it
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert torch.equal(sd["embed.weight"], saved["b"]["embed.weight"])


def test_missing_directory_latest_or_tag_is_named(tmp_path):
    with pytest.raises(zero8.Zero8IOError, match=f"{tmp_path / 'nowhere'}.*no such checkpoint directory"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(zero8.Zero8IOError, match=f"{tmp_path / 'empty' / 'latest'}.*missing"):
        load_state_dict_from_zero_checkpoint(_TiedLM(0), tmp_path / "empty")
    _tied_lm_checkpoint(tmp_path / "ckpt", "fp32")
    with pytest.raises(zero8.Zero8IOError, match=f"tag 'nope' is not in {tmp_path / 'ckpt'}"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", tag="nope")
    with pytest.raises(zero8.Zero8IOError, match="tag 'nope' is not in"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out.safetensors", tag="nope")
    assert not (tmp_path / "out.safetensors").exists()
    # A tag is a name in checkpoint_dir, never a path out of it (tmp_path/other/../ckpt/t is the tag t).
    (tmp_path / "other").mkdir()
    with pytest.raises(zero8.Zero8ValueError, match="'tag': '../ckpt/t' contains '/'"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "other", tag="../ckpt/t")
    with pytest.raises(zero8.Zero8ValueError, match="'tag': '../ckpt/t' contains '/'"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "other", tmp_path / "out.safetensors", tag="../ckpt/t")
    assert not (tmp_path / "out.safetensors").exists()
    # A corrupt file of the tag, also one the export does not read (the model-states file, the working
    # copy): every checksum is checked, and the error names the file.
    for name in ("mp_rank_00_model_states.pt", "model.safetensors"):
        path = tmp_path / "ckpt" / "t" / name
        good = path.read_bytes()
        path.write_bytes(good[:-9] + bytes([good[-9] ^ 1]) + good[-8:])
        with pytest.raises(zero8.Zero8IOError, match=f"{name}: checksum mismatch"):
            get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
        with pytest.raises(zero8.Zero8IOError, match=f"{name}: checksum mismatch"):
            convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out.safetensors")
        assert not (tmp_path / "out.safetensors").exists()
        path.write_bytes(good)
    # A corrupt manifest: the error names it.
    (tmp_path / "ckpt" / "t" / "manifest.json").write_text("{}")
    with pytest.raises(zero8.Zero8IOError, match="manifest.json"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert not [f for f in _files(tmp_path / "ckpt") if f.startswith(".zero8-to-fp32-")]


def test_a_checkpoint_directory_it_cannot_write_to(tmp_path, monkeypatch):
    # The temporary export goes to the system's temporary directory then (root can write anywhere, so
    # the refusal is simulated), and is removed there too.
    import zero8.utils.zero_to_fp32 as z

    _, model, _ = _tied_lm_checkpoint(tmp_path / "ckpt", "fp32")
    made = []
    real = z.tempfile.mkdtemp

    def mkdtemp(prefix=None, dir=None):
        if dir is not None:
            raise PermissionError(13, "Permission denied", dir)
        made.append(real(prefix=prefix))
        return made[-1]

    monkeypatch.setattr(z.tempfile, "mkdtemp", mkdtemp)
    _check_full_state_dict(get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt"), model, "fp32")
    assert len(made) == 1 and not os.path.exists(made[0])


def test_convert_writes_a_safetensors_file_atomically(tmp_path):
    engine, model, _ = _tied_lm_checkpoint(tmp_path / "ckpt", "bf16")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model.safetensors"
    out.write_bytes(b"an older file")  # replaced
    assert convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out) is None
    assert _files(out_dir) == ["model.safetensors"]  # no temporary file left beside it
    sd = safetensors.torch.load_file(str(out))
    _check_full_state_dict(sd, model, "bf16")
    ref = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", tag="t")
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    with open(out, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt", "zero8_tag": "t", "zero8_step": "3",
                                      "zero8_source": "fp32 masters + model_rest"}  # as CHECKPOINT.md lists
    # A directory (newer DeepSpeed's output_dir) is refused, not written into.
    with pytest.raises(zero8.Zero8ValueError, match=f"{out_dir}: is a directory"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out_dir)
    # A replaced file keeps its permission bits.
    os.chmod(out, 0o600)
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out)
    assert os.stat(out).st_mode & 0o777 == 0o600
    # A file of the checkpoint itself is never the output (the rename would replace it with the export).
    own = tmp_path / "ckpt" / "t" / "model.safetensors"
    before = own.read_bytes()
    with pytest.raises(zero8.Zero8IOError, match=f"{own}: is inside .*, a tag directory of the checkpoint"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", own)
    assert own.read_bytes() == before and zero8._C.checkpoint_verify(str(tmp_path / "ckpt" / "t"))["ok"]
    # A missing directory is named as given, before anything is written.
    with pytest.raises(zero8.Zero8IOError, match=f"{out_dir / 'nodir' / 'x.st'}: the directory .* does not exist"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out_dir / "nodir" / "x.st")


def test_default_tag_counts_skipped_steps_the_step_fields_do_not(tmp_path):
    # CHECKPOINT.md: the engine's default tag is global_step<global_steps>, which counts steps skipped on an
    # fp16 overflow (as DeepSpeed's); the manifest's step and the export's zero8_step are optimizer steps applied.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.Linear(300, 4))
    cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2}, "zero8": {}, "fp16": {"enabled": True, "initial_scale_power": 30}}
    engine, *_ = zero8.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(2):  # a loss scale of 2**30 overflows fp16: both steps are skipped
        engine.backward(engine(torch.randn(2, 8).half()).float().pow(2).mean() * 1e4)
        engine.step()
    assert (engine.global_steps, engine.skipped_steps) == (2, 2)
    engine.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    manifest = json.loads((tmp_path / "ckpt" / "global_step2" / "manifest.json").read_text())
    assert manifest["step"] == 0
    out = tmp_path / "out.safetensors"
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out)
    with open(out, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"]["zero8_tag"] == "global_step2" and header["__metadata__"]["zero8_step"] == "0"


def test_the_module_runs_as_deepspeed_s_script(tmp_path):
    # `python zero_to_fp32.py <checkpoint_dir> <output_file> [-t TAG]` as DeepSpeed's script: it writes the
    # file (a run that did nothing and exited 0 used to be all `python -m` gave), names errors, and says
    # that a .bin name still gets safetensors.
    _, model, _ = _tied_lm_checkpoint(tmp_path / "ckpt", "bf16")

    def run(*args):
        return subprocess.run([sys.executable, "-m", "zero8.utils.zero_to_fp32", *map(str, args)],
                              capture_output=True, text=True, timeout=120)

    out = tmp_path / "pytorch_model.bin"
    r = run(tmp_path / "ckpt", out, "-t", "t")
    assert r.returncode == 0, r.stderr
    assert "will be a safetensors file, not a torch.save one" in r.stderr and f"wrote {out}" in r.stdout
    _check_full_state_dict(safetensors.torch.load_file(str(out)), model, "bf16")
    r = run(tmp_path / "nowhere", tmp_path / "x.safetensors")
    assert r.returncode == 1 and "zero_to_fp32: error:" in r.stderr and "nowhere" in r.stderr, r.stderr
    assert not (tmp_path / "x.safetensors").exists()
    assert run(tmp_path / "ckpt").returncode == 2  # usage


def test_importable_under_deepspeed_s_path():
    import zero8.utils.zero_to_fp32 as z

    assert zero8.utils.zero_to_fp32 is z and "utils" in dir(zero8)
    assert z.__all__ == ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
                         "convert_zero_checkpoint_to_fp32_state_dict"]
