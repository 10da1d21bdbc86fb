"""Runs the engine command (mpirun/srun) and watches its output: forwards the ranks' prefixed output as it
comes, reads the wrappers' marker lines (rank started / ended how), condenses mpirun's own failure
banners, ends the job on a timeout (after asking every rank for its Python stacks) or a stop request, and
after the job explains a failure: which rank failed first and how (its error, from the tail of its log),
which ranks failed because of it.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from .netinfo import this_host_among
from .rank_wrapper import MARKER, SCRIPT_STACKS_SIGNAL, STOP_SIGNAL, parse_marker, status_path

# Seconds between repeats of the stop signal while some rank has not acknowledged it.
STOP_RESEND = 0.5
# Seconds between asking the ranks for their Python stacks on --timeout (STACKS_SIGNAL) and ending the job:
# time for the wrappers to pass the request on (they look every 0.1 s) and to write what the scripts print.
STACKS_WAIT = 2.0
# Seconds after the launch at which the launcher says which ranks it still waits for (once).
START_NOTICE = 30.0

__all__ = ["JobMonitor", "RankState", "run_job", "error_excerpt", "traceback_cut"]

_RANK_LINE = re.compile(rb"^\[rank(\d+)\] ")
_DASHES = re.compile(rb"^-{20,}\s*$")
# mpirun's aggregated help notices, signal forwarding notices: its own chatter.
_MPIRUN_CHATTER = re.compile(rb"^\[[^\]\s]+:\d+\] .*(help message|orte_base_help_aggregate)|^mpirun: Forwarding signal")
# OpenMPI 4.1.4's mpirun, when a rank calls MPI_Abort, often prints "[host:pid] [[job,0],0] ORTE_ERROR_LOG:
# Data unpack would read past end of buffer in file ../../../orte/util/show_help.c at line 507" (also "had
# inadequate space", "Out of resource", line 513) in place of that rank's MPI_ABORT banner: show_help.c is
# where mpirun ([[job,0],0]) takes in the help and error messages the ranks send it, to print them, and it
# could not unpack one, which is then lost; the abort goes on (here in 2 of 6 aborts on an idle machine and
# in 4 of 6 logged on a loaded one, each job ending as the others did). It reads like an internal failure
# but tells nothing about the job, whose cause the failure report names: kept in launcher.log, not shown.
# The same line is reported, its cause not explained, in open-mpi/ompi#8356 (4.0.1).
_MPIRUN_LOST_HELP = re.compile(rb"^\[[^\]\s]+:\d+\] \[\[\d+,\d+\],\d+\] ORTE_ERROR_LOG: .* in file \S*show_help\.c "
                               rb"at line \d+\s*$")
_SRUN_TASK = re.compile(rb"^srun: error: \S+: tasks? [\d,\-]+: (Exited with exit code \d+|Killed|Terminated)")
# Banners that restate a rank's failure (summarized, not repeated).
_NOISE_BLOCK = re.compile(r"exited on signal|non-zero (exit code|status)|exiting improperly|MPI_ABORT was invoked|"
                          r"terminated normally|lost communication with a remote daemon|daemon has unexpectedly failed|"
                          r"orted .* exited|An ORTE daemon", re.I)
_SECONDARY = re.compile(r"Zero8CommError")
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")
# A communicator timeout (comm/src/comm_mpi.cpp, timeout_cause): "<call> (rank 0 of 2): timed out after 600.0 s
# (timeout 600 s); not heard from: rank 1 (not in a communication call for 600.2 s (last: ...)); ...". The ranks
# not heard from are the cause (alive but hung), though the rank whose call timed out is the one that exits.
_COMM_TIMEOUT = re.compile(r"(\S+ #\d+ on '[^']*') \(rank (\d+) of \d+\): timed out after [0-9.]+ s "
                           r"\(timeout ([^)]*) s\); not heard from: (.*)")
_PEER_NAME = re.compile(r"rank (\d+)(?: \(world rank (\d+)\))? \(")


@dataclass
class RankState:
    rank: int
    host: str = ""
    pid: int | None = None
    started: bool = False
    exit_code: int | None = None
    signal: int = 0
    stopped_by: str = ""
    seconds: float | None = None
    log: str = ""
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    order: int | None = None  # position among the ranks' ends, as the launcher saw them
    mpirun_signal: str = ""   # mpirun's report: "9 (Killed)"
    signalled: str = ""       # the wrapper received this signal from the engine/launcher (job ending)
    stacks: str = ""          # on --timeout, its wrapper asked the script for its Python stacks: "1"; "0": no handler
    record: str = ""          # how it ended was read from this status file, its exit record having been lost


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _last_traceback(lines: list[str]) -> int | None:
    """The index of the last "Traceback (most recent call last):" line, or None."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last)"):
            return i
    return None


