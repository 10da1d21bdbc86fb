"""Tests of zero8-launch (launcher/zero8_launch): hostfile parsing and resource selection as DeepSpeed's
launcher does them, the mpirun/srun command lines it builds, the rank wrapper's variables and output
handling, and real local jobs under OpenMPI: the variables each rank sees, per-rank logs, a failing or
killed rank ending the job promptly with its error shown, --timeout, a graceful stop, a zero8 job.
The two-host runs are in test_multinode.py.
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "launch"))
from launch_util import (RANK_ENV, TRAIN_JOB, env_lines, installed_problem, job_env, launch,  # noqa: E402
                         launch_cmd, mpirun)

pytestmark = pytest.mark.slow  # conftest.py starts such files first

# The tests run against the installed launcher (as users run it); a missing or stale install fails
# every test with the reinstall command instead of testing old code.
_problem = installed_problem()
if _problem is None:
    from zero8_launch import cli
    from zero8_launch.commands import Job, mpirun_command, rank_command, select_exports, srun_command
    from zero8_launch.hostfile import (LaunchError, expand_hostlist, filter_resources, parse_core_list,
                                       parse_hostfile, read_hostfile, select_resources)
    from zero8_launch.monitor import JobMonitor, error_excerpt
    from zero8_launch import netinfo
    from zero8_launch.netinfo import default_route_iface, default_route_ifaddr, local_ipv4, pick_comm_ifaddr
    from zero8_launch.rank_wrapper import (_Prefixer, core_binding, format_marker, parse_hosts, parse_marker,
                                           rank_environment, visible_devices)


@pytest.fixture(autouse=True)
def _launcher_installed():
    if _problem:
        pytest.fail(_problem, pytrace=False)


def hosts(**slots) -> "OrderedDict[str, int]":
    return OrderedDict(slots)


# ---------------------------------------------------------------------------------------------
# Hostfiles
# ---------------------------------------------------------------------------------------------

def test_hostfile_good_with_comments_and_blank_lines():
    text = ("# cluster\n"
            "\n"
            "worker-0 slots=4\n"
            "   worker-1   slots=2   # the small one\n"
            "worker-2 slots=8 max_slots=16\n")
    pool = parse_hostfile(text, "hf")
    assert list(pool.items()) == [("worker-0", 4), ("worker-1", 2), ("worker-2", 8)]


def test_hostfile_duplicate_host_names_both_lines():
    with pytest.raises(LaunchError, match=r"hf:4: host 'a' is listed twice \(first on line 1\)"):
        parse_hostfile("a slots=1\nb slots=1\n\na slots=2\n", "hf")


@pytest.mark.parametrize("line, what", [
    ("worker-0", "bad hostfile line"),            # DeepSpeed requires slots= (OpenMPI would assume 1)
    ("worker-0 slot=2", "bad hostfile line"),
    ("worker-0 slots=0", "bad slot count '0'"),
    ("worker-0 slots=-1", "bad slot count '-1'"),
    ("worker-0 slots=two", "bad slot count 'two'"),
    ("worker-0 slots=", "bad hostfile line"),
    # Separators in mpirun's --host list and the wrapper's: '127.0.0.1:5' became --host 127.0.0.1:5:1.
    ("127.0.0.1:5 slots=1", "bad host name '127.0.0.1:5': ':' cannot be in a host name"),
    ("a,b slots=1", "bad host name 'a,b': ',' cannot be in a host name"),
    ("a@b:1 slots=1", "bad host name 'a@b:1': ':' '@' cannot be in a host name"),
])
def test_hostfile_bad_lines_name_file_and_line(line, what):
    with pytest.raises(LaunchError) as e:
        parse_hostfile(f"# header\nok slots=1\n{line}\n", "/path/hosts")
    assert str(e.value).startswith("/path/hosts:3: ")
    assert what in str(e.value)


def test_hostfile_empty_and_missing(tmp_path):
    with pytest.raises(LaunchError, match="names no hosts"):
        parse_hostfile("# nothing\n\n", "hf")
    with pytest.raises(LaunchError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path / "absent"))
    f = tmp_path / "hosts"
    f.write_text("n1 slots=2\n")
    assert read_hostfile(str(f)) == {"n1": 2}


# ---------------------------------------------------------------------------------------------
# --include / --exclude / --num_nodes / --num_procs
# ---------------------------------------------------------------------------------------------

def _pool():
    return OrderedDict([("w0", [0, 1, 2, 3]), ("w1", [0, 1, 2, 3]), ("w2", [0, 1])])


def test_include_whole_hosts_and_slots_keep_hostfile_order():
    # DeepSpeed's docstring example: all of one host, slots 0 and 2 of another.
    got = filter_resources(_pool(), include="w1:0,2@w0")
    assert list(got.items()) == [("w0", [0, 1, 2, 3]), ("w1", [0, 2])]


def test_exclude_slots_and_hosts():
    got = filter_resources(_pool(), exclude="w1:0@w2")
    assert list(got.items()) == [("w0", [0, 1, 2, 3]), ("w1", [1, 2, 3])]
    # Excluding every slot of a host removes it.
    assert list(filter_resources(_pool(), exclude="w2:0,1")) == ["w0", "w1"]


@pytest.mark.parametrize("kw, msg", [
    (dict(include="w0", exclude="w1"), "mutually exclusive"),
    (dict(include="w9"), "host 'w9' is not in the hostfile"),
    (dict(include="w2:5"), "host 'w2' has no slot 5"),
    (dict(exclude="w0:x"), "bad slot 'x'"),
    (dict(include="w0@@w1"), "empty host"),
])
def test_filter_errors(kw, msg):
    with pytest.raises(LaunchError, match=msg):
        filter_resources(_pool(), **kw)


def test_select_num_nodes_and_num_procs():
    pool = hosts(a=4, b=4, c=2)
    assert list(select_resources(pool, num_nodes=2).items()) == [("a", [0, 1, 2, 3]), ("b", [0, 1, 2, 3])]
    assert list(select_resources(pool, num_procs=2).items()) == [("a", [0, 1]), ("b", [0, 1]), ("c", [0, 1])]
    assert list(select_resources(pool, num_nodes=1, num_procs=3).items()) == [("a", [0, 1, 2])]
    with pytest.raises(LaunchError, match="host 'c' has only 2 slot"):
        select_resources(pool, num_procs=3)
    assert select_resources(pool, num_procs=3, oversubscribe=True)["c"] == [0, 1, 2]
    with pytest.raises(LaunchError, match="lists only 3 host"):
        select_resources(pool, num_nodes=4)
    with pytest.raises(LaunchError, match="cannot be combined"):
        select_resources(pool, num_nodes=1, include="a")
    assert list(select_resources(pool, include="b:1@c").items()) == [("b", [1]), ("c", [0, 1])]


def test_include_and_exclude_without_a_hostfile_select_local_slots(tmp_path):
    # As DeepSpeed without a hostfile: the filters pick slots of "localhost", here one per core.
    cores = os.cpu_count()
    job, _ = _plan(["--include", "localhost:1", "--log_dir", str(tmp_path), "s.py"])
    assert job.hosts == {"localhost": [1]} and job.set_devices and job.master_addr == "127.0.0.1"
    if cores > 1:
        job, _ = _plan(["-e", "localhost:0", "--log_dir", str(tmp_path), "s.py"])
        assert job.hosts == {"localhost": list(range(1, cores))} and job.total_procs == cores - 1
    job, _ = _plan(["-i", "localhost", "--log_dir", str(tmp_path), "s.py"])
    assert job.hosts == {"localhost": list(range(cores))} and not job.set_devices
    for argv, msg in ((["-i", "n1"], "host 'n1' is not in a run without --hostfile .*localhost, "
                                     f"with {cores} slot"),
                      (["-i", f"localhost:{cores}"], f"host 'localhost' has no slot {cores}"),
                      (["-e", "localhost"], "no host left"),
                      (["-i", "localhost", "--num_procs", "1"], "cannot be combined")):
        with pytest.raises(LaunchError, match=msg):
            _plan(argv + ["--log_dir", str(tmp_path), "s.py"])


def test_core_lists_and_their_errors():
    assert parse_core_list("0,2-5,7") == [0, 2, 3, 4, 5, 7]
    assert parse_core_list("3") == [3]
    for bad, msg in (("0-x", "bad item '0-x'"), ("1,,2", "bad item ''"), ("5-3", "range '5-3' runs backwards"),
                     ("1,0-2", "core 1 is listed twice"), ("-1", "bad item '-1'")):
        with pytest.raises(LaunchError, match=msg):
            parse_core_list(bad)


def test_core_binding_shares_the_cores_out_as_deepspeed_does():
    allowed = set(range(8))
    assert [core_binding("", r, 2, allowed) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # The remainder stays unused; a given list is shared out in its own order.
    assert [core_binding("", r, 3, allowed) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [core_binding("6,7,1-3", r, 2, allowed) for r in range(2)] == [[6, 7], [1, 2]]
    with pytest.raises(LaunchError, match=r"core\(s\) 9-10,12 are not available on this host \(this rank may "
                                          r"run on cores 0-7\)"):
        core_binding("1,9,10,12", 0, 1, allowed)
    with pytest.raises(LaunchError, match=r"2 core\(s\) \(0-1\) for 3 ranks on this host: every rank needs"):
        core_binding("0,1", 0, 3, allowed)


def test_bind_cores_to_rank_command_lines(tmp_path):
    job, warnings = _plan(["--num_procs", "2", "--bind_cores_to_rank", "--bind_core_list", "0-1",
                           "--log_dir", str(tmp_path), "s.py"])
    assert job.bind_cores and job.core_list == "0,1" and not warnings
    argv = mpirun_command(job, "mpirun").argv
    # mpirun's own binding is off (the wrappers bind), and the wrappers get the list.
    assert argv[argv.index("--bind-to") + 1] == "none"
    assert _tail_from(argv, "zero8_launch.rank_wrapper")[-5:] == ["--bind_cores", "--core_list", "0,1", "--", "s.py"]
    assert "--cpu-bind=none" in srun_command(job).argv
    job, warnings = _plan(["--bind_core_list", "0", "--log_dir", str(tmp_path), "s.py"])
    assert warnings == ["--bind_core_list has no effect without --bind_cores_to_rank (as in DeepSpeed)"]
    argv = mpirun_command(job, "mpirun").argv
    assert "--bind_cores" not in argv and "--core_list" not in argv
    assert argv[argv.index("--bind-to") + 1] == "none"  # unbound, as DeepSpeed's launchers leave ranks


def test_mpirun_leaves_ranks_unbound_unless_told(tmp_path):
    # mpirun's default binds up to 2 ranks to one core each: one rank per host would use one core of it.
    job, _ = _plan(["--num_procs", "2", "--log_dir", str(tmp_path), "s.py"])
    argv = mpirun_command(job, "mpirun").argv
    assert argv.count("--bind-to") == 1 and argv[argv.index("--bind-to") + 1] == "none"
    for given in (["--bind-to", "core"], ["--bind-to=socket"]):
        argv = mpirun_command(_job(launcher_args=given), "mpirun").argv
        assert [a for a in argv if a.startswith("--bind-to")] == given[:1]  # the user's binding only
    with pytest.raises(LaunchError, match="--bind_core_list '1-0': range '1-0' runs backwards"):
        _plan(["--bind_cores_to_rank", "--bind_core_list", "1-0", "s.py"])


def _tail_from(argv: list[str], word: str) -> list[str]:
    return argv[argv.index(word):]


def test_expand_slurm_hostlist():
    assert expand_hostlist("node[01-03,07],gpu1") == ["node01", "node02", "node03", "node07", "gpu1"]
    assert expand_hostlist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]
    with pytest.raises(LaunchError):
        expand_hostlist("node[1-")


# ---------------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------------

def _job(**kw) -> Job:
    base = dict(script="train.py", script_args=["--lr", "1e-3"], log_dir="/logs", python="/py")
    base.update(kw)
    return Job(**base)


def _tail(argv: list[str]) -> list[str]:
    """The rank wrapper command at the end of an engine command."""
    return argv[argv.index("/py"):]


def test_mpirun_local_command():
    cmd = mpirun_command(_job(local_procs=3), "mpirun", as_root=True)
    argv = cmd.argv
    assert argv[:3] == ["mpirun", "-np", "3"]
    assert "--allow-run-as-root" in argv and "--oversubscribe" in argv
    assert "--host" not in argv and "--mca" not in argv
    assert _tail(argv) == ["/py", "-u", "-m", "zero8_launch.rank_wrapper", "--log_dir", "/logs",
                           "--master_addr", "127.0.0.1", "--master_port", "29500", "--", "train.py", "--lr", "1e-3"]
    assert "--allow-run-as-root" not in mpirun_command(_job(), "mpirun", as_root=False).argv


def test_mpirun_multi_host_command():
    job = _job(hosts=OrderedDict([("n1", [0, 1]), ("n2", [0])]), master_addr="n1", master_port=1234,
               net_if="10.0.0.0/24", exports=OrderedDict([("PATH", None), ("ZERO8_X", "a b")]),
               launcher_args=["--bind-to", "none"])
    argv = mpirun_command(job, "mpirun", as_root=False).argv
    assert argv[:5] == ["mpirun", "-np", "3", "--host", "n1:2,n2:1"]
    assert "--oversubscribe" not in argv  # the hostfile's slots are the hosts' capacity
    text = " ".join(argv)
    assert ("--mca pml ob1 --mca btl self,vader,tcp --mca btl_tcp_if_include 10.0.0.0/24 "
            "--mca oob_tcp_if_include 10.0.0.0/24") in text
    assert argv[argv.index("PATH") - 1] == "-x" and argv[argv.index("ZERO8_X=a b") - 1] == "-x"
    tail = _tail(argv)
    assert argv[argv.index("/py") - 2:argv.index("/py")] == ["--bind-to", "none"]  # the user's, once
    assert argv.count("--bind-to") == 1
    assert tail[tail.index("--hosts") + 1] == "n1:0,1@n2:0"
    assert tail[tail.index("--net_if") + 1] == "10.0.0.0/24"
    assert tail[tail.index("--master_addr") + 1:tail.index("--master_addr") + 4] == ["n1", "--master_port", "1234"]
    assert parse_hosts("n1:0,1@n2:0") == [["n1", [0, 1]], ["n2", [0]]]


def test_mpirun_many_hosts_use_a_generated_hostfile():
    many = OrderedDict((f"h{i}", [0, 1]) for i in range(40))
    cmd = mpirun_command(_job(hosts=many), "mpirun", as_root=False)
    path = cmd.argv[cmd.argv.index("--hostfile") + 1]
    assert path == "/logs/mpirun_hostfile"
    assert cmd.files[path].splitlines() == [f"h{i} slots=2" for i in range(40)]
    assert cmd.argv[2] == "80"


def test_srun_commands():
    equal = srun_command(_job(hosts=OrderedDict([("n1", [0, 1]), ("n2", [0, 1])])), "srun")
    assert equal.argv[:5] == ["srun", "--ntasks=4", "--nodes=2", "--ntasks-per-node=2", "--nodelist=n1,n2"]
    assert "--kill-on-bad-exit=1" in equal.argv and "--export=ALL" in equal.argv
    assert "ZERO8_COMM_IFADDR" in equal.unset and "ZERO8_COMM_NODE" in equal.unset  # per host by nature
    unequal = srun_command(_job(hosts=OrderedDict([("n1", [0, 1, 2]), ("n2", [0])]),
                                exports=OrderedDict([("A", "1"), ("PATH", None)])), "srun")
    assert "--distribution=arbitrary" in unequal.argv and "--ntasks=4" in unequal.argv
    assert unequal.env["SLURM_HOSTFILE"] == "/logs/slurm_hostfile"
    assert unequal.files["/logs/slurm_hostfile"].split() == ["n1", "n1", "n1", "n2"]
    assert unequal.env["A"] == "1" and "PATH" not in unequal.env  # --export=ALL carries the rest
    alloc = srun_command(_job(hosts=None, num_nodes=2, num_procs=4, oversubscribe=True), "srun")
    assert alloc.argv[:4] == ["srun", "--nodes=2", "--ntasks-per-node=4", "--overcommit"]
    assert _tail(alloc.argv)[-4:] == ["--", "train.py", "--lr", "1e-3"]


def test_exports(tmp_path):
    environ = {"PATH": "/bin", "PYTHONPATH": "/p", "ZERO8_COMM_IFADDR": "10.0.0.1", "OMP_NUM_THREADS": "1",
               "HOME": "/root", "SECRET": "x", "NCCL_DEBUG": "INFO"}
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text("# comment\nFOO=bar=baz\n\n")
    got, warnings = select_exports(environ, multi_node=True, explicit=["HOME", "X=1"], env_files=[str(env_file)])
    assert list(got.items()) == [("NCCL_DEBUG", None), ("OMP_NUM_THREADS", None), ("PATH", None),
                                 ("PYTHONPATH", None), ("FOO", "bar=baz"), ("HOME", None), ("X", "1")]
    assert len(warnings) == 1 and "ZERO8_COMM_IFADDR" in warnings[0]
    single, warnings = select_exports(environ, multi_node=False)
    assert "ZERO8_COMM_IFADDR" in single and not warnings
    with pytest.raises(LaunchError, match="not set here"):
        select_exports(environ, multi_node=False, explicit=["UNSET_VAR"])


def test_cuda_visible_devices_stays_on_its_host():
    """CUDA_VISIBLE_DEVICES matches the CUDA_ prefix, but each host has its own (SLURM's, or the user's there):
    on several hosts it is not copied from the launcher's (mpirun -x, srun --export=ALL), so a host's own list
    is what the selected slots index into; on one host it is the user's, and goes with the ranks."""
    environ = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "CUDA_HOME": "/cuda"}
    multi, warnings = select_exports(environ, multi_node=True)
    assert list(multi) == ["CUDA_HOME", "PATH"]
    assert warnings == ["CUDA_VISIBLE_DEVICES is set here but differs per host: not exported to the ranks (each "
                        "host's own value applies, and selected slots index into it; --export "
                        "CUDA_VISIBLE_DEVICES=... forces one value)"]
    single, warnings = select_exports(environ, multi_node=False)
    assert "CUDA_VISIBLE_DEVICES" in single and not warnings
    forced, _ = select_exports(environ, multi_node=True, explicit=["CUDA_VISIBLE_DEVICES=0,1"])
    assert forced["CUDA_VISIBLE_DEVICES"] == "0,1"
    job = _job(hosts=OrderedDict([("n1", [2, 3]), ("n2", [2, 3])]), exports=multi)
    argv = mpirun_command(job, "mpirun", as_root=False).argv
    assert not any(a.startswith("CUDA_VISIBLE_DEVICES") for a in argv)
    assert "CUDA_VISIBLE_DEVICES" in srun_command(job, "srun").unset


