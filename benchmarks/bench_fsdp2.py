"""zero8 in FSDP2 (fully_shard) jobs, measured side by side in one job: (1) zero8.optim.AdamW8bit against
torch.optim.AdamW on the same sharded model, the optimizer state each rank holds and the time of
optimizer.step(); (2) --train: whole training steps with FSDP2's float32 collectives, with zero8.fsdp's int8
gradient reduce-scatter, and with that and its int8 parameter all-gather (the same model, batches and 8-bit
optimizer, rounds alternated), the step time and the bytes sent; with --ddp, DistributedDataParallel's float32
all-reduce against zero8.ddp's int8 hook instead; with --hsdp, HSDP on 2 replicas: FSDP2's native HSDP (a 2-d
mesh, float32 all-reduce across the replicas) against sharding over the mesh's shard dimension with
zero8.fsdp.int8_replicate_all_reduce over its replicate one, alone and with the int8 reduce-scatter; (3)
--where: (2) on two hosts, the ranks in two network namespaces joined by a veth pair, rate-shaped with tc
(scripts/netns_cluster.sh, as benchmarks/bench_vs_deepspeed.py; needs root), one rank per host (--hsdp: two, a
host's ranks the shard group, the hosts the replicas); (4) --quality: what the int8 wires cost in loss, the
pretraining example's GPT trained with each; (5) --codec-calls, in one process without torchrun: the host
time of one exchange's codec work (the int8 reduce-scatter's encode and sum, the all-gather's decode) with all
ranks' pieces in one call of the codec each, as zero8.fsdp and zero8.ddp run it, against one call per piece
(written out here; what they ran before), alternated, at several rank counts and piece sizes.

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_fsdp2.py            # (1), CPU, gloo
    torchrun --standalone --nproc_per_node 1 benchmarks/bench_fsdp2.py --device cuda
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_fsdp2.py --train    # (2), one host
    python3 benchmarks/bench_fsdp2.py --where 1gbit,10gbit                        # (3), as root
    python3 benchmarks/bench_fsdp2.py --where 1gbit,10gbit --ddp                  # (3) for DDP
    python3 benchmarks/bench_fsdp2.py --where 1gbit,10gbit --hsdp                 # (3) for HSDP, 2 hosts x 2 ranks
    torchrun --standalone --nproc_per_node 4 benchmarks/bench_fsdp2.py --train --hsdp  # (2) for HSDP, one host
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_fsdp2.py --quality --seeds 1234,1235  # (4)
    python3 benchmarks/bench_fsdp2.py --codec-calls [--device cuda]               # (5)

The model is a stack of MLP blocks (dim x 4 dim and back), every weight sharded by rows over the ranks (--hsdp:
over the shard group), trained to shrink its output's mean square. Rank 0 prints a table and, last, one JSON line
(also written to --json-out), with every step's loss per wire; the driver of (3) prints one table for its
scenarios: the speed-ups, the bytes on the link and how far each int8 wire's loss strayed from float32's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch


def state_bytes(opt) -> int:
    """Bytes of this rank's optimizer state (DTensors: their local shards; the shared code maps not counted)."""
    total = 0
    for st in opt.state.values():
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and not key.startswith("qmap"):
                v = v.to_local() if hasattr(v, "to_local") else v
                total += v.numel() * v.element_size()
    return total


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10, help="(1): steps timed; (2), (3): rounds per wire")
    ap.add_argument("--steps", type=int, default=2, help="(2), (3): training steps per round (default 2)")
    ap.add_argument("--tokens", type=int, default=512, help="(2), (3): rows of a batch (default 512)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--train", action="store_true", help="(2): training steps, float32 against the int8 wires")
    ap.add_argument("--ddp", action="store_true", help="(2), (3): DistributedDataParallel instead of FSDP2")
    ap.add_argument("--hsdp", action="store_true",
                    help="(2), (3): HSDP on 2 replicas instead of FSDP2 (an even number of ranks; (3): 2 per host)")
    ap.add_argument("--where", default=None, help="(3): scenarios, comma-separated: local, 1gbit, 10gbit")
    ap.add_argument("--quality", action="store_true",
                    help="(4): the pretraining example's GPT trained with each wire; validation losses")
    ap.add_argument("--seeds", default="1234", help="(4): comma-separated seeds (initialization and batches)")
    ap.add_argument("--quality-steps", type=int, default=600, help="(4): training steps per run (default 600)")
    ap.add_argument("--codec-calls", action="store_true",
                    help="(5): the codec's host time per exchange, one call for all pieces against one per piece")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.ddp and args.hsdp:
        ap.error("--ddp and --hsdp: one of them")
    if args.hsdp and not (args.train or args.where is not None):
        ap.error("--hsdp is for the training steps: with --train or --where")
    return args


