"""A rank script for the launcher tests (tests/python/test_launch.py): standard library only, so it starts
in milliseconds. Prints the launcher's variables as one JSON line, writes to stdout and stderr, and on
request fails, sleeps, or waits for SIGTERM and reports it. --ready PATH: each rank writes PATH.RANK.ready
once running (with its SIGTERM handler, if any, in place), and --fail_rank fails only once every rank's
is there; --term_file PATH: PATH.RANK with the signal's name when SIGTERM comes.

    rank_env.py [--fail_rank R] [--kill_self] [--sleep S] [--ready PATH] [--term_file PATH]
"""

import argparse
import json
import os
import signal
import sys
import time

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "ZERO8_COMM_NODE", "ZERO8_COMM_IFADDR", "ZERO8_LAUNCH_HOST", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED",
        "ZERO8_TEST_EXPORT", "ZERO8_TEST_EXPLICIT", "OMP_NUM_THREADS"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fail_rank", type=int, default=-1)
    p.add_argument("--kill_self", action="store_true", help="--fail_rank dies by SIGKILL instead of raising")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--ready", default="")
    p.add_argument("--term_file", default="")
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "-1"))
    seen = {k: os.environ.get(k) for k in KEYS}
    seen["AFFINITY"] = sorted(os.sched_getaffinity(0))  # the cores this rank may run on
    print("ENV " + json.dumps(seen, sort_keys=True))
    print(f"hello from rank {rank} on stderr", file=sys.stderr)
    if a.term_file:
        def on_term(signum, _frame):
            with open(f"{a.term_file}.{rank}", "w") as f:
                f.write(signal.Signals(signum).name)
            print(f"rank {rank} got {signal.Signals(signum).name}: saving and exiting")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
    if a.ready:
        open(f"{a.ready}.{rank}.ready", "w").close()
    if rank == a.fail_rank:
        if a.ready:  # every rank running first: the others are then ended by the job's abort, not unstarted
            world = int(os.environ["WORLD_SIZE"])
            deadline = time.monotonic() + 60
            while not all(os.path.exists(f"{a.ready}.{r}.ready") for r in range(world)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank}: not every rank wrote {a.ready}.<R>.ready within 60 s")
                time.sleep(0.02)
        # The tests time the job's end from this line, not from the launch (a loaded machine starts slowly).
        print(f"test event: rank {rank} {'kills itself' if a.kill_self else 'raises'} at t={time.time():.3f}",
              flush=True)
        if a.kill_self:
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"rank {rank} fails on purpose (test)")
    deadline = time.monotonic() + a.sleep
    while time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"rank {rank} done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
