"""benchmarks/loss_study.py without its training runs (those take hours): the variants' configs and the
issue-31 rule that picks the default among them."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("loss_study", ROOT / "benchmarks" / "loss_study.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_variant_configs(study, tmp_path):
    cfg = json.loads(study.write_config("int8_ef_b256+p8", tmp_path).read_text())
    base = json.loads(study.CONFIG.read_text())
    assert cfg["zero8"] == {**base["zero8"], "int8_gradients": True, "error_feedback": True, "wire_block_size": 256,
                            "int8_params": True}
    assert {k: v for k, v in cfg.items() if k != "zero8"} == {k: v for k, v in base.items() if k != "zero8"}
    fp32 = json.loads(study.write_config("fp32", tmp_path).read_text())["zero8"]
    assert fp32["int8_gradients"] is False and fp32["int8_params"] is False
    # A variant without "+p8" turns the int8 parameter sync off (CONFIG has zero8's default, on).
    assert json.loads(study.write_config("int8", tmp_path).read_text())["zero8"]["int8_params"] is False
    for bad in ("int9", "fp32+p8", "int8+p8+p8"):
        with pytest.raises(SystemExit, match=re.escape(f"unknown variant '{bad}'")):
            study.variant(bad)


def _row(rel_mean, grad_ratio=0.25, extra=0.0, nbytes=100.0, val=2.0):
    return {"rel_mean": rel_mean, "grad_ratio": grad_ratio, "extra_bytes_per_param": extra,
            "bytes_per_rank_step": nbytes, "val_mean": val}


def test_rule(study):
    rows = {"int8": _row(0.004), "int8_ef": _row(0.001, extra=4.0), "int8_sr": _row(0.0019, nbytes=100.0),
            "int8_b256": _row(0.0, nbytes=101.0), "int8_b64": _row(-0.01, grad_ratio=0.27)}
    best, ok = study.choose(rows, list(rows), 0.002)
    # over the bound (int8), over the byte bound (int8_b64): out; the cheapest in memory, then bytes, wins
    assert ok == ["int8_ef", "int8_sr", "int8_b256"] and best == "int8_sr"
    # equal in memory and bytes: the fewest remedies, not a loss difference inside the noise, decide
    best, _ = study.choose({"int8": _row(0.001), "int8_sr": _row(-0.001)}, ["int8", "int8_sr"], 0.002)
    assert best == "int8"
    # a lower loss than fp32 costs nothing: the bound is one-sided
    best, ok = study.choose({"int8": _row(-0.004)}, ["int8"], 0.002)
    assert best == "int8" and ok == ["int8"]
    assert study.choose({"int8": _row(0.0021)}, ["int8"], 0.002) == (None, [])
