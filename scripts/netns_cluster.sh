#!/usr/bin/env bash
# A two-"host" cluster on this machine for multi-node tests: two network namespaces (z8h0, z8h1) joined
# by a veth pair with private addresses (10.208.0.1/24, 10.208.0.2/24) that exist only inside them, and a
# way to run a command "on a host" (its own network and hostname). OpenMPI's mpirun runs inside z8h0 and
# reaches z8h1 through scripts/netns_rsh.sh, which plays ssh. Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN).
#
#   netns_cluster.sh check                 can namespaces be made here? (prints the error if not)
#   netns_cluster.sh up | down             create / remove the cluster (down also ends its processes)
#   netns_cluster.sh exec HOST CMD...      run CMD on HOST (z8h0, z8h1 or its address)
#   netns_cluster.sh hostfile [SLOTS]      print a hostfile naming both hosts (default 2 slots each)
#   netns_cluster.sh stats                 bytes each host's veth sent/received, one JSON object
#   netns_cluster.sh shape RATE|off        rate-limit both directions of the veth (tc tbf; RATE: 1gbit,
#                                          10gbit, 500mbit) or remove the limit
#   netns_cluster.sh run CMD...            up, run CMD on z8h0, down (always, also on failure/Ctrl-C)
#
# Inside the cluster OMPI_MCA_plm_rsh_agent points at netns_rsh.sh, so (with `hostfile > /tmp/hosts`)
#   netns_cluster.sh exec z8h0 zero8-launch --hostfile /tmp/hosts --net_if 10.208.0.0/24 script.py
# starts ranks on both hosts. docs/LAUNCH.md has more. 'run' (and tests/python/test_multinode.py) hold
# /run/lock/zero8-netns-<prefix>.lock while the cluster exists. Environment: ZERO8_NETNS_PREFIX (default
# z8h; 1-13 letters, digits and '-': the hosts' names are hostnames), ZERO8_NETNS_NET (default 10.208.0: the first three octets of the /24).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="${ZERO8_NETNS_PREFIX:-z8h}"
net="${ZERO8_NETNS_NET:-10.208.0}"
hosts=("${prefix}0" "${prefix}1")
addrs=("${net}.1" "${net}.2")
veths=("${prefix}v0" "${prefix}v1")

die() { echo "netns_cluster: $*" >&2; exit 1; }

need_root() {
  [[ $(id -u) -eq 0 ]] || die "needs root (ip netns add requires CAP_SYS_ADMIN and CAP_NET_ADMIN)"
  command -v ip >/dev/null || die "the 'ip' command (iproute2) is not installed"
  command -v unshare >/dev/null || die "the 'unshare' command (util-linux) is not installed"
}

