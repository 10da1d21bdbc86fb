"""The per-rank wrapper zero8-launch starts on every rank (`python -m zero8_launch.rank_wrapper ... -- script
args`): maps the engine's rank variables (OpenMPI's OMPI_COMM_WORLD_*, SLURM's SLURM_*) to DeepSpeed's
names, runs the user's script as a child process, writes its output to <log_dir>/rank<R>.log while
forwarding it prefixed with '[rank<R>] ', forwards stop signals, has the script write its Python stacks on
the launcher's --timeout, and records how the rank ended (a status file and a marker line the launcher
reads, so the launcher knows even without a shared file system).
"""

from __future__ import annotations

import signal

# The signal zero8-launch sends (through mpirun/srun, which forward it) to ask every rank to stop: the
# wrapper turns it into SIGTERM for the script, which may save a checkpoint before exiting. mpirun's own
# SIGTERM would be followed by SIGKILL within seconds.
STOP_SIGNAL = signal.SIGUSR1
# The signals the wrapper passes on to the script (STOP_SIGNAL as SIGTERM).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2, STOP_SIGNAL)
# The signal zero8-launch sends on --timeout, a moment before it ends the job, through mpirun, which forwards
# it by default (srun keeps SIGALRM for its own timer): the wrapper then asks the script for the Python
# stacks of all its threads, which say where the rank hung.
STACKS_SIGNAL = signal.SIGALRM
# The signal that asks the script: faulthandler writes the stacks to the script's stderr, registered for it
# by stacks_site/sitecustomize.py as the script starts. Ignored by default, so that a script without the
# handler (not Python; python -I, -E or -S, which skip that file) is not harmed.
SCRIPT_STACKS_SIGNAL = signal.SIGURG

# A stop that reaches the wrapper before main() has installed its handlers (while this module's imports
# load) must not kill it by the signal's default action, which the launcher would report as a crash: it
# is recorded here, before the other imports, and acted on as soon as main() is ready. (The interpreter's
# own start-up, before this line runs, is the only window left.)
_EARLY_SIGNALS: list[int] = []
if __name__ == "__main__":
    for _s in FORWARDED_SIGNALS:
        signal.signal(_s, lambda signum, _frame: _EARLY_SIGNALS.append(signum))
    signal.signal(STACKS_SIGNAL, lambda *_: None)  # no script yet, no stacks

import ctypes  # noqa: E402
import errno  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import selectors  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.parse  # noqa: E402

from .hostfile import LaunchError, parse_core_list  # noqa: E402
from .netinfo import pick_comm_ifaddr  # noqa: E402

__all__ = ["MARKER", "format_hosts", "parse_hosts", "engine_ranks", "rank_environment", "visible_devices",
           "format_marker", "parse_marker", "main"]

# Lines the wrapper writes for the launcher start with this (rank output is prefixed '[rankN] ').
MARKER = "[zero8-launch]"
# Seconds an unterminated output line waits for its newline before being forwarded as is.
PARTIAL_DELAY = 0.2
# Seconds a script gets to exit after SIGTERM when its engine died without ending it (the launcher's
# --stop_grace, passed on, overrides this).
DEFAULT_STOP_GRACE = 30.0
# The directory whose sitecustomize.py registers SCRIPT_STACKS_SIGNAL in the script (first on its PYTHONPATH).
STACKS_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stacks_site")


def _int_env(env, name: str) -> int | None:
    v = env.get(name)
    if v is None or not v.strip().lstrip("-").isdigit():
        return None
    return int(v)


