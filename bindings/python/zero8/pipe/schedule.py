"""The pipeline schedules, as the list of instructions one stage executes: 1F1B for training (after a
warm-up of forwards, one forward and one backward alternate, so a stage holds at most ``stages - stage``
micro-batches' activations) and forwards only for evaluation.

Sends and receives are blocking (the communicator's send/recv may wait until the peer takes the message;
with zero8.queued_stage_messages over NCCL they are queued on the stage's stream, which waits so in the
host's place), so the order matters: where a stage sends to a neighbour and receives from the same
neighbour back to back, the even stage of the pair sends first and the odd one receives first, so the two always meet.
``simulate`` runs every stage's list against each other under those rules and reports a deadlock or a
message taken out of order; the tests run it for many shapes.
"""

from __future__ import annotations

from typing import NamedTuple

# Instruction kinds. micro: the micro-batch (0-based) within the batch; -1 for STEP.
RECV_ACT = "recv_activation"      # from stage - 1
FORWARD = "forward"               # the first and last stages read their part of the micro-batch here
SEND_ACT = "send_activation"      # to stage + 1
RECV_GRAD = "recv_grad"           # from stage + 1
BACKWARD = "backward"             # autograd only; the gradient reduction is END_BACKWARD's
SEND_GRAD = "send_grad"           # to stage - 1
REDUCE_TIED = "reduce_tied_grads"  # the replicas of tied weights send their gradients to the owner stage
END_BACKWARD = "end_backward"     # the data-parallel reduction of the micro-batch (collective over dp)
STEP = "optimizer_step"           # collective over dp and the pipeline group, then tied weights re-synced


class Instruction(NamedTuple):
    kind: str
    micro: int = -1

    def __repr__(self) -> str:
        return self.kind if self.micro < 0 else f"{self.kind}({self.micro})"


def _pair(stage: int, send: Instruction, recv: Instruction) -> list[Instruction]:
    """A send and a receive with the same neighbour: the even stage sends first, the odd one receives."""
    return [send, recv] if stage % 2 == 0 else [recv, send]


