"""The commands zero8-launch runs: OpenMPI's mpirun or SLURM's srun, each starting the per-rank wrapper
(rank_wrapper.py) around the user's script, and the environment variables carried to remote hosts.
Pure functions of a Job description, so the command lines are unit-tested without running them.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

from .hostfile import LaunchError
from .rank_wrapper import DEFAULT_STOP_GRACE, format_hosts

__all__ = ["Job", "Command", "EXPORT_PREFIXES", "EXPORT_NAMES", "PER_HOST_VARS", "select_exports",
           "read_env_file", "rank_command", "mpirun_command", "srun_command"]

# Variables carried to every rank (remote ranks do not inherit the launcher's environment): DeepSpeed's
# list (runner.py EXPORT_ENVS: MLFLOW, NCCL, PYTHON, MV2, UCX) plus zero8's, the thread and library
# settings torch reads, and the paths that find the same Python.
EXPORT_PREFIXES = ("ZERO8_", "PYTHON", "NCCL", "MLFLOW", "MV2", "UCX", "OMP_", "MKL_", "KMP_", "TORCH",
                   "CUDA_", "HF_")
EXPORT_NAMES = ("PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX")
# Per host by nature: never copied from the launcher's host to the others. The wrapper sets the first two;
# CUDA_VISIBLE_DEVICES is each host's own (SLURM's, or the user's there), and --include/--exclude slots
# index into it (rank_wrapper.visible_devices). It matches the "CUDA_" prefix above.
PER_HOST_VARS = ("ZERO8_COMM_IFADDR", "ZERO8_COMM_NODE", "CUDA_VISIBLE_DEVICES")
# Host lists longer than this go to a generated hostfile instead of --host.
MAX_HOST_ARG = 32


@dataclass
class Job:
    """What to run where. hosts: {host: slot indices} in rank order, or None for 'this machine' (local)
    or, under SLURM without a hostfile, 'the allocation'."""
    script: str
    script_args: list[str] = field(default_factory=list)
    hosts: "OrderedDict[str, list[int]] | None" = None
    local_procs: int = 1                 # hosts is None: processes on this machine (OpenMPI)
    num_nodes: int = -1                  # SLURM allocation: --nodes
    num_procs: int = -1                  # SLURM allocation: --ntasks-per-node
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    log_dir: str = "."
    module: bool = False
    no_python: bool = False
    no_prefix: bool = False
    net_if: str = ""
    oversubscribe: bool = False
    set_devices: bool = False            # slots were chosen explicitly: CUDA_VISIBLE_DEVICES per host
    bind_cores: bool = False             # each rank bound to its share of its host's cores
    core_list: str = ""                  # the cores to share out ("" : those the rank may run on)
    launcher_args: list[str] = field(default_factory=list)
    stop_grace: float = DEFAULT_STOP_GRACE  # the wrappers' too, should the engine die without ending them
    exports: "OrderedDict[str, str | None]" = field(default_factory=OrderedDict)  # None: the launcher's value
    python: str = sys.executable

    @property
    def multi_node(self) -> bool:
        return self.hosts is not None and len(self.hosts) > 1 or (self.hosts is None and self.num_nodes > 1)

    @property
    def total_procs(self) -> int | None:
        if self.hosts is not None:
            return sum(len(s) for s in self.hosts.values())
        return self.local_procs


@dataclass
class Command:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)    # added to the launcher's environment
    unset: list[str] = field(default_factory=list)       # removed from it
    files: dict[str, str] = field(default_factory=dict)  # written before running (path -> text)

    def text(self) -> str:
        pre = [f"-u {v}" for v in self.unset] + [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return ("env " + " ".join(pre) + " " if pre else "") + shlex.join(self.argv)


def read_env_file(path: str) -> "OrderedDict[str, str]":
    """DeepSpeed's .deepspeed_env: NAME=VALUE lines (blank lines and '#' comments skipped)."""
    out: "OrderedDict[str, str]" = OrderedDict()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, value = line.partition("=")
            if not sep or not name.strip().isidentifier():
                raise LaunchError(f"{path}:{lineno}: expected NAME=VALUE, got '{line}'")
            out[name.strip()] = value
    return out


def select_exports(environ, multi_node: bool, explicit: list[str] = (), env_files: list[str] = ()
                   ) -> tuple["OrderedDict[str, str | None]", list[str]]:
    """({name: value or None}, warnings): the launcher's variables with the exported prefixes/names
    (value None: mpirun copies it), then the env files' NAME=VALUE lines, then --export NAME[=VALUE]."""
    out: "OrderedDict[str, str | None]" = OrderedDict()
    warnings = []
    for name in sorted(environ):
        if name in EXPORT_NAMES or name.startswith(EXPORT_PREFIXES):
            if multi_node and name in PER_HOST_VARS:
                own = ("each host's own value applies, and selected slots index into it"
                       if name == "CUDA_VISIBLE_DEVICES" else "each rank's wrapper picks its own")
                warnings.append(f"{name} is set here but differs per host: not exported to the ranks "
                                f"({own}; --export {name}=... forces one value)")
                continue
            out[name] = None
    for path in env_files:
        for name, value in read_env_file(path).items():
            out[name] = value
    for item in explicit:
        name, sep, value = item.partition("=")
        if not name.isidentifier():
            raise LaunchError(f"--export '{item}': expected NAME or NAME=VALUE")
        if sep:
            out[name] = value
        elif name in environ:
            out[name] = None
        else:
            raise LaunchError(f"--export {name}: the variable is not set here (use NAME=VALUE)")
    return out, warnings


