#!/usr/bin/env bash
# The "ssh" of the namespace cluster (scripts/netns_cluster.sh) for OpenMPI's rsh launcher
# (--mca plm_rsh_agent scripts/netns_rsh.sh): called as `netns_rsh.sh [ssh options] HOST COMMAND...`,
# it runs COMMAND with a shell on HOST's namespace, as ssh would on a real host. ssh options that
# OpenMPI adds are accepted and ignored.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
while [[ $# -gt 0 && "$1" == -* ]]; do
  case "$1" in
    # ssh options that take an argument
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
    *) shift ;;
  esac
done
if [[ $# -lt 2 ]]; then
  echo "netns_rsh: usage: netns_rsh.sh [ssh options] HOST COMMAND..." >&2
  exit 255
fi
host="$1"
shift
# ssh joins the command words with spaces and hands them to the remote shell; so does this.
exec "$here/netns_cluster.sh" exec "$host" /bin/sh -c "$*"
