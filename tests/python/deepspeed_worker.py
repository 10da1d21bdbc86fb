"""One rank of tests/python/test_deepspeed.py's runs under DeepSpeed (torchrun, gloo, CPU): a tiny GPT-2 built
from a config (no download) trained with zero8's optimizer or torch's AdamW as DeepSpeed's client optimizer,
checkpoints saved and loaded. Each scenario named on the command line runs in turn; rank 0 writes what it
measured as JSON to --out.

    torchrun --nproc_per_node 2 deepspeed_worker.py --dir D --out R.json train resume ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

torch.set_num_threads(1)

import deepspeed  # noqa: E402
import transformers  # noqa: E402
from deepspeed.utils import logger as ds_logger  # noqa: E402

import zero8  # noqa: E402
from zero8.optim.partition import LAYOUT_KEY  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from pretrain_example import gloo_rank_exit  # noqa: E402

ds_logger.setLevel("ERROR")
transformers.logging.set_verbosity_error()

STEPS = 8  # training steps of a run
SAVE_AT = 4  # the checkpoint the resume and conversion scenarios start from
VOCAB, SEQ, MICRO = 128, 32, 4
MIN_8BIT = 4096
OVERRIDE = "transformer.h.0.mlp.c_fc.weight"  # 8-bit by size, 32-bit by override


def model_config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def new_model(dtype=torch.float32):
    torch.manual_seed(1234)
    return transformers.GPT2LMHeadModel(model_config()).to(dtype)


def batch(step: int, rank: int) -> torch.Tensor:
    """A learnable batch: each sequence repeats a short random motif, different per step and rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    motif = torch.randint(0, VOCAB, (MICRO, 4), generator=g)
    return motif.repeat(1, SEQ // 4)


def ds_config(stage: int, bf16: bool, universal: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if stage == 3:  # several sub-groups per param group, each stepped as a partition of its own
        cfg["zero_optimization"]["sub_group_size"] = 40000
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def engine_for(kind: str, stage: int = 2, bf16: bool = False, universal: bool = False):
    model = new_model(torch.bfloat16 if bf16 else torch.float32)
    if kind == "zero8":
        opt = zero8.deepspeed.optimizer(model, "AdamW8bit", lr=2e-3, weight_decay=0.01, min_8bit_size=MIN_8BIT)
        opt.override_config(dict(model.named_parameters())[OVERRIDE], optim_bits=32)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, bf16, universal))
    return engine


def train(engine, first: int, last: int) -> list:
    losses = []
    rank = torch.distributed.get_rank()
    for step in range(first, last):
        x = batch(step, rank)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1)
        torch.distributed.all_reduce(t)
        losses.append(float(t) / torch.distributed.get_world_size())
    return losses


def base_opt(engine):
    return engine.optimizer.optimizer  # DeepSpeed's ZeRO wrapper -> the client optimizer


def flat_partitions(ds_optimizer) -> list:
    """The flat fp32 partitions DeepSpeed steps its client optimizer on: one per param group under ZeRO 1/2; under
    ZeRO-3 one per sub-group, held outside the client's param groups (DeepSpeed puts them there only to step, save
    and load them)."""
    z3 = getattr(ds_optimizer, "fp32_partitioned_groups_flat", None)
    return list(z3) if z3 is not None else [g["params"][0] for g in ds_optimizer.optimizer.param_groups]


def numel(p) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # a ZeRO-3 parameter is empty outside its forward