def build(args, mesh):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.dim, 4 * args.dim), torch.nn.GELU(), torch.nn.Linear(4 * args.dim, args.dim)]
    base = torch.nn.Sequential(*layers).to(args.device)

    def sharded(on=mesh):
        m = copy.deepcopy(base)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=on)
        fully_shard(m, mesh=on)
        return m

    return base, sharded


def optimizer_step(args, rank, world, mesh) -> dict:
    """(1): the optimizers' state and step time on the same sharded model and gradients."""
    import zero8.optim as zo
    base, sharded = build(args, mesh)
    numel = sum(p.numel() for p in base.parameters())
    variants = {"zero8 AdamW8bit": lambda ps: zo.AdamW8bit(ps, lr=1e-4, weight_decay=0.01),
                "torch AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True),
                "torch AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)}
    runs = {}
    for name, make in variants.items():
        m = sharded()
        runs[name] = (m, make(m.parameters()))
    x = torch.randn(64, args.dim, device=args.device)
    for m, _ in runs.values():  # gradients once; every round steps with them
        m(x).pow(2).mean().backward()
    times = {name: [] for name in runs}
    for r in range(args.rounds + 2):  # 2 warm-up rounds (the states are made in the first)
        for name, (_, opt) in runs.items():
            sync(args)
            t0 = time.perf_counter()
            opt.step()
            sync(args)
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    out = {"device": args.device, "world": world, "params": numel, "rounds": args.rounds, "rows": []}
    ref = statistics.median(times["torch AdamW (fused)"])
    for name, (_, opt) in runs.items():
        med = statistics.median(times[name])
        out["rows"].append({"optimizer": name, "state_bytes_per_rank": state_bytes(opt), "step_ms": med * 1e3,
                            "speed_vs_torch_fused": ref / med})
    if rank == 0:
        print(f"FSDP2 over {world} rank(s), {args.device}, {numel / 1e6:.1f} M parameters, "
              f"median of {args.rounds} steps")
        print("| optimizer | state bytes / parameter (per rank, x ranks) | step ms | speed / torch fused |")
        print("|---|---|---|---|")
        for row in out["rows"]:
            print(f"| {row['optimizer']} | {row['state_bytes_per_rank'] * world / numel:.3f} | {row['step_ms']:.2f} "
                  f"| {row['speed_vs_torch_fused']:.2f} |")
    return out


def sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def link_tx() -> int:
    """Bytes this rank's network namespace sent on its links (not the loopback): with one rank per namespace,
    what this rank put on the wire."""
    from vs_deepspeed_worker import link_counters  # run as a script (also by torchrun): its folder is on sys.path
    return sum(tx for name, (tx, _) in link_counters().items() if name != "lo")


# Each wire: its name, and the exchanges zero8 makes int8 (gradients: the reduce-scatter within the shard group;
# parameters: the all-gather; replicas: HSDP's all-reduce across the replicas). DDP's "int8" is zero8.ddp's hook.
WIRES = {"fp32": ("float32", ()),
         "int8": ("int8 gradients", ("gradients",)),
         "int8_params": ("int8 gradients and parameters", ("gradients", "parameters")),
         "int8_replicas": ("int8 replicas' all-reduce", ("replicas",)),
         "int8_replicas_rs": ("int8 replicas' all-reduce and reduce-scatter", ("replicas", "gradients"))}
WIRE_NAMES = {w: name for w, (name, _) in WIRES.items()}
# The wires each training mode compares, float32 (the baseline of every ratio) first.
MODE_WIRES = {"train": ("fp32", "int8", "int8_params"), "train-ddp": ("fp32", "int8"),
              "train-hsdp": ("fp32", "int8_replicas", "int8_replicas_rs")}


def train_mode(args) -> str:
    return "train-ddp" if args.ddp else "train-hsdp" if args.hsdp else "train"


def fsdp2_wire(model, wire: str, replicate_group=None) -> dict:
    """zero8.fsdp's int8 exchanges that `wire` names set on FSDP2 `model`, by what they carry (replicas: over
    `replicate_group`, `model` sharded over the shard group alone)."""
    import zero8.fsdp
    make = {"gradients": zero8.fsdp.int8_reduce_scatter, "parameters": zero8.fsdp.int8_all_gather,
            "replicas": lambda m: zero8.fsdp.int8_replicate_all_reduce(m, replicate_group)}
    return {k: make[k](model) for k in WIRES[wire][1]}


def hsdp_mesh(args, world: int):
    """HSDP's (replicate, shard) mesh of 2 replicas: ranks 0 .. world/2 - 1 shard the model, the others hold a
    replica of it. Under torchrun a host's ranks are consecutive, so the shard group must be a host's ranks (or
    all on one host): checked, since otherwise the replicas' all-reduce would not be what crosses the hosts."""
    import socket
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if world % 2:
        raise SystemExit(f"--hsdp: 2 replicas need an even number of ranks, not {world}")
    names = [None] * world
    dist.all_gather_object(names, socket.gethostname())
    shard = world // 2
    groups = [set(names[i:i + shard]) for i in (0, shard)]
    if any(len(g) > 1 for g in groups):
        raise SystemExit(f"--hsdp: the shard groups span hosts ({names}): run {shard} ranks per host")
    return init_device_mesh(args.device, (2, shard), mesh_dim_names=("replicate", "shard"))


def training(args, rank, world, mesh) -> dict:
    """(2): training steps with FSDP2's float32 collectives, with zero8.fsdp's int8 gradient reduce-scatter, and
    with that and its int8 parameter all-gather (--ddp: DDP's float32 all-reduce and zero8.ddp's int8 hook;
    --hsdp: native HSDP on the 2-d `mesh` and the int8 replicas' all-reduce), rounds alternated; per wire the
    median step time, the bytes zero8's exchanges sent against what the float32 collectives they replace would
    have, the bytes on the links, and the loss of every step (the mean over the ranks)."""
    import torch.distributed as dist
    import zero8.ddp
    import zero8.optim as zo
    mode = train_mode(args)
    base, sharded = build(args, mesh)
    numel = sum(p.numel() for p in base.parameters())
    runs = {}
    for wire in MODE_WIRES[mode]:
        if args.ddp:
            m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
            comms = {"gradients": zero8.ddp.int8_gradients(m)} if wire == "int8" else {}
        elif args.hsdp and wire != "fp32":  # sharded over the host's ranks, zero8 averaging over the replicas
            m = sharded(mesh["shard"])
            comms = fsdp2_wire(m, wire, mesh["replicate"].get_group())
        else:
            m = sharded()
            comms = fsdp2_wire(m, wire)
        runs[wire] = (m, zo.AdamW8bit(m.parameters(), lr=1e-4, weight_decay=0.01), comms)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(args.tokens, args.dim, generator=g).to(args.device) for _ in range(args.steps)]
    times = {w: [] for w in runs}
    links = {w: 0 for w in runs}
    warmup_bytes = {}
    losses = {w: [] for w in runs}
    host_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the ranks whose sends a namespace's counters add
    for r in range(args.rounds + 1):  # the first round warms up (and makes the states)
        for wire, (m, opt, comms) in runs.items():
            if r == 1:  # the warm-up's bytes, subtracted
                warmup_bytes[wire] = {k: (c.wire_bytes, c.full_bytes) for k, c in comms.items()}
            dist.barrier()
            tx0, t0 = link_tx(), time.perf_counter()
            for x in batches:
                out = m(x).pow(2).mean()
                out.backward()
                opt.step()
                opt.zero_grad()
                losses[wire].append(out.detach())
            sync(args)
            dt = time.perf_counter() - t0
            dist.barrier()  # the other ranks of this host sent all of theirs too
            tx = (link_tx() - tx0) / host_ranks
            if r >= 1:
                times[wire].append(dt / len(batches))
                links[wire] += tx
    steps = args.rounds * args.steps
    sent = {}  # per wire and exchange: bytes per step, int8 against the float32 collective's
    for wire, (_, _, comms) in runs.items():
        sent[wire] = {k: {"int8": (c.wire_bytes - warmup_bytes[wire][k][0]) / steps,
                          "fp32": (c.full_bytes - warmup_bytes[wire][k][1]) / steps} for k, c in comms.items()}
    loss = {}  # every step's loss (warm-up included), the mean over the ranks
    for wire, ls in losses.items():
        t = torch.stack(ls).float()
        dist.all_reduce(t)
        loss[wire] = (t / world).tolist()
    out = {"mode": mode, "device": args.device, "world": world, "params": numel,
           "rounds": args.rounds, "steps": steps, "tokens": args.tokens,
           "step_s": {w: statistics.median(t) for w, t in times.items()},
           "link_bytes_per_step": {w: links[w] / steps for w in links},
           "exchange_bytes_per_step": sent,
           "loss_per_step": loss,
           "last_loss": {w: v[-1] for w, v in loss.items()}}
    out["speedup"] = {w: out["step_s"]["fp32"] / out["step_s"][w] for w in runs if w != "fp32"}
    # how far each wire's loss strayed from float32's, over the same steps and batches from the same start
    out["loss_max_rel_diff"] = {w: max(abs(a / b - 1) for a, b in zip(loss[w], loss["fp32"]))
                                for w in runs if w != "fp32"}
    if rank == 0:
        what = {"train": "FSDP2", "train-ddp": "DDP", "train-hsdp": f"HSDP (2 replicas x {world // 2} shards)"}[mode]
        print(f"{what} training over {world} rank(s), {args.device}, {numel / 1e6:.1f} M parameters, batches of "
              f"{args.tokens} x {args.dim}; median of {args.rounds} rounds of {args.steps} steps per wire")
        for wire in runs:
            line = f"{WIRE_NAMES[wire]}: step {out['step_s'][wire] * 1e3:.1f} ms"
            if wire != "fp32":
                line += f" ({out['speedup'][wire]:.2f}x)"
            for k, b in sent[wire].items():
                line += f"; {k} {b['int8'] / 1e6:.1f} MB per step and rank against {b['fp32'] / 1e6:.1f}"
            line += f"; on the links {out['link_bytes_per_step'][wire] / 1e6:.1f} MB"
            if wire != "fp32":
                line += f"; loss within {out['loss_max_rel_diff'][wire] * 100:.2f}% of float32's at every step"
            print(line)
    return out


