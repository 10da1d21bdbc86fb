"""zero8._C, the raw-pointer layer under the Python package: every binding reachable, C++ errors mapped to
the right Python classes, the GIL released during long calls, the single-process communicator, config
parsing errors with their key paths, the sharded optimizer's zero-copy buffers and its step against the
fused kernel called directly, and a checkpoint round trip.
"""

from __future__ import annotations

import copy
import gc
import importlib.metadata
import json
import pickle
import sys
import threading
import time

import pytest
import torch

import zero8
from zero8 import _C
from zero8 import functional as F

F32_EPS = 2.0**-24

# ---------------------------------------------------------------------------------------------------
# Surface


API = [
    # build, dispatch, enums
    "version", "build_info", "isa_active", "isa_supported", "DType", "MapKind", "Algo", "Isa",
    "cuda_quant_kernels", "set_cuda_quant_kernels",
    # maps and codec
    "map_values", "map_dynamic_values", "quantize_blockwise", "quantize_blockwise_values",
    "dequantize_blockwise", "dequantize_blockwise_values", "quant_num_blocks", "quant_bytes",
    # optimizer kernels
    "Hyper", "StepArgs", "step_range", "norms_range", "trust_ratio", "step_tensor", "state_bytes",
    "algo_num_states", "hyper_validate", "algo_table", "algo_spec", "AlgoSpec", "HyperSpec",
    # CUDA entries (every build has them; a CPU-only build raises Zero8NotSupportedError from each)
    "quant_table_bytes", "quantize_blockwise_cuda", "quantize_blockwise_table_cuda", "dequantize_blockwise_cuda",
    "dequantize_blockwise_table_cuda", "step_tensor_cuda", "int8_quantize_rows_cuda", "int8_quantize_cols_cuda",
    "int8_quantize_blocks_cuda", "int8_dequantize_blocks_cuda", "int8_outlier_columns_cuda",
    "int8_dequantize_matmul_cuda", "int8_gemm_cuda", "int8_block_matmul_cuda",
    # communicator
    "Communicator", "comm_create", "comm_backend_available", "topology_split", "node_groups",
    # config
    "config_parse", "config_parse_file", "config_info", "lr_at", "momentum_at", "Scheduler",
    "Config", "ConfigBatch", "ConfigOptimizer", "ConfigScheduler", "ConfigFp16", "ConfigBf16", "ConfigZero",
    "ConfigCheckpoint", "ConfigZero8", "SchedulerType", "WarmupType", "CommDataType",
    "TagValidation", "CommBackend",
    # sharded optimizer, checkpoints
    "ParamSpec", "ShardConfig", "shard_config_from_json", "ShardedOptimizer", "checkpoint_save",
    "checkpoint_load", "latest_read", "checkpoint_tags", "checkpoint_verify", "checkpoint_export_fp32",
    # exceptions
    "Zero8Error", "Zero8ValueError", "Zero8NotSupportedError", "Zero8IOError", "Zero8CommError",
    "Zero8InternalError",
]


@pytest.mark.parametrize("name", API)
def test_binding_exists(name):
    assert hasattr(_C, name), f"zero8._C.{name} is missing"


def test_every_cuda_entry_takes_pointers_checked():
    """zero8's Python side calls the *_cuda entries with pointers_checked=True for tensors it has checked (no
    driver query per pointer); an entry without the keyword would fail only on a GPU."""
    names = [n for n in dir(_C) if n.endswith("_cuda") and callable(getattr(_C, n))]
    assert len(names) >= 15, names
    missing = [n for n in names if "pointers_checked: bool = False" not in getattr(_C, n).__doc__]
    assert not missing, missing


def test_build_and_version():
    assert zero8.__version__ == _C.version() == importlib.metadata.version("zero8")
    info = _C.build_info()
    assert set(info) == {"cuda", "nccl", "mpi", "x86_simd"} and all(isinstance(v, bool) for v in info.values())
    assert _C.isa_supported(_C.Isa.scalar) and _C.isa_supported(_C.isa_active())
    assert zero8.build_info()["isa"] == _C.isa_active().name


def test_enum_values_are_the_cpp_codes():
    assert [int(_C.DType.f32), int(_C.DType.bf16), int(_C.DType.f16)] == [0, 1, 2]
    assert [int(k) for k in (_C.MapKind.dynamic_signed, _C.MapKind.dynamic_unsigned, _C.MapKind.linear_signed,
                             _C.MapKind.linear_unsigned)] == [0, 1, 2, 3]
    names = ["adam", "adamw", "sgd", "lion", "rmsprop", "adagrad", "lamb", "lars"]
    assert [int(getattr(_C.Algo, n)) for n in names] == list(range(8))
    assert [int(_C.Isa.scalar), int(_C.Isa.avx2), int(_C.Isa.avx512)] == [0, 1, 2]