def layout_report(engine) -> dict:
    """Per rank: the 8-bit state bytes and elements, and every segment checked against the rules."""
    opt = base_opt(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    embeddings = {id(w) for w in zero8.deepspeed.embedding_weights(engine.module)}
    bytes8 = n8 = segs8 = 0
    bad = []
    flats = flat_partitions(engine.optimizer)
    # Each segment's elements of the partition must be the fp32 master's elements it claims (a collective).
    full = {id(p): t.reshape(-1) for p, t in zip(engine.module.parameters(), fp32_weights(engine).values())}
    for flat in flats:
        st = opt.state[flat]
        for s in opt.partition_segments(flat):
            if not torch.equal(flat[s.start:s.start + s.numel], full[id(s.param)][s.offset:s.offset + s.numel]):
                bad.append([s.name, "elements", s.start, s.offset, s.numel])
            want = 8 if (numel(s.param) >= MIN_8BIT and id(s.param) not in embeddings and s.name != OVERRIDE) else 32
            if s.bits != want or s.name != names[id(s.param)]:
                bad.append([s.name, s.bits, want])
            if s.bits == 8 and s.block != 256:
                bad.append([s.name, "block", s.block])
            segs8 += s.bits == 8
        if "state1" in st:
            n8 += st["state1"].numel()
            bytes8 += sum(st[k].numel() * st[k].element_size() for k in ("state1", "state2", "absmax1", "absmax2"))
        assert st[LAYOUT_KEY] == tuple(s.record() for s in opt.partition_segments(flat))
    total8 = sum(numel(p) for n, p in engine.module.named_parameters()
                 if numel(p) >= MIN_8BIT and id(p) not in embeddings and n != OVERRIDE)
    return {"bytes8": bytes8, "n8": n8, "segs8": segs8, "total8": total8, "bad": bad, "partitions": len(flats),
            "groups": len(opt.param_groups)}


def gather(obj):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def fp32_weights(engine) -> dict:
    """The full fp32 master weights (DeepSpeed's safe_get_full_fp32_param, a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("scenarios", nargs="+", help="train, resume, load_torch, load_universal=<tag dir>, hf")
    a = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    res: dict = {"world": world}
    ckpt = os.path.join(a.dir, f"zero8_np{world}")
    for sc in a.scenarios:
        sc, _, arg = sc.partition("=")
        if sc == "train":  # zero8 and torch's AdamW, same data; zero8's checkpoint at SAVE_AT
            e = engine_for("zero8", a.stage, a.bf16)
            res["zero8_losses"] = train(e, 0, SAVE_AT)
            e.save_checkpoint(ckpt, tag=f"global_step{SAVE_AT}")
            res["zero8_losses"] += train(e, SAVE_AT, STEPS)
            res["layout"] = gather(layout_report(e))
            res["zero8_final"] = final_weights(e)
            t = engine_for("torch", a.stage, a.bf16)
            res["torch_losses"] = train(t, 0, STEPS)
            t.save_checkpoint(os.path.join(a.dir, f"torch_np{world}"), tag=f"global_step{STEPS}")
        elif sc == "resume":  # exact resume of zero8's checkpoint at the same world size
            e = engine_for("zero8", a.stage, a.bf16)
            e.load_checkpoint(ckpt, tag=f"global_step{SAVE_AT}")
            res["resume_start"] = final_weights(e)
            res["resume_losses"] = train(e, SAVE_AT, STEPS)
            res["resume_final"] = final_weights(e)
        elif sc == "load_torch":  # torch's AdamW ZeRO checkpoint (same world size) into zero8: quantized
            tag_dir = os.path.join(a.dir, f"torch_np{world}", f"global_step{STEPS}")
            e = engine_for("zero8", a.stage, a.bf16)
            e.load_checkpoint(os.path.dirname(tag_dir), tag=os.path.basename(tag_dir))
            res["load_torch"] = check_loaded(e, zero8.deepspeed.read_checkpoint(tag_dir))
            res["load_torch_losses"] = train(e, STEPS, STEPS + 2)
        elif sc == "load_universal":  # a universal checkpoint into zero8 at this world size; saved again
            e = engine_for("zero8", a.stage, a.bf16, universal=True)
            e.load_checkpoint(os.path.dirname(arg), tag=os.path.basename(arg))
            key = f"load_universal:{os.path.basename(os.path.dirname(arg))}"
            res[key] = check_loaded(e, zero8.deepspeed.read_checkpoint(arg))
            res[key + ":losses"] = train(e, STEPS, STEPS + 2)
            e.save_checkpoint(os.path.join(a.dir, f"from_{os.path.basename(os.path.dirname(arg))}_np{world}"),
                              tag=f"global_step{STEPS + 2}")
        elif sc == "hf":
            res["hf"] = hf_trainer(a.dir, a.stage)
        else:
            raise SystemExit(f"unknown scenario {sc}")
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(res, f)
    gloo_rank_exit()  # past every rank's work: not the gloo abort some interpreter exits end in


def final_weights(engine) -> dict:
    return {n: float(t.double().norm()) for n, t in fp32_weights(engine).items()}


def hf_trainer(out_dir: str, stage: int) -> dict:
    """The Hugging Face Trainer under DeepSpeed with zero8's optimizer through optimizer_cls_and_kwargs."""
    model = new_model()

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            x = batch(i, 0)[0]
            return {"input_ids": x, "labels": x}

    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, "hf"), per_device_train_batch_size=MICRO, max_steps=4, learning_rate=2e-3,
        logging_steps=1, save_strategy="no", report_to=[], deepspeed=ds_config(stage, False),
        disable_tqdm=True)
    cls_kwargs = zero8.deepspeed.trainer_optimizer_cls_and_kwargs(model, args, min_8bit_size=MIN_8BIT)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(), optimizer_cls_and_kwargs=cls_kwargs)
    out = trainer.train()
    opt = trainer.model_wrapped.optimizer.optimizer
    bits = {}
    for flat in flat_partitions(trainer.model_wrapped.optimizer):
        for s in opt.partition_segments(flat):
            bits[s.name] = s.bits
    return {"class": f"{type(opt).__module__}.{type(opt).__name__}", "loss": out.training_loss,
            "groups": len(opt.param_groups), "bits": bits}