def hung_ranks(line: str) -> list[tuple[int, str, str, str]]:
    """(world rank, what it was doing, the call it did not join, the timeout) of each live rank that a
    communicator timeout in `line` names as not heard from (dead, lost or finished ranks are not hung)."""
    m = _COMM_TIMEOUT.search(line)
    if m is None:
        return []
    call, _, timeout, rest = m.groups()
    found, pos = [], 0
    while (p := _PEER_NAME.match(rest, pos)) is not None:
        depth, i = 1, p.end()  # the state text is the balanced parenthesis after the name
        while i < len(rest) and depth:
            depth += {"(": 1, ")": -1}.get(rest[i], 0)
            i += 1
        state = rest[p.end():i - 1]
        if not state.startswith(("died", "lost", "has already shut down")):
            found.append((int(p.group(2) or p.group(1)), state, call, timeout))
        if not rest.startswith("; ", i):
            break
        pos = i + 2
    return found


def error_excerpt(lines: list[str], max_lines: int = 30) -> list[str]:
    """The end of a rank's output that explains its failure: from its last Python traceback, else the
    last dozen lines."""
    lines = [l.rstrip("\n") for l in lines]
    while lines and not lines[-1].strip():
        lines.pop()
    start = _last_traceback(lines)
    chosen = lines[start:] if start is not None else lines[-12:]
    return chosen[-max_lines:]


def traceback_cut(lines: list[str]) -> bool:
    """Whether the output ends inside a Python traceback: after its last "Traceback (most recent call
    last):" line, only indented frame lines, no exception line (the process was ended while printing)."""
    start = _last_traceback(lines)
    return start is not None and not any(l.strip() and not l[0].isspace() for l in lines[start + 1:])