def test_package_reexports_and_lazy_submodules():
    for cls in ("Zero8Error", "Zero8ValueError", "Zero8NotSupportedError", "Zero8IOError", "Zero8CommError",
                "Zero8InternalError"):
        assert getattr(zero8, cls) is getattr(_C, cls)
    assert zero8.functional is F
    with pytest.raises(AttributeError):
        zero8.no_such_thing  # noqa: B018
    with pytest.raises(AttributeError, match="not installed"):
        zero8._submodule("no_such_module")  # what zero8.<missing submodule> raises: hasattr() stays usable
    namespace = {}
    exec("from zero8 import *", namespace)
    assert namespace["Zero8ValueError"] is zero8.Zero8ValueError
    # Every submodule dir(zero8) lists exists (it listed a zero8.comm that did not).
    for name in zero8._SUBMODULES:
        assert name in dir(zero8) and getattr(zero8, name).__name__ == f"zero8.{name}"


def test_state_bytes_and_counts():
    n = 1000  # 4 blocks of 256, the last one partial
    assert _C.state_bytes(_C.Algo.adamw, n, 8, 256) == 2 * (n + 4 * 4)
    assert _C.state_bytes(_C.Algo.lion, n, 8, 256) == n + 4 * 4
    assert _C.state_bytes(_C.Algo.adam, n, 32, 256) == 2 * 4 * n
    assert [_C.algo_num_states(a) for a in (_C.Algo.adam, _C.Algo.lamb, _C.Algo.sgd, _C.Algo.adagrad)] == [2, 2, 1, 1]
    assert _C.quant_num_blocks(n, 256) == 4 and _C.quant_bytes(n, 256) == n + 16


def test_struct_keyword_constructors():
    h = _C.Hyper(lr=0.5, beta1=0.8, nesterov=True)
    assert h.lr == 0.5 and h.beta1 == pytest.approx(0.8) and h.nesterov and h.eps == pytest.approx(1e-8)
    with pytest.raises(AttributeError):
        _C.Hyper(learning_rate=0.1)
    a = _C.StepArgs(algo=_C.Algo.lion, n=10, bits=32)
    a.h.lr = 0.25  # the nested Hyper is a reference, not a copy
    assert a.h.lr == 0.25 and a.map1 == _C.MapKind.dynamic_signed and a.map2 == _C.MapKind.dynamic_unsigned
    c = _C.ShardConfig(state_block=64, min_8bit_size=10, dynamic_loss_scale=False)
    c.hyper.weight_decay = 0.5
    assert (c.state_block, c.min_8bit_size, c.dynamic_loss_scale, c.hyper.weight_decay) == (64, 10, False, 0.5)
    assert _C.ParamSpec("w", [3, 4]).numel() == 12


# ---------------------------------------------------------------------------------------------------
# Exceptions


CLASSES = {
    "invalid_argument": (zero8.Zero8ValueError, ValueError),
    "unsupported": (zero8.Zero8NotSupportedError, NotImplementedError),
    "io": (zero8.Zero8IOError, OSError),
    "comm": (zero8.Zero8CommError, RuntimeError),
    "internal": (zero8.Zero8InternalError, RuntimeError),
}


@pytest.mark.parametrize("code", sorted(CLASSES))
def test_every_error_code_maps_to_its_class(code):
    cls, builtin = CLASSES[code]
    with pytest.raises(cls) as info:
        _C._throw(code, f"message of {code}")
    e = info.value
    assert type(e) is cls and isinstance(e, builtin) and isinstance(e, zero8.Zero8Error)
    assert str(e) == f"message of {code}" and e.code == code
    others = [c for k, (c, _) in CLASSES.items() if k != code]
    assert not any(isinstance(e, c) for c in others)
    assert cls("raised from Python").code == code  # zero8's Python modules raise these classes too


def test_errors_from_real_calls():
    with pytest.raises(zero8.Zero8ValueError, match="'block': must be a power of two") as info:
        _C.quantize_blockwise(0, _C.DType.f32, 0, 100, _C.MapKind.dynamic_signed, 0, 0)
    assert info.value.code == "invalid_argument"
    with pytest.raises(zero8.Zero8ValueError, match="'x': null pointer"):
        _C.quantize_blockwise(0, _C.DType.f32, 10, 64, _C.MapKind.dynamic_signed, 0, 0)
    with pytest.raises(zero8.Zero8ValueError, match="'beta1'"):
        _C.hyper_validate(_C.Algo.adamw, _C.Hyper(beta1=1.5))


def test_unsupported_backend_raises_not_supported():
    if _C.build_info()["nccl"]:
        pytest.skip("this build has NCCL: comm_create('nccl') would try to use a GPU")
    with pytest.raises(zero8.Zero8NotSupportedError, match="NCCL"):
        _C.comm_create("nccl")


