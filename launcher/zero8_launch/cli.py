"""`zero8-launch`: starts a training script on one or many nodes through an existing engine (OpenMPI's
mpirun, SLURM's srun), with DeepSpeed's launcher options, hostfile format and rank variables; one log
file per rank; a failing rank ends the whole job and its error is shown. docs/LAUNCH.md is the manual.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import time
from collections import OrderedDict

from .commands import Job, mpirun_command, select_exports, srun_command
from .hostfile import LOCAL_HOST, LaunchError, expand_hostlist, parse_core_list, read_hostfile, select_resources
from .monitor import JobMonitor, run_job
from .netinfo import local_ipv4, this_host_among
from .rank_wrapper import DEFAULT_STOP_GRACE, STACKS_SIGNAL

__all__ = ["build_parser", "plan", "main"]

DEFAULT_MASTER_PORT = 29500  # DeepSpeed's (torch.distributed's) default
DEFAULT_LOG_ROOT = "zero8_logs"
DEFAULT_START_TIMEOUT = 300.0


class _Parser(argparse.ArgumentParser):
    """argparse, except that `--launcher_args X` among the launcher's own options (before the script)
    is read as `--launcher_args=X`: argparse takes a separate value that starts with '-' and has no
    space in it ('--mpi=pmix', '--report-bindings') for an unknown option and fails with "expected one
    argument"."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        takes_value = {s for a in self._actions if a.nargs != 0 for s in a.option_strings}
        i = 0
        while i < len(args) and args[i].startswith("-") and args[i] not in ("-", "--"):
            if args[i] == "--launcher_args" and i + 1 < len(args):
                args[i:i + 2] = [f"--launcher_args={args[i + 1]}"]
            elif args[i] in takes_value:
                i += 1  # its value, which is not the script
            i += 1
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="zero8-launch",
        description="Start script.py on every rank of a job (OpenMPI's mpirun or SLURM's srun), with "
                    "DeepSpeed's environment variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR, "
                    "MASTER_PORT, CROSS_RANK, CROSS_SIZE), one log file per rank, and the whole job ended when a "
                    "rank fails. Without --hostfile: --num_procs processes (default 1) on this machine.",
        epilog="Hostfile lines: 'hostname slots=N' ('#' comments). --include/--exclude: "
               "'host1@host2:0,2' (all of host1, slots 0 and 2 of host2). See docs/LAUNCH.md.")
    p.add_argument("-H", "--hostfile", default=None, help="hosts and their slots, DeepSpeed's format (default: this machine only)")
    p.add_argument("--num_nodes", type=int, default=None, help="use the first N hosts of the hostfile")
    p.add_argument("--num_procs", "--num_gpus", dest="num_procs", type=int, default=None,
                   help="processes per node (slots 0..P-1 of each host); without a hostfile, processes on "
                        "this machine (default 1)")
    p.add_argument("-i", "--include", default="", help="only these hosts/slots: host[:slot[,slot]]@host... "
                                                       "(without a hostfile: localhost, one slot per core)")
    p.add_argument("-e", "--exclude", default="", help="all but these hosts/slots: host[:slot[,slot]]@host...")
    p.add_argument("--master_addr", default="", help="MASTER_ADDR for the ranks (default: the first host, "
                                                     "127.0.0.1 on this machine)")
    p.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT, help="MASTER_PORT (default 29500)")
    p.add_argument("--launcher", default="openmpi", choices=["openmpi", "slurm"],
                   help="engine that starts the ranks (default openmpi: mpirun)")
    p.add_argument("--launcher_args", default="", help="extra arguments for mpirun/srun (one string, shell-split)")
    p.add_argument("--net_if", default="", help="multi-node: network for MPI and zero8's communicator, an "
                                                "interface name or IPv4 subnet (e.g. eth1 or 10.0.0.0/24)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than a host's slots/cores (always on without a hostfile)")
    p.add_argument("--export", action="append", default=[], metavar="NAME[=VALUE]",
                   help="also carry this variable to the ranks (repeatable)")
    p.add_argument("--log_dir", default="", help=f"per-rank logs go here (default {DEFAULT_LOG_ROOT}/<date-time>)")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="end the job after S seconds (0: no limit); under mpirun every rank first writes its "
                        "Python stacks (all threads) to its log")
    p.add_argument("--start_timeout", type=float, default=DEFAULT_START_TIMEOUT,
                   help=f"end the job if some rank has not started S seconds after the launch, naming it and "
                        f"its host (default {DEFAULT_START_TIMEOUT:g}; 0: wait forever)")
    p.add_argument("--stop_grace", type=float, default=DEFAULT_STOP_GRACE,
                   help="seconds the ranks get to exit after a Ctrl-C/SIGTERM before the job is killed")
    p.add_argument("--fail_grace", type=float, default=30.0,
                   help="seconds after a rank failed before the launcher ends a job the engine did not end")
    p.add_argument("--bind_cores_to_rank", action="store_true",
                   help="give each rank of a host its own share of the host's cores (CPU affinity) and set "
                        "OMP_NUM_THREADS to that share, as DeepSpeed does")
    p.add_argument("--bind_core_list", default="",
                   help="with --bind_cores_to_rank: the cores to share out, e.g. 0,2-5 (default: every core "
                        "the rank may run on)")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("--no_python", action="store_true", help="run the script directly, not with python")
    p.add_argument("--no_local_rank", action="store_true",
                   help="accepted for DeepSpeed command lines: zero8-launch never passes --local_rank to the script "
                        "(it reads LOCAL_RANK)")
    p.add_argument("--no_prefix", action="store_true", help="do not prefix the ranks' output with [rankN]")
    p.add_argument("--dry_run", action="store_true", help="print the command and exit")
    p.add_argument("user_script", help="the training script (or module with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _default_log_dir() -> str:
    base = os.path.join(DEFAULT_LOG_ROOT, time.strftime("%Y%m%d-%H%M%S"))
    path, i = base, 1
    while os.path.exists(path):
        i += 1
        path = f"{base}-{i}"
    return path


def engine_status(engine: str, rc: int) -> str:
    """How the engine ended, for the summary: 'mpirun exit code 1' or 'mpirun killed by signal 11 (SIGSEGV)'
    (Popen's negative return code)."""
    if rc < 0:
        try:
            name = f" ({signal.Signals(-rc).name})"
        except ValueError:
            name = ""
        return f"{engine} killed by signal {-rc}{name}"
    return f"{engine} exit code {rc}"


def exit_code_of(rc: int) -> int:
    """The launcher's exit code for an engine return code: a death by signal N is 128+N, as a shell says
    (sys.exit(-11) would exit 245)."""
    return 128 - rc if rc < 0 else rc


def _check_net_if_subnet(net_if: str, hosts: list[str]) -> list[str]:
    """--net_if with subnets (one, or OpenMPI's comma list of interfaces and subnets): this host must have
    an address in one of them when it runs ranks (else mpirun would use whatever network it finds, or
    none); when it is not one of the hosts, only a warning (mpirun, which runs here, may still reach the
    hosts' daemons). Interface names are checked by mpirun: a list naming one is not checked here."""
    nets = []
    for entry in net_if.split(","):
        if "/" not in entry:
            return []
        try:
            nets.append(ipaddress.IPv4Network(entry.strip(), strict=False))
        except ValueError as e:
            raise LaunchError(f"--net_if {net_if}: {entry!r} is not an interface name or an IPv4 subnet ({e})")
    net = ", ".join(str(n) for n in nets)
    ifaces = local_ipv4()
    if any(i.ip in n for i in ifaces.values() for n in nets):
        return []
    have = ", ".join(f"{name} {i}" for name, i in ifaces.items()) or "none"
    here = this_host_among(hosts, (LOCAL_HOST,))
    if here is not None:
        raise LaunchError(f"--net_if {net_if}: this host ({socket.gethostname()}, '{here}' in the hostfile) has no "
                          f"address in {net}; its addresses: {have}. Give the subnet the hosts share, or an "
                          f"interface name")
    return [f"--net_if {net_if}: this host ({socket.gethostname()}, not in the hostfile) has no address in {net} "
            f"(its addresses: {have}); mpirun runs here and must reach the hosts' daemons"]


def plan(args: argparse.Namespace, environ=None) -> tuple[Job, list[str]]:
    """The Job the options describe, and warnings. Raises LaunchError on contradictory options."""
    environ = os.environ if environ is None else environ
    warnings: list[str] = []
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python exclude each other")
    # What leaving a count out means depends on where the ranks run: say that, not "all".
    if args.hostfile:
        all_procs, all_nodes = "every slot of each host", "every host of the hostfile"
    elif args.launcher == "slurm":
        all_procs, all_nodes = "srun's default for the allocation", "every node of the allocation"
    else:
        all_procs, all_nodes = "1 process (the default without a hostfile)", "this machine alone"
    # Every number the options take, checked before anything runs: a count of -1 (DeepSpeed's "all"
    # sentinel) or 0 used to run one rank without a word, a negative or NaN time to act as no limit.
    for flag, value, default in (("--num_procs/--num_gpus", args.num_procs, all_procs),
                                 ("--num_nodes", args.num_nodes, all_nodes)):
        if value is not None and value < 1:
            raise LaunchError(f"{flag} {value}: give a count >= 1, or leave it out for {default}")
    for flag, value, zero in (("--timeout", args.timeout, "no limit"),
                              ("--start_timeout", args.start_timeout, "wait forever"),
                              ("--stop_grace", args.stop_grace, "kill at once"),
                              ("--fail_grace", args.fail_grace, "end the job at once")):
        if not (math.isfinite(value) and value >= 0):
            raise LaunchError(f"{flag} {value:g}: give seconds >= 0 (0: {zero})")
    if not 1 <= args.master_port <= 65535:
        raise LaunchError(f"--master_port {args.master_port}: not a TCP port (1..65535)")
    # -1 below: not given (Job, select_resources).
    num_nodes = -1 if args.num_nodes is None else args.num_nodes
    num_procs = -1 if args.num_procs is None else args.num_procs
    job = Job(script=args.user_script, script_args=list(args.user_args), master_port=args.master_port,
              module=args.module, no_python=args.no_python, no_prefix=args.no_prefix, net_if=args.net_if,
              oversubscribe=args.oversubscribe, launcher_args=shlex.split(args.launcher_args),
              stop_grace=args.stop_grace, bind_cores=args.bind_cores_to_rank,
              log_dir=os.path.abspath(args.log_dir or _default_log_dir()))
    if args.bind_core_list:
        job.core_list = ",".join(map(str, parse_core_list(args.bind_core_list)))
        if not args.bind_cores_to_rank:
            warnings.append("--bind_core_list has no effect without --bind_cores_to_rank (as in DeepSpeed)")
    if args.hostfile:
        pool = read_hostfile(args.hostfile)
        job.hosts = select_resources(pool, num_nodes, num_procs, args.include, args.exclude,
                                     oversubscribe=args.oversubscribe)
        job.set_devices = any(slots != list(range(len(slots))) for slots in job.hosts.values())
        job.master_addr = args.master_addr or next(iter(job.hosts))
        if job.multi_node and "/" in args.net_if:
            warnings += _check_net_if_subnet(args.net_if, list(job.hosts))
    elif args.launcher == "slurm":
        if args.include or args.exclude:
            raise LaunchError("--include/--exclude need a --hostfile (under SLURM, srun's --nodelist/--exclude "
                              "go in --launcher_args)")
        job.num_nodes, job.num_procs = num_nodes, num_procs
        job.local_procs = None
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
        first = expand_hostlist(nodelist)[:1] if nodelist else []
        if args.master_addr:
            job.master_addr = args.master_addr
        elif first:
            job.master_addr = first[0]
        else:
            raise LaunchError("--launcher slurm without a hostfile: no SLURM_JOB_NODELIST here (not inside an "
                              "allocation?); give --master_addr or --hostfile")
    else:
        if num_nodes > 1:
            raise LaunchError(f"--num_nodes {num_nodes} needs a --hostfile naming the nodes")
        job.master_addr = args.master_addr or "127.0.0.1"
        if args.include or args.exclude:
            # As DeepSpeed without a hostfile: the filters select slots of "localhost", here one per core.
            cores = os.cpu_count() or 1
            job.hosts = select_resources(OrderedDict([(LOCAL_HOST, cores)]), num_nodes, num_procs,
                                         args.include, args.exclude, oversubscribe=True,
                                         source=f"a run without --hostfile (its one host is {LOCAL_HOST}, "
                                                f"with {cores} slot(s), one per core)")
            job.set_devices = any(slots != list(range(len(slots))) for slots in job.hosts.values())
        else:
            job.local_procs = num_procs if num_procs > 0 else 1
    env_files = []
    # DeepSpeed's .deepspeed_env (home, then the working directory; DS_ENV_FILE names another file).
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    for d in (os.path.expanduser("~"), "."):
        path = os.path.join(d, name)
        if os.path.isfile(path) and os.path.abspath(path) not in map(os.path.abspath, env_files):
            env_files.append(path)
    job.exports, w = select_exports(environ, job.multi_node, args.export, env_files)
    warnings += w
    return job, warnings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        job, warnings = plan(args)
    except LaunchError as e:
        print(f"zero8-launch: error: {e}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"zero8-launch: warning: {w}", file=sys.stderr)
    engine = "srun" if args.launcher == "slurm" else "mpirun"
    exe = shutil.which(engine) or engine
    cmd = srun_command(job, exe) if args.launcher == "slurm" else mpirun_command(job, exe)
    if args.dry_run:
        print(cmd.text())
        for path, text in cmd.files.items():
            print(f"# {path}:\n" + "".join(f"#   {l}\n" for l in text.splitlines()))
        return 0
    if shutil.which(engine) is None:
        print(f"zero8-launch: error: {engine} not found on PATH ("
              + ("install OpenMPI: apt-get install openmpi-bin" if engine == "mpirun" else "not a SLURM node?") + ")",
              file=sys.stderr)
        return 2
    os.makedirs(job.log_dir, exist_ok=True)
    for path, text in cmd.files.items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    env = dict(os.environ)
    for v in cmd.unset:
        env.pop(v, None)
    env.update(cmd.env)
    where = (f"{len(job.hosts)} host(s): " + ", ".join(f"{h}:{len(s)}" for h, s in job.hosts.items())
             if job.hosts is not None else ("this machine" if args.launcher == "openmpi" else "the SLURM allocation"))
    n = job.total_procs
    launcher_log_path = os.path.join(job.log_dir, "launcher.log")
    with open(launcher_log_path, "wb") as launcher_log:
        monitor = JobMonitor(job.log_dir, n, launcher_log=launcher_log, hosts=job.hosts)
        monitor.say(f"{n} rank(s) on {where}" if n is not None else f"ranks on {where}")
        monitor.say(f"running: {cmd.text()}")
        monitor.say(f"logs: {job.log_dir}/rank<R>.log (engine output: {launcher_log_path})")
        t0 = time.monotonic()
        # srun keeps SIGALRM to itself: under it the ranks cannot be asked for their stacks.
        rc, how = run_job(cmd.argv, env, monitor, timeout=args.timeout, stop_grace=args.stop_grace,
                          fail_grace=args.fail_grace, start_timeout=args.start_timeout,
                          stacks_signal=STACKS_SIGNAL if engine == "mpirun" else None)
        elapsed = time.monotonic() - t0
        failed = [s for s in monitor.ranks.values() if s.exit_code not in (None, 0) and not s.stopped_by]
        if how == "done" and rc == 0 and not failed:
            monitor.say(f"all {n if n is not None else len(monitor.ranks)} rank(s) finished in {elapsed:.1f} s; "
                        f"logs: {job.log_dir}")
            return 0
        if how == "stopped":
            code = 128 + (monitor.stop_signal or 2)
            # Over the ranks that reported; those that never started are said apart (all() over none is true).
            ok = all(s.exit_code == 0 or (s.exit_code is not None and s.stopped_by) for s in monitor.ranks.values())
            never = monitor.not_started()
            if never and len(never) == n:
                what = f"before any rank had started ({engine_status(engine, rc)})"
            elif never:
                what = (f"(rank(s) {monitor.describe_ranks(never)} had not started; "
                        + ("the others exited" if ok else engine_status(engine, rc)) + ")")
            else:
                what = "(every rank exited)" if ok and rc == 0 else f"({engine_status(engine, rc)})"
            monitor.say(f"job stopped on request after {elapsed:.1f} s {what}; logs: {job.log_dir}")
            return code
        # A negative code: the engine itself was killed by that signal (not a rank).
        lines, code = monitor.failure_report(engine, -rc if rc < 0 and how == "done" else 0)
        if how == "timeout":
            monitor.say(f"job ended by --timeout {args.timeout:g} after {elapsed:.1f} s")
            lines = monitor.stacks_report() + lines
            code = 124
        elif how == "start-timeout":
            monitor.say(f"job FAILED after {elapsed:.1f} s: not every rank started within --start_timeout "
                        f"{args.start_timeout:g}")
            code = code or 1  # not mpirun's code: the launcher ended it
        else:
            monitor.say(f"job FAILED after {elapsed:.1f} s ({engine_status(engine, rc)})")
        for line in lines:
            monitor.say(line)
        monitor.say(f"logs: {job.log_dir}")
        return code if code else (exit_code_of(rc) if rc else 1)


if __name__ == "__main__":
    sys.exit(main())