class JobMonitor:
    """Consumes the engine's stdout/stderr (feed) and keeps the ranks' states."""

    def __init__(self, log_dir: str, world_size: int | None, out=None, err=None, launcher_log=None, hosts=None):
        self.log_dir = log_dir
        self.world_size = world_size
        # hosts: {host: slots} in rank order (the hostfile's selection), to name the host of a rank that
        # never reported (ranks are placed host by host); None when the launcher does not know it.
        self.placement: dict[int, str] = {}
        for host, slots in (hosts or {}).items():
            for _ in range(slots if isinstance(slots, int) else len(slots)):
                self.placement[len(self.placement)] = host
        self.out = out if out is not None else sys.stdout.buffer
        self.err = err if err is not None else sys.stderr.buffer
        self.launcher_log = launcher_log
        self.ranks: dict[int, RankState] = {}
        self.mpirun_notes: list[str] = []       # condensed failure banners, in order
        self.first_failure: float | None = None
        self.ends = 0
        self.stop_signal = 0                    # the signal that asked the launcher to stop, if any
        self.stacks_asked: list[int] = []       # the ranks running when the launcher asked for their stacks
        self.started_at = time.time()           # status files older than this are another job's
        self._lock = threading.Lock()
        self._buf = {"out": b"", "err": b""}
        self._continuing = {"out": None, "err": None}  # rank whose unterminated segment was forwarded
        self._block: dict[str, list[bytes] | None] = {"out": None, "err": None}

    # ---- output handling ----
    def _write(self, stream: str, data: bytes) -> None:
        f = self.out if stream == "out" else self.err
        try:
            f.write(data)
            f.flush()
        except (BrokenPipeError, ValueError):
            pass

    def say(self, text: str) -> None:
        with self._lock:
            self._write("err", f"zero8-launch: {text}\n".encode())
            if self.launcher_log:
                self.launcher_log.write(f"zero8-launch: {text}\n".encode())
                self.launcher_log.flush()

    def rank(self, r: int) -> RankState:
        if r not in self.ranks:
            self.ranks[r] = RankState(r)
        return self.ranks[r]

    def feed(self, stream: str, data: bytes) -> None:
        """Process a chunk of the engine's output (b'' at EOF flushes what is left)."""
        with self._lock:
            if self.launcher_log:
                self.launcher_log.write(data)
                self.launcher_log.flush()
            buf = self._buf[stream] + data
            pos = 0
            while True:
                m = re.compile(rb"\r\n|\r|\n").search(buf, pos)
                if m is None:
                    break
                self._segment(stream, buf[pos:m.start()], buf[m.start():m.end()])
                pos = m.end()
            rest = buf[pos:]
            if not data:  # EOF
                if rest:
                    self._segment(stream, rest, b"")
                blk = self._block[stream]
                if blk is not None:
                    self._end_block(stream, blk, closed=False)
                self._buf[stream] = b""
                return
            # A rank's unterminated output (a progress bar) is shown now, not at its next line end.
            if rest:
                cont = self._continuing[stream]
                m = _RANK_LINE.match(rest)
                if cont is not None or m is not None:
                    self._write(stream, rest)
                    if cont is None:
                        self._continuing[stream] = int(m.group(1))
                    rest = b""
            self._buf[stream] = rest

    def _segment(self, stream: str, body: bytes, term: bytes) -> None:
        cont = self._continuing[stream]
        if cont is not None:
            self._continuing[stream] = None
            self._write(stream, body + term)
            return
        blk = self._block[stream]
        if blk is not None:
            if _DASHES.match(body):
                self._end_block(stream, blk, closed=True)
            else:
                blk.append(body)
            return
        m = _RANK_LINE.match(body)
        if m is not None:
            self._write(stream, body + term)
            if term != b"\r":
                self.rank(int(m.group(1))).tail.append(body[m.end():].decode("utf-8", "replace"))
            return
        text = body.decode("utf-8", "replace")
        if text.startswith(MARKER):
            fields = parse_marker(text)
            if fields is not None:
                self._marker(fields)
                return
        if _DASHES.match(body):
            self._block[stream] = []
            return
        if _MPIRUN_CHATTER.search(body) or _MPIRUN_LOST_HELP.match(body) or _SRUN_TASK.match(body):
            return
        self._write(stream, body + term)

    def _end_block(self, stream: str, lines: list[bytes], closed: bool) -> None:
        self._block[stream] = None
        text = "\n".join(l.decode("utf-8", "replace") for l in lines)
        if _NOISE_BLOCK.search(text):
            self._mpirun_facts(text)
            return
        dash = b"-" * 74 + b"\n"
        self._write(stream, dash + b"".join(l + b"\n" for l in lines) + (dash if closed else b""))

    def _mpirun_facts(self, text: str) -> None:
        flat = " ".join(text.split())
        note = None
        m = re.search(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+) \(([^)]*)\)", flat)
        if m:
            r = self.rank(int(m.group(1)))
            r.mpirun_signal = f"{m.group(3)} ({m.group(4)})"
            r.host = r.host or m.group(2)
            note = f"mpirun: rank {m.group(1)} on node {m.group(2)} exited on signal {m.group(3)} ({m.group(4)})"
        m2 = re.search(r"Process name: \[\[\d+,\d+\],(\d+)\] Exit code: (\d+)", flat)
        if note is None and m2:
            note = f"mpirun: the first rank to exit with a non-zero status was rank {m2.group(1)} (code {m2.group(2)})"
        m3 = re.search(r"process rank (\d+) with PID \d+ on node (\S+) exiting improperly", flat)
        if note is None and m3:
            note = f"mpirun: rank {m3.group(1)} on node {m3.group(2)} exited without finalizing MPI"
        if note is None and re.search(r"lost communication with a remote daemon|daemon has unexpectedly failed", flat, re.I):
            m4 = re.search(r"Remote daemon: \S+ on node (\S+)", flat)
            note = "mpirun: lost contact with the daemon on node " + (m4.group(1) if m4 else "?") + \
                   " (the host or its network failed)"
        if note is None and "MPI_ABORT" in flat:
            m5 = re.search(r"MPI_COMM_WORLD\s+with errorcode (\d+)", flat)
            note = "mpirun: a rank called MPI_Abort" + (f" (error code {m5.group(1)})" if m5 else "")
        if note is None and re.search(r"Primary job terminated normally", flat):
            note = ""  # only restates that a rank exited non-zero (the next banner names it)
        if note is None:
            note = "mpirun: " + flat[:200]
        if note and note not in self.mpirun_notes:
            self.mpirun_notes.append(note)
        if self.first_failure is None:
            self.first_failure = time.monotonic()

    def not_started(self) -> list[int]:
        """The ranks (of world_size, if known) that have neither reported a start nor an end."""
        if self.world_size is None:
            return []
        with self._lock:
            return [r for r in range(self.world_size) if r not in self.ranks
                    or not (self.ranks[r].started or self.ranks[r].exit_code is not None)]

    def describe_ranks(self, ranks: list[int]) -> str:
        """'0, 1 (host a), 2 (host b)': the ranks, grouped by the host the launcher placed them on."""
        groups: list[tuple[str, list[int]]] = []
        for r in ranks:
            host = (self.ranks[r].host if r in self.ranks else "") or self.placement.get(r, "")
            if groups and groups[-1][0] == host:
                groups[-1][1].append(r)
            else:
                groups.append((host, [r]))
        return ", ".join(", ".join(map(str, rs)) + (f" (host {h})" if h else "") for h, rs in groups)

    def start_causes(self, ranks: list[int]) -> str:
        """What most likely kept these ranks from starting."""
        hosts = list(dict.fromkeys(self.placement[r] for r in ranks if r in self.placement))
        here = this_host_among(hosts) if hosts else None
        remote = [h for h in hosts if h != here]
        if not remote:
            return ("likely causes: the engine could not start them (its own output, in launcher.log, may say "
                    "why), or starting the script is slow on this machine")
        # mpirun starts no rank before every daemon has reported back: this host's ranks wait for the others.
        return (f"likely causes: the engine's daemon on host(s) {', '.join(remote)} could not connect back to this "
                f"host (a firewall dropping its packets, a --net_if on which it cannot reach this host, routing), "
                f"the host is unreachable (ssh), or starting the script there is slow"
                + (f" (this host's ranks wait for every daemon: mpirun starts none before)" if here in hosts else "")
                + "; the engine's own output is in launcher.log")

    def stop_unacknowledged(self) -> bool:
        """After a stop request: whether some rank has neither said that it got the stop signal nor ended
        (it may not have existed when the signal was sent: the engine only forwards to live ranks)."""
        with self._lock:
            done = sum(1 for r in self.ranks.values() if r.signalled or r.exit_code is not None)
        return done < self.world_size

    def _marker(self, f: dict) -> None:
        try:
            r = self.rank(int(f["rank"]))
        except ValueError:
            return
        r.host = f.get("host") or r.host
        if f["event"] == "start":
            r.started = True
            r.pid = int(f["pid"]) if f.get("pid", "").isdigit() else None
            return
        if f["event"] == "signal":
            r.signalled = f.get("name", "?")
            return
        if f["event"] == "stacks":
            r.stacks = f.get("written", "0")
            r.log = f.get("log") or r.log
            return
        if f["event"] != "exit":
            return
        r.exit_code = int(f.get("code", "1"))
        r.signal = int(f.get("signal", "0") or 0)
        r.stopped_by = f.get("stopped_by", "")
        r.log = f.get("log", "")
        try:
            r.seconds = float(f.get("seconds", ""))
        except ValueError:
            pass
        r.order = self.ends
        self.ends += 1
        if r.exit_code != 0 and not r.stopped_by:
            if self.first_failure is None:
                self.first_failure = time.monotonic()
            where = f" (host {r.host})" if r.host else ""
            how = (f"was killed by signal {r.signal} ({_signal_name(r.signal)})" if r.signal
                   else f"exited with code {r.exit_code}")
            self._write("err", f"zero8-launch: rank {r.rank}{where} {how}\n".encode())

    def ask_stacks(self) -> None:
        """Notes the ranks running now, as the launcher asks them for their Python stacks (stacks_report)."""
        with self._lock:
            self.stacks_asked = sorted(r.rank for r in self.ranks.values() if r.started and r.exit_code is None)

    def stacks_report(self) -> list[str]:
        """Where the Python stacks the ranks wrote on --timeout are, and which ranks wrote none."""
        ranks = [self.rank(r) for r in self.stacks_asked]
        written = [s.rank for s in ranks if s.stacks == "1"]
        none = [s.rank for s in ranks if s.stacks == "0"]
        silent = [s.rank for s in ranks if not s.stacks]
        out = []
        if written:
            hosts = {s.host or self.placement.get(s.rank, "") for s in ranks}
            out.append(f"rank(s) {self.describe_ranks(written)} wrote the Python stacks of all their threads at the "
                       f"timeout: above, and in {os.path.join(self.log_dir, 'rank<R>.log')}"
                       + (" on each rank's host" if len(hosts) > 1 else ""))
        if none:
            out.append(f"rank(s) {self.describe_ranks(none)} wrote no Python stacks: their scripts have no handler "
                       f"for {SCRIPT_STACKS_SIGNAL.name} (not Python, or Python run with -I, -E or -S)")
        if silent:
            out.append(f"rank(s) {self.describe_ranks(silent)} did not answer the request for their Python stacks "
                       f"within {STACKS_WAIT:g} s")
        return out

    # ---- after the job ----
    def rank_lines(self, r: RankState) -> tuple[list[str], str]:
        """(the rank's last output lines, where they come from): its log file when this host can read
        it (a shared or local log dir), else what the launcher saw forwarded."""
        path = r.log or os.path.join(self.log_dir, f"rank{r.rank}.log")
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 65536))
                data = f.read().decode("utf-8", "replace")
            lines = re.split(r"\r\n|\n|\r", data)[-200:]
            if any(l.strip() for l in lines):
                return lines, path
        except OSError:
            pass
        return list(r.tail), "its forwarded output"

    def read_status_records(self) -> None:
        """For ranks whose exit record did not reach the launcher (its engine daemon died with the output
        path), how they ended from their status files (rank<R>.status.json), when this host can read them
        (a shared log dir) and they are this job's (written after the launch, by the process that started)."""
        ranks = range(self.world_size) if self.world_size is not None else sorted(self.ranks)
        for r in ranks:
            s = self.ranks.get(r)
            if s is not None and s.exit_code is not None:
                continue
            path = status_path(self.log_dir, r)
            try:
                with open(path, encoding="utf-8") as f:
                    rec = json.load(f)
                fresh = float(rec.get("start_time") or 0) >= self.started_at - 5.0  # 5 s: clocks of other hosts
            except (OSError, ValueError, TypeError, AttributeError):
                continue
            if not fresh or rec.get("exit_code") is None or (s is not None and s.pid and rec.get("pid") != s.pid):
                continue
            s = self.rank(r)
            s.started = s.started or rec.get("pid") is not None
            s.host = s.host or rec.get("host") or ""
            s.exit_code = int(rec["exit_code"])
            sig = rec.get("signal")
            s.signal = (int(sig) if str(sig).isdigit() else
                        signal.Signals[sig].value if sig in signal.Signals.__members__ else 0) if sig else 0
            s.stopped_by = rec.get("stopped_by") or ""
            s.record = path

    def failure_report(self, engine: str = "mpirun", engine_signal: int = 0) -> tuple[list[str], int | None]:
        """(report lines, exit code of the rank that failed first) after a failed job. The cause is told
        apart from its consequences: ranks that were killed or failed on their own come first (with the
        end of their output); ranks whose communicator failed because of them (zero8.Zero8CommError) and
        ranks ended by the job's abort (also while they printed a traceback, which is then mentioned) are
        listed after. engine_signal: the engine itself was killed by this signal, which is then the cause
        (its ranks' exit records were lost with it)."""
        if engine_signal:
            return self._engine_death_report(engine, engine_signal), 128 + engine_signal
        self.read_status_records()
        ranks = sorted(self.ranks.values(), key=lambda s: s.rank)
        info = {s.rank: self.rank_lines(s) for s in ranks}

        def has_error(s: RankState) -> bool:
            return any(l.startswith("Traceback (most recent call last)") for l in info[s.rank][0])

        def comm_error(s: RankState) -> bool:
            return any(_SECONDARY.search(l) for l in info[s.rank][0][-60:])

        # A rank failed if it exited non-zero on its own, or raised before the abort's signal reached it.
        failed = [s for s in ranks if (s.exit_code not in (None, 0) and not s.stopped_by and not s.signal)
                  or (s.stopped_by and has_error(s))]
        # A rank that the abort ended while it printed a traceback (under load the SIGTERM can arrive before
        # the exception line) did raise, but what is unknown, and most likely in consequence of the cause
        # (a Zero8CommError): it is listed with the ranks the abort ended, unless no other rank is a cause.
        cut = [s for s in failed if s.stopped_by and traceback_cut(info[s.rank][0])]
        failed = [s for s in failed if s not in cut]
        # Ranks that the survivors' communicators saw die (the kernel closed their connections).
        seen_dead: set[int] = set()
        for s in failed:
            for l in info[s.rank][0][-60:]:
                if _SECONDARY.search(l):
                    seen_dead.update(int(x) for x in re.findall(r"rank (\d+) died", l))
        # A wrapper always writes an exit record, also when the job is aborted (it passes the signal on
        # and waits); a started rank without one, that was never told to stop, lost its wrapper too:
        # killed together, or its host or daemon died.
        killed = [s for s in ranks if s not in failed and s not in cut and (
            (s.signal and not s.stopped_by) or (s.exit_code is None and s.mpirun_signal)
            or (s.rank in seen_dead and (s.exit_code is None or s.signal))
            or (s.exit_code is None and s.started and not s.signalled) or s.stopped_by == "engine_exit")]
        # Ranks that ended on their own come before ranks that raised and were then ended by the job's end
        # (stopped_by, exit 143), and the job's exit code is theirs, not the first by rank order.
        own = [s for s in failed if not comm_error(s)]
        primary = killed + [s for s in own if not s.stopped_by] + [s for s in own if s.stopped_by]
        if not primary:
            by_end = sorted(failed or cut, key=lambda s: s.order if s.order is not None else 1 << 30)
            primary = by_end[:1]
        primary_ids = {s.rank for s in primary}
        out: list[str] = []
        for s in primary[:4]:
            where = f" (host {s.host})" if s.host else ""
            if s.stopped_by == "engine_exit":
                how = (f"was ended by its wrapper (exit code {s.exit_code}"
                       + (f", signal {s.signal} ({_signal_name(s.signal)})" if s.signal else "")
                       + ") because the engine process that started it died (the engine's daemon on its host, "
                         "or mpirun)" + (f"; per its status file {s.record}" if s.record else ""))
            elif s.signal and not s.stopped_by:
                how = f"was killed by signal {s.signal} ({_signal_name(s.signal)})"
            elif s.exit_code is None and s.mpirun_signal:
                how = f"was killed: signal {s.mpirun_signal} per mpirun (no exit record: its wrapper died too)"
            elif s.exit_code is None and s.rank in seen_dead:
                how = ("died: no exit record, and its peers saw its connections close without a clean "
                       "shutdown (killed with its wrapper, or its host failed)")
            elif s.exit_code is None:
                how = "died: no exit record, and it was never told to stop (killed with its wrapper, or its host failed)"
            else:
                how = f"exited with code {s.exit_code}" if s.exit_code else "failed"
            out.append(f"rank {s.rank}{where} {how}")
            excerpt = error_excerpt(info[s.rank][0]) if s in failed or s in cut else []
            if excerpt:
                out.append(f"  --- last lines of rank {s.rank}'s output ({info[s.rank][1]}) ---")
                out += ["  " + l for l in excerpt]
        if len(primary) > 4:
            out.append(f"(and rank(s) {', '.join(str(s.rank) for s in primary[4:])} likewise)")
        others = [s for s in failed if s.rank not in primary_ids]
        if others:
            kind = "communication errors" if all(comm_error(s) for s in others) else "errors"
            out.append(f"rank(s) {', '.join(str(s.rank) for s in others)} then failed with {kind}, e.g.:")
            for s in others[:2]:
                lines = info[s.rank][0]
                last = next((l for l in reversed(lines) if _EXC_LINE.match(l.strip())), None)
                if last is None:
                    last = next((l for l in reversed(lines) if l.strip()), "(no output)")
                out.append(f"  rank {s.rank}: {last.strip()[:400]}")
        accounted = primary_ids | {s.rank for s in others}
        aborted = [s for s in ranks if s.rank not in accounted and (s.exit_code is None or s.stopped_by)
                   and (s.started or s.exit_code is not None)]
        if aborted:
            cut_ids = [str(s.rank) for s in aborted if s in cut]
            which = (f" (which cut off the traceback that rank {cut_ids[0]} was printing)" if len(cut_ids) == 1 else
                     f" (which cut off the tracebacks that ranks {', '.join(cut_ids)} were printing)" if cut_ids else "")
            out.append(f"rank(s) {', '.join(str(s.rank) for s in aborted)} were ended by the job's abort{which}")
        never = self.not_started()
        if never:
            # Also when none started (a host whose daemon never connected back holds up every rank).
            out.append(f"rank(s) {self.describe_ranks(never)} never reported a start"
                       + (" (no rank did)" if len(never) == self.world_size else ""))
            out.append(self.start_causes(never))
        # Ranks that a communicator timeout names as not heard from while alive: the cause of the job's end,
        # named first, though they were ended by the abort that the timed-out rank's error started.
        hung: dict[int, str] = {}
        for s in failed + cut:
            for l in info[s.rank][0][-60:]:
                for r, state, call, timeout in hung_ranks(l):
                    hung.setdefault(r, f"rank {r} hung: alive, but it did not join {call} within the communicator "
                                       f"timeout ({timeout} s, on rank {s.rank}); it was {state}")
        out = [hung[r] for r in sorted(hung)] + out
        out += self.mpirun_notes
        code = None
        if primary and primary[0].exit_code:
            code = primary[0].exit_code
        elif primary and primary[0].mpirun_signal:
            num = primary[0].mpirun_signal.split()[0]
            code = 128 + int(num) if num.isdigit() else None
        return out, code

    def _engine_death_report(self, engine: str, sig: int) -> list[str]:
        out = [f"{engine} was killed by signal {sig} ({_signal_name(sig)}) while its ranks ran"]
        ranks = sorted(self.ranks.values(), key=lambda s: s.rank)
        failed = [s for s in ranks if s.exit_code not in (None, 0) and not s.stopped_by]
        for s in failed[:4]:
            out.append(f"rank {s.rank} had already " + (f"been killed by signal {s.signal} ({_signal_name(s.signal)})"
                                                         if s.signal else f"exited with code {s.exit_code}"))
        running = [s.rank for s in ranks if s.exit_code is None and s.started]
        if running:
            out.append(f"rank(s) {', '.join(map(str, running))} were still running: their wrappers end their "
                       f"scripts (SIGTERM, then SIGKILL after --stop_grace); see their logs")
        return out