def test_cuda_quant_kernels_setting():
    """The form of the CUDA 8-bit kernels by name (benchmarks time both); a setting in every build."""
    before = _C.cuda_quant_kernels()
    try:
        _C.set_cuda_quant_kernels("warp")
        assert _C.cuda_quant_kernels() == "warp"
        _C.set_cuda_quant_kernels("block")
        assert _C.cuda_quant_kernels() == "block"
        with pytest.raises(zero8.Zero8ValueError, match="name=fast is not one of block, warp"):
            _C.set_cuda_quant_kernels("fast")
        assert _C.cuda_quant_kernels() == "block"
    finally:
        _C.set_cuda_quant_kernels(before)


def test_io_error_names_the_file(tmp_path):
    with pytest.raises(zero8.Zero8IOError, match="latest"):
        _C.latest_read(str(tmp_path))
    with pytest.raises(zero8.Zero8IOError, match="no_such.json"):
        _C.config_parse_file(str(tmp_path / "no_such.json"), 1)


# ---------------------------------------------------------------------------------------------------
# Config


def read_bad_configs(data_dir):
    rows = []
    for line in (data_dir / "configs" / "bad" / "expected.tsv").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, world, code, substring = line.split("\t")
            rows.append((name, int(world), code, substring))
    assert len(rows) >= 20
    return rows


def test_config_errors_carry_key_path_and_class(data_dir):
    for name, world, code, substring in read_bad_configs(data_dir):
        path = data_dir / "configs" / "bad" / name
        cls, _ = CLASSES[code]
        with pytest.raises(cls) as info:
            _C.config_parse_file(str(path), world)
        assert substring in str(info.value), name
        assert str(info.value).startswith(str(path)), name  # "<source>: <key path>: ..." or "<source>:<line>:..."
        # The same text parsed from a string names the source it is given.
        with pytest.raises(cls) as info:
            _C.config_parse(path.read_text(), world, "from_string.json")
        message = str(info.value)
        assert substring.replace(name, "from_string.json") in message and message.startswith("from_string.json"), name


def test_config_parse_normalizes_and_warns():
    text = json.dumps({
        "train_batch_size": 32, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
        "zero8": {"int8_params": True, "error_feedback": True, "state_block_size": 128, "release_gradients": True},
        "fp16": {"enabled": True},
        "not_a_deepspeed_key": 1,
    })
    normalized, warnings = _C.config_parse(text, 4, "w.json")
    cfg = json.loads(normalized)
    assert cfg["train_micro_batch_size_per_gpu"] == 4  # 32 / (2 * 4)
    assert any("not_a_deepspeed_key" in w for w in warnings)
    info = _C.config_info(normalized)  # the world size comes back from the batch triple
    assert info["world_size"] == 4 and info["algo"] == _C.Algo.adamw and info["optimizer_name"] == "AdamW8bit"
    sc = _C.shard_config_from_json(normalized, 4)
    assert (sc.algo, sc.bits, sc.stage, sc.state_block, sc.reduce_bucket_size) == (_C.Algo.adamw, 8, 2, 128, 1000)
    assert sc.int8_grads and sc.int8_params and sc.error_feedback and sc.release_grads and sc.fp16
    assert not _C.shard_config_from_json(_C.config_parse(json.dumps({"train_batch_size": 4}), 1, "d.json")[0], 1).release_grads
    assert sc.working_dtype == _C.DType.f16 and sc.dynamic_loss_scale and sc.initial_scale_power == 16
    assert sc.hyper.lr == pytest.approx(0.01)
    # Without a zero8 section: exact fp32 communication and 32-bit states; stage 0 runs as stage 1.
    plain, _ = _C.config_parse(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 0}}), 1, "p")
    sp = _C.shard_config_from_json(plain, 1)
    assert (sp.bits, sp.int8_grads, sp.int8_params, sp.stage) == (32, False, False, 1)


# How the typed config (_C.Config) names what the normalized JSON holds: the batch triple is Config.batch,
# "zero_optimization" is Config.zero, zero8.checkpoint.<key> is ConfigZero8.checkpoint_<key>, the
# optimizer's betas are beta1 and beta2, and enum values are the JSON's in lower case (DeepSpeed's
# scheduler names in snake case).
TYPED_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
TYPED_SECTIONS = {"zero_optimization": "zero"}
TYPED_SCHEDULERS = {"WarmupLR": "warmup_lr", "WarmupDecayLR": "warmup_decay_lr", "WarmupCosineLR": "warmup_cosine_lr",
                    "OneCycle": "one_cycle", "LRRangeTest": "lr_range_test"}


def assert_typed_value(typed, value, path: str) -> None:
    if isinstance(value, str) and not isinstance(typed, str):  # an enum
        assert typed.name == TYPED_SCHEDULERS.get(value, value.lower()), path
    else:
        assert type(typed) is type(value) and typed == value, path