def quality(args, rank, world, mesh) -> dict:
    """(4): the pretraining example's GPT as `python3 examples/pretrain_gpt.py` trains it (its default model,
    corpus and validation sequences; examples/configs/gpt_zero8_stage2.json's batch, AdamW settings, schedule
    and clipping, with AdamW8bit), sharded by FSDP2 per transformer block and trained with each wire for each
    seed; the validation loss at the end."""
    import zero8.optim as zo
    from torch.distributed.fsdp import fully_shard
    from pretrain_example import load_example  # as link_tx: this folder is on sys.path
    from zero8.lr_schedules import WarmupCosineLR
    from zero8.pipe import LayerModule
    ex = load_example()
    a = ex.parse_args([])  # the example's defaults
    cfg, steps, _ = ex.load_config(str(Path(ex.__file__).parent / "configs" / "gpt_zero8_stage2.json"),
                                   args.quality_steps, None, None)
    corpus = ex.Corpus(int(a.corpus_mb * 1e6))
    rows = cfg["train_batch_size"] // world
    val_x, val_y = ex.sequences(corpus.val, ex.validation_offsets(corpus, a.seq_len, a.eval_seqs), a.seq_len)
    hyper = dict(cfg["optimizer"]["params"], betas=tuple(cfg["optimizer"]["params"]["betas"]))
    results = {}
    for seed in [int(v) for v in args.seeds.split(",")]:
        for wire in MODE_WIRES["train"]:
            layers = ex.gpt_layers(a.d_model, a.n_layer, a.n_head, a.seq_len, a.tie_weights)
            model = LayerModule(layers, seed_layers=True, base_seed=seed).to(args.device)
            for m in list(model.modules())[1:]:
                if isinstance(m, ex.Block):
                    fully_shard(m, mesh=mesh)
            fully_shard(model, mesh=mesh)
            fsdp2_wire(model, wire)
            opt = zo.AdamW8bit(ex.param_groups(model), **hyper)
            sched = WarmupCosineLR(opt, **cfg["scheduler"]["params"])
            t0 = time.perf_counter()
            for step in range(steps):
                offsets = ex.batch_offsets(seed, step, rows * world, corpus.train.numel(), a.seq_len)
                x, y = ex.sequences(corpus.train, offsets[rank * rows:(rank + 1) * rows], a.seq_len)
                loss = ex.lm_loss(model(x.to(args.device)), y.to(args.device))
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["gradient_clipping"])
                opt.step()
                sched.step()
            with torch.no_grad():
                val = ex.lm_loss(model(val_x.to(args.device)), val_y.to(args.device)).item()
            results.setdefault(wire, {})[seed] = val
            if rank == 0:
                print(f"seed {seed}, {WIRE_NAMES[wire]}: validation loss {val:.4f} after {steps} steps "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    seeds = list(results["fp32"])
    rel = {w: statistics.mean(results[w][sd] / results["fp32"][sd] - 1 for sd in seeds) for w in results}
    out = {"mode": "quality", "world": world, "steps": steps, "val_loss": results, "mean_rel_diff": rel}
    if rank == 0:
        print("| wire | validation loss (mean over seeds) | relative difference to float32 (mean) |")
        print("|---|---|---|")
        for w in results:
            print(f"| {WIRE_NAMES[w]} | {statistics.mean(results[w].values()):.4f} | {rel[w] * 100:+.2f}% |")
    return out


def worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = hsdp_mesh(args, world) if args.hsdp else init_device_mesh(args.device, (world,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.quality:
            out = quality(args, rank, world, mesh)
        else:
            out = training(args, rank, world, mesh) if args.train else optimizer_step(args, rank, world, mesh)
    if rank == 0:
        print(json.dumps(out))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(out, f)
    from pretrain_example import gloo_rank_exit
    gloo_rank_exit()  # not the gloo abort some interpreter exits end in, after the result


def wire_table(results: dict) -> str:
    """The driver's table: per scenario each wire's step time (and speed-up over float32), the bytes on the link
    per step and rank (and their ratio to float32's; scenarios over a link, which have its goodput measured), and
    how far each int8 wire's loss strayed from float32's."""
    r0 = next(iter(results.values()))
    wires = list(r0["step_s"])
    head = " | ".join(f"step, {WIRE_NAMES[w]}" + ("" if w == "fp32" else " (speed-up)") for w in wires)
    lines = [f"| scenario (TCP goodput) | {head} | MB on the link per step and rank, {' -> '.join(wires)} "
             f"(/ float32) | loss: largest difference to float32's over the {len(r0['loss_per_step']['fp32'])} "
             f"steps, {', '.join(wires[1:])} |",
             "|---" * (len(wires) + 3) + "|"]
    for scen, r in results.items():
        link = r["link_bytes_per_step"]
        sent = " -> ".join(f"{link[w] / 1e6:.1f}" + ("" if w == "fp32" else f" ({link[w] / link['fp32']:.2f}x)")
                           for w in wires) if "goodput_gbps" in r else "(no link)"
        goodput = f" ({r['goodput_gbps']:.2f} Gbit/s)" if "goodput_gbps" in r else ""
        steps = " | ".join(f"{r['step_s'][w] * 1e3:.0f} ms" + ("" if w == "fp32" else f" ({r['speedup'][w]:.2f}x)")
                           for w in wires)
        loss = ", ".join(f"{r['loss_max_rel_diff'][w] * 100:.2f}%" for w in wires[1:])
        lines.append(f"| {scen}{goodput} | {steps} | {sent} | {loss} |")
    return "\n".join(lines)


def driver(args) -> None:
    """(3): the training comparison in each scenario (one host, or two namespaces over a shaped link; --hsdp: two
    ranks on each)."""
    from bench_vs_deepspeed import SCENARIOS, Hosts, netns_problem, rank_env, run_procs
    where = [w.strip() for w in args.where.split(",") if w.strip()]
    bad = [w for w in where if w not in SCENARIOS]
    if bad:
        raise SystemExit(f"--where: unknown scenario {', '.join(bad)} (known: {', '.join(SCENARIOS)})")
    problem = netns_problem()
    if problem and any(SCENARIOS[w][1] for w in where):
        raise SystemExit(f"--where {args.where} needs two network namespaces: {problem}")
    hosts = Hosts("z8f", "10.210.0", use_netns=problem is None)
    worker_args = [str(Path(__file__).resolve()), "--train", "--dim", str(args.dim), "--layers", str(args.layers),
                   "--rounds", str(args.rounds), "--steps", str(args.steps), "--tokens", str(args.tokens)]
    worker_args += ["--ddp"] if args.ddp else ["--hsdp"] if args.hsdp else []
    per_host = 2 if args.hsdp else 1
    results = {}
    port = 29810
    try:
        hosts.open()
        with tempfile.TemporaryDirectory() as tmp:
            for scen in where:
                hosts.shape(SCENARIOS[scen][1])
                out = Path(tmp) / f"{scen}.json"
                port += 1
                py = [sys.executable, "-m", "torch.distributed.run"]
                if SCENARIOS[scen][1]:
                    cmds = [hosts.on(node, py + ["--nnodes", "2", "--node_rank", str(node),
                                                 "--nproc_per_node", str(per_host),
                                                 "--master_addr", hosts.addrs[0], "--master_port", str(port)]
                                     + worker_args + ["--json-out", str(out)]) for node in (0, 1)]
                    envs = [dict(rank_env(hosts, 1), GLOO_SOCKET_IFNAME=hosts.veths[node]) for node in (0, 1)]
                else:
                    cmds = [hosts.on(0, py + ["--nproc_per_node", str(2 * per_host), "--master_addr", "127.0.0.1",
                                              "--master_port", str(port)] + worker_args + ["--json-out", str(out)])]
                    envs = [dict(rank_env(hosts, 1), GLOO_SOCKET_IFNAME="lo")]
                print(f"[{scen}] {SCENARIOS[scen][0]} ...", flush=True)
                rc = run_procs(cmds, envs, Path(tmp) / f"{scen}.log", 1800)
                if rc != 0 or not out.exists():
                    log = (Path(tmp) / f"{scen}.log").read_text(errors="replace").splitlines()[-60:]
                    raise SystemExit(f"[{scen}] failed (exit {rc}):\n" + "\n".join(log))
                results[scen] = json.loads(out.read_text())
                if SCENARIOS[scen][1]:
                    results[scen]["goodput_gbps"] = hosts.goodput_gbps()
    finally:
        hosts.close()
    if results:
        print(wire_table(results))
    print(json.dumps({"bench": "fsdp2_wire", "scenarios": results}))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"bench": "fsdp2_wire", "scenarios": results}, f)


CODEC_CASES = ((2, 4099), (8, 4099), (8, 65539), (64, 1025))  # (ranks, elements per piece): pieces end mid-block


def codec_call_cases(device: str, rounds: int, block: int = 2048) -> dict:
    """(5), also run by bench_gpu.py: per exchange, the reduce-scatter's encode of n pieces and its sum of the n
    pieces received, and the all-gather's decode of n pieces: three calls of the codec, or (the loop) one call
    per piece and an add per piece. The best time of each over `rounds` rounds of 50 calls, in microseconds,
    and their ratio, per case; both ways first checked to give the same bits."""
    from zero8 import _C
    from zero8.functional import _dequantize_into, _dequantize_rows_into, _quantize_into, _quantize_rows_into
    kind, dev = _C.MapKind.dynamic_signed, torch.device(device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    out = {}
    for n, piece in CODEC_CASES:
        x = torch.randn(n, piece, device=dev)
        codes = torch.empty(n, piece, dtype=torch.uint8, device=dev)
        scales = torch.empty(n, -(-piece // block), device=dev)
        total, part, every = torch.empty(piece, device=dev), torch.empty(piece, device=dev), torch.empty_like(x)

        def one_call():
            _quantize_rows_into(x, kind, block, codes.data_ptr(), scales.data_ptr())
            _dequantize_rows_into(codes.data_ptr(), scales.data_ptr(), n, block, kind, total, sum=True)
            _dequantize_rows_into(codes.data_ptr(), scales.data_ptr(), n, block, kind, every)

        def per_piece():
            for j in range(n):
                _quantize_into(x[j], kind, block, codes[j].data_ptr(), scales[j].data_ptr())
            for j in range(n):
                _dequantize_into(codes[j].data_ptr(), scales[j].data_ptr(), block, kind, total if j == 0 else part)
                if j:
                    total.add_(part)
            for j in range(n):
                _dequantize_into(codes[j].data_ptr(), scales[j].data_ptr(), block, kind, every[j])

        results = []
        for fn in (per_piece, one_call):  # the same bits both ways, or the comparison means nothing
            fn()
            results.append([t.clone() for t in (codes, scales, total, every)])
        if not all(torch.equal(a, b) for a, b in zip(*results)):
            raise SystemExit(f"codec calls: {n} x {piece}: one call for all pieces differs from one per piece")
        times = {"one_call": [], "per_piece": []}
        for _ in range(rounds):
            for name, fn in (("per_piece", per_piece), ("one_call", one_call)):
                fn()
                sync()
                reps, t = 50, time.perf_counter()
                for _ in range(reps):
                    fn()
                sync()
                times[name].append((time.perf_counter() - t) / reps)
        best = {k: min(v) for k, v in times.items()}
        out[f"{n}x{piece}"] = {"ranks": n, "piece": piece, "us": {k: v * 1e6 for k, v in best.items()},
                               "speedup": best["per_piece"] / best["one_call"], "same_bits": True}
    return out


def codec_calls(args) -> None:
    rounds, block = max(args.rounds, 3), 2048
    cases = codec_call_cases(args.device, rounds, block)
    print(f"codec calls per exchange on {args.device} (blocks of {block}; minimum of {rounds} rounds)")
    print("| ranks x piece | one call per piece | one call for all pieces |\n|---|---|---|")
    for c in cases.values():
        print(f"| {c['ranks']} x {c['piece']} | {c['us']['per_piece']:.1f} us | {c['us']['one_call']:.1f} us "
              f"({c['speedup']:.2f}x) |")
    line = json.dumps({"bench": "fsdp2_codec_calls", "device": args.device, "cases": cases})
    print(line)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.codec_calls:
        codec_calls(args)
    elif args.where is not None:
        driver(args)
    else:
        worker(args)


if __name__ == "__main__":
    main()