def train_schedule(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """The 1F1B training schedule of one stage (non-interleaved, as DeepSpeed's TrainSchedule and
    PipeDream-Flush): ``stages - stage - 1`` warm-up forwards, then forward/backward pairs, then the
    remaining backwards, and one optimizer step. The bubble: each stage idles for ``stages - 1``
    micro-batch times of forward and backward per batch, so efficiency is M / (M + stages - 1)."""
    _check(stage, stages, micro_batches)
    first, last = stage == 0, stage == stages - 1
    warmup = min(stages - stage - 1, micro_batches)
    out: list[Instruction] = []
    for i in range(warmup):
        if not first:
            out.append(Instruction(RECV_ACT, i))
        out.append(Instruction(FORWARD, i))
        if not last:
            out.append(Instruction(SEND_ACT, i))
    steady = micro_batches - warmup
    for j in range(steady):
        f, b = warmup + j, j
        if j == 0 and not first:
            out.append(Instruction(RECV_ACT, f))
        out.append(Instruction(FORWARD, f))
        if not last:
            out.extend(_pair(stage, Instruction(SEND_ACT, f), Instruction(RECV_GRAD, b)))
        out.append(Instruction(BACKWARD, b))
        if not first:
            if f + 1 < micro_batches:
                out.extend(_pair(stage, Instruction(SEND_GRAD, b), Instruction(RECV_ACT, f + 1)))
            else:
                out.append(Instruction(SEND_GRAD, b))
        out.extend(_end_backward(b, micro_batches))
    for b in range(steady, micro_batches):
        if not last:
            out.append(Instruction(RECV_GRAD, b))
        out.append(Instruction(BACKWARD, b))
        if not first:
            out.append(Instruction(SEND_GRAD, b))
        out.extend(_end_backward(b, micro_batches))
    out.append(Instruction(STEP))
    return out


def _end_backward(b: int, micro_batches: int) -> list[Instruction]:
    # The tied gradients join the owner's before its last reduction: after this stage's last SEND_GRAD,
    # so the stages before it are never kept waiting for their gradient.
    tail = [Instruction(REDUCE_TIED, b)] if b == micro_batches - 1 else []
    return tail + [Instruction(END_BACKWARD, b)]


def eval_schedule(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """Forwards only: each micro-batch is received, run and sent on, in order."""
    _check(stage, stages, micro_batches)
    out: list[Instruction] = []
    for i in range(micro_batches):
        if stage > 0:
            out.append(Instruction(RECV_ACT, i))
        out.append(Instruction(FORWARD, i))
        if stage < stages - 1:
            out.append(Instruction(SEND_ACT, i))
    return out


def _check(stage: int, stages: int, micro_batches: int) -> None:
    if stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"pipeline schedule: stage {stage} of {stages} stages")
    if micro_batches < 1:
        raise ValueError(f"pipeline schedule: {micro_batches} micro-batches (at least 1)")


def simulate(programs: list[list[Instruction]], tie_groups: tuple[tuple[int, ...], ...] = ()) -> list[str]:
    """Runs the stages' instruction lists against each other with rendezvous semantics: a send and the
    matching receive complete together, a stage blocks at either until its peer gets there; STEP is a
    collective of all stages and REDUCE_TIED one of the stages of each tie group holding the stage.
    Returns the order in which operations completed; raises RuntimeError on a deadlock (naming where
    each stage waits) or when a receive would take another message than the one sent."""
    n = len(programs)
    pc = [0] * n
    done: list[str] = []

    def peer_of(s: int, ins: Instruction) -> int:
        return s + 1 if ins.kind in (SEND_ACT, RECV_GRAD) else s - 1

    def matches(send: Instruction, recv: Instruction) -> bool:
        return (send.kind, recv.kind) in ((SEND_ACT, RECV_ACT), (SEND_GRAD, RECV_GRAD))

    def collective_members(s: int, ins: Instruction) -> list[int] | None:
        if ins.kind == STEP:
            return list(range(n))
        if ins.kind == REDUCE_TIED:
            groups = [g for g in tie_groups if s in g]
            return sorted(set().union(*groups)) if groups else [s]
        return None

    while any(pc[s] < len(programs[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            if pc[s] >= len(programs[s]):
                continue
            ins = programs[s][pc[s]]
            if ins.kind in (FORWARD, BACKWARD, END_BACKWARD):
                done.append(f"stage {s}: {ins!r}")
                pc[s] += 1
                progressed = True
                continue
            members = collective_members(s, ins)
            if members is not None:
                if all(pc[m] < len(programs[m]) and programs[m][pc[m]] == ins for m in members):
                    for m in members:
                        pc[m] += 1
                    done.append(f"stages {members}: {ins!r}")
                    progressed = True
                continue
            if ins.kind not in (SEND_ACT, SEND_GRAD):
                continue  # receives complete from the sender's side
            p = peer_of(s, ins)
            if not 0 <= p < n:
                raise RuntimeError(f"stage {s}: {ins!r} to stage {p}, which does not exist")
            if pc[p] >= len(programs[p]):
                continue
            theirs = programs[p][pc[p]]
            if theirs.kind in (RECV_ACT, RECV_GRAD) and peer_of(p, theirs) == s:
                if not matches(ins, theirs) or theirs.micro != ins.micro:
                    raise RuntimeError(f"stage {s} sends {ins!r} while stage {p} receives {theirs!r}")
                pc[s] += 1
                pc[p] += 1
                done.append(f"stage {s} -> {p}: {ins!r}")
                progressed = True
        if not progressed:
            waits = [f"stage {s} at {programs[s][pc[s]]!r}" for s in range(n) if pc[s] < len(programs[s])]
            raise RuntimeError("pipeline schedule deadlock: " + "; ".join(waits))
    return done