def assert_typed_matches_json(cfg: "_C.Config", normalized: dict) -> int:
    """Every value of the normalized JSON against the typed config's attribute for it; returns how many."""
    n = 0
    for key, value in normalized.items():
        if key in TYPED_BATCH_KEYS:
            assert_typed_value(getattr(cfg.batch, key), value, key)
        elif key in ("optimizer", "scheduler"):
            section = getattr(cfg, key)
            assert_typed_value(section.type, value["type"], f"{key}.type")
            for k, v in value["params"].items():
                if key == "optimizer":  # the values of the type's table row, by DeepSpeed's key
                    typed = (section.get("betas[0]"), section.get("betas[1]")) if k == "betas" else section.get(k)
                    assert_typed_value(typed, tuple(v) if k == "betas" else v, f"{key}.params.{k}")
                else:
                    assert_typed_value(getattr(section, k), v, f"{key}.params.{k}")
                n += 1
        elif isinstance(value, dict):
            section = getattr(cfg, TYPED_SECTIONS.get(key, key))
            for k, v in value.items():
                if (key, k) == ("zero8", "checkpoint"):
                    for ck, cv in v.items():
                        assert_typed_value(getattr(section, f"checkpoint_{ck}"), cv, f"zero8.checkpoint.{ck}")
                else:
                    assert_typed_value(getattr(section, k), v, f"{key}.{k}")
                n += 1
        else:
            assert_typed_value(getattr(cfg, key), value, key)
        n += 1
    return n


def test_typed_config_holds_every_value_of_the_normalized_config(data_dir):
    examples = data_dir.parents[1] / "examples" / "configs"
    paths = sorted((data_dir / "configs").glob("*.json")) + sorted(examples.glob("*.json"))
    assert len(paths) >= 5
    for path in paths:
        cfg = _C.Config.from_file(str(path), 1)
        normalized = json.loads(cfg.to_json())
        assert normalized == json.loads(_C.config_parse_file(str(path), 1)[0]), path
        assert assert_typed_matches_json(cfg, normalized) > 60, path
        assert cfg.source == str(path) and _C.Config.from_normalized(cfg.to_json()) == cfg
        assert _C.config_info(cfg) == _C.config_info(cfg.to_json(), 1)
    # Every scheduler type, and the values only some configs set.
    for sched, params in (("WarmupLR", {"warmup_max_lr": 0.05, "warmup_type": "linear"}),
                          ("WarmupDecayLR", {"total_num_steps": 100}),
                          ("WarmupCosineLR", {"total_num_steps": 100, "warmup_min_ratio": 0.1}),
                          ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2}),
                          ("LRRangeTest", {"lr_range_test_staircase": True})):
        cfg = _C.Config(json.dumps({
            "train_batch_size": 8, "communication_data_type": "bf16", "bf16": {"enabled": True},
            "optimizer": {"type": "Lamb", "params": {"lr": 0.02, "max_coeff": 5.0}},
            "scheduler": {"type": sched, "params": params},
            "checkpoint": {"tag_validation": "Fail"}, "zero8": {"comm_backend": "mpi", "seed": 7},
        }), 2, "all.json")
        assert assert_typed_matches_json(cfg, json.loads(cfg.to_json())) > 60, sched
        assert cfg.communication_data_type == _C.CommDataType.bf16 and cfg.working_dtype == _C.DType.bf16
        assert (cfg.batch.train_micro_batch_size_per_gpu, cfg.world_size, cfg.algo) == (4, 2, _C.Algo.lamb)


def test_typed_config_is_read_only_and_outlives_nothing_it_needs():
    cfg = _C.Config(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 2}, "zero8": {}}), 1, "r.json")
    assert (cfg.zero.stage, cfg.zero8.enabled, cfg.optimizer.present) == (2, True, False)
    with pytest.raises(AttributeError):
        cfg.zero.stage = 1
    with pytest.raises(AttributeError):
        cfg.zero8 = None
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and (again.source, again.warnings) == (cfg.source, cfg.warnings) and again is not cfg
    assert copy.deepcopy(cfg) == cfg
    zero = cfg.zero  # a section keeps its Config alive
    del cfg
    gc.collect()
    assert zero.stage == 2
    with pytest.raises(zero8.Zero8ValueError, match="zero_optimization.stage"):
        _C.Config(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 7}}), 1, "bad.json")
    # load_config hands it over, parsed once with the normalized JSON and the warnings.
    from zero8.config import load_config

    loaded = load_config({"train_batch_size": 4, "not_a_key": 1}, 1, warn=False)
    assert loaded.typed.to_json() == loaded.json and list(loaded.typed.warnings) == loaded.warnings
    assert any("not_a_key" in w for w in loaded.warnings)
    assert pickle.loads(pickle.dumps(loaded)) == loaded  # a plain dataclass, as before it held the typed config


