#!/usr/bin/env bash
# Runs a command with this machine's own copies of what scripts/gpu_check.sh --prepare ships made invisible,
# so that the check proves its prepared packages are enough, as on the lent GPU machine that has none of
# them. Needs root: a private mount namespace (unshare -m) in which /usr and /etc are overlay mounts whose
# upper layers hold whiteouts for every file of the hidden packages (and for the alternatives links that
# lead to them). Nothing outside the command's namespace changes.
#
#   bash tests/gpu_check/hide_system_deps.sh .gpu-deps -- bash scripts/gpu_check.sh --quick --no-gpu-ok \
#        --deps .gpu-deps --budget 7200
#
# Hidden: every package in DEPS_DIR, plus the system packages the lent machine is not known to have
# either and that could stand in for them (ssh for mpirun, hwloc's plugins, the -dev packages of OpenMPI's
# dependencies, GoogleTest's sources, oneDNN).
set -euo pipefail

if [[ $# -lt 3 || $2 != -- ]]; then
  echo "usage: $0 DEPS_DIR -- COMMAND [ARGS...]" >&2
  exit 2
fi
deps=$1
shift 2
[[ $(id -u) -eq 0 ]] || { echo "hide_system_deps: needs root (mount namespaces, overlayfs)" >&2; exit 2; }
compgen -G "$deps/*.deb" >/dev/null || { echo "hide_system_deps: $deps holds no .deb files" >&2; exit 2; }

EXTRA=(openssh-client libhwloc-plugins libhwloc-dev libevent-dev libpmix-dev libibverbs-dev libnuma-dev
  libnl-3-dev libnl-route-3-dev googletest libdnnl-dev libdnnl3)
pkgs=()
for deb in "$deps"/*.deb; do pkgs+=("$(dpkg-deb -f "$deb" Package)"); done
pkgs+=("${EXTRA[@]}")

layer=$(mktemp -d /tmp/zero8-hide.XXXXXX)
trap 'rm -rf "$layer"' EXIT
hidden="$layer/hidden.txt"
# The files of the installed ones among them (paths through /lib etc. resolved: /usr is merged), and the links
# that lead to a hidden file (Debian's alternatives: /usr/bin/mpirun -> /etc/alternatives/mpirun -> ...).
for top in usr etc; do mkdir -p "$layer/$top/up" "$layer/$top/work"; done
n=$(python3 - "$hidden" "${pkgs[@]}" <<'PY'
import glob, os, stat, subprocess, sys
out, pkgs = sys.argv[1], sys.argv[2:]
installed = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${Status}\\n"] + pkgs, capture_output=True,
                           text=True).stdout.splitlines()
files = set()
for line in installed:
    name, _, status = line.partition(" ")
    if status != "install ok installed":
        continue
    for f in subprocess.run(["dpkg", "-L", name], capture_output=True, text=True).stdout.splitlines():
        if os.path.isdir(f) or not os.path.lexists(f):  # directories stay (emptied)
            continue
        files.add(os.path.join(os.path.realpath(os.path.dirname(f)), os.path.basename(f)))
real = {os.path.realpath(f) for f in files}
for pattern in ("/usr/bin/*", "/usr/lib/x86_64-linux-gnu/*.so*", "/usr/include/x86_64-linux-gnu/*", "/etc/alternatives/*"):
    for link in glob.glob(pattern):
        if os.path.islink(link) and os.path.realpath(link) in real:
            files.add(link)
with open(out, "w") as f:
    f.write("".join(p + "\\n" for p in sorted(files)))
# An overlay whiteout (a 0/0 character device) in the upper layer of /usr or /etc hides the lower file.
layer = os.path.dirname(out)
for p in files:
    top = p.split("/")[1]
    if top not in ("usr", "etc"):
        continue
    w = os.path.join(layer, top, "up", os.path.relpath(p, "/" + top))
    os.makedirs(os.path.dirname(w), exist_ok=True)
    os.mknod(w, 0o600 | stat.S_IFCHR, os.makedev(0, 0))
print(len(files))
PY
)
echo "hide_system_deps: hiding $n files of ${#pkgs[@]} packages (list: $hidden while it runs)" >&2

export HIDE_LAYER=$layer
unshare -m --propagation private bash -c '
  set -e
  for top in usr etc; do
    mount -t overlay overlay -o "lowerdir=/$top,upperdir=$HIDE_LAYER/$top/up,workdir=$HIDE_LAYER/$top/work" "/$top"
  done
  exec "$@"' hide "$@"