def check_loaded(engine, states) -> dict:
    """How far the loaded weights and states are from the per-parameter tensors the checkpoint holds
    (zero8.deepspeed.read_checkpoint): the fp32 weights must be equal; the states within the 8-bit codes' error
    (relative to each parameter's largest state value)."""
    from deepspeed.utils import safe_get_full_fp32_param
    want = states.params
    opt = base_opt(engine)
    worst = {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    # The states as torch's names over each flat partition, decoded, then by parameter through the mapping.
    from zero8.optim.partition import decode_partition_state
    got_states = {}
    opt.state_dict()  # quantizes what a universal load wrote under torch's names
    for group in opt.param_groups:
        flat = group["params"][0]
        st = opt.state[flat]
        assert "exp_avg" not in st and st["state1"].dtype == torch.uint8
        got_states[id(flat)] = decode_partition_state(st, st[LAYOUT_KEY], flat.numel(), 2, "check")
    for p, name in engine.optimizer.param_names.items():
        w = want[name]
        fp32 = safe_get_full_fp32_param(p)
        worst["fp32"] = max(worst["fp32"], float((fp32 - w["fp32"]).abs().max()))
        for key, idx in (("exp_avg", 0), ("exp_avg_sq", 1)):
            full = torch.zeros(p.numel())
            m = p._hp_mapping
            if m is not None:
                hp, lp = m.get_hp_fragment_address(), m.lp_fragment_address
                flat_id = next(id(g["params"][0]) for gi, g in enumerate(opt.param_groups)
                               if any(q is p for q in engine.optimizer.bit16_groups[gi]))
                full[lp.start:lp.start + lp.numel] = got_states[flat_id][idx][hp.start:hp.start + hp.numel]
            torch.distributed.all_reduce(full)
            ref = w[key].reshape(-1)
            scale = float(ref.abs().max()) or 1.0
            worst[key] = max(worst[key], float((full - ref).abs().max()) / scale)
    return worst


if __name__ == "__main__":
    sys.exit(main())