def test_scheduler_from_config():
    text = json.dumps({
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                     "warmup_num_steps": 10, "warmup_type": "linear"}},
    })
    normalized, _ = _C.config_parse(text, 1, "s")
    sch = _C.Scheduler(normalized)
    lrs = [sch.lr_at(i) for i in range(-1, 15)]
    assert sch.type == "WarmupLR"
    assert all(b >= a for a, b in zip(lrs, lrs[1:])), "warmup never decreases"
    assert lrs[-1] == 0.05 and lrs[0] < 0.05  # reaches warmup_max_lr exactly after the warmup
    assert [_C.lr_at(normalized, i) for i in range(-1, 15)] == lrs
    # No scheduler and no optimizer section: the client optimizer's lr, set by the caller.
    bare, _ = _C.config_parse(json.dumps({"train_batch_size": 4}), 1, "b")
    with pytest.raises(zero8.Zero8ValueError):
        _C.lr_at(bare, 0)
    assert _C.lr_at(bare, 5, base_lr=0.3) == 0.3
    with pytest.raises(zero8.Zero8ValueError, match="momentum"):
        sch.momentum_at(0)


# ---------------------------------------------------------------------------------------------------
# GIL


def assert_runs_without_gil(call):
    """Run `call` in a thread while this thread keeps executing Python: if the call held the GIL, this
    thread could not run between the call's start and end (beyond one switch interval before it enters
    C++), so its loop iterations would not span the call."""
    times = {}
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-3)  # a GIL held across the call would then leave this thread ~1 ms at most

    def worker():
        times["start"] = time.perf_counter()
        call()
        times["end"] = time.perf_counter()

    t = threading.Thread(target=worker)
    ticks = []
    t.start()
    while t.is_alive():
        ticks.append(time.perf_counter())
        sum(range(100))
    t.join()
    sys.setswitchinterval(old_interval)
    duration = times["end"] - times["start"]
    inside = [s for s in ticks if times["start"] < s < times["end"]]
    assert duration > 0.03, f"the call took {duration:.4f} s: too short to tell"
    assert inside and max(inside) - min(inside) > 0.5 * duration, (
        f"this thread ran for {max(inside) - min(inside) if inside else 0:.4f} s of the call's {duration:.4f} s")


def test_gil_released_during_quantize():
    n = 1 << 26
    x = torch.randn(n)
    codes = torch.empty(n, dtype=torch.uint8)
    absmax = torch.empty(n // 4096)
    # One long call (stochastic rounding on one thread: 0.1-0.4 s here); several short ones would let this
    # thread run between them and pass without proving anything.
    assert_runs_without_gil(lambda: _C.quantize_blockwise(
        x.data_ptr(), _C.DType.f32, n, 4096, _C.MapKind.dynamic_signed, codes.data_ptr(), absmax.data_ptr(),
        stochastic=True, threads=1))


def test_gil_released_during_step():
    # 8-bit LAMB, both phases in one long call: 2^26 elements on one thread take ~0.1 s here (2^24 took
    # 25 ms after the VBMI kernels, too short for the check; several calls would not prove anything).
    n = 1 << 26
    p, g = torch.randn(n), torch.randn(n)
    codes = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
    absmax = [torch.zeros(n // 256) for _ in range(2)]
    a = _C.StepArgs(algo=_C.Algo.lamb, n=n, bits=8, param=p.data_ptr(), grad=g.data_ptr(),
                    code1=codes[0].data_ptr(), absmax1=absmax[0].data_ptr(),
                    code2=codes[1].data_ptr(), absmax2=absmax[1].data_ptr())
    assert_runs_without_gil(lambda: _C.step_tensor(a, threads=1))


# ---------------------------------------------------------------------------------------------------
# Optimizer kernels through raw pointers


def test_step_tensor_adamw_32bit_matches_torch():
    # 32-bit AdamW through the binding against torch.optim.AdamW: the fields reach the kernel. Tolerance:
    # twice the error of torch's own float32 AdamW against the float64 one.
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(3000, generator=g)
    grads = [torch.randn(3000, generator=g) for _ in range(5)]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)

    def run_torch(dtype):
        w = torch.nn.Parameter(p0.to(dtype).clone())
        opt = torch.optim.AdamW([w], **hp, foreach=False)
        for gr in grads:
            w.grad = gr.to(dtype)
            opt.step()
        return w.detach().double()

    ref64, ref32 = run_torch(torch.float64), run_torch(torch.float32)
    p, m, v = p0.clone(), torch.zeros(3000), torch.zeros(3000)
    a = _C.StepArgs(algo=_C.Algo.adamw, n=3000, bits=32, param=p.data_ptr(), state1=m.data_ptr(),
                    state2=v.data_ptr())
    a.h = _C.Hyper(lr=hp["lr"], beta1=0.9, beta2=0.99, eps=hp["eps"], weight_decay=hp["weight_decay"])
    for k, gr in enumerate(grads, start=1):
        a.grad = gr.data_ptr()
        a.h.step = k
        _C.step_tensor(a)
    err_ours = (p.double() - ref64).abs().max().item()
    err_torch = (ref32 - ref64).abs().max().item()
    assert err_ours <= 2 * err_torch + F32_EPS * ref64.abs().max().item()


def test_lamb_step_tensor_is_norms_trust_step():
    # step_tensor = norms_range -> trust_ratio -> step_range with that trust, bit for bit.
    g = torch.Generator().manual_seed(1)
    n = 1000
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    results = []
    for two_phase in (False, True):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        a = _C.StepArgs(algo=_C.Algo.lamb, n=n, bits=32, param=p.data_ptr(), grad=grad.data_ptr(),
                        state1=m.data_ptr(), state2=v.data_ptr(), h=_C.Hyper(lr=0.01, weight_decay=0.01))
        if two_phase:
            (w_sq, u_sq), = _C.norms_range(a)
            assert w_sq == pytest.approx(float(p0.double().pow(2).sum()), rel=1e-6)
            a.set_segments([], [_C.trust_ratio(_C.Algo.lamb, a.h, w_sq, u_sq)])
            _C.step_range(a)
        else:
            with pytest.raises(zero8.Zero8ValueError, match="seg_trust"):
                _C.step_range(a)  # phase 2 alone needs the trust ratios
            _C.step_tensor(a)
        results.append(p)
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], p0)