cmd_check() {
  need_root
  local probe="${prefix}probe$$" err
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "netns_cluster: cannot create a network namespace: ip netns add: $err" >&2
    exit 1
  fi
  if ! err=$(ip -n "$probe" link set lo up 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    echo "netns_cluster: cannot configure a network namespace: ip link set lo up: $err" >&2
    exit 1
  fi
  if ! err=$(unshare --uts true 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    echo "netns_cluster: cannot create a UTS namespace: unshare --uts: $err" >&2
    exit 1
  fi
  ip netns del "$probe"
  echo "netns_cluster: network namespaces work here"
}

cmd_down() {
  local ns pids
  for ns in "${hosts[@]}"; do
    if ip netns list | awk '{print $1}' | grep -qx "$ns"; then
      # Processes left in a namespace keep it (and its addresses) alive after 'ip netns del'.
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      if [[ -n "$pids" ]]; then
        # shellcheck disable=SC2086  # a list of pids
        kill -9 $pids 2>/dev/null || true
      fi
      ip netns del "$ns" 2>/dev/null || true
    fi
  done
  # The veth pair goes with its namespaces; a half-made one may be left in the root namespace.
  ip link del "${veths[0]}" 2>/dev/null || true
}

cmd_up() {
  # Each host's name is its namespace's name, set as its hostname at every 'exec': letters, digits and
  # '-' only ('_' made every exec fail with "hostname: the specified hostname is invalid"), and the veth
  # names (<prefix>v0) must fit in 15 characters.
  [[ "$prefix" =~ ^[A-Za-z0-9][A-Za-z0-9-]{0,12}$ ]] ||
    die "ZERO8_NETNS_PREFIX '$prefix': use 1-13 letters, digits and '-' (not first): it names the hosts" \
        "(${hosts[0]}, ${hosts[1]}), which are also their hostnames, and their interfaces (${veths[0]})"
  need_root
  cmd_down
  ip netns add "${hosts[0]}"
  ip netns add "${hosts[1]}"
  ip link add "${veths[0]}" type veth peer name "${veths[1]}"
  local i
  for i in 0 1; do
    ip link set "${veths[$i]}" netns "${hosts[$i]}"
    ip -n "${hosts[$i]}" link set lo up
    ip -n "${hosts[$i]}" addr add "${addrs[$i]}/24" dev "${veths[$i]}"
    ip -n "${hosts[$i]}" link set "${veths[$i]}" up
  done
  echo "netns_cluster: up: ${hosts[0]} (${addrs[0]}, ${veths[0]}) <-> ${hosts[1]} (${addrs[1]}, ${veths[1]})"
}

# host name or address -> namespace
ns_of() {
  local h="$1" i
  for i in 0 1; do
    if [[ "$h" == "${hosts[$i]}" || "$h" == "${addrs[$i]}" ]]; then
      echo "${hosts[$i]}"
      return 0
    fi
  done
  return 1
}

cmd_exec() {
  [[ $# -ge 2 ]] || die "usage: netns_cluster.sh exec HOST CMD..."
  local ns
  ns=$(ns_of "$1") || die "unknown host '$1' (hosts: ${hosts[*]} / ${addrs[*]})"
  shift
  # Its own hostname too: OpenMPI names shared-memory files and session directories by hostname, and
  # both "hosts" share /tmp and /dev/shm.
  # shellcheck disable=SC2016  # expanded by the inner shell
  exec ip netns exec "$ns" unshare --uts -- env OMPI_MCA_plm_rsh_agent="$here/netns_rsh.sh" \
    /bin/sh -c 'hostname "$1" && shift && exec "$@"' sh "$ns" "$@"
}

cmd_hostfile() {
  local slots="${1:-2}"
  echo "# zero8 namespace cluster (scripts/netns_cluster.sh): one line per host"
  echo "${addrs[0]} slots=$slots"
  echo "${addrs[1]} slots=$slots"
}

cmd_stats() {
  local i first=1
  printf '{'
  for i in 0 1; do
    local d="/sys/class/net/${veths[$i]}/statistics" tx rx
    tx=$(ip netns exec "${hosts[$i]}" cat "$d/tx_bytes")
    rx=$(ip netns exec "${hosts[$i]}" cat "$d/rx_bytes")
    ((first)) || printf ', '
    first=0
    printf '"%s": {"veth": "%s", "tx_bytes": %s, "rx_bytes": %s}' "${hosts[$i]}" "${veths[$i]}" "$tx" "$rx"
  done
  printf '}\n'
}

# Token bucket on each veth end's egress, so both directions run at RATE. tbf, not netem: kernels without
# sch_netem (no added delay) still have it. The bucket holds 4 ms at RATE (500 KB at 1 Gbit/s): at least
# one 64 KB segmentation-offload packet, and enough that a timer tick of the host does not idle the link.
cmd_shape() {
  [[ $# -eq 1 ]] || die "usage: netns_cluster.sh shape RATE|off (RATE: <N>mbit or <N>gbit)"
  local rate="$1" bits=0 i
  if [[ "$rate" =~ ^([1-9][0-9]{0,5})(mbit|gbit)$ ]]; then
    bits=$(( BASH_REMATCH[1] * 1000000 ))
    [[ "${BASH_REMATCH[2]}" == gbit ]] && bits=$(( bits * 1000 ))
  elif [[ "$rate" != off ]]; then
    die "shape '$rate': give the rate as <N>mbit or <N>gbit (e.g. 1gbit, 10gbit, 500mbit), or 'off'"
  fi
  need_root
  command -v tc >/dev/null || die "the 'tc' command (iproute2) is not installed"
  if [[ "$rate" == off ]]; then
    for i in 0 1; do
      ip netns exec "${hosts[$i]}" tc qdisc del dev "${veths[$i]}" root 2>/dev/null || true
    done
    echo "netns_cluster: ${veths[0]} <-> ${veths[1]} not shaped"
    return 0
  fi
  for i in 0 1; do
    ip netns exec "${hosts[$i]}" tc qdisc replace dev "${veths[$i]}" root tbf rate "$rate" \
      burst $(( bits / 8 / 250 > 65536 ? bits / 8 / 250 : 65536 )) latency 100ms ||
      die "tc qdisc replace dev ${veths[$i]} root tbf rate $rate failed in ${hosts[$i]} (is sch_tbf available?)"
  done
  echo "netns_cluster: ${veths[0]} <-> ${veths[1]} shaped to $rate each way (tbf)"
}

cmd_run() {
  [[ $# -ge 1 ]] || die "usage: netns_cluster.sh run CMD..."
  need_root
  # One cluster at a time on this machine.
  exec 8>"/run/lock/zero8-netns-${prefix}.lock"
  flock 8
  trap cmd_down EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  cmd_up
  local rc=0
  "$0" exec "${hosts[0]}" "$@" || rc=$?
  return $rc
}

sub="${1:-}"
[[ -n "$sub" ]] || die "usage: netns_cluster.sh check|up|down|exec|hostfile|stats|run ..."
shift
case "$sub" in
  check) cmd_check ;;
  up) cmd_up ;;
  down) need_root; cmd_down ;;
  exec) cmd_exec "$@" ;;
  hostfile) cmd_hostfile "$@" ;;
  stats) cmd_stats ;;
  shape) cmd_shape "$@" ;;
  run) cmd_run "$@" ;;
  *) die "unknown command '$sub' (check|up|down|exec|hostfile|stats|shape|run)" ;;
esac
