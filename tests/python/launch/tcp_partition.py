"""A network partition under the tcp backend (torchrun's and DeepSpeed's launchers), with a rank's data in
flight to the host it loses, which TCP keepalive does not see (tests/python/test_multinode.py). As root:

    python3 tcp_partition.py SCENARIO OUT_DIR

Three network namespaces play two hosts and the switch between them (a bridge): each host's veth stays up
when the switch ends its port, so its packets vanish without an error, as in a real partition (a host's own
link going down would fail its sends locally instead). Two ranks, one per host, made by comm_create_tcp
over a file rendezvous in OUT_DIR, with ZERO8_COMM_LINK_TIMEOUT=2 and ZERO8_COMM_TIMEOUT=60.

SCENARIO in_flight: both ranks all-reduce 16 MB again and again. shut_window: rank 0 sends rank 1 64 MB
while rank 1 sleeps (RANK1_SLEEP s), so rank 0's send waits on a shut receive window, answered only by
window probes. Once both ranks are at it (CUT_AFTER s), the switch ends both ports. Each rank writes
OUT_DIR/rank<R>.json ({"error": its Zero8CommError's text or "", "time": time.time() when it ended});
OUT_DIR/report.json holds the time of the cut (null if none), what the script saw, and, where the namespaces
could not be made, "setup_error".
"""

import json
import os
import subprocess
import sys
import time

LINK_TIMEOUT = 2
CUT_AFTER = 2.0
RANK1_SLEEP = 12.0
SUBNET = "10.214.0"


def rank_main(scenario: str, out: str, rank: int) -> None:
    import torch

    import zero8
    import zero8._C as C

    def exchange(mine: str) -> list:
        tmp = os.path.join(out, f"contact{rank}.tmp")
        with open(tmp, "w") as f:
            f.write(mine)
        os.replace(tmp, os.path.join(out, f"contact{rank}"))
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(out, f"contact{r}")) for r in (0, 1)):
            if time.monotonic() > deadline:
                raise RuntimeError("the other rank never published its contact string")
            time.sleep(0.01)
        return [open(os.path.join(out, f"contact{r}")).read() for r in (0, 1)]

    error = ""
    try:
        c = C.comm_create_tcp(rank, 2, exchange)
        c.barrier()
        open(os.path.join(out, f"ready{rank}"), "w").close()
        if scenario == "in_flight":
            x = torch.ones(4 << 20)
            while True:
                c.all_reduce_ptr(x.data_ptr(), x.numel(), "f32", "max")
        elif rank == 0:
            c.send_bytes(bytes(64 << 20), 1)
        else:
            time.sleep(RANK1_SLEEP)
            c.recv_bytes(64 << 20, 0)
    except zero8.Zero8CommError as e:
        error = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error, "time": time.time()}, f)
    os._exit(0)


def make_network(run, tag: str, hosts: list, switch: str) -> None:
    """The namespaces: each host's eth0 joined to port <tag>p<i> of a bridge in the switch namespace."""
    for ns in hosts + [switch]:
        run("ip", "netns", "add", ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")
    run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
    run("ip", "-n", switch, "link", "set", "br0", "up")
    for i, ns in enumerate(hosts):
        run("ip", "link", "add", f"{tag}p{i}", "netns", switch, "type", "veth", "peer", "name", "eth0", "netns", ns)
        run("ip", "-n", switch, "link", "set", f"{tag}p{i}", "master", "br0", "up")
        run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")


def controller(scenario: str, out: str) -> None:
    tag = f"z8tp{os.getpid() % 100000}"
    hosts, switch = [f"{tag}h0", f"{tag}h1"], f"{tag}sw"
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)  # noqa: E731
    report = {"scenario": scenario, "cut": None, "log": []}
    procs = []
    try:
        try:
            make_network(run, tag, hosts, switch)
        except subprocess.CalledProcessError as e:
            report["setup_error"] = f"{' '.join(e.cmd)}: {e.stderr.strip()}"
            return
        for r, ns in enumerate(hosts):
            env = dict(os.environ, ZERO8_COMM_IFADDR=f"{SUBNET}.{r + 1}", ZERO8_COMM_LINK_TIMEOUT=str(LINK_TIMEOUT),
                       ZERO8_COMM_TIMEOUT="60", OMP_NUM_THREADS="1")
            log = open(os.path.join(out, f"rank{r}.log"), "w")
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, __file__, "rank", scenario,
                                           out, str(r)], env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 90
        while not all(os.path.exists(os.path.join(out, f"ready{r}")) for r in (0, 1)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                report["log"].append("the ranks did not start")
                return
            time.sleep(0.05)
        time.sleep(CUT_AFTER)
        for i in range(2):
            run("ip", "-n", switch, "link", "set", f"{tag}p{i}", "down")
        report["cut"] = time.time()
        deadline = time.monotonic() + 70
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        report["log"].append(f"ranks still running at the end: {[r for r, p in enumerate(procs) if p.poll() is None]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for ns in hosts + [switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        controller(sys.argv[1], sys.argv[2])