def test_step_args_segment_validation():
    a = _C.StepArgs()
    with pytest.raises(zero8.Zero8ValueError, match="'offsets'"):
        a.set_segments([0])
    with pytest.raises(zero8.Zero8ValueError, match="'trust'"):
        a.set_segments([0, 5, 10], [1.0])
    a.set_segments([0, 5, 10], [1.0, 2.0])
    assert a.seg_offsets == [0, 5, 10] and a.seg_trust == [1.0, 2.0]
    a.clear_segments()
    assert a.seg_offsets == [] and a.seg_trust == []


# ---------------------------------------------------------------------------------------------------
# Communicator (single backend)


def test_comm_single_backend_ops():
    c = _C.comm_create("single")
    assert (c.rank, c.size, c.backend, c.name, c.memory) == (0, 1, "single", "world", "host")
    assert "single" in c.description() and c.world_ranks == [0]
    c.timeout = 12.5
    assert c.timeout == 12.5
    c.barrier()
    assert c.broadcast_bytes(b"hello", 0) == b"hello"
    assert c.all_gather_bytes(b"xyz") == [b"xyz"]
    assert c.all_reduce_f64([1.5, -2.0], "sum") == [1.5, -2.0]
    assert c.all_reduce_f64([1.5, -2.0], "max") == [1.5, -2.0]
    for dtype, name in ((torch.float32, "f32"), (torch.float64, "float64"), (torch.int64, "i64")):
        t = torch.arange(5, dtype=dtype)
        c.all_reduce_ptr(t.data_ptr(), 5, name, "sum")
        assert torch.equal(t, torch.arange(5, dtype=dtype))
    buf = torch.arange(4, dtype=torch.int32)
    out = torch.zeros(4, dtype=torch.int32)
    c.all_gather_ptr(buf.data_ptr(), out.data_ptr(), 16)
    assert torch.equal(out, buf)
    # Point-to-point queued on a stream is NCCL's alone: a host backend has nothing in flight to wait for.
    assert not c.queues_p2p
    c.sync()
    s = c.stats()
    assert s["barrier"]["calls"] == 1 and s["broadcast"]["calls"] == 2 and s["all_reduce"]["calls"] == 5
    assert s["sync"]["calls"] == 1
    assert all(v["bytes"] == 0 and v["bytes_to_peer"] == [0] for v in s.values())  # nothing leaves the process
    c.stats_reset()
    assert all(v["calls"] == 0 for v in c.stats().values())
    child = c.split(3, 0, "child")
    assert child.size == 1 and child.name == "child" and child.timeout == 12.5
    assert c.split(-1, 0, "none") is None
    topo = _C.topology_split(c, 1)
    assert (topo["pp"], topo["dp"], topo["pp_stage"], topo["dp_rank"]) == (1, 1, 0, 0)
    assert topo["dp_group"].size == 1 and topo["pp_group"].size == 1
    nodes = _C.node_groups(c)
    assert nodes["nodes"] == 1 and nodes["local_size"] == 1
    with pytest.raises(zero8.Zero8ValueError, match="'op'"):
        c.all_reduce_f64([1.0], "prod")
    with pytest.raises(zero8.Zero8ValueError, match="'scalar_type'"):
        c.all_reduce_ptr(buf.data_ptr(), 4, "complex", "sum")
    with pytest.raises(zero8.Zero8ValueError):
        c.send_bytes(b"x", 1)  # no peer 1 in a world of one


# ---------------------------------------------------------------------------------------------------
# Sharded optimizer (single backend)


