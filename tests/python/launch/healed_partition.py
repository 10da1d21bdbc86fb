"""A partition that heals after one side's kernel has given up on a liveness connection, but before the
other side's has (tests/python/test_multinode.py). Run in a private network namespace, as root:

    unshare -n python3 healed_partition.py OUT_DIR      (mpirun: $MPIRUN, else from PATH)

Two ranks on loopback (ZERO8_COMM_LINK_TIMEOUT=2): rank 0 waits in a barrier, sending rank 1 a status
query every 5 s; rank 1 sleeps, alive, in no call. Once rank 0's first query is seen (its socket's
bytes_sent, from `ss`), loopback goes down 0.7 s before the second, which then stays unacknowledged:
rank 0's kernel would end the connection 2 s after sending it, rank 1's (which hears nothing from its
last keepalive answer on) up to a second earlier. As soon as rank 1's end is gone and rank 0's is not,
loopback comes back: rank 0's next retransmission meets a kernel without the connection, which answers
with a reset. Writes OUT_DIR/report.json ({"healed_between": whether that order happened, "log": what
was seen, "error": why the controller stopped early, if it did}); each rank writes OUT_DIR/rank<R> with
the outcome of its barrier.
"""

import json
import os
import subprocess
import sys
import time

from launch_util import established_tcp

RANK_SLEEP = 12.0  # rank 1's sleep: past the outage and rank 0's failure


def rank_main(out: str) -> None:
    import zero8
    import zero8._C as C

    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    c = C.comm_create("mpi")
    c.barrier()
    # Published whole by a rename: the controller reads the file as soon as it exists.
    with open(os.path.join(out, f"pid{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
    if rank == 1:
        time.sleep(RANK_SLEEP)
    try:
        c.barrier()
        msg = "OK"
    except zero8.Zero8CommError as e:
        msg = f"COMM_ERROR {e}"
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(msg)
    os._exit(0)  # no MPI_Finalize with a failed peer


def controller(out: str) -> None:
    log = []
    say = lambda what: log.append(f"{time.monotonic() - t0:7.3f} {what}")  # noqa: E731
    t0 = time.monotonic()
    lo = lambda state: subprocess.run(["ip", "link", "set", "lo", state], check=True)  # noqa: E731
    lo("up")
    env = dict(os.environ, ZERO8_COMM_LINK_TIMEOUT="2", ZERO8_COMM_TIMEOUT="60")
    mpirun = subprocess.Popen([os.environ.get("MPIRUN", "mpirun"), "--allow-run-as-root", "--oversubscribe",
                               "--mca", "btl", "self,vader", "-np", "2", sys.executable, __file__, "rank", out],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    healed_between = False
    output = ""
    error = ""
    try:
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(out, f"pid{r}")) for r in (0, 1)):
            if time.monotonic() > deadline or mpirun.poll() is not None:
                output = mpirun.communicate()[0] if mpirun.poll() is not None else ""
                raise SystemExit("the ranks did not start (mpirun's output in the report)")
            time.sleep(0.05)
        pids = [int(open(os.path.join(out, f"pid{r}")).read()) for r in (0, 1)]
        # The mesh connection between the two ranks: rank 0's end and rank 1's.
        ends = None
        while ends is None:
            socks = established_tcp()
            for a in socks:
                for b in socks:
                    if (pids[0] in a["pids"] and pids[1] in b["pids"] and a["local"] == b["peer"]
                            and a["peer"] == b["local"]):
                        ends = (a, b)
            if ends is None:
                assert time.monotonic() < deadline, f"no connection between the ranks: {socks}"
                time.sleep(0.05)
        say(f"mesh connection {ends[0]['local']} <-> {ends[1]['local']}")

        def find(end):
            return next((s for s in established_tcp() if s["local"] == end["local"] and s["peer"] == end["peer"]), None)

        sent0 = ends[0]["sent"]
        while True:  # rank 0's first status query, 2 s into its wait
            s = find(ends[0])
            assert s is not None and time.monotonic() < deadline, "rank 0's mesh connection ended early"
            if s["sent"] > sent0:
                break
            time.sleep(0.01)
        first = time.monotonic()
        say("rank 0 sent its first status query")
        time.sleep(max(0.0, first + 4.3 - time.monotonic()))  # the second comes 5 s after the first
        lo("down")
        say("loopback down")
        until = time.monotonic() + 6
        while time.monotonic() < until:
            have0, have1 = find(ends[0]) is not None, find(ends[1]) is not None
            if not have1 or not have0:
                lo("up")
                healed_between = have0 and not have1
                say(f"loopback up: rank 0's end {'still there' if have0 else 'gone'}, "
                    f"rank 1's {'still there' if have1 else 'gone'}")
                break
            time.sleep(0.005)
        else:
            lo("up")
            say("loopback up: neither end was gone after 6 s")
        output = mpirun.communicate(timeout=60)[0]
        say(f"mpirun exited {mpirun.returncode}")
    except BaseException as e:  # said in the report, which the test shows
        error = f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}"
        raise
    finally:
        if mpirun.poll() is None:
            mpirun.kill()
            output = mpirun.communicate()[0]
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump({"healed_between": healed_between, "log": log, "error": error, "mpirun": output[-3000:]}, f,
                      indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank_main(sys.argv[2])
    else:
        controller(sys.argv[1])