def rank_command(job: Job) -> list[str]:
    """What each rank runs: the wrapper (with the job layout it maps ranks onto), then the user's program."""
    cmd = [job.python, "-u", "-m", "zero8_launch.rank_wrapper", "--log_dir", os.path.abspath(job.log_dir)]
    if job.hosts is not None:
        cmd += ["--hosts", format_hosts(job.hosts.items())]
    cmd += ["--master_addr", job.master_addr, "--master_port", str(job.master_port)]
    if job.net_if:
        cmd += ["--net_if", job.net_if]
    if job.stop_grace != DEFAULT_STOP_GRACE:
        cmd += ["--stop_grace", f"{job.stop_grace:g}"]
    for flag in ("set_devices", "bind_cores", "module", "no_python", "no_prefix"):
        if getattr(job, flag):
            cmd.append("--" + flag)
    if job.bind_cores and job.core_list:
        cmd += ["--core_list", job.core_list]
    return cmd + ["--", job.script] + list(job.script_args)


def mpirun_command(job: Job, mpirun: str = "mpirun", as_root: bool | None = None) -> Command:
    """OpenMPI 4's mpirun: -np, the hosts (--host h:n,... or a generated hostfile), --allow-run-as-root
    as root, --oversubscribe when asked or on this machine alone, TCP interface selection for
    multi-node jobs given --net_if, -x for the exported variables."""
    if as_root is None:
        as_root = os.geteuid() == 0
    cmd = Command([mpirun, "-np", str(job.total_procs)])
    if job.hosts is not None:
        if len(job.hosts) <= MAX_HOST_ARG:
            cmd.argv += ["--host", ",".join(f"{h}:{len(s)}" for h, s in job.hosts.items())]
        else:
            path = os.path.join(os.path.abspath(job.log_dir), "mpirun_hostfile")
            cmd.files[path] = "".join(f"{h} slots={len(s)}\n" for h, s in job.hosts.items())
            cmd.argv += ["--hostfile", path]
    if as_root:
        cmd.argv.append("--allow-run-as-root")
    if job.oversubscribe or job.hosts is None:
        # This machine alone: P ranks whatever its core count (OpenMPI refuses more ranks than cores).
        cmd.argv.append("--oversubscribe")
    if not any(a == "--bind-to" or a.startswith("--bind-to=") for a in job.launcher_args):
        # mpirun binds each rank to ONE core when it starts at most 2 ranks (to a socket above that), so one
        # rank per host would train on one of its cores. DeepSpeed's launchers do not bind; neither does
        # zero8-launch unless asked: --bind_cores_to_rank binds in the wrappers, and a --bind-to in
        # --launcher_args is the user's choice.
        cmd.argv += ["--bind-to", "none"]
    if job.multi_node and job.net_if:
        # ob1 + TCP on the named network for MPI, and the runtime's own (orted <-> mpirun) connections.
        cmd.argv += ["--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp",
                     "--mca", "btl_tcp_if_include", job.net_if, "--mca", "oob_tcp_if_include", job.net_if]
    for name, value in job.exports.items():
        cmd.argv += ["-x", name if value is None else f"{name}={value}"]
    cmd.argv += list(job.launcher_args)
    cmd.argv += rank_command(job)
    return cmd


def srun_command(job: Job, srun: str = "srun") -> Command:
    """SLURM's srun: the hostfile's hosts and per-host counts (equal counts: --nodelist and
    --ntasks-per-node; unequal: an arbitrary distribution from a generated SLURM_HOSTFILE), or, without
    a hostfile, the allocation (--nodes/--ntasks-per-node when given). --kill-on-bad-exit ends the step
    when a rank fails; --export=ALL carries the environment (exported values set in srun's)."""
    cmd = Command([srun])
    if job.hosts is not None:
        counts = [len(s) for s in job.hosts.values()]
        cmd.argv += [f"--ntasks={sum(counts)}", f"--nodes={len(counts)}"]
        if len(set(counts)) == 1:
            cmd.argv += [f"--ntasks-per-node={counts[0]}", f"--nodelist={','.join(job.hosts)}"]
        else:
            path = os.path.join(os.path.abspath(job.log_dir), "slurm_hostfile")
            cmd.files[path] = "".join(f"{h}\n" for h, s in job.hosts.items() for _ in s)
            cmd.env["SLURM_HOSTFILE"] = path
            cmd.argv.append("--distribution=arbitrary")
    else:
        if job.num_nodes > 0:
            cmd.argv.append(f"--nodes={job.num_nodes}")
        if job.num_procs > 0:
            cmd.argv.append(f"--ntasks-per-node={job.num_procs}")
    if job.oversubscribe:
        cmd.argv.append("--overcommit")
    if job.bind_cores:
        cmd.argv.append("--cpu-bind=none")  # as for mpirun: the wrappers bind
    cmd.argv += ["--kill-on-bad-exit=1", "--export=ALL"]
    if job.multi_node:
        # --export=ALL would copy this host's values to every host.
        cmd.unset += [v for v in PER_HOST_VARS if v not in job.exports]
    for name, value in job.exports.items():
        if value is not None:
            cmd.env[name] = value
    if job.multi_node and job.net_if:
        cmd.env.update({"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader,tcp",
                        "OMPI_MCA_btl_tcp_if_include": job.net_if})
    cmd.argv += list(job.launcher_args)
    cmd.argv += rank_command(job)
    return cmd