SPECS = [("w1", [64, 80]), ("b1", [80]), ("w2", [80, 70]), ("b2", [70])]  # w*: 8-bit states, b*: fp32


def make_optimizer(comm=None):
    cfg = _C.ShardConfig(algo=_C.Algo.adamw, bits=8, stage=2, reduce_bucket_size=4096, int8_params=False)
    cfg.hyper.lr = 1e-2
    cfg.hyper.weight_decay = 0.01
    return _C.ShardedOptimizer([_C.ParamSpec(n, s) for n, s in SPECS], cfg, comm or _C.comm_create("single"))


def f32_view(mv) -> torch.Tensor:
    return torch.frombuffer(mv, dtype=torch.float32)


def grads_of_step(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(torch.Size(shape).numel(), generator=g) for _, shape in SPECS]


def train(opt, steps: range):
    grad_views = [f32_view(opt.grad_buffer(gr)) for gr in range(_C.NUM_GROUPS)]
    infos = []
    for s in steps:
        for i, gr in enumerate(grads_of_step(s)):
            group, offset, numel = opt.param_slot(i)
            grad_views[group][offset:offset + numel] = gr
        for i in reversed(range(len(SPECS))):
            opt.grad_ready(i)
        opt.backward_end(True)
        infos.append(opt.step())
    return infos


def init_weights(opt):
    working = [f32_view(opt.working_buffer(gr)) for gr in range(_C.NUM_GROUPS)]
    g = torch.Generator().manual_seed(7)
    for i in range(len(SPECS)):
        group, offset, numel = opt.param_slot(i)
        working[group][offset:offset + numel] = torch.randn(numel, generator=g) * 0.1
    opt.init()
    return working


def test_sharded_buffers_are_zero_copy_views():
    opt = make_optimizer()
    assert (opt.rank, opt.world, opt.num_params, opt.steps) == (0, 1, 4, 0)
    assert [opt.param_slot(i)[0] for i in range(4)] == [0, 1, 0, 1]  # min_8bit_size 4096
    working = init_weights(opt)
    # Written through the torch view, read by C++: init() set the masters from the working copy.
    for gr in range(_C.NUM_GROUPS):
        begin, valid = opt.part_range(gr)
        assert begin == 0 and valid == opt.group_numel(gr) <= opt.group_padded(gr)
        assert torch.equal(f32_view(opt.master_values(gr)), working[gr][:valid])
    # Written by C++ (the step), seen through the same torch tensor without copying.
    before = working[0].clone()
    ptr = working[0].data_ptr()
    train(opt, range(1))
    assert working[0].data_ptr() == ptr and not torch.equal(working[0], before)
    # The views keep the optimizer alive: a tensor made from one holds a reference until it is gone.
    mv = opt.working_buffer(0)
    assert mv.obj.owner is opt and not mv.readonly
    del mv
    refs = sys.getrefcount(opt)
    t = f32_view(opt.grad_buffer(1))
    assert sys.getrefcount(opt) == refs + 1
    del t
    gc.collect()
    assert sys.getrefcount(opt) == refs
    expected = working[0].clone()
    del opt
    gc.collect()
    assert torch.equal(working[0], expected)
    with pytest.raises(zero8.Zero8ValueError, match="'group'"):
        make_optimizer().working_buffer(2)
    with pytest.raises(zero8.Zero8ValueError, match="'param'"):
        make_optimizer().param_slot(4)


def test_sharded_keeps_its_communicator_alive():
    opt = make_optimizer(_C.comm_create("single"))  # no other reference to the communicator
    gc.collect()
    init_weights(opt)
    assert train(opt, range(2))[-1]["step"] == 2