def _die_with_parent() -> None:
    # The engine runs in its own session (so a terminal's Ctrl-C reaches only the launcher, which stops
    # the job gracefully); it must still not outlive a launcher that is killed.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def run_job(argv: list[str], env: dict, monitor: JobMonitor, timeout: float = 0.0, stop_grace: float = 30.0,
            fail_grace: float = 30.0, kill_grace: float = 10.0, start_timeout: float = 0.0,
            stacks_signal: int | None = None) -> tuple[int, str]:
    """Runs the engine; returns (its exit code, how it ended: 'done' | 'timeout' | 'stopped' |
    'failed-hung' | 'start-timeout'). While some rank has not reported a start, the launcher says which
    after START_NOTICE seconds, and ends the job after start_timeout seconds (0: never). Signals: the first SIGINT/SIGTERM asks the ranks to stop (STOP_SIGNAL through the
    engine, SIGTERM for the scripts) and gives them stop_grace seconds; a second, or the grace running
    out, terminates the engine (then SIGKILL after kill_grace). A rank failure that the engine does not
    turn into the job's end within fail_grace seconds terminates it too. On the timeout, stacks_signal (if
    given: rank_wrapper.STACKS_SIGNAL, for an engine that forwards it) asks every rank for its Python
    stacks STACKS_WAIT seconds before the engine is terminated."""
    state = {"requests": 0, "signal": 0}

    def on_signal(signum, _frame):
        state["requests"] += 1
        state["signal"] = state["signal"] or signum

    # Installed before the engine starts: a stop request (Ctrl-C, a scheduler's SIGTERM) that arrives
    # while it is being started is handled like any other, instead of killing the launcher unreported.
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore_handlers():
        for s, h in old.items():
            signal.signal(s, h)

    try:
        # stdin: none (mpirun would otherwise read the terminal from outside its session for rank 0).
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, start_new_session=True, preexec_fn=_die_with_parent)
    except BaseException:
        restore_handlers()
        raise

    def pump(f, stream):
        while True:
            try:
                chunk = os.read(f.fileno(), 65536)
            except OSError:
                chunk = b""
            monitor.feed(stream, chunk)
            if not chunk:
                break

    pumps = [threading.Thread(target=pump, args=(proc.stdout, "out"), daemon=True),
             threading.Thread(target=pump, args=(proc.stderr, "err"), daemon=True)]
    for t in pumps:
        t.start()

    start = time.monotonic()
    deadlines: dict[str, float] = {}
    how = "done"
    handled = 0
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if state["requests"] > handled:
                # Two requests can arrive between two looks (timeout(1) signals its child, then its process
                # group): the first is still a stop request, so the job ends as stopped, not as failed.
                if handled == 0:
                    monitor.say(f"stop requested: every rank gets SIGTERM and {stop_grace:g} s to exit "
                                f"(again to end the job now)")
                    how = "stopped"
                    _send(proc, STOP_SIGNAL)
                    deadlines.setdefault("stop", now + stop_grace)
                    deadlines["resend"] = now + STOP_RESEND
                handled = state["requests"]
                if handled > 1 and "term" not in deadlines:
                    monitor.say("ending the job now")
                    deadlines["term"] = now
            # A stop sent while the engine was still starting ranks reaches only those alive then: send
            # it again until every rank has acknowledged it (a rank's wrapper ignores repeats).
            if "resend" in deadlines and "term" not in deadlines and now > deadlines["resend"]:
                if monitor.stop_unacknowledged():
                    _send(proc, STOP_SIGNAL)
                    deadlines["resend"] = now + STOP_RESEND
                else:
                    del deadlines["resend"]
            # Ranks that never start (a host whose daemon cannot connect back) would otherwise hold the job
            # silently until --timeout, if any.
            if ("started" not in deadlines and "term" not in deadlines and how == "done"
                    and monitor.first_failure is None and now - start > min(START_NOTICE, start_timeout or START_NOTICE)):
                waiting = monitor.not_started()
                if not waiting:
                    deadlines["started"] = now
                elif start_timeout > 0 and now - start > start_timeout:
                    monitor.say(f"start timeout: rank(s) {monitor.describe_ranks(waiting)} did not start within "
                                f"{start_timeout:g} s; ending the job")
                    how = "start-timeout"
                    deadlines["term"] = now
                elif now - start > START_NOTICE and "start_notice" not in deadlines:
                    deadlines["start_notice"] = now
                    monitor.say(f"still waiting for rank(s) {monitor.describe_ranks(waiting)} to start after "
                                f"{now - start:.0f} s" + (f" (--start_timeout {start_timeout:g} ends the job)"
                                                          if start_timeout > 0 else ""))
            if timeout > 0 and now - start > timeout and "term" not in deadlines:
                how = "timeout"
                if stacks_signal:
                    monitor.say(f"timeout: the job ran longer than {timeout:g} s; every rank writes its Python "
                                f"stacks to its log, then the job ends")
                    monitor.ask_stacks()
                    _send(proc, stacks_signal)
                    deadlines["term"] = now + STACKS_WAIT  # and nothing else ends it before
                else:
                    monitor.say(f"timeout: the job ran longer than {timeout:g} s; ending it")
                    deadlines["term"] = now
            if "stop" in deadlines and now > deadlines["stop"] and "term" not in deadlines:
                monitor.say(f"the ranks did not stop within {stop_grace:g} s; ending the job")
                deadlines["term"] = now
            if (monitor.first_failure is not None and now - monitor.first_failure > fail_grace
                    and "term" not in deadlines):
                monitor.say(f"a rank failed {fail_grace:g} s ago and the job is still running; ending it")
                how = "failed-hung"
                deadlines["term"] = now
            if "term" in deadlines and "term_sent" not in deadlines and now >= deadlines["term"]:
                _send(proc, signal.SIGTERM)
                deadlines["term_sent"] = now
                deadlines["kill"] = now + kill_grace
            if "kill" in deadlines and now > deadlines["kill"] and "kill_sent" not in deadlines:
                monitor.say(f"{argv[0]} did not exit {kill_grace:g} s after SIGTERM; killing it")
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                deadlines["kill_sent"] = now
            time.sleep(0.05)
        rc = proc.wait()
    finally:
        restore_handlers()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for t in pumps:
        t.join(timeout=5.0)
    monitor.stop_signal = state["signal"]
    return rc, how


def _send(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