def _slurm_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE '2(x3),1' -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return []
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def engine_ranks(env) -> dict:
    """Rank facts as the engine that started this process gives them:
    dict(engine, rank, size, local_rank, local_size, node (or None), nodes (or None))."""
    if _int_env(env, "OMPI_COMM_WORLD_RANK") is not None:
        return dict(engine="openmpi", rank=_int_env(env, "OMPI_COMM_WORLD_RANK"),
                    size=_int_env(env, "OMPI_COMM_WORLD_SIZE"),
                    local_rank=_int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                    local_size=_int_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE"), node=None, nodes=None)
    if _int_env(env, "SLURM_PROCID") is not None:
        node = _int_env(env, "SLURM_NODEID")
        per_node = _slurm_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
        local_size = per_node[node] if node is not None and node < len(per_node) else None
        return dict(engine="slurm", rank=_int_env(env, "SLURM_PROCID"),
                    size=_int_env(env, "SLURM_NTASKS") or _int_env(env, "SLURM_NPROCS"),
                    local_rank=_int_env(env, "SLURM_LOCALID"), local_size=local_size, node=node,
                    nodes=_int_env(env, "SLURM_STEP_NUM_NODES") or _int_env(env, "SLURM_NNODES"))
    if _int_env(env, "PMI_RANK") is not None:  # MPICH's hydra
        return dict(engine="pmi", rank=_int_env(env, "PMI_RANK"), size=_int_env(env, "PMI_SIZE"),
                    local_rank=_int_env(env, "MPI_LOCALRANKID"), local_size=_int_env(env, "MPI_LOCALNRANKS"),
                    node=None, nodes=None)
    return dict(engine="none", rank=_int_env(env, "RANK") or 0, size=_int_env(env, "WORLD_SIZE") or 1,
                local_rank=_int_env(env, "LOCAL_RANK") or 0, local_size=_int_env(env, "LOCAL_SIZE") or 1,
                node=None, nodes=None)


def rank_environment(env, world: dict) -> tuple[dict, dict, list[str]]:
    """(variables to set for the script, facts about this rank, warnings). `world` is the launcher's
    world info: hosts [[name, [slots]], ...] (or None: unknown, e.g. a SLURM allocation), master_addr,
    master_port, net_if, set_devices. facts["error"]: why the rank cannot start (its selected slots are not
    among the host's devices), or None."""
    r = engine_ranks(env)
    warnings: list[str] = []
    rank, size = r["rank"], r["size"]
    local_rank, local_size = r["local_rank"], r["local_size"]
    node, nodes = r["node"], r["nodes"]
    host, slots = None, None
    hosts = world.get("hosts")
    if hosts:
        # mpirun/srun fill the hosts in order: ranks [start, start + n) on host i.
        start = 0
        for i, (name, host_slots) in enumerate(hosts):
            if start <= rank < start + len(host_slots):
                consistent = ((local_rank is None or local_rank == rank - start)
                              and (local_size is None or local_size == len(host_slots))
                              and (node is None or node == i))
                if consistent:
                    host, slots = name, host_slots
                    node, nodes = i, len(hosts)
                    local_rank, local_size = rank - start, len(host_slots)
                else:
                    warnings.append(f"rank {rank}: the engine placed it as local rank {local_rank} of {local_size}, "
                                    f"not as the hostfile order implies (host '{name}', local rank {rank - start} "
                                    f"of {len(host_slots)}); CROSS_RANK and ZERO8_COMM_NODE are not set")
                break
            start += len(host_slots)
        total = sum(len(s) for _, s in hosts)
        if size is not None and size != total:
            warnings.append(f"rank {rank}: world size {size} differs from the {total} slots the launcher selected")
    out = {
        "RANK": str(rank), "WORLD_SIZE": str(size if size is not None else 1),
        "LOCAL_RANK": str(local_rank if local_rank is not None else 0),
        "LOCAL_SIZE": str(local_size if local_size is not None else 1),
        "PYTHONUNBUFFERED": "1",
    }
    if node is None and nodes is None and not warnings and size is not None and local_size == size:
        node, nodes = 0, 1  # every rank on this node (a local run without a hostfile): node 0 of 1
    if node is not None and nodes is not None:
        out["CROSS_RANK"], out["CROSS_SIZE"] = str(node), str(nodes)
    master_addr = world.get("master_addr")
    if master_addr:
        out["MASTER_ADDR"] = str(master_addr)
    if world.get("master_port"):
        out["MASTER_PORT"] = str(world["master_port"])
    if host is not None:
        out["ZERO8_LAUNCH_HOST"] = host
    multi_node = (nodes or 1) > 1
    if multi_node:
        # Every rank of a host must agree on its node name, and hosts must differ: the hostfile's names do.
        if host is not None and not env.get("ZERO8_COMM_NODE"):
            out["ZERO8_COMM_NODE"] = host
        if not env.get("ZERO8_COMM_IFADDR"):
            addr, why = pick_comm_ifaddr(world.get("net_if") or "", host, master_addr)
            if addr:
                out["ZERO8_COMM_IFADDR"] = addr
            else:
                warnings.append(f"rank {rank}: ZERO8_COMM_IFADDR not set: {why}")
    error = None
    if world.get("set_devices") and slots is not None:
        try:
            devices = visible_devices(env.get("CUDA_VISIBLE_DEVICES"), host, slots)
        except LaunchError as e:
            error = str(e)
        else:
            if devices is not None:
                out["CUDA_VISIBLE_DEVICES"] = devices
    facts = dict(rank=rank, size=size, local_rank=int(out["LOCAL_RANK"]), local_size=int(out["LOCAL_SIZE"]),
                 node=node, nodes=nodes, host=host, engine=r["engine"], error=error)
    return out, facts, warnings


def visible_devices(visible: str | None, host: str, slots: list[int]) -> str | None:
    """CUDA_VISIBLE_DEVICES for the selected slots of `host`, as DeepSpeed: the slots are the devices, and
    LOCAL_RANK indexes them. Where the host already has a device list (`visible`: SLURM's, or the user's on
    that host), the slots index into it (slot 0 is its first entry), so a selection is never ignored nor
    escapes the list; a slot beyond it raises LaunchError naming the host and the slot. An empty list (no
    device visible: a CPU job) is left as it is (None)."""
    if visible is None:
        return ",".join(str(s) for s in slots)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not entries:
        return None
    beyond = [s for s in slots if s >= len(entries)]
    if beyond:
        raise LaunchError(f"host '{host}': slot {beyond[0]} was selected (--include/--exclude), but this host's "
                          f"CUDA_VISIBLE_DEVICES is '{visible}', {len(entries)} device(s) (slots 0 to "
                          f"{len(entries) - 1}), and slots index into it; select slots of that list, or unset "
                          f"CUDA_VISIBLE_DEVICES on that host for the slots to be its devices")
    return ",".join(entries[s] for s in slots)


def stacks_environment(env) -> dict:
    """The variables that have the script's Python register SCRIPT_STACKS_SIGNAL (stacks_site/sitecustomize.py,
    which then restores PYTHONPATH as it is in `env`)."""
    path = env.get("PYTHONPATH")
    return {"PYTHONPATH": STACKS_SITE if path is None else STACKS_SITE + os.pathsep + path,
            "ZERO8_LAUNCH_STACKS_SIGNAL": str(int(SCRIPT_STACKS_SIGNAL))}


def catches_signal(pid: int, sig: int) -> bool | None:
    """Whether process `pid` has a handler for `sig` (Linux: SigCgt in /proc/<pid>/status); None if unknown."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _core_text(cores) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def core_binding(core_list: str, local_rank: int, local_size: int, allowed) -> list[int]:
    """The cores of local rank `local_rank` (of `local_size` on its host) under --bind_cores_to_rank, as
    DeepSpeed shares them out (deepspeed/utils/numa.py, get_numactl_cmd): the list (default: the cores
    this process may run on, ascending) cut into `local_size` equal runs in order, any remainder unused.
    Raises LaunchError for cores this process may not use and for fewer cores than ranks."""
    allowed = set(allowed)
    cores = parse_core_list(core_list) if core_list else sorted(allowed)
    missing = [c for c in cores if c not in allowed]
    if missing:
        raise LaunchError(f"--bind_core_list: core(s) {_core_text(missing)} are not available on this host "
                          f"(this rank may run on cores {_core_text(allowed)})")
    per = len(cores) // local_size
    if per < 1:
        raise LaunchError(f"--bind_cores_to_rank: {len(cores)} core(s) ({_core_text(cores)}) for {local_size} "
                          f"ranks on this host: every rank needs a core of its own (start fewer ranks per host, "
                          f"or leave out --bind_cores_to_rank)")
    return cores[local_rank * per:(local_rank + 1) * per]


def format_marker(**fields) -> str:
    return MARKER + " " + " ".join(f"{k}={urllib.parse.quote(str(v), safe='/:.,-_@')}" for k, v in fields.items())


def status_path(log_dir: str, rank: int) -> str:
    """Where the wrapper of `rank` records how the rank ended (read by the launcher's monitor)."""
    return os.path.join(log_dir, f"rank{rank}.status.json")


def parse_marker(line: str) -> dict | None:
    """A marker line -> its fields (strings), or None for any other line."""
    if not line.startswith(MARKER + " "):
        return None
    fields = {}
    for tok in line[len(MARKER) + 1:].split():
        k, sep, v = tok.partition("=")
        if not sep:
            return None
        fields[k] = urllib.parse.unquote(v)
    return fields if "rank" in fields and "event" in fields else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError as e:
            # The reader is gone (EPIPE for a pipe, EIO for mpirun's pseudo-terminal): keep logging to the file.
            if e.errno in (errno.EPIPE, errno.EIO):
                return
            raise
        view = view[n:]


_SEP = re.compile(rb"(\r\n|\r|\n)")


class _Prefixer:
    """Inserts the rank prefix at every line start (after '\\n' or '\\r', so progress bars are prefixed too)."""

    def __init__(self, prefix: bytes):
        self.prefix = prefix
        self.at_start = True

    def __call__(self, chunk: bytes) -> bytes:
        if not self.prefix:
            return chunk
        out = bytearray()
        for j, part in enumerate(_SEP.split(chunk)):
            if j % 2 == 0:
                if part:
                    if self.at_start:
                        out += self.prefix
                        self.at_start = False
                    out += part
            else:
                # An empty line gets the prefix too (the launcher attributes lines by it), except before a
                # carriage return, where it would only be overwritten.
                if self.at_start and part != b"\r":
                    out += self.prefix
                out += part
                self.at_start = True
        return bytes(out)


def _relay(child: subprocess.Popen, sources: dict, log, prefix: bytes, tick=None) -> None:
    """Copies the child's stdout/stderr to the log file (in arrival order, unprefixed) and to this
    process's stdout/stderr (prefixed) until both close, or shortly after the child exits (a process the
    script started may hold the pipes open). Forwarding goes by whole lines, so that print()'s separate
    writes of text and newline are not interleaved with other ranks' lines downstream; an unterminated
    line (a progress bar) is forwarded after PARTIAL_DELAY seconds. `tick()`, if given, is called about
    every PARTIAL_DELAY / 2 seconds."""
    sel = selectors.DefaultSelector()
    pending = {}
    for src, dst in sources.items():
        sel.register(src, selectors.EVENT_READ, (dst, _Prefixer(prefix)))
        pending[src] = [b"", 0.0]

    def flush(src, dst, prefixer, partial):
        buf = pending[src][0]
        cut = len(buf) if partial else max(buf.rfind(b"\n"), buf.rfind(b"\r")) + 1
        if cut > 0:
            _write_all(dst, prefixer(buf[:cut]))
            pending[src][0] = buf[cut:]

    exited_at = None
    while sel.get_map():
        if tick is not None:
            tick()
        if exited_at is None and child.poll() is not None:
            exited_at = time.monotonic()
        if exited_at is not None and time.monotonic() - exited_at > 2.0:
            break
        for key, _ in sel.select(timeout=PARTIAL_DELAY / 2):
            dst, prefixer = key.data
            try:
                chunk = os.read(key.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                flush(key.fd, dst, prefixer, partial=True)
                sel.unregister(key.fd)
                continue
            log.write(chunk)
            log.flush()
            if not pending[key.fd][0]:
                pending[key.fd][1] = time.monotonic()
            pending[key.fd][0] += chunk
            flush(key.fd, dst, prefixer, partial=False)
        now = time.monotonic()
        for key in list(sel.get_map().values()):
            if pending[key.fd][0] and now - pending[key.fd][1] > PARTIAL_DELAY:
                flush(key.fd, *key.data, partial=True)
    for key in list(sel.get_map().values()):
        flush(key.fd, *key.data, partial=True)
        sel.unregister(key.fd)
    sel.close()
    for src in sources:
        os.close(src)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _child_setup() -> None:
    # Its own process group: mpirun/orted signal the whole group of the process they started (the
    # wrapper), and the wrapper must decide what the script gets (SIGUSR1 becomes SIGTERM). And if the
    # wrapper is killed (SIGKILL from mpirun's abort), the script must not live on as an orphan.
    os.setpgid(0, 0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: best effort
        pass


def _start_group_guard(pgid: int) -> tuple[int, int]:
    """Starts a process that SIGKILLs process group `pgid` (the script's) if this wrapper dies before it
    has ended the script: mpirun's abort, and the job's end after --stop_grace or a second Ctrl-C, SIGKILL
    the wrapper's group about a second after SIGTERM; a script that ignores SIGTERM then dies by
    PR_SET_PDEATHSIG, but the processes it started would live on. The guard waits on a pipe that only this
    wrapper can write to: a byte releases it (`_release_group_guard`), end-of-file (the wrapper is gone, its
    end closed by the kernel) fires it. It runs in its own process group, out of reach of the SIGKILL that
    ends the wrapper, and holds none of the wrapper's files (the engine waits for the rank's output to
    close). Returns (its pid, the pipe's write end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            for s in FORWARDED_SIGNALS + (STACKS_SIGNAL,):
                signal.signal(s, signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.closerange(3, r)
            os.closerange(r + 1, os.sysconf("SC_OPEN_MAX"))
            if os.read(r, 1) == b"":
                _signal_group(pgid, signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(r)
    return pid, w


def _release_group_guard(pid: int, w: int) -> None:
    _write_all(w, b"x")
    os.close(w)
    os.waitpid(pid, 0)


def format_hosts(hosts) -> str:
    """[[host, [slots]], ...] -> 'host:0,1@host2:0,1' (the wrapper's --hosts)."""
    return "@".join(f"{h}:{','.join(str(x) for x in slots)}" for h, slots in hosts)


def parse_hosts(text: str) -> list:
    out = []
    for spec in text.split("@"):
        host, _, slots = spec.rpartition(":")
        out.append([host, [int(x) for x in slots.split(",") if x]])
    return out


_VALUE_OPTS = ("log_dir", "hosts", "master_addr", "master_port", "net_if", "stop_grace", "core_list")
_FLAG_OPTS = ("set_devices", "bind_cores", "module", "no_python", "no_prefix")


def _usage(msg: str) -> int:
    sys.stderr.write(f"zero8_launch.rank_wrapper: {msg}\n"
                     "usage: python -m zero8_launch.rank_wrapper [--log_dir D] [--hosts H:0,1@H2:0,1] "
                     "[--master_addr A] [--master_port P] [--net_if IF] [--stop_grace S] [--set_devices] "
                     "[--bind_cores [--core_list 0,2-5]] "
                     "[--module | --no_python] [--no_prefix] -- script [args...]\n")
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts: dict = {k: None for k in _VALUE_OPTS}
    opts.update({k: False for k in _FLAG_OPTS})
    while argv and argv[0] != "--":
        a = argv.pop(0)
        key = a[2:] if a.startswith("--") else None
        if key in _VALUE_OPTS:
            if not argv:
                return _usage(f"{a} needs a value")
            opts[key] = argv.pop(0)
        elif key in _FLAG_OPTS:
            opts[key] = True
        else:
            return _usage(f"unknown option '{a}'")
    if not argv or argv[0] != "--" or len(argv) < 2:
        return _usage("missing '-- script [args...]'")
    try:
        stop_grace = float(opts["stop_grace"]) if opts["stop_grace"] is not None else DEFAULT_STOP_GRACE
    except ValueError:
        return _usage(f"--stop_grace '{opts['stop_grace']}': expected seconds")
    program = argv[1:]
    # The engine process that started this wrapper (mpirun, orted, slurmstepd): if it dies without ending
    # this rank (SIGKILLed; or mpirun on a second SIGTERM, which exits at once), nothing else will.
    engine_pid = os.getppid()
    world = {"hosts": parse_hosts(opts["hosts"]) if opts["hosts"] else None, "master_addr": opts["master_addr"],
             "master_port": opts["master_port"], "net_if": opts["net_if"] or "", "set_devices": opts["set_devices"]}

    env = dict(os.environ)
    updates, facts, warnings = rank_environment(env, world)
    rank = facts["rank"]
    start_error = f"rank {rank}: {facts['error']}" if facts["error"] else None
    if opts["bind_cores"] and start_error is None:
        # The wrapper binds itself and the script inherits it (so do the threads and processes it starts).
        try:
            cores = core_binding(opts["core_list"] or "", facts["local_rank"], facts["local_size"],
                                 os.sched_getaffinity(0))
            os.sched_setaffinity(0, cores)
            updates["OMP_NUM_THREADS"] = str(len(cores))  # as DeepSpeed: one thread per bound core
            facts["cores"] = _core_text(cores)
        except (LaunchError, OSError) as e:
            start_error = f"rank {rank}: {e}"
    updates.update(stacks_environment(env))
    env.update(updates)
    for w in warnings:
        sys.stderr.write(f"zero8-launch: warning: {w}\n")

    log_dir = opts["log_dir"] or "."
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"rank{rank}.log")
    status_file = status_path(log_dir, rank)
    if opts["no_python"]:
        cmd = program
    elif opts["module"]:
        cmd = [sys.executable, "-u", "-m"] + program
    else:
        cmd = [sys.executable, "-u"] + program

    status = dict(rank=rank, world_size=facts["size"], local_rank=facts["local_rank"], host=facts["host"],
                  hostname=socket.gethostname(), command=cmd, log=os.path.abspath(log_path),
                  start_time=time.time(), end_time=None, exit_code=None, signal=None, stopped_by=None,
                  environment={k: updates[k] for k in sorted(updates)}, cores=facts.get("cores"))

    def write_status() -> None:
        tmp = status_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(status, f, indent=1)
        os.replace(tmp, status_file)

    running: dict = {}  # "child": the script's process once started

    def forward(signum, _frame):
        if signum == STOP_SIGNAL and status["stopped_by"] == STOP_SIGNAL.name:
            return  # the launcher repeats a stop until every rank has acknowledged it: act on it once
        status["stopped_by"] = signal.Signals(signum).name
        # Said at once: if mpirun's abort SIGKILLs this wrapper before the script has exited, the
        # launcher still knows this rank was alive when the job was ended (not a rank that died).
        sys.stderr.write(format_marker(rank=rank, event="signal", name=status["stopped_by"]) + "\n")
        sys.stderr.flush()
        child = running.get("child")
        if child is None:  # not started yet: do not start it
            raise SystemExit(128 + signum)
        try:
            child.send_signal(signal.SIGTERM if signum == STOP_SIGNAL else signum)
        except ProcessLookupError:
            pass

    stacks_asked: list[bool] = []  # acted on by tick(), outside the signal handler (it writes the log)

    def ask_stacks(_signum, _frame):
        if running.get("child") is not None:
            stacks_asked.append(True)

    for s in FORWARDED_SIGNALS:
        signal.signal(s, forward)
    signal.signal(STACKS_SIGNAL, ask_stacks)
    if _EARLY_SIGNALS:  # asked to stop while starting: the script is not started
        forward(_EARLY_SIGNALS[0], None)

    log = open(log_path, "wb")
    try:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            if start_error:
                raise LaunchError(start_error)
            child = subprocess.Popen(cmd, stdout=out_w, stderr=err_w, env=env, preexec_fn=_child_setup)
        except (OSError, LaunchError) as e:
            # 127 as a shell's for a program it cannot run; 2 for a usage error (the core binding).
            msg, code = ((f"cannot start {cmd[0]}: {e.strerror or e}\n", 127) if isinstance(e, OSError)
                         else (f"zero8-launch: error: {e}\n", 2))
            log.write(msg.encode())
            _write_all(2, f"[rank{rank}] {msg}".encode())
            status.update(end_time=time.time(), exit_code=code)
            write_status()
            sys.stderr.write(format_marker(rank=rank, event="exit", code=code, signal=0, stopped_by="",
                                           host=facts["host"] or "", seconds=0, log=status["log"]) + "\n")
            return code
        finally:
            os.close(out_w)
            os.close(err_w)
        guard = _start_group_guard(child.pid)
        running["child"] = child
        status["pid"] = child.pid
        write_status()
        sys.stderr.write(format_marker(rank=rank, event="start", pid=child.pid, host=facts["host"] or "",
                                       hostname=status["hostname"]) + "\n")
        sys.stderr.flush()

        prefix = b"" if opts["no_prefix"] else f"[rank{rank}] ".encode()
        ending: dict = {}

        def write_stacks() -> None:
            # The script writes them to its stderr, which comes here like the rest of its output.
            caught = catches_signal(child.pid, SCRIPT_STACKS_SIGNAL)
            if caught is False:
                note = (f"zero8-launch: --timeout: no Python stacks of this rank: its script (pid {child.pid}) has "
                        f"no handler for {SCRIPT_STACKS_SIGNAL.name} (not Python, or Python run with -I, -E or -S)\n")
            else:
                note = "zero8-launch: --timeout: the Python stacks of every thread of this rank's script follow\n"
            log.write(note.encode())
            log.flush()
            if caught is not False:
                child.send_signal(SCRIPT_STACKS_SIGNAL)
            sys.stderr.write(format_marker(rank=rank, event="stacks", written=int(caught is not False),
                                           host=facts["host"] or "", log=status["log"]) + "\n")
            sys.stderr.flush()

        def tick() -> None:
            now = time.monotonic()
            if stacks_asked and "stacks" not in ending and child.poll() is None:
                ending["stacks"] = now
                write_stacks()
            if "exited" not in ending and child.poll() is not None:
                # The script has ended: so do the processes it started in its group (helpers, servers),
                # as no rank may outlive the job. SIGTERM now, SIGKILL once its output is drained.
                ending["exited"] = now
                _signal_group(child.pid, signal.SIGTERM)
            if "engine_gone" not in ending and os.getppid() != engine_pid:
                ending["engine_gone"] = now
                note = (f"zero8-launch: rank {rank}: the engine that started it (pid {engine_pid}) is gone; "
                        f"ending the script (SIGTERM, SIGKILL after {stop_grace:g} s)\n")
                log.write(note.encode())
                log.flush()
                _write_all(2, note.encode())
                status["stopped_by"] = status["stopped_by"] or "engine_exit"
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            if ("engine_gone" in ending and "killed" not in ending and child.poll() is None
                    and now - ending["engine_gone"] > stop_grace):
                ending["killed"] = now
                _signal_group(child.pid, signal.SIGKILL)

        _relay(child, {out_r: 1, err_r: 2}, log, prefix, tick)
        code = child.wait()
        _signal_group(child.pid, signal.SIGKILL)
        _release_group_guard(*guard)
    finally:
        log.flush()
    status["end_time"] = time.time()
    if code < 0:
        status["signal"] = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        exit_code = 128 - code
    else:
        exit_code = code
    status["exit_code"] = exit_code
    write_status()
    log.close()
    sys.stderr.write(format_marker(rank=rank, event="exit", code=exit_code, signal=-code if code < 0 else 0,
                                   stopped_by=status["stopped_by"] or "", host=facts["host"] or "",
                                   seconds=f"{status['end_time'] - status['start_time']:.2f}",
                                   log=status["log"]) + "\n")
    sys.stderr.flush()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