def test_sharded_step_matches_step_tensor():
    opt = make_optimizer()
    working = init_weights(opt)
    # The reference: per group, the fused kernel over the group's flat range (the layout concatenates the
    # parameters, so 8-bit blocks span them exactly as in the sharded optimizer), states created as C++ does.
    ref = []
    for gr, bits in ((0, 8), (1, 32)):
        n = opt.group_numel(gr)
        p = working[gr][:n].clone()
        a = _C.StepArgs(algo=_C.Algo.adamw, n=n, bits=bits, block=256, param=p.data_ptr())
        keep = [p]
        if bits == 8:
            for which in (1, 2):
                codes, state = F.quantize_blockwise(torch.zeros(n), blocksize=256)
                setattr(a, f"code{which}", codes.data_ptr())
                setattr(a, f"absmax{which}", state.absmax.data_ptr())
                keep += [codes, state.absmax]
        else:
            s1, s2 = torch.zeros(n), torch.zeros(n)
            a.state1, a.state2 = s1.data_ptr(), s2.data_ptr()
            keep += [s1, s2]
        ref.append((a, keep))
    infos = train(opt, range(3))
    for step in range(3):
        flat = [torch.zeros(opt.group_numel(gr)) for gr in range(2)]
        for i, gd in enumerate(grads_of_step(step)):
            group, offset, numel = opt.param_slot(i)
            flat[group][offset:offset + numel] = gd
        for gr, (a, keep) in enumerate(ref):
            a.h = opt.hyper
            a.h.step = step + 1
            a.grad = flat[gr].data_ptr()
            keep.append(flat[gr])
            _C.step_tensor(a)
    assert [i["step"] for i in infos] == [1, 2, 3] and not any(i["skipped"] for i in infos)
    # One rank: gradients arrive exactly (own range), grad_scale 1: identical arithmetic, identical bits.
    for gr, (a, keep) in enumerate(ref):
        n = opt.group_numel(gr)
        assert torch.equal(working[gr][:n], keep[0]), f"group {gr}"
        assert torch.equal(f32_view(opt.master_values(gr)), keep[0])
    # The 8-bit states too: State::values decodes what the reference kernel wrote.
    n0 = opt.group_numel(0)
    codes1, absmax1 = ref[0][1][1], ref[0][1][2]
    m1 = F.dequantize_blockwise(codes1, absmax=absmax1, blocksize=256)
    assert torch.equal(torch.tensor(opt.state_values(0, 1)), m1) and m1.numel() == n0
    codes2, absmax2 = ref[0][1][3], ref[0][1][4]
    m2 = F.dequantize_blockwise(codes2, absmax=absmax2, code=F.create_dynamic_map(signed=False), blocksize=256)
    assert torch.equal(torch.tensor(opt.state_values(0, 2)), m2)
    # grad_norm of step 3: the global norm of the gradient, in float64 here.
    last = torch.cat([gd.double() for gd in grads_of_step(2)]).norm().item()
    assert infos[-1]["grad_norm"] == pytest.approx(last, rel=1e-12)
    mem = opt.memory()
    assert mem["state"] == _C.state_bytes(_C.Algo.adamw, n0, 8, 256) + _C.state_bytes(_C.Algo.adamw, opt.group_numel(1), 32, 256)


def test_sharded_hyper_is_live():
    opt = make_optimizer()
    opt.set_lr(0.5)
    assert opt.lr == 0.5 and opt.hyper.lr == 0.5
    opt.hyper.beta2 = 0.95  # by reference
    assert opt.config.hyper.beta2 == pytest.approx(0.95)
    assert opt.num_hyper_groups == 1 and opt.group_hyper(0).beta2 == pytest.approx(0.95)
    opt.group_hyper(0).lr = 0.25
    assert opt.lr == 0.25 and opt.config.hyper.lr == 0.25
    with pytest.raises(zero8.Zero8ValueError, match="hyper_group"):
        opt.group_hyper(1)


# ---------------------------------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_round_trip(tmp_path):
    opt = make_optimizer()
    working = init_weights(opt)
    train(opt, range(3))
    saved = _C.checkpoint_save(opt, str(tmp_path), client_state_json=json.dumps({"epoch": 3, "it": [1, 2]}),
                               config_json='{"train_batch_size": 1}')
    assert saved["tag"] == "global_step3" and saved["removed"] == [] and saved["bytes"] > 0
    assert _C.latest_read(str(tmp_path)) == "global_step3"
    assert _C.checkpoint_tags(str(tmp_path)) == ["global_step3"]
    check = _C.checkpoint_verify(saved["path"])
    assert check["ok"], check["problems"]

    fresh = make_optimizer()
    fresh_working = init_weights(fresh)  # different from what was saved until loaded
    loaded = _C.checkpoint_load(fresh, str(tmp_path))
    assert loaded["tag"] == "global_step3" and loaded["step"] == 3 and loaded["saved_world"] == 1
    assert json.loads(loaded["client_state_json"]) == {"epoch": 3, "it": [1, 2]}
    assert json.loads(loaded["config_json"]) == {"train_batch_size": 1}
    assert fresh.steps == 3
    for gr in range(_C.NUM_GROUPS):
        assert torch.equal(fresh_working[gr], working[gr])
        assert torch.equal(f32_view(fresh.master_values(gr)), f32_view(opt.master_values(gr)))
        for which in (1, 2):
            assert fresh.state_values(gr, which) == opt.state_values(gr, which)
    # Resuming continues exactly as the uninterrupted run.
    train(opt, range(3, 5))
    train(fresh, range(3, 5))
    for gr in range(_C.NUM_GROUPS):
        assert torch.equal(fresh_working[gr], working[gr])

    out = tmp_path / "weights.safetensors"
    _C.checkpoint_export_fp32(saved["path"], str(out))
    assert out.stat().st_size > 4 * sum(torch.Size(s).numel() for _, s in SPECS)
    with pytest.raises(zero8.Zero8IOError):
        _C.checkpoint_load(fresh, str(tmp_path / "missing"))