def _plan(argv, environ=None):
    return cli.plan(cli.build_parser().parse_args(argv), environ or {})


def test_plan_defaults_and_errors(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("n1 slots=2\nn2 slots=2\n")
    job, _ = _plan(["--num_procs", "3", "--log_dir", str(tmp_path / "l"), "s.py", "--x", "1"])
    assert job.hosts is None and job.local_procs == 3 and job.master_addr == "127.0.0.1"
    assert job.script == "s.py" and job.script_args == ["--x", "1"]
    job, _ = _plan(["--hostfile", str(hf), "--log_dir", str(tmp_path / "l"), "s.py"])
    assert list(job.hosts) == ["n1", "n2"] and job.master_addr == "n1" and not job.set_devices
    job, _ = _plan(["--hostfile", str(hf), "--include", "n2:1", "--log_dir", str(tmp_path), "s.py"])
    assert job.hosts == {"n2": [1]} and job.set_devices
    job, _ = _plan(["--launcher", "slurm", "--log_dir", str(tmp_path), "s.py"], {"SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert job.hosts is None and job.master_addr == "gpu07"
    for bad in (["--num_nodes", "2", "s.py"], ["--include", "a", "s.py"], ["--module", "--no_python", "s.py"]):
        with pytest.raises(LaunchError):
            _plan(bad)
    # A count of 0 (or below -1, "all") used to run one rank without a word; ports outside 1..65535 failed late.
    for bad, msg in ((["--num_gpus", "0", "s.py"], "--num_procs/--num_gpus 0"),
                     (["--num_procs", "-3", "s.py"], "--num_procs/--num_gpus -3"),
                     (["--hostfile", str(hf), "--num_nodes", "0", "s.py"], "--num_nodes 0"),
                     (["--master_port", "70000", "s.py"], "--master_port 70000: not a TCP port")):
        with pytest.raises(LaunchError, match=msg):
            _plan(bad)


def test_count_of_zero_says_what_leaving_it_out_means(tmp_path):
    # "leave it out for all" was wrong without a hostfile, where leaving --num_procs out runs 1 process.
    hf = tmp_path / "hosts"
    hf.write_text("n1 slots=2\n")
    for argv, meaning in ((["--num_procs", "0"], "1 process (the default without a hostfile)"),
                          (["--num_nodes", "0"], "this machine alone"),
                          (["-H", str(hf), "--num_procs", "0"], "every slot of each host"),
                          (["-H", str(hf), "--num_nodes", "0"], "every host of the hostfile"),
                          (["--launcher", "slurm", "--num_procs", "0"], "srun's default for the allocation")):
        with pytest.raises(LaunchError) as e:
            _plan(argv + ["s.py"], {"SLURM_JOB_NODELIST": "gpu1"})
        assert str(e.value).endswith(f": give a count >= 1, or leave it out for {meaning}")


def test_every_numeric_flag_refuses_a_value_out_of_range(tmp_path, capsys):
    # `--num_procs -1` ran one rank: -1, DeepSpeed's "all" sentinel, was taken for "not given". Every count
    # and time the launcher takes is checked before anything runs, and the error names the flag.
    hf = tmp_path / "hosts"
    hf.write_text("n1 slots=2\nn2 slots=2\n")
    for argv, msg in ((["--num_procs", "-1"], "--num_procs/--num_gpus -1: give a count >= 1"),
                      (["--num_gpus", "-1"], "--num_procs/--num_gpus -1: give a count >= 1"),
                      (["-H", str(hf), "--num_procs", "-1"], "--num_procs/--num_gpus -1: give a count >= 1"),
                      (["-H", str(hf), "--num_nodes", "-1"], "--num_nodes -1: give a count >= 1"),
                      (["--launcher", "slurm", "--num_nodes", "-1"], "--num_nodes -1: give a count >= 1"),
                      (["--timeout", "-5"], "--timeout -5: give seconds >= 0 (0: no limit)"),
                      (["--timeout", "nan"], "--timeout nan: give seconds >= 0"),
                      (["--start_timeout", "-1"], "--start_timeout -1: give seconds >= 0 (0: wait forever)"),
                      (["--start_timeout", "inf"], "--start_timeout inf: give seconds >= 0"),
                      (["--stop_grace", "-0.5"], "--stop_grace -0.5: give seconds >= 0"),
                      (["--fail_grace", "nan"], "--fail_grace nan: give seconds >= 0"),
                      (["--master_port", "0"], "--master_port 0: not a TCP port")):
        with pytest.raises(LaunchError, match=re.escape(msg)):
            _plan(argv + ["s.py"], {"SLURM_JOB_NODELIST": "gpu1"})
    # From the command line: exit 2 and the message, before any rank is started.
    assert cli.main(["--num_procs", "-1", "--log_dir", str(tmp_path / "logs"), "s.py"]) == 2
    assert "zero8-launch: error: --num_procs/--num_gpus -1: give a count >= 1" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()
    # Leaving them out keeps the defaults.
    job, _ = _plan(["--log_dir", str(tmp_path), "s.py"])
    assert job.local_procs == 1 and job.hosts is None
    job, _ = _plan(["-H", str(hf), "--num_procs", "1", "--log_dir", str(tmp_path), "s.py"])
    assert job.hosts == {"n1": [0], "n2": [0]}


def test_deepspeed_command_lines_are_accepted(tmp_path):
    # Flags DeepSpeed users type: -H/-i/-e for --hostfile/--include/--exclude, -m for --module, and
    # --no_local_rank (zero8-launch never passes --local_rank: the scripts read LOCAL_RANK).
    hf = tmp_path / "hosts"
    hf.write_text("n1 slots=2\nn2 slots=2\n")
    job, _ = _plan(["-H", str(hf), "-i", "n2:1", "--no_local_rank", "--log_dir", str(tmp_path), "-m", "pkg.train",
                    "--x", "1"])
    assert job.hosts == {"n2": [1]} and job.module and job.script == "pkg.train" and job.script_args == ["--x", "1"]
    job, _ = _plan(["-H", str(hf), "-e", "n1", "--log_dir", str(tmp_path), "s.py"])
    assert list(job.hosts) == ["n2"]
    assert "--local_rank" not in " ".join(rank_command(job))


def test_launcher_args_may_be_one_option(tmp_path, capsys):
    # LAUNCH.md's example `--launcher_args "--mpi=pmix"` failed in argparse ("expected one argument"), as did
    # any one-word value that starts with '-'; the script's own --launcher_args stay the script's.
    for argv, engine_args in ((["--launcher", "slurm", "--master_addr", "n1", "--launcher_args", "--mpi=pmix"],
                               ["--mpi=pmix"]),
                              (["--num_procs", "2", "--launcher_args", "--report-bindings"], ["--report-bindings"]),
                              (["--launcher_args", "--bind-to none"], ["--bind-to", "none"]),
                              (["--launcher_args=-v"], ["-v"])):
        job, _ = _plan(argv + ["--log_dir", str(tmp_path), "s.py", "--launcher_args", "-x"])
        assert job.launcher_args == engine_args and job.script_args == ["--launcher_args", "-x"]
    assert cli.main(["--launcher", "slurm", "--master_addr", "n1", "--launcher_args", "--mpi=pmix", "--dry_run",
                     "--log_dir", str(tmp_path), "s.py"]) == 0
    assert "--export=ALL --mpi=pmix " in capsys.readouterr().out


def test_dry_run_prints_the_command(tmp_path, capsys):
    hf = tmp_path / "hosts"
    hf.write_text("10.1.0.1 slots=2\n10.1.0.2 slots=2\n")
    assert cli.main(["--dry_run", "--hostfile", str(hf), "--net_if", "10.1.0.0/24", "--log_dir",
                     str(tmp_path / "l"), "train.py", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "mpirun -np 4 --host 10.1.0.1:2,10.1.0.2:2" in out and "-- train.py --steps 3" in out
    assert not (tmp_path / "l").exists()  # nothing run, nothing written
    assert cli.main(["--dry_run", "--launcher", "slurm", "--hostfile", str(hf), "--log_dir",
                     str(tmp_path / "l"), "train.py"]) == 0
    assert "srun --ntasks=4 --nodes=2" in capsys.readouterr().out


def test_net_if_subnet_this_host_has_no_address_in_is_refused(tmp_path, capsys):
    # A subnet no host has was accepted and the job ran over whatever network OpenMPI found.
    subnet = "10.232.9.0/24"
    assert not any(i.ip in ipaddress.IPv4Network(subnet) for i in local_ipv4().values())
    hf = tmp_path / "hosts"
    hf.write_text("127.0.0.1 slots=1\n10.232.9.9 slots=1\n")  # this host runs rank 0
    args = ["--dry_run", "--hostfile", str(hf), "--log_dir", str(tmp_path / "l"), "train.py"]
    assert cli.main(["--net_if", subnet] + args) == 2
    err = capsys.readouterr().err
    assert f"error: --net_if {subnet}: this host (" in err and "'127.0.0.1' in the hostfile) has no address in " \
        f"{subnet}; its addresses: " in err, err
    lo = next(n for n, i in local_ipv4().items() if str(i.ip) == "127.0.0.1")
    assert f"{lo} 127.0.0.1/8" in err
    assert cli.main(["--net_if", "127.0.0.0/8"] + args) == 0  # a subnet this host has
    assert cli.main(["--net_if", "10.232.9.0/33"] + args) == 2
    assert "--net_if 10.232.9.0/33: '10.232.9.0/33' is not an interface name or an IPv4 subnet" in \
        capsys.readouterr().err
    # OpenMPI's comma list of interfaces and subnets: one this host has passes, as does a list naming an
    # interface (mpirun checks those); a list of subnets this host has none of is refused.
    assert cli.main(["--net_if", f"{subnet},127.0.0.0/8"] + args) == 0
    assert cli.main(["--net_if", f"{lo},{subnet}"] + args) == 0
    assert cli.main(["--net_if", f"{subnet},10.232.8.0/24"] + args) == 2
    assert f"has no address in {subnet}, 10.232.8.0/24; its addresses: " in capsys.readouterr().err
    # This host not in the hostfile: it cannot tell, only warns.
    hf.write_text("10.232.9.8 slots=1\n10.232.9.9 slots=1\n")
    assert cli.main(["--net_if", subnet] + args) == 0
    assert f"warning: --net_if {subnet}: this host (" in capsys.readouterr().err


@pytest.mark.parametrize("prefix", ["lfx_t", "-lfx", "lfx-too-long-pfx"])
def test_netns_cluster_refuses_a_prefix_that_cannot_be_a_hostname(prefix):
    # A '_' in the prefix made the cluster, then failed at every exec ("hostname: the specified hostname is
    # invalid"); a prefix over 13 characters makes veth names over 15.
    script = Path(__file__).resolve().parents[2] / "scripts" / "netns_cluster.sh"
    env = dict(os.environ, ZERO8_NETNS_PREFIX=prefix, ZERO8_NETNS_NET="10.232.0")
    try:
        r = subprocess.run(["bash", str(script), "up"], env=env, capture_output=True, text=True, timeout=60)
    finally:  # the old script made the namespaces (as root): remove them
        subprocess.run(["bash", str(script), "down"], env=env, capture_output=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith(f"netns_cluster: ZERO8_NETNS_PREFIX '{prefix}': use 1-13 letters, digits and '-'"), r.stderr
    assert "up:" not in r.stdout


# ---------------------------------------------------------------------------------------------
# The rank wrapper's pieces
# ---------------------------------------------------------------------------------------------

def _ompi(rank, size, local_rank, local_size):
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size)}


def test_rank_environment_openmpi_two_hosts():
    world = {"hosts": [["127.0.0.1", [0, 1]], ["localhost", [0, 1]]], "master_addr": "127.0.0.1",
             "master_port": 4000, "net_if": "", "set_devices": False}
    env, facts, warnings = rank_environment(_ompi(3, 4, 1, 2), world)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                                 "MASTER_ADDR", "MASTER_PORT", "ZERO8_COMM_NODE")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4000", "ZERO8_COMM_NODE": "localhost"}
    assert facts["host"] == "localhost"
    # Both hosts are loopback here: no address the other host could reach, so the default is kept, said.
    assert "ZERO8_COMM_IFADDR" not in env and warnings == [
        "rank 3: ZERO8_COMM_IFADDR not set: no non-loopback address found; the communicator's default applies"]
    # The user's own node name wins.
    env, _, _ = rank_environment({**_ompi(0, 4, 0, 2), "ZERO8_COMM_NODE": "mine"}, world)
    assert "ZERO8_COMM_NODE" not in env
    # A placement that contradicts the hostfile order is reported, not trusted.
    env, facts, warnings = rank_environment(_ompi(1, 4, 0, 2), world)
    assert facts["host"] is None and "CROSS_RANK" not in env and "placed it" in warnings[0]
    assert env["LOCAL_RANK"] == "0"


def test_comm_ifaddr_choice():
    ifaces = local_ipv4()
    assert str(ifaces["lo"].ip) == "127.0.0.1"
    # --net_if as an interface name or a subnet: that interface's address, loopback included.
    assert pick_comm_ifaddr("lo", None, None)[0] == "127.0.0.1"
    assert pick_comm_ifaddr("127.0.0.0/8", None, None)[0] == "127.0.0.1"
    others = [i for name, i in ifaces.items() if name != "lo"]
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 interface to test the hostfile-name rule with")
    mine = str(others[0].ip)
    # A hostfile name that is (or resolves to) an address of this host: that address.
    assert pick_comm_ifaddr("", mine, None) == (mine, f"hostfile name '{mine}' resolves to this host's {mine}")
    # Else the source address of the route to MASTER_ADDR.
    addr, why = pick_comm_ifaddr("", "192.0.2.1", mine)
    assert addr == mine and "route to MASTER_ADDR" in why


_ROUTE_HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"


def _route(*rows) -> str:
    """/proc/net/route's text: rows of (iface, destination, flags, metric, mask) in its hex notation."""
    return _ROUTE_HEADER + "".join(f"{i}\t{d}\t00000000\t{f}\t0\t0\t{m}\t{k}\t0\t0\t0\n" for i, d, f, m, k in rows)


def test_default_route_interface_from_the_routing_table(tmp_path, monkeypatch):
    """The interface of the IPv4 default route, read from the kernel's table (nothing is sent): the lowest
    metric where there are several, routes that are down skipped; its address, unless it has none."""
    table = tmp_path / "route"
    table.write_text(_route(("eth0", "0000000A", "0001", 0, "000000FF"), ("eth1", "00000000", "0003", 100, "00000000"),
                            ("eth2", "00000000", "0003", 50, "00000000"), ("eth3", "00000000", "0002", 0, "00000000")))
    assert default_route_iface(str(table)) == "eth2"
    monkeypatch.setattr(netinfo, "local_ipv4", lambda: {"lo": ipaddress.IPv4Interface("127.0.0.1/8"),
                                                        "eth2": ipaddress.IPv4Interface("10.1.2.3/16")})
    assert default_route_ifaddr(str(table)) == ("10.1.2.3", "the address of eth2, the interface of the default route")
    table.write_text(_route(("eth0", "0000000A", "0001", 0, "000000FF")))
    assert default_route_ifaddr(str(table)) == (None, "this host has no IPv4 default route")
    table.write_text(_route(("eth5", "00000000", "0003", 0, "00000000")))
    assert default_route_ifaddr(str(table)) == (
        None, "the default route's interface eth5 has no IPv4 address other than loopback")
    assert default_route_iface(str(tmp_path / "missing")) is None


def test_rank_environment_single_host_and_devices():
    world = {"hosts": [["n1", [1, 3]]], "master_addr": "n1", "master_port": 29500, "set_devices": True}
    env, _, _ = rank_environment(_ompi(1, 2, 1, 2), world)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["CROSS_SIZE"] == "1"
    assert "ZERO8_COMM_NODE" not in env and "ZERO8_COMM_IFADDR" not in env  # one host: defaults are right


def test_selected_slots_index_into_the_host_s_own_devices():
    """--include n1:1,3 where n1 already has CUDA_VISIBLE_DEVICES (SLURM's, or set there): the slots are
    entries of that list, not ignored; a slot beyond it stops the rank, naming the host and the slot."""
    world = {"hosts": [["n1", [1, 3]]], "master_addr": "n1", "master_port": 29500, "set_devices": True}
    env, facts, _ = rank_environment({**_ompi(0, 2, 0, 2), "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, world)
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7" and facts["error"] is None
    env, facts, _ = rank_environment({**_ompi(0, 2, 0, 2), "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, world)
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert facts["error"] == ("host 'n1': slot 3 was selected (--include/--exclude), but this host's "
                              "CUDA_VISIBLE_DEVICES is 'GPU-a,GPU-b', 2 device(s) (slots 0 to 1), and slots index "
                              "into it; select slots of that list, or unset CUDA_VISIBLE_DEVICES on that host for "
                              "the slots to be its devices")
    assert visible_devices(None, "n1", [1, 3]) == "1,3"  # no list there: the slots are the devices
    assert visible_devices("", "n1", [1, 3]) is None  # no device visible (a CPU job): left as it is
    with pytest.raises(LaunchError, match="host 'n2': slot 1 was selected"):
        visible_devices("x", "n2", [0, 1])


def test_rank_environment_local_run_is_node_0_of_1():
    # Without a hostfile the engine's local size tells: all ranks here is one node; otherwise unknown.
    world = {"master_addr": "127.0.0.1", "master_port": 29500, "set_devices": False}
    env, _, _ = rank_environment(_ompi(1, 2, 1, 2), world)
    assert (env["CROSS_RANK"], env["CROSS_SIZE"]) == ("0", "1")
    env, _, _ = rank_environment(_ompi(1, 2, 0, 1), world)
    assert "CROSS_RANK" not in env and "CROSS_SIZE" not in env


def test_rank_environment_slurm():
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
             "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}
    env, _, _ = rank_environment(slurm, {"hosts": None, "master_addr": "gpu07", "master_port": 29500})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_SIZE"], env["CROSS_RANK"],
            env["CROSS_SIZE"]) == ("5", "7", "1", "2", "2", "4")


def test_prefixer_marks_every_line_start():
    p = _Prefixer(b"[rank3] ")
    assert p(b"a\nb") + p(b"c\n\n") + p(b"\r10%\r20%\n") == \
        b"[rank3] a\n[rank3] bc\n[rank3] \n\r[rank3] 10%\r[rank3] 20%\n"


def test_stop_before_the_wrapper_is_ready_is_a_stop_not_a_crash(tmp_path, capsys):
    # A stop signal caught by the early handlers (while the wrapper's module loads) is acted on once
    # main() is ready: the script is never started, and the launcher hears a stop, not a death.
    from zero8_launch import rank_wrapper as rw

    started = tmp_path / "started"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(started)!r}, 'w').close()\n")
    saved = {s: signal.getsignal(s) for s in rw.FORWARDED_SIGNALS + (rw.STACKS_SIGNAL,)}
    rw._EARLY_SIGNALS.append(signal.SIGUSR1)
    try:
        with pytest.raises(SystemExit) as e:
            rw.main(["--log_dir", str(tmp_path / "logs"), "--", str(script)])
    finally:
        rw._EARLY_SIGNALS.clear()
        for s, h in saved.items():
            signal.signal(s, h)
    assert e.value.code == 128 + signal.SIGUSR1
    assert not started.exists()
    markers = [parse_marker(l) for l in capsys.readouterr().err.splitlines() if l.startswith(rw.MARKER)]
    assert {"event": "signal", "rank": "0", "name": "SIGUSR1"}.items() <= markers[-1].items()


def test_marker_round_trip():
    line = format_marker(rank=3, event="exit", code=1, log="/a dir/rank3.log")
    assert " " not in line.split("log=")[1]
    assert parse_marker(line) == {"rank": "3", "event": "exit", "code": "1", "log": "/a dir/rank3.log"}
    assert parse_marker("[rank3] [zero8-launch] rank=1 event=exit") is None


def test_monitor_filters_and_attributes():
    out, err = io.BytesIO(), io.BytesIO()
    m = JobMonitor("/nonexistent", 2, out=out, err=err)
    dashes = b"-" * 74 + b"\n"
    m.feed("out", b"[rank0] hello\n[rank1] 10%")
    assert out.getvalue() == b"[rank0] hello\n[rank1] 10%"  # a progress bar is not held back
    m.feed("out", b"\r[rank1] 20%\n")
    m.feed("err", format_marker(rank=1, event="start", pid=7, host="n2").encode() + b"\n")
    m.feed("err", b"[rank1] Traceback (most recent call last):\n[rank1] ValueError: boom\n")
    m.feed("err", format_marker(rank=1, event="exit", code=1, signal=0, stopped_by="", host="n2").encode() + b"\n")
    m.feed("err", dashes + b"mpirun detected that one or more processes exited with non-zero status, thus causing\n"
           b"  Process name: [[1,1],1]\n  Exit code:    1\n" + dashes)
    m.feed("err", dashes + b"WARNING: something the user must see\n" + dashes)
    m.feed("err", b"")
    text = err.getvalue().decode()
    assert "[zero8-launch]" not in text and "mpirun detected" not in text
    assert "zero8-launch: rank 1 (host n2) exited with code 1" in text
    assert "WARNING: something the user must see" in text
    assert m.ranks[1].exit_code == 1 and list(m.ranks[1].tail)[-1] == "ValueError: boom"
    lines, code = m.failure_report()
    assert code == 1 and lines[0] == "rank 1 (host n2) exited with code 1"
    assert "  ValueError: boom" in lines
    assert any("first rank to exit with a non-zero status was rank 1" in l for l in lines)


def test_monitor_says_which_ranks_wrote_their_stacks_on_the_timeout():
    # Asked on --timeout: rank 0's script wrote its stacks, rank 1's has no handler (not Python), rank 2's
    # wrapper never answered; rank 3 had ended before and was not asked.
    m = JobMonitor("/logs", 4, out=io.BytesIO(), err=io.BytesIO())
    for r in range(4):
        m.feed("err", format_marker(rank=r, event="start", pid=10 + r).encode() + b"\n")
    m.feed("err", format_marker(rank=3, event="exit", code=0, signal=0, stopped_by="").encode() + b"\n")
    m.ask_stacks()
    m.feed("err", format_marker(rank=0, event="stacks", written=1, log="/logs/rank0.log").encode() + b"\n")
    m.feed("err", format_marker(rank=1, event="stacks", written=0, log="/logs/rank1.log").encode() + b"\n")
    assert m.stacks_report() == [
        "rank(s) 0 wrote the Python stacks of all their threads at the timeout: above, and in /logs/rank<R>.log",
        "rank(s) 1 wrote no Python stacks: their scripts have no handler for SIGURG (not Python, or Python run "
        "with -I, -E or -S)",
        "rank(s) 2 did not answer the request for their Python stacks within 2 s"]


def test_monitor_a_traceback_cut_by_the_abort_does_not_make_that_rank_the_cause():
    # Rank 1 raises and aborts the job; the abort's SIGTERM reaches rank 0 while it prints its own traceback
    # (a Zero8CommError), before the exception line (seen under heavy load). Rank 1 is still the rank named
    # first, and its code is the job's (it was rank 0's 143).
    m = JobMonitor("/nonexistent", 2, out=io.BytesIO(), err=io.BytesIO())
    for r in (0, 1):
        m.feed("err", format_marker(rank=r, event="start", pid=10 + r).encode() + b"\n")
    m.feed("err", b"[rank1] Traceback (most recent call last):\n[rank1] RuntimeError: boom\n")
    m.feed("err", b"[rank0] Traceback (most recent call last):\n[rank0]   File \"engine.py\", line 708, in hook\n")
    m.feed("err", format_marker(rank=0, event="signal", name="SIGTERM").encode() + b"\n")
    m.feed("err", format_marker(rank=0, event="exit", code=143, signal=15, stopped_by="SIGTERM").encode() + b"\n")
    m.feed("err", format_marker(rank=1, event="exit", code=1, signal=0, stopped_by="").encode() + b"\n")
    lines, code = m.failure_report()
    assert code == 1 and lines[0] == "rank 1 exited with code 1", lines
    assert "  RuntimeError: boom" in lines


def test_monitor_a_rank_whose_traceback_the_abort_cut_is_listed_as_ended_by_it():
    # The engine output of a loaded run (launcher.log, shortened): rank 1 raises and aborts the job; the
    # abort's SIGTERM ends rank 0 in the middle of its own traceback, before its exception line. Rank 1 is
    # the only cause shown; rank 0 is among the ranks the abort ended, with a mention of its cut traceback.
    m = JobMonitor("/nonexistent", 3, out=io.BytesIO(), err=io.BytesIO())
    for r in (0, 1, 2):
        m.feed("err", format_marker(rank=r, event="start", pid=10 + r).encode() + b"\n")
    m.feed("out", b"[rank0] step 1/3 loss 0.505897\n")
    m.feed("err", b"[rank1] Traceback (most recent call last):\n"
           b"[rank1]   File \"train_job.py\", line 113, in train\n"
           b"[rank1]     raise RuntimeError(f\"rank {rank} raises at step {step} on purpose (test)\")\n"
           b"[rank1] RuntimeError: rank 1 raises at step 1 on purpose (test)\n"
           b"[rank1] [zero8] rank 1: exiting on an uncaught RuntimeError; ending the job so that the other "
           b"ranks do not wait for it\n")
    m.feed("err", b"[rank0] Traceback (most recent call last):\n"
           b"[rank0]   File \"train_job.py\", line 124, in train\n"
           b"[rank0]     engine.backward(loss)\n"
           b"[rank0]   File \"torch/autograd/__init__.py\", line 395, in backward\n")
    for r in (0, 2):
        m.feed("err", format_marker(rank=r, event="signal", name="SIGTERM").encode() + b"\n")
        m.feed("err", format_marker(rank=r, event="exit", code=143, signal=15, stopped_by="SIGTERM").encode() + b"\n")
    m.feed("err", format_marker(rank=1, event="exit", code=1, signal=0, stopped_by="").encode() + b"\n")
    m.feed("err", b"")
    lines, code = m.failure_report()
    assert code == 1 and lines[0] == "rank 1 exited with code 1", lines
    assert "  RuntimeError: rank 1 raises at step 1 on purpose (test)" in lines
    assert not any(l.startswith("rank 0 ") or "rank 0's output" in l or "backward" in l for l in lines), lines
    assert ("rank(s) 0, 2 were ended by the job's abort (which cut off the traceback that rank 0 was printing)"
            in lines), lines


def test_monitor_names_a_hung_rank_first():
    # Rank 1 hangs alive; rank 0's collective times out naming it, and rank 0's exit aborts the job. The rank
    # that hung is the cause, named first with what it was doing; rank 0's error follows. A dead peer named in
    # the same message is not called hung.
    m = JobMonitor("/nonexistent", 3, out=io.BytesIO(), err=io.BytesIO())
    for r in (0, 1, 2):
        m.feed("err", format_marker(rank=r, event="start", pid=10 + r).encode() + b"\n")
    m.feed("err", b"[rank0] Traceback (most recent call last):\n"
           b"[rank0] zero8.Zero8CommError: all_reduce #7 on 'world' (rank 0 of 3): timed out after 600.1 s (timeout "
           b"600 s); not heard from: rank 1 (not in a communication call for 600.3 s (last: barrier #6 on 'world' "
           b"(rank 1 of 3))); rank 2 (died)\n")
    m.feed("err", format_marker(rank=0, event="exit", code=1, signal=0, stopped_by="").encode() + b"\n")
    for r in (1, 2):
        m.feed("err", format_marker(rank=r, event="exit", code=143, signal=15, stopped_by="SIGTERM").encode() + b"\n")
    m.feed("err", b"")
    lines, code = m.failure_report()
    assert lines[0] == ("rank 1 hung: alive, but it did not join all_reduce #7 on 'world' within the communicator "
                        "timeout (600 s, on rank 0); it was not in a communication call for 600.3 s (last: barrier "
                        "#6 on 'world' (rank 1 of 3))"), lines
    assert not any(l.startswith("rank 2 hung") for l in lines), lines
    assert code == 1 and lines[1] == "rank 0 exited with code 1", lines


def test_monitor_reads_the_status_file_of_a_rank_whose_exit_record_was_lost(tmp_path):
    # The daemon (orted) of rank 1's host was SIGKILLed: its wrapper ended the script (exit 143, stopped_by
    # engine_exit) and wrote rank1.status.json in the shared log dir, but its exit record never reached the
    # launcher, whose report said "rank 1 (host n1) died: no exit record".
    def run(record_pid):
        m = JobMonitor(str(tmp_path), 2, out=io.BytesIO(), err=io.BytesIO())
        for r in (0, 1):
            m.feed("err", format_marker(rank=r, event="start", pid=10 + r, host=f"n{r}").encode() + b"\n")
        (tmp_path / "rank1.status.json").write_text(json.dumps(
            {"rank": 1, "host": "n1", "pid": record_pid, "start_time": time.time(), "exit_code": 143,
             "signal": "SIGTERM", "stopped_by": "engine_exit"}))
        m.feed("err", b"[rank0] Traceback (most recent call last):\n[rank0] zero8.Zero8CommError: barrier #8 on "
                      b"'world' (rank 0 of 2): rank 1 died (its connection closed without a clean shutdown)\n")
        m.feed("err", format_marker(rank=0, event="exit", code=1, signal=0, stopped_by="").encode() + b"\n")
        return m.failure_report()

    lines, code = run(record_pid=11)
    assert lines[0] == ("rank 1 (host n1) was ended by its wrapper (exit code 143, signal 15 (SIGTERM)) because the "
                        "engine process that started it died (the engine's daemon on its host, or mpirun); per its "
                        f"status file {tmp_path / 'rank1.status.json'}"), lines
    assert code == 143 and not any("no exit record" in l for l in lines)
    assert "rank(s) 0 then failed with communication errors, e.g.:" in lines
    # Another job's file (another pid) is not taken for this one's.
    lines, _ = run(record_pid=99)
    assert lines[0].startswith("rank 1 (host n1) died: no exit record"), lines


def test_monitor_keeps_mpirun_s_lost_help_message_error_in_its_log_only():
    # OpenMPI 4.1.4's line in place of an aborting rank's MPI_ABORT banner (the four variants seen in
    # launcher.log of loaded runs): in launcher.log, not on the console. Its other errors are still shown.
    out, err, log = io.BytesIO(), io.BytesIO(), io.BytesIO()
    m = JobMonitor("/nonexistent", 2, out=out, err=err, launcher_log=log)
    lost = [b"[vm:04350] [[31744,0],0] ORTE_ERROR_LOG: Data unpack had inadequate space in file "
            b"../../../orte/util/show_help.c at line 513",
            b"[vm:04369] [[32239,0],0] ORTE_ERROR_LOG: Out of resource in file "
            b"../../../orte/util/show_help.c at line 507",
            b"[vm:04423] [[32185,0],0] ORTE_ERROR_LOG: Data unpack would read past end of buffer in file "
            b"../../../orte/util/show_help.c at line 507",
            b"[vm:04460] [[32146,0],0] ORTE_ERROR_LOG: Data unpack would read past end of buffer in file "
            b"../../../orte/util/show_help.c at line 513"]
    other = (b"[n1:63575] [[3722,0],1] ORTE_ERROR_LOG: Data unpack would read past end of buffer in file "
             b"../../../../../orte/mca/grpcomm/direct/grpcomm_direct.c at line 351")
    m.feed("err", b"[rank1] RuntimeError: boom\n" + b"\n".join(lost) + b"\n" + other + b"\n")
    m.feed("err", b"")
    assert err.getvalue() == b"[rank1] RuntimeError: boom\n" + other + b"\n"
    assert all(l in log.getvalue() for l in lost)


def test_error_excerpt_starts_at_the_last_traceback():
    lines = ["x"] * 50 + ["Traceback (most recent call last):", "  File a", "E: 1", "Traceback (most recent call last):",
                          "  File b", "E: 2", ""]
    assert error_excerpt(lines) == ["Traceback (most recent call last):", "  File b", "E: 2"]
    assert error_excerpt([str(i) for i in range(40)]) == [str(i) for i in range(28, 40)]


# ---------------------------------------------------------------------------------------------
# Real jobs on this machine (OpenMPI)
# ---------------------------------------------------------------------------------------------

needs_mpirun = pytest.mark.skipif(mpirun() is None, reason="mpirun not found (scripts/setup.sh installs OpenMPI)")


@needs_mpirun
def test_two_local_ranks_environment_and_logs(tmp_path):
    logs = tmp_path / "logs"
    env = job_env(ZERO8_TEST_EXPORT="exported")
    r = launch(["--num_procs", "2", "--master_port", "29999", "--export", "ZERO8_TEST_EXPLICIT=given",
                "--log_dir", logs, RANK_ENV, "--sleep", "0.2"], env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = env_lines(r.stdout)
    assert sorted(seen) == [0, 1]
    for rank, v in seen.items():
        assert (v["RANK"], v["LOCAL_RANK"], v["WORLD_SIZE"], v["LOCAL_SIZE"]) == (str(rank), str(rank), "2", "2")
        assert (v["MASTER_ADDR"], v["MASTER_PORT"], v["PYTHONUNBUFFERED"]) == ("127.0.0.1", "29999", "1")
        assert v["ZERO8_TEST_EXPORT"] == "exported" and v["ZERO8_TEST_EXPLICIT"] == "given"
        # One log per rank: its own stdout and stderr, unprefixed, nobody else's.
        log = (logs / f"rank{rank}.log").read_text()
        assert log.count("ENV {") == 1 and json.loads(log.split("ENV ", 1)[1].splitlines()[0])["RANK"] == str(rank)
        assert f"hello from rank {rank} on stderr" in log and f"rank {1 - rank}" not in log
        assert "[rank" not in log
        status = json.loads((logs / f"rank{rank}.status.json").read_text())
        assert status["exit_code"] == 0 and status["rank"] == rank
        assert f"[rank{rank}] hello from rank {rank} on stderr" in r.stderr
    assert "[zero8-launch]" not in r.stdout + r.stderr  # the wrappers' markers are for the launcher
    assert f"logs: {logs}" in r.stderr and "running: " in r.stderr and "mpirun -np 2" in r.stderr


@needs_mpirun
def test_selected_slots_under_the_launcher_index_into_cuda_visible_devices(tmp_path):
    """End to end on this machine: the rank sees the selected entry of the launcher's CUDA_VISIBLE_DEVICES,
    and a slot beyond it fails the job before the script starts, naming the host and the slot."""
    env = job_env(CUDA_VISIBLE_DEVICES="4,5,6,7")
    r = launch(["--include", "localhost:1", "--log_dir", tmp_path / "a", RANK_ENV], env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = env_lines(r.stdout)
    assert sorted(seen) == [0] and seen[0]["CUDA_VISIBLE_DEVICES"] == "5", r.stdout
    env = job_env(CUDA_VISIBLE_DEVICES="4")
    r = launch(["--include", "localhost:1", "--log_dir", tmp_path / "b", RANK_ENV], env=env, timeout=60)
    assert r.returncode != 0 and not env_lines(r.stdout), r.stdout + r.stderr
    assert ("host 'localhost': slot 1 was selected (--include/--exclude), but this host's CUDA_VISIBLE_DEVICES "
            "is '4'") in r.stdout + r.stderr, r.stdout + r.stderr


def _seconds_since_test_event(r: subprocess.CompletedProcess) -> float:
    """Seconds from the rank script's injected failure (the 'test event: ... at t=<time>' line of
    rank_env.py or train_job.py) to now, just after the job ended: the tests time the job's end from the
    failure, not from the launch, since start-up alone (torch's import on every rank) took over 30 s on a
    loaded machine."""
    m = re.search(r"^\[rank\d+\] test event: .* at t=(\d+\.\d+)$", r.stdout, re.M)
    assert m, "the rank script did not report its test event:\n" + r.stdout[-3000:] + r.stderr[-3000:]
    return time.time() - float(m.group(1))


@needs_mpirun
def test_bind_cores_to_rank_gives_each_rank_its_own_cores(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"this machine lets the tests run on {len(allowed)} core(s); the test shares out two")
    r = launch(["--num_procs", "2", "--bind_cores_to_rank", "--log_dir", tmp_path / "a", RANK_ENV],
               env=job_env(), timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = env_lines(r.stdout)
    per = len(allowed) // 2
    for rank in (0, 1):
        # Its share of the cores, and OMP_NUM_THREADS set to it (the tests' environment says 1).
        assert seen[rank]["AFFINITY"] == allowed[rank * per:(rank + 1) * per]
        assert seen[rank]["OMP_NUM_THREADS"] == str(per)
    # One rank, two cores of a given list, chosen without a hostfile as slot 1 of localhost.
    r = launch(["--include", "localhost:1", "--bind_cores_to_rank", "--bind_core_list",
                f"{allowed[1]},{allowed[0]}", "--log_dir", tmp_path / "b", RANK_ENV], env=job_env(), timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = env_lines(r.stdout)
    assert list(seen) == [0]
    assert seen[0]["AFFINITY"] == sorted(allowed[:2]) and seen[0]["OMP_NUM_THREADS"] == "2"
    assert (seen[0]["LOCAL_RANK"], seen[0]["WORLD_SIZE"], seen[0]["CUDA_VISIBLE_DEVICES"]) == ("0", "1", "1")
    # More ranks than cores: every rank fails before starting the script, saying why.
    n = len(allowed) + 1
    r = launch(["--num_procs", str(n), "--bind_cores_to_rank", "--log_dir", tmp_path / "c", RANK_ENV],
               env=job_env(), timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{len(allowed)} core(s)" in r.stderr and f"for {n} ranks on this host: every rank needs a core" in r.stderr
    assert "ENV {" not in r.stdout


@needs_mpirun
def test_failing_rank_ends_the_job_and_shows_its_error(tmp_path):
    # Rank 1 raises once every rank is running; the others would sleep 60 s. The job must end about when
    # rank 1 fails.
    r = launch(["--num_procs", "3", "--log_dir", tmp_path, RANK_ENV, "--fail_rank", "1", "--ready", tmp_path / "up",
                "--sleep", "60"], timeout=120)
    elapsed = _seconds_since_test_event(r)
    assert r.returncode == 1, r.stderr
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after rank 1 raised (the others sleep 60 s)"
    err = r.stderr
    assert "zero8-launch: job FAILED" in err
    assert "zero8-launch: rank 1 exited with code 1" in err
    assert "zero8-launch:   RuntimeError: rank 1 fails on purpose (test)" in err  # the tail of its log
    assert "rank(s) 0, 2 were ended by the job's abort" in err
    assert "Primary job" not in err and "-----" not in err  # mpirun's banners are summarized
    status = json.loads((tmp_path / "rank1.status.json").read_text())
    assert status["exit_code"] == 1


@needs_mpirun
def test_killed_rank_is_named(tmp_path):
    r = launch(["--num_procs", "2", "--log_dir", tmp_path, RANK_ENV, "--fail_rank", "0", "--kill_self",
                "--sleep", "60"], timeout=90)
    assert r.returncode == 137, r.stderr
    assert "rank 0 was killed by signal 9 (SIGKILL)" in r.stderr


@needs_mpirun
def test_timeout_ends_the_job(tmp_path):
    t0 = time.monotonic()
    r = launch(["--num_procs", "2", "--timeout", "3", "--log_dir", tmp_path, RANK_ENV, "--sleep", "60"], timeout=90)
    assert r.returncode == 124, r.stderr
    assert time.monotonic() - t0 < 30
    assert "timeout: the job ran longer than 3 s" in r.stderr


_HANGING_SCRIPT = """import threading, time
def helper_thread_waits_forever():
    time.sleep(600)
def rank_hangs_in_this_function():
    time.sleep(600)
threading.Thread(target=helper_thread_waits_forever, daemon=True).start()
rank_hangs_in_this_function()
"""


@needs_mpirun
def test_timeout_writes_the_stacks_of_every_rank_before_ending_the_job(tmp_path):
    # A job ended by --timeout said nothing of where its ranks were. Now every rank's script writes the
    # stacks of all its threads (faulthandler) to its log and stderr first, and the launcher says where.
    script = tmp_path / "hang.py"
    script.write_text(_HANGING_SCRIPT)
    logs = tmp_path / "logs"
    r = launch(["--num_procs", "2", "--timeout", "5", "--log_dir", logs, script], timeout=90)
    assert r.returncode == 124, r.stderr
    assert "timeout: the job ran longer than 5 s; every rank writes its Python stacks to its log" in r.stderr
    for rank in (0, 1):
        log = (logs / f"rank{rank}.log").read_text()
        _, note, stacks = log.partition("zero8-launch: --timeout: the Python stacks of every thread of this "
                                        "rank's script follow\n")
        assert note, log
        here = rf'  File "{re.escape(str(script))}", line 5 in rank_hangs_in_this_function$'
        assert re.search(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):\n" + here, stacks, re.M), log
        assert re.search(r"^  File .*, line 3 in helper_thread_waits_forever$", stacks, re.M), log
        assert f"[rank{rank}]   File \"{script}\", line 5 in rank_hangs_in_this_function" in r.stderr
    assert (f"rank(s) 0, 1 wrote the Python stacks of all their threads at the timeout: above, and in "
            f"{logs / 'rank<R>.log'}") in r.stderr, r.stderr


@needs_mpirun
def test_a_script_without_the_stacks_handler_is_said_to_have_written_none(tmp_path):
    # sleep(1) is no Python: nothing in it registers the signal that asks for the stacks.
    r = launch(["--num_procs", "1", "--timeout", "3", "--log_dir", tmp_path, "--no_python", "sleep", "60"],
               timeout=90)
    assert r.returncode == 124, r.stderr
    assert "rank(s) 0 wrote no Python stacks: their scripts have no handler for SIGURG" in r.stderr, r.stderr
    assert "no handler for SIGURG (not Python" in (tmp_path / "rank0.log").read_text()


@needs_mpirun
def test_the_stacks_handler_leaves_the_script_s_environment_as_it_was(tmp_path):
    # The wrapper's sitecustomize, first on the script's PYTHONPATH, puts PYTHONPATH and sys.path back
    # and runs the sitecustomize it hides (here the user's own, on their PYTHONPATH).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    script = tmp_path / "env.py"
    script.write_text("import json, os, sys\n"
                      "print('SEEN ' + json.dumps([os.environ.get('PYTHONPATH'), os.environ.get('USER_SITECUSTOMIZE'),\n"
                      "    'ZERO8_LAUNCH_STACKS_SIGNAL' in os.environ, any('stacks_site' in p for p in sys.path),\n"
                      "    sys.argv[1:], sys.path[0]]))\n")
    r = launch(["--num_procs", "1", "--log_dir", tmp_path / "logs", script, "a"],
               env=job_env(PYTHONPATH=str(site)), timeout=60)
    assert r.returncode == 0, r.stderr
    seen = json.loads(re.search(r"^\[rank0\] SEEN (.*)$", r.stdout, re.M).group(1))
    assert seen == [str(site), "ran", False, False, ["a"], str(tmp_path)]


@needs_mpirun
def test_stop_request_reaches_every_rank(tmp_path):
    # SIGTERM to the launcher -> SIGTERM to every script (through mpirun's SIGUSR1 forwarding), which
    # "saves" and exits 0; the launcher then reports a stop on request (128 + SIGTERM).
    term = tmp_path / "term"
    proc = subprocess.Popen(launch_cmd(["--num_procs", "2", "--log_dir", tmp_path / "logs", RANK_ENV,
                                        "--sleep", "60", "--ready", term, "--term_file", term]),
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for i in (0, 1):  # both ranks' SIGTERM handlers are in place
        _wait_for_file(Path(f"{term}.{i}.ready"), timeout=60)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    for i in (0, 1):
        assert Path(f"{term}.{i}").read_text() == "SIGTERM"
        assert f"rank {i} got SIGTERM: saving and exiting" in out
    assert "stop requested" in err and "job stopped on request" in err


@needs_mpirun
def test_zero8_training_under_the_launcher(tmp_path):
    out = tmp_path / "result.json"
    r = launch(["--num_procs", "2", "--log_dir", tmp_path / "logs", TRAIN_JOB, "--steps", "3", "--hidden", "64",
                "--out", out], timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and sorted(result["losses"]) == ["1", "2", "3"]
    assert "[rank0] done" in r.stdout


@needs_mpirun
def test_uncaught_exception_after_initialize_ends_the_job(tmp_path):
    # Rank 1 raises between collectives; rank 0 is already waiting in the next step's reduction. The job
    # must end about when rank 1 fails, not at the communicator timeout (600 s by default, 60 s in these tests).
    r = launch(["--num_procs", "2", "--log_dir", tmp_path / "logs", TRAIN_JOB, "--steps", "3", "--hidden", "64",
                "--raise_rank", "1", "--raise_step", "1"], timeout=200)
    elapsed = _seconds_since_test_event(r)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after rank 1 raised (the comm timeout is 60 s)"
    out = r.stdout + r.stderr  # rank 1's traceback and note, forwarded and in the summary's excerpt of its log
    assert "RuntimeError: rank 1 raises at step 1 on purpose (test)" in out
    assert "rank 1: exiting on an uncaught RuntimeError; ending the job" in out
    assert "show_help.c" not in out  # OpenMPI's line in place of the MPI_ABORT banner, often (launcher.log only)


@needs_mpirun
def test_rank_that_ends_its_loop_early_ends_the_job(tmp_path):
    # Rank 1 runs out of data and exits normally (its engine says "bye" at exit) while rank 0 waits in the
    # step's reduction: rank 0 must fail about a second later naming rank 1, not at the timeout (60 s here).
    r = launch(["--num_procs", "2", "--log_dir", tmp_path / "logs", TRAIN_JOB, "--steps", "4", "--hidden", "64",
                "--exit_rank", "1", "--exit_step", "1"], timeout=200)
    elapsed = _seconds_since_test_event(r)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after rank 1 left (the comm timeout is 60 s)"
    assert "rank 1 has shut down its communicators (it ended without joining this call)" in out, out[-3000:]


@needs_mpirun
def test_rank_that_saves_alone_ends_the_job_naming_the_mismatch(tmp_path):
    # Rank 0 alone calls save_checkpoint (a checkpoint call under `if rank == 0:`, as DeepSpeed forbids)
    # while rank 1 goes on to the step's reduction: both must fail within seconds naming the two calls,
    # not after the save's I/O timeout (an hour) or with MPI's bare "message truncated".
    r = launch(["--num_procs", "2", "--log_dir", tmp_path / "logs", TRAIN_JOB, "--steps", "4", "--hidden", "64",
                "--ckpt_dir", tmp_path / "ckpt", "--save_alone_rank", "0", "--save_alone_step", "1"], timeout=200)
    elapsed = _seconds_since_test_event(r)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after rank 0 saved alone (the comm timeout is 60 s)"
    assert re.search(r"mismatched collectives: this rank called \w+ #\d+ on '[\w-]+', rank 1 called \w+ #\d+", out), \
        out[-3000:]


@needs_mpirun
def test_hung_rank_ends_the_job_naming_it_and_the_call(tmp_path):
    # Rank 1 is alive but stuck (a long sleep before its step: no death, no exit, its connections open) while
    # rank 0 waits for it in the step's first collective. The communicator's timeout (5 s here, 600 s by
    # default) must end the job, and the report must name rank 1, what it was doing, and the call rank 0 waited in.
    r = launch(["--num_procs", "2", "--log_dir", tmp_path / "logs", TRAIN_JOB, "--steps", "3", "--hidden", "64",
                "--sleep_step", "600", "--sleep_ranks", "1"], env=job_env(ZERO8_COMM_TIMEOUT="5"), timeout=200)
    elapsed = _seconds_since_test_event(r)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert elapsed < 40, f"the job took {elapsed:.0f} s to end after rank 1 hung (the comm timeout is 5 s)"
    m = re.search(r"zero8-launch: .*Zero8CommError: (\w+) #\d+ on '[\w-]+' \(rank 0 of 2\).* timed out after "
                  r"[0-9.]+ s \(timeout 5 s\); not heard from: rank 1 \(not in a communication call for", r.stderr)
    assert m, out[-3000:]
    # The hung rank is named first, as the cause.
    assert re.search(r"job FAILED .*\nzero8-launch: rank 1 hung: alive, but it did not join \w+ #\d+ on '[\w-]+' "
                     r"within the communicator timeout \(5 s, on rank 0\); it was not in a communication call", r.stderr), \
        r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# No process outlives the job
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# Engines that misbehave (a stand-in `mpirun` first on PATH): what the launcher reports
# ---------------------------------------------------------------------------------------------

def _fake_mpirun(tmp_path: Path, body: str) -> dict:
    """job_env() with a stand-in `mpirun` (a Python script running `body`) first on PATH; it writes
    <tmp_path>/engine.ready once its signal handlers are in place, and never dumps core."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    engine = bindir / "mpirun"
    engine.write_text(f"#!{sys.executable}\n"
                      "import os, resource, signal, sys, time\n"
                      "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
                      "signal.signal(signal.SIGSEGV, signal.SIG_DFL)\n"
                      "def segv(*_):\n"
                      "    os.kill(os.getpid(), signal.SIGSEGV)\n"
                      f"READY = {str(tmp_path / 'engine.ready')!r}\n" + body)
    engine.chmod(0o755)
    return job_env(PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")


def _wait_for_file(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout:g} s"
        time.sleep(0.05)


def test_engine_killed_by_a_signal_exits_128_plus_n(tmp_path):
    # mpirun reports a lost daemon and hangs; the launcher ends it after --fail_grace and mpirun dies of
    # SIGSEGV (OpenMPI 4.1's mpirun did, in PMIx_Finalize). The exit code was sys.exit(-11), i.e. 245.
    env = _fake_mpirun(tmp_path, "signal.signal(signal.SIGTERM, segv)\n"
                                 "print('-' * 74 + '\\nAn ORTE daemon has unexpectedly failed after launch and before\\n"
                                 "communicating back to mpirun.\\n' + '-' * 74, file=sys.stderr, flush=True)\n"
                                 "while True:\n    time.sleep(1)\n")
    r = launch(["--num_procs", "2", "--fail_grace", "0.5", "--log_dir", tmp_path / "logs", RANK_ENV],
               env=env, timeout=60)
    assert r.returncode == 128 + signal.SIGSEGV, r.stderr
    assert "job FAILED after" in r.stderr and "(mpirun killed by signal 11 (SIGSEGV))" in r.stderr, r.stderr
    assert "exit code -11" not in r.stderr


_ENGINE_THAT_STARTS_NOTHING = ("open(READY, 'w').close()\n"
                               "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))\n"
                               "while True:\n    time.sleep(1)\n")


def test_timeout_report_names_ranks_that_never_started_also_when_none_did(tmp_path):
    # A host whose daemon never connects back: no rank ever starts. The report said nothing about it
    # (it named ranks that never started only when some others had).
    hf = tmp_path / "hosts"
    hf.write_text("n0 slots=2\nn1 slots=2\n")
    env = _fake_mpirun(tmp_path, _ENGINE_THAT_STARTS_NOTHING)
    r = launch(["--hostfile", hf, "--timeout", "1", "--log_dir", tmp_path / "logs", RANK_ENV], env=env, timeout=60)
    assert r.returncode == 124, r.stderr
    assert "rank(s) 0, 1 (host n0), 2, 3 (host n1) never reported a start (no rank did)" in r.stderr, r.stderr
    assert "daemon on host(s) n0, n1 could not connect back to this host" in r.stderr


def test_start_timeout_ends_a_job_whose_ranks_do_not_all_start(tmp_path):
    # Rank 0 (on n0) starts, rank 1 (on n1) never does: --start_timeout ends the job naming rank 1 and n1.
    hf = tmp_path / "hosts"
    hf.write_text("n0 slots=1\nn1 slots=1\n")
    env = _fake_mpirun(tmp_path, "print('[zero8-launch] rank=0 event=start pid=1 host=n0', file=sys.stderr, flush=True)\n"
                                 + _ENGINE_THAT_STARTS_NOTHING)
    t0 = time.monotonic()
    r = launch(["--hostfile", hf, "--start_timeout", "1", "--log_dir", tmp_path / "logs", RANK_ENV],
               env=env, timeout=60)
    assert r.returncode == 1, r.stderr
    assert time.monotonic() - t0 < 30
    assert "start timeout: rank(s) 1 (host n1) did not start within 1 s; ending the job" in r.stderr, r.stderr
    assert "not every rank started within --start_timeout 1" in r.stderr
    assert "rank(s) 1 (host n1) never reported a start\n" in r.stderr
    assert "daemon on host(s) n1 could not connect back to this host (a firewall" in r.stderr
    r = launch(["--start_timeout", "-1", "--dry_run", RANK_ENV], timeout=60)
    assert r.returncode == 2 and "--start_timeout -1: give seconds >= 0" in r.stderr, r.stderr


def test_start_report_does_not_blame_this_host_s_daemon(tmp_path):
    # No rank starts, this host (127.0.0.1) among the hosts: mpirun starts no rank before every daemon has
    # reported, so only the other host's daemon is suspect (both hosts were named as suspects).
    hf = tmp_path / "hosts"
    hf.write_text("127.0.0.1 slots=1\nn1 slots=1\n")
    env = _fake_mpirun(tmp_path, _ENGINE_THAT_STARTS_NOTHING)
    r = launch(["--hostfile", hf, "--start_timeout", "1", "--log_dir", tmp_path / "logs", RANK_ENV], env=env, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "rank(s) 0 (host 127.0.0.1), 1 (host n1) never reported a start (no rank did)" in r.stderr, r.stderr
    assert ("likely causes: the engine's daemon on host(s) n1 could not connect back to this host (a firewall" in
            r.stderr and "(this host's ranks wait for every daemon: mpirun starts none before)" in r.stderr), r.stderr


def test_stop_before_any_rank_started_says_so(tmp_path):
    # Stopped while no rank had started (the summary said "(every rank exited)": all() over no rank), and
    # stopped while mpirun then died of a signal (it said "mpirun exit code -11").
    hf = tmp_path / "hosts"
    hf.write_text("n0 slots=1\nn1 slots=1\n")
    for exits, summary in (("sys.exit(0)", "before any rank had started (mpirun exit code 0)"),
                           ("segv()", "before any rank had started (mpirun killed by signal 11 (SIGSEGV))")):
        sub = tmp_path / exits[:3]
        sub.mkdir()
        env = _fake_mpirun(sub, _ENGINE_THAT_STARTS_NOTHING.replace("sys.exit(0)", exits))
        proc = subprocess.Popen(launch_cmd(["--hostfile", hf, "--log_dir", sub / "logs", RANK_ENV]), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for_file(sub / "engine.ready")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert re.search(r"^zero8-launch: job stopped on request after [\d.]+ s " + re.escape(summary) + "; logs: ",
                         err, re.M), err
        assert "every rank exited" not in err


def test_two_stop_requests_at_once_still_stop_the_job(tmp_path):
    # Two signals handled between two looks of the launcher (here SIGINT and SIGTERM sent together; timeout(1)
    # sends SIGTERM to its child, then to its process group) skipped the stop request: the job was ended
    # at once and reported as FAILED ("mpirun was killed by signal 15").
    env = _fake_mpirun(tmp_path, "os.kill(os.getppid(), signal.SIGTERM); os.kill(os.getppid(), signal.SIGINT)\n"
                                 + _ENGINE_THAT_STARTS_NOTHING)
    r = launch(["--num_procs", "2", "--log_dir", tmp_path / "logs", RANK_ENV], env=env, timeout=60)
    assert r.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), r.stderr
    assert "stop requested: every rank gets SIGTERM" in r.stderr and "ending the job now" in r.stderr, r.stderr
    assert "job stopped on request after" in r.stderr and "FAILED" not in r.stderr, r.stderr



def test_a_stop_request_while_the_engine_starts_is_handled(tmp_path):
    # The launcher installed its SIGINT/SIGTERM handlers only after starting the engine and its output
    # pumps: a stop request in that gap (a scheduler's SIGTERM as the job starts) killed the launcher
    # with no report (exit 143; 4 runs in 5 with this engine, a shell script that signals at once).
    bindir = tmp_path / "bin"
    bindir.mkdir()
    engine = bindir / "mpirun"
    engine.write_text("#!/bin/sh\nkill -TERM $PPID\ntrap 'exit 0' USR1\nwhile :; do sleep 0.05; done\n")
    engine.chmod(0o755)
    env = job_env(PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    r = launch(["--num_procs", "2", "--log_dir", tmp_path / "logs", RANK_ENV], env=env, timeout=60)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert "stop requested: every rank gets SIGTERM" in r.stderr, r.stderr
    assert "job stopped on request after" in r.stderr and "FAILED" not in r.stderr, r.stderr

def test_launcher_says_which_ranks_it_still_waits_for(tmp_path, monkeypatch):
    from zero8_launch import monitor as mon

    env = _fake_mpirun(tmp_path, _ENGINE_THAT_STARTS_NOTHING)
    monkeypatch.setattr(mon, "START_NOTICE", 0.2)
    err = io.BytesIO()
    m = JobMonitor(str(tmp_path), 2, out=io.BytesIO(), err=err, hosts=OrderedDict([("n0", [0]), ("n1", [0])]))
    m.feed("err", format_marker(rank=0, event="start", pid=1, host="n0").encode() + b"\n")
    rc, how = mon.run_job([str(tmp_path / "bin" / "mpirun")], env, m, start_timeout=1.5)
    text = err.getvalue().decode()
    assert how == "start-timeout", text
    lines = text.splitlines()
    waiting = [l for l in lines if "still waiting" in l]
    assert len(waiting) == 1 and waiting[0].startswith("zero8-launch: still waiting for rank(s) 1 (host n1) to start "
                                                       "after "), text
    assert waiting[0].endswith("(--start_timeout 1.5 ends the job)")
    assert lines.index(waiting[0]) < next(i for i, l in enumerate(lines) if "start timeout:" in l)


def _alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill_all(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pids_in(directory: Path, pattern: str) -> list[int]:
    return [int(p.read_text()) for p in sorted(directory.glob(pattern)) if p.read_text().strip()]


def _wait_for_pids(directory: Path, pattern: str, count: int, timeout: float = 60.0) -> list[int]:
    """The pids in `directory`'s files matching `pattern`, once `count` are there or at the timeout."""
    deadline = time.monotonic() + timeout
    pids = _pids_in(directory, pattern)
    while len(pids) < count and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = _pids_in(directory, pattern)
    return pids


# The start of a rank script that starts a helper (`sleep 300`) and then publishes its pid in
# <dir>/helper_pid.<RANK> (whole, by a rename); {sigterm} is run first.
_HELPER_SCRIPT_HEAD = (
    "import os, signal, subprocess, sys, time\n"
    "D, rank = {dir!r}, os.environ['RANK']\n"
    "{sigterm}"
    "helper = subprocess.Popen(['sleep', '300'])\n"
    "open(os.path.join(D, '.tmp' + rank), 'w').write(str(helper.pid))\n"
    "os.replace(os.path.join(D, '.tmp' + rank), os.path.join(D, 'helper_pid.' + rank))\n"
    "def wait_for_helper_of_rank_0():  # before failing: rank 0 must have started its helper\n"
    "    deadline = time.monotonic() + 60\n"
    "    while not os.path.exists(os.path.join(D, 'helper_pid.0')):\n"
    "        if time.monotonic() > deadline:\n"
    "            sys.exit('rank 1: rank 0 did not start its helper within 60 s')\n"
    "        time.sleep(0.02)\n")


@needs_mpirun
def test_processes_a_rank_started_end_with_it(tmp_path):
    # Each rank's script starts a helper (a data server, a tokenizer worker...) that would run for minutes,
    # then rank 1 fails: no helper may outlive its rank (as under torchrun, which ends each worker's group).
    script = tmp_path / "helper.py"
    script.write_text(_HELPER_SCRIPT_HEAD.format(dir=str(tmp_path), sigterm="") +
                      "if rank == '1':\n"
                      "    wait_for_helper_of_rank_0()\n"
                      "    sys.exit('rank 1 fails on purpose (test)')\n"
                      "time.sleep(60)\n")
    helpers: list[int] = []
    try:
        r = launch(["--num_procs", "2", "--log_dir", tmp_path / "logs", script], timeout=90)
        helpers = _pids_in(tmp_path, "helper_pid.*")
        assert r.returncode == 1, r.stderr
        assert len(helpers) == 2, r.stderr
        left = _wait_gone(helpers, 5.0)
        assert not left, f"helper process(es) {left} outlived their rank"
    finally:
        _kill_all(helpers)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


@needs_mpirun
def test_ranks_end_when_the_engine_dies(tmp_path):
    # mpirun dies without ending its ranks (SIGKILLed by the OOM killer; or on a second SIGTERM, which makes
    # it exit at once: a SIGKILLed launcher's death signal reaches it once per launcher thread) while they
    # run a script that catches SIGTERM and carries on: the ranks must still end, within --stop_grace plus
    # a few seconds, not run on as orphans, and the launcher must say that the engine died.
    script = tmp_path / "stubborn.py"
    script.write_text(
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: print('SIGTERM caught; carrying on', flush=True))\n"
        f"open(os.path.join({str(tmp_path)!r}, 'script_pid.' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
        "while True:\n"
        "    time.sleep(0.1)\n")
    proc = subprocess.Popen(launch_cmd(["--num_procs", "2", "--stop_grace", "2", "--log_dir", tmp_path / "logs",
                                        script]),
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        ranks = _wait_for_pids(tmp_path, "script_pid.*", 2)
        assert len(ranks) == 2, "the ranks did not start"
        engine = _children(proc.pid)
        assert len(engine) == 1, engine
        os.kill(engine[0], signal.SIGKILL)
        left = _wait_gone(ranks, 15.0)
        assert not left, f"rank script(s) {left} outlived the engine"
        out, err = proc.communicate(timeout=30)
        # The engine's death is the cause, said as such (not as ranks that died), with 128 + its signal.
        assert proc.returncode == 128 + signal.SIGKILL, err
        assert "mpirun was killed by signal 9 (SIGKILL)" in err and "died" not in err, err
        for rank in (0, 1):
            log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
            assert "SIGTERM caught; carrying on" in log and "is gone; ending the script" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_all(ranks)


@needs_mpirun
@pytest.mark.parametrize("how", ["stop_grace_runs_out", "second_ctrl_c", "another_rank_fails"])
def test_processes_of_a_rank_that_ignores_sigterm_end_with_the_job(tmp_path, how):
    # The scripts ignore SIGTERM and have started a helper; the job is then ended by force: mpirun SIGKILLs
    # the wrappers about a second after its SIGTERM, and the scripts die with them (PR_SET_PDEATHSIG). Their
    # helpers used to live on, re-parented to init: no helper may outlive the job.
    script = tmp_path / "deaf.py"
    script.write_text(_HELPER_SCRIPT_HEAD.format(dir=str(tmp_path),
                                                 sigterm="signal.signal(signal.SIGTERM, signal.SIG_IGN)\n") +
                      f"if rank == '1' and {how == 'another_rank_fails'}:\n"
                      "    wait_for_helper_of_rank_0()\n"
                      "    sys.exit('rank 1 fails on purpose (test)')\n"
                      "time.sleep(300)\n")
    grace = ["--stop_grace", "2"] if how == "stop_grace_runs_out" else ["--stop_grace", "30", "--fail_grace", "5"]
    proc = subprocess.Popen(launch_cmd(["--num_procs", "2", *grace, "--log_dir", tmp_path / "logs", script]),
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    helpers: list[int] = []
    try:
        # A script publishes its helper's pid after its SIG_IGN: both ignore SIGTERM from here on.
        helpers = _wait_for_pids(tmp_path, "helper_pid.*", 2)
        assert len(helpers) == 2, "the ranks did not start their helpers"
        if how != "another_rank_fails":
            proc.send_signal(signal.SIGINT)
            if how == "second_ctrl_c":
                # The second once the first has reached both scripts (each wrapper's signal marker, in
                # the engine output the launcher keeps), which ignore it.
                log = tmp_path / "logs" / "launcher.log"
                deadline = time.monotonic() + 30
                while not all(re.search(rf"^\[zero8-launch\] rank={i} event=signal ", log.read_text(), re.M)
                              for i in (0, 1)):
                    assert time.monotonic() < deadline, "the stop request did not reach both ranks within 30 s:\n" \
                        + log.read_text()[-3000:]
                    time.sleep(0.05)
                proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == (1 if how == "another_rank_fails" else 128 + signal.SIGINT), err
        left = _wait_gone(helpers, 5.0)
        assert not left, f"helper process(es) {left} outlived the job ({how})"
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_all(helpers)
