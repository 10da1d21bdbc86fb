#!/usr/bin/env bash
# The one-command GPU check: builds zero8 with CUDA for this machine's GPU, runs the CUDA tests (ctest -L cuda,
# pytest -m cuda), the GPU benchmarks and a 200-step single-GPU pretraining run, and writes report.md and
# report.json. Made for a lent GPU machine without network or registry: what the build needs beyond the
# CUDA toolkit, python3 and torch travels as Debian packages prepared beforehand with --prepare.
#
#   bash scripts/gpu_check.sh --prepare .gpu-deps        # here (Debian 12 with apt): fetch the .debs
#   bash scripts/gpu_check.sh --deps .gpu-deps --out DIR  # there: the full check (about 8 min on an H200)
#   bash scripts/gpu_check.sh --quick ...                 # build + tests only
#
# Every stage runs under a time limit inside an overall deadline; a failed stage is recorded and the
# next one still runs, and the report is rewritten after every stage, so it exists whatever happens.
# docs/BENCHMARKS.md ("GPU check") describes the report and the targets.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPORT_PY="$ROOT/scripts/gpu_check_report.py"

# The Debian 12 packages the GPU machine lacks (its image: Ubuntu 24.04 with the CUDA toolkit, python3 and
# torch). Build: GoogleTest/GoogleMock, nlohmann-json and xxHash (headers, static libraries, CMake files),
# OpenMPI (mpicc's wrapper data for CMake's FindMPI, mpirun for the multi-rank tests). Then the shared
# libraries OpenMPI and its components load that a bare Ubuntu 24.04 does not have; --prepare checks that
# every library any shipped binary needs is shipped or in BASE_SONAMES. Left out on purpose: hwloc's
# plugins (optional, X11/OpenCL deps), ssh (mpirun starts local ranks itself), the -dev packages of
# OpenMPI's dependencies (FindMPI links -lmpi only) and oneDNN (the check configures ZERO8_DNNL=OFF).
GPU_DEPS_PACKAGES=(
  libgtest-dev libgmock-dev nlohmann-json3-dev libxxhash-dev
  libopenmpi-dev libopenmpi3 openmpi-bin openmpi-common
  libevent-core-2.1-7 libevent-pthreads-2.1-7 libhwloc15 libpmix2 libmunge2 libudev1
  libfabric1 libucx0 libibverbs1 ibverbs-providers librdmacm1 libpsm2-2 libpsm-infinipath1
  libnuma1 libnl-3-200 libnl-route-3-200 libatomic1 libuuid1
)
# Libraries every glibc system with a C++ compiler has; nothing else may be assumed on the GPU machine.
BASE_SONAMES="libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 ld-linux-x86-64.so.2 libstdc++.so.6
libgcc_s.so.1 libz.so.1"
# Libraries of the OpenMPI build itself: always the shipped ones (their components must match them).
OWN_LIB_RE='^lib(mpi|open-rte|open-pal|oshmem|mca_common_|ompitrace|pmix)'

usage() {
  cat <<'EOF'
usage: scripts/gpu_check.sh --prepare DIR
       scripts/gpu_check.sh [--quick] [--deps DIR] [--out DIR] [--work DIR] [--no-gpu-ok]
                            [--cuda-arch A] [--budget SECONDS] [--jobs N] [--stop-after STAGE]

  --prepare DIR   on a Debian 12 machine with apt: download the .deb files the GPU machine lacks into DIR
                  (about 10 MB; the repository's .gpu-deps/ is git-ignored for this) and check them.
  --deps DIR      the prepared DIR: unpacked into the work directory (never into /), and CMake, the
                  compilers and mpirun pointed at it. Without it the system's packages are used.
  --quick         build and CUDA tests only (no benchmarks, no pretraining run).
  --out DIR       where report.md, report.json and the logs go (at most 8 files; default out/gpu_check).
  --work DIR      build trees, unpacked packages, results (default: a new directory under $TMPDIR).
                  Reusing one makes a second run incremental.
  --no-gpu-ok     without a GPU, run the same pipeline anyway (the CUDA tests skip, no figures) instead
                  of stopping; the report says that no GPU was present.
  --cuda-arch A   CMAKE_CUDA_ARCHITECTURES (default: the GPU's compute capability, 90 without a GPU).
  --budget S      overall deadline in seconds (default 560: the report is written before a 10-minute
                  limit); each stage's time limit is cut to what is left, and a larger budget stretches
                  the stages' own limits in proportion (for slower machines).
  --jobs N        build parallelism (default: nproc).
  --stop-after S  stop after the stage deps, configure or build (CI checks the packaging half this way).

Environment: PYTHON (default python3, the interpreter with torch), ZERO8_COMMIT (the commit to report, for
a copied working tree; without it, the tree's .git says).
Exit status: 0 all stages passed, 1 a stage failed, 2 bad arguments or no GPU (without --no-gpu-ok).
EOF
}

die_usage() {
  echo "gpu_check: $*" >&2
  echo "run scripts/gpu_check.sh --help for the options" >&2
  exit 2
}

# ---------------------------------------------------------------------------------------------------
# --prepare: download the .debs and prove that they are complete

# elf_needed FILE / elf_soname FILE: dynamic section entries (readelf, binutils).
elf_needed() { readelf -d "$1" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
elf_soname() { readelf -d "$1" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p'; }
is_elf() { [[ -f "$1" && ! -L "$1" ]] && [[ "$(head -c 4 "$1" 2>/dev/null | od -An -c | tr -d ' ')" == '177ELF' ]]; }

# deb_extract DEB DEST: dpkg-deb where there is one, else ar + tar (a .deb is an ar archive).
deb_extract() {
  if command -v dpkg-deb >/dev/null 2>&1; then
    dpkg-deb -x "$1" "$2"
    return
  fi
  local member
  member=$(ar t "$1" | grep '^data\.tar') || return 1
  case "$member" in
    *.xz) ar p "$1" "$member" | tar -xJ -C "$2" ;;
    *.zst) ar p "$1" "$member" | zstd -dc | tar -x -C "$2" ;;
    *.gz) ar p "$1" "$member" | tar -xz -C "$2" ;;
    *) ar p "$1" "$member" | tar -x -C "$2" ;;
  esac
}

# check_closure PREFIX: every NEEDED library of every ELF file under PREFIX is shipped or in BASE_SONAMES.
# Prints the highest GLIBC_ symbol version required, for the manifest.
check_closure() {
  local prefix=$1 f so missing=0 shipped
  shipped=$(find "$prefix" \( -type f -o -type l \) -name '*.so*' -printf '%f\n'
            find "$prefix" -type f -name '*.so*' -print0 | xargs -0 -n 64 readelf -d 2>/dev/null |
              sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
  shipped=$(sort -u <<<"$shipped")
  while IFS= read -r -d '' f; do
    is_elf "$f" || continue
    for so in $(elf_needed "$f"); do
      grep -qxF "$so" <<<"$shipped" && continue
      grep -qw -- "$so" <<<"$BASE_SONAMES" && continue
      echo "gpu_check: --prepare: ${f#"$prefix"} needs $so, which is neither shipped nor a base library" >&2
      missing=1
    done
  done < <(find "$prefix" -type f -print0)
  ((missing == 0)) || return 1
  # (readelf fails on the non-ELF files among them, which is fine here)
  { find "$prefix" -type f -name '*.so*' -print0 -o -type f -path '*/bin/*' -print0 |
      xargs -0 readelf -V 2>/dev/null | grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2,2n -u | tail -1; } || true
}

prepare() {
  local dir=$1 tmp
  command -v apt-get >/dev/null 2>&1 || { echo "gpu_check: --prepare needs apt-get (Debian 12)" >&2; return 1; }
  mkdir -p "$dir" || return 1
  dir=$(cd "$dir" && pwd)
  tmp=$(mktemp -d) || return 1
  # shellcheck disable=SC2064  # expand now: tmp is local
  trap "rm -rf '$tmp'" RETURN
  local sandbox=()
  [[ $(id -u) -eq 0 ]] && sandbox=(-o APT::Sandbox::User=root)  # root's temp dir is not _apt's to write
  echo "gpu_check: downloading ${#GPU_DEPS_PACKAGES[@]} Debian packages into $dir"
  if ! (cd "$tmp" && apt-get "${sandbox[@]}" -q download "${GPU_DEPS_PACKAGES[@]}"); then
    echo "gpu_check: apt-get download failed; updating the package lists once and retrying"
    apt-get -q update && (cd "$tmp" && apt-get "${sandbox[@]}" -q download "${GPU_DEPS_PACKAGES[@]}") || return 1
  fi
  mkdir -p "$tmp/root"
  local deb
  for deb in "$tmp"/*.deb; do deb_extract "$deb" "$tmp/root" || { echo "gpu_check: cannot unpack $deb" >&2; return 1; }; done
  local glibc
  glibc=$(check_closure "$tmp/root") || { echo "gpu_check: --prepare: the package set is incomplete (above)" >&2; return 1; }
  rm -f "$dir"/*.deb
  mv "$tmp"/*.deb "$dir"/
  {
    echo "# zero8 GPU check dependencies: Debian packages for scripts/gpu_check.sh --deps (see its header)"
    echo "debian=$(. /etc/os-release && echo "$PRETTY_NAME")"
    echo "prepared_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "prepared_commit=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "needs_glibc=${glibc:-unknown}"
    for deb in "$dir"/*.deb; do
      echo "deb=$(basename "$deb") $(sha256sum "$deb" | cut -d' ' -f1)"
    done
  } >"$dir/manifest.txt"
  echo "gpu_check: $(find "$dir" -name '*.deb' | wc -l) packages, $(du -sh "$dir" | cut -f1) in $dir; needs ${glibc:-?} or newer"
}

# ---------------------------------------------------------------------------------------------------
# Stages: each runs in its own bash under `timeout`, with its own log; the record goes to stages.jsonl.

env_set() { printf '%s=%s\n' "$1" "$(tr '\n' ' ' <<<"$2" | sed 's/ *$//')" >>"$ENVF"; }
json_str() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; printf '"%s"' "$(printf '%s' "$s" | tr '\n\t' '  ')"; }

record() {  # record NAME STATUS RC SECONDS NOTE
  printf '{"name": %s, "status": %s, "rc": %s, "seconds": %s, "log": %s, "note": %s}\n' "$(json_str "$1")" \
    "$(json_str "$2")" "$3" "$4" "$(json_str "logs/$1.log")" "$(json_str "$5")" >>"$STAGES"
}

write_report() {
  if ! "$PY" "$REPORT_PY" --work "$WORK" --out "$OUT_DIR" >>"$WORK/logs/report.log" 2>&1; then
    # The generator failed (no python3?): a plain table, so that there is still a report.
    {
      echo "# zero8 GPU check (report generator failed: see report.log)"
      echo
      sed 's/^/    /' "$ENVF"
      echo
      sed 's/^/    /' "$STAGES"
    } >"$OUT_DIR/report.md"
    cp "$WORK/logs/report.log" "$OUT_DIR/report.log" 2>/dev/null
  fi
}

# run_stage NAME MAX_SECONDS FUNCTION: FUNCTION (exported) runs in a new bash, its output in logs/NAME.log.
# The limit is MAX_SECONDS or what the deadline leaves (minus time to write the report).
run_stage() {
  local name=$1 max=$2 fn=$3 now left limit start rc status note=""
  # A budget above the default stretches every stage's own limit alike (a slower machine, e.g. 2 cores).
  ((BUDGET > 560)) && max=$((max * BUDGET / 560))
  now=$(date +%s)
  left=$((DEADLINE - now - 20))
  limit=$((max < left ? max : left))
  local log="$WORK/logs/$name.log"
  if ((limit < 10)); then
    echo "== $name: skipped, the deadline (--budget $BUDGET s) is reached" | tee "$log"
    record "$name" skipped 0 0 "not run: the overall deadline (--budget $BUDGET s) was reached"
    return 1
  fi
  echo "== $name (limit ${limit} s) ..."
  start=$(date +%s)
  timeout -k 10 "$limit" bash -c "$fn" >"$log" 2>&1 </dev/null
  rc=$?
  local secs=$(($(date +%s) - start))
  if ((rc == 0)); then
    status=ok
  elif ((rc == 124 || rc == 137)); then
    status=timeout note="stopped after its limit of ${limit} s"
  else
    status=failed
  fi
  # A stage that found nothing it could run says so (stage_skip) and is recorded as skipped.
  if ((rc == 0)) && [[ -e "$WORK/results/$name.skip" ]]; then
    status=skipped
  fi
  # A stage may leave a one-line note for the report (e.g. why it failed, or what it skipped).
  if [[ -s "$WORK/results/$name.note" ]]; then
    note="${note:+$note; }$(head -c 600 "$WORK/results/$name.note")"
  fi
  record "$name" "$status" "$rc" "$secs" "$note"
  echo "== $name: $status (${secs} s${note:+; $note})"
  [[ $status == ok ]]
}

# The last report, and the exit status: 1 when a stage failed or timed out.
finish() {
  env_set total_seconds "$(($(date +%s) - T0))"
  write_report
  echo "gpu_check: done in $(($(date +%s) - T0)) s${STOP_AFTER:+ (stopped after $STOP_AFTER)}: $OUT_DIR/report.md"
  grep -q '"status": "\(failed\|timeout\)"' "$STAGES" && exit 1
  exit 0
}

skip_stage() {  # skip_stage NAME WHY
  echo "== $1: skipped ($2)" | tee "$WORK/logs/$1.log"
  record "$1" skipped 0 0 "$2"
}

# ---------------------------------------------------------------------------------------------------
# What is there

gpu_query() {
  command -v nvidia-smi >/dev/null 2>&1 || { echo "nvidia-smi not found"; return 1; }
  local q
  q=$(nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,compute_mode --format=csv,noheader 2>&1) ||
    { echo "nvidia-smi failed: $(head -c 300 <<<"$q")"; return 1; }
  [[ -n "$q" ]] || { echo "nvidia-smi lists no GPU"; return 1; }
  echo "$q"
}

# ---------------------------------------------------------------------------------------------------
# Stage functions (each runs in its own bash; `note` leaves a line for the report)

note() { echo "$*" >>"$WORK/results/${STAGE:?}.note"; echo "note: $*"; }
# stage_skip WHY: the stage could not run what it is for (it then returns 0): recorded as skipped, with WHY.
stage_skip() { note "$*"; : >"$WORK/results/${STAGE:?}.skip"; }
export -f note stage_skip

st_deps() {
  set -uo pipefail
  export STAGE=deps
  local p=$DEPS_ROOT lib=$DEPS_ROOT/usr/lib/x86_64-linux-gnu
  rm -rf "$p" && mkdir -p "$p" || return 1
  local deb n=0
  for deb in "$DEPS_DIR"/*.deb; do
    deb_extract "$deb" "$p" || { note "cannot unpack $(basename "$deb")"; return 1; }
    n=$((n + 1))
  done
  echo "unpacked $n packages into $p"
  # Some packages still install into /lib (libnl); on a merged /usr that is /usr/lib, and so it is here.
  local top
  for top in lib bin sbin; do
    if [[ -d "$p/$top" && ! -L "$p/$top" ]]; then
      mkdir -p "$p/usr/$top" && cp -a "$p/$top/." "$p/usr/$top/" && rm -rf "${p:?}/$top" || return 1
    fi
  done
  # Debian's alternatives (not in the packages): the MPI command names the build and the tests use.
  local b
  for b in mpicc mpicxx mpiCC mpic++; do ln -sf opal_wrapper "$p/usr/bin/$b"; done
  for b in mpirun mpiexec; do ln -sf orterun "$p/usr/bin/$b"; done
  # Libraries installed outside the library directory and linked into it by alternatives (libpsm_infinipath).
  local f so
  while IFS= read -r -d '' f; do
    so=$(elf_soname "$f")
    [[ -n "$so" && ! -e "$lib/$so" && ! -e "$(dirname "$f")/$so" ]] && ln -s "$f" "$lib/$so"
  done < <(find "$p/usr/lib" -mindepth 2 -maxdepth 2 -type f -name 'lib*.so.*' -print0)
  # Leaf libraries this system already has are dropped: its own builds suit its other programs better,
  # and the same soname promises the same interface. OpenMPI's own libraries always stay (their
  # components must match them exactly).
  local sys pruned=""
  for f in "$lib"/*.so.*; do
    [[ -e "$f" && ! -L "$f" ]] || continue
    so=$(elf_soname "$f")
    [[ -n "$so" ]] || continue
    [[ "$so" =~ $OWN_LIB_RE ]] && continue
    sys=$(ldconfig -p 2>/dev/null | awk -v s="$so" '$1 == s {print $NF}' | while read -r c; do [[ -e "$c" ]] && echo "$c"; done | head -1)
    if [[ -n "$sys" ]]; then
      rm -f "$lib/$so" "$f"
      pruned+=" $so"
    fi
  done
  echo "system copies used instead of the shipped ones:${pruned:- none}"
  # The shipped binaries were built against Debian 12's glibc; say so plainly if this one is older.
  local need have
  need=$(sed -n 's/^needs_glibc=GLIBC_//p' "$DEPS_DIR/manifest.txt" 2>/dev/null)
  have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
  if [[ -n "$need" && -n "$have" ]] && [[ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]]; then
    note "the packages need glibc $need, this system has $have"
    return 1
  fi
  # Relocation: OpenMPI finds its components, help files and config (/etc/openmpi, which sets the
  # transports Debian excludes) under OPAL_DESTDIR; PMIx likewise under PMIX_DESTDIR, and its plugins by
  # path, since PMIx 4 searches its built-in plugin folder first and the shipped pmix-mca-params.conf names
  # it again: a machine with its own PMIx has other plugins there, built for another PMIx (on the first
  # GPU machine they failed to load, "undefined symbol pmix_output_info", and ranks under mpirun crashed in
  # MPI_Init). hwloc loads no plugins from the system (they would not match this hwloc).
  cat >"$DEPS_ENV" <<EOF
export PATH="$p/usr/bin:\$PATH"
export LD_LIBRARY_PATH="$lib:$lib/openmpi/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export CMAKE_PREFIX_PATH="$p/usr\${CMAKE_PREFIX_PATH:+:\$CMAKE_PREFIX_PATH}"
export OPAL_DESTDIR="$p"
export PMIX_DESTDIR="$p"
export PMIX_MCA_mca_base_component_path="$lib/pmix2/lib/pmix"
export HWLOC_PLUGINS_PATH="$p/hwloc-plugins-none"
EOF
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  echo "--- mpirun --version"
  mpirun --version || { note "the unpacked mpirun does not run"; return 1; }
  echo "--- mpicc -showme"
  mpicc -showme || { note "the unpacked mpicc wrapper does not run"; return 1; }
  mpicc -showme | grep -q -- "-I$p/" || { note "mpicc -showme does not point into $p (relocation failed)"; return 1; }
  echo "--- mpirun -np 2 (ranks started, PMIx and the components found)"
  mpirun -np 2 --oversubscribe printenv OMPI_COMM_WORLD_RANK || { note "the unpacked mpirun cannot start 2 ranks"; return 1; }
}

# find_nccl: "INCLUDE_DIR LIBRARY" of an NCCL: first the nvidia-nccl wheel torch loads, then the system's or
# the CUDA toolkit's. The same library as torch's matters: whichever of torch and zero8 is imported first
# loads libnccl.so.2 for both, and torch fails on an older one (undefined symbol ncclCommResume, seen here).
find_nccl() {
  local roots=() r inc lib wheel
  # (nvidia.nccl may be a namespace package: no __file__, its folder in __path__)
  wheel=$("$PY" -c 'import nvidia.nccl as m, os; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])' 2>/dev/null) &&
    roots+=("$wheel")
  roots+=(/usr /usr/local/cuda)
  for r in "${roots[@]}"; do
    inc=$(find "$r/include" -maxdepth 1 -name nccl.h 2>/dev/null | head -1)
    lib=$(find "$r/lib" "$r/lib64" "$r/lib/x86_64-linux-gnu" -maxdepth 1 -name 'libnccl.so*' 2>/dev/null | sort | head -1)
    if [[ -n "$inc" && -n "$lib" ]]; then
      echo "$(dirname "$inc") $lib"
      return 0
    fi
  done
  return 1
}
export -f find_nccl

# The CMake definitions shared by the C++ build and the Python extension's build.
cmake_defs() {
  echo "-DCMAKE_BUILD_TYPE=Release -DZERO8_CUDA=ON -DZERO8_DNNL=OFF -DZERO8_MPI=${1:-ON}"
  echo "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH${NVCC:+ -DCMAKE_CUDA_COMPILER=$NVCC}"
  local nccl
  if [[ "${1:-ON}" == ON ]] && nccl=$(find_nccl); then
    echo "-DZERO8_NCCL=ON -DNCCL_INCLUDE_DIR=${nccl% *} -DNCCL_LIBRARY=${nccl#* }"
  else
    echo "-DZERO8_NCCL=OFF"
  fi
}
export -f cmake_defs

st_configure() {
  set -uo pipefail
  export STAGE=configure
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  local nccl
  nccl=$(find_nccl) && echo "NCCL: $nccl" || note "no NCCL found (system, CUDA toolkit, pip wheel): the NCCL backend is not built"
  # shellcheck disable=SC2046  # cmake_defs prints whitespace-separated arguments (paths without spaces)
  cmake -S "$ROOT" -B "$BUILD" -G Ninja $(cmake_defs ON) && return 0
  # MPI is what most often fails on a foreign machine: without it the single-process CUDA tests still run.
  note "configure failed with MPI; configured again without MPI and NCCL (the multi-rank CUDA tests are not built)"
  rm -f "$BUILD/CMakeCache.txt"
  # shellcheck disable=SC2046
  cmake -S "$ROOT" -B "$BUILD" -G Ninja $(cmake_defs OFF)
  return 1
}

st_build() {
  set -uo pipefail
  export STAGE=build
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  # cuda_tests: every executable holding tests labelled cuda (tests/CMakeLists.txt); zero8-bench: the
  # CUDA benchmarks.
  local targets=(cuda_tests)
  [[ $MODE == full ]] && targets+=(zero8-bench)
  ninja -C "$BUILD" -j "$JOBS" "${targets[@]}"
}

st_python_build() {
  set -uo pipefail
  export STAGE=python_build
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  # Installed into a directory of its own (on PYTHONPATH), not into the interpreter's environment; no
  # dependency is installed or downloaded (scripts/constraints.txt's torch pin is not honoured here: the
  # machine's torch is what is tested, and the report names it).
  local defs=() d
  for d in $(cmake_defs ON); do defs+=(-C "cmake.define.${d#-D}"); done
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$PY" -m pip install --no-build-isolation --no-deps --no-index --upgrade \
    --target "$SITE" -C "build-dir=$PYBUILD" "${defs[@]}" "$ROOT" || return 1
  PYTHONPATH="$SITE" "$PY" -c 'import zero8, sys; i = zero8.build_info(); print("zero8", zero8.__version__, i); sys.exit(0 if i["cuda"] else 3)' ||
    { note "the installed zero8 was built without CUDA"; return 1; }
}

st_ctest() {
  set -uo pipefail
  export STAGE=ctest_cuda
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  [[ -f "$BUILD/CTestTestfile.cmake" ]] || { note "no build tree"; return 1; }
  local n
  n=$(ctest --test-dir "$BUILD" -N -L cuda | sed -n 's/^Total Tests: //p')
  ((${n:-0} > 0)) || { note "no ctest test carries the label cuda"; return 1; }
  # Whole outputs in the JUnit file: the report lists every GoogleTest case, skipped ones with the reason.
  ctest --test-dir "$BUILD" -L cuda --output-on-failure -j 4 --timeout 300 \
    --output-junit "$WORK/results/ctest.xml" --test-output-size-passed 200000 --test-output-size-failed 1000000
}

# cuda_tool NAME: the path of a CUDA toolkit program (compute-sanitizer, ncu) on PATH or beside nvcc; empty
# when there is none.
cuda_tool() {
  local t
  t=$(command -v "$1" || true)
  [[ -z "$t" && -n "$NVCC" && -x "$(dirname "$NVCC")/$1" ]] && t="$(dirname "$NVCC")/$1"
  echo "$t"
}
export -f cuda_tool

# st_sanitize TOOL: the CUDA 8-bit kernels' tests (both forms of each kernel, CudaQuantKernels) and the
# per-block int8 product's (both kernels) under compute-sanitizer's TOOL: memcheck for an access outside a
# buffer or shared memory that the bit comparisons might not show, racecheck for shared-memory hazards
# between threads with no barrier between them (zero8's CUDA simulator switches threads only at barriers,
# shuffles and votes, so it cannot show those inside a warp). Skipped where there is no compute-sanitizer
# or it refuses the device (seen on gVisor machines).
st_sanitize() {
  set -uo pipefail
  local tool=$1
  export STAGE=$tool
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  local cs
  cs=$(cuda_tool compute-sanitizer)
  [[ -n "$cs" ]] || { stage_skip "compute-sanitizer not found"; return 0; }
  local t exe filter out rc
  for t in "test_codec_cuda:CodecCuda.*" "test_optim_cuda:OptimCuda.StepEqualsCpuReferenceBitwise" \
    "test_int8_cuda:Int8CudaKernels.BlockProductEqualsTheReference"; do
    exe=${t%%:*} filter=${t#*:}
    [[ -x "$BUILD/tests/$exe" ]] || { note "$exe was not built"; return 1; }
    echo "\$ compute-sanitizer --tool $tool $exe --gtest_filter=$filter"
    out=$("$cs" --tool "$tool" --error-exitcode 7 "$BUILD/tests/$exe" --gtest_filter="$filter" 2>&1)
    rc=$?
    echo "$out"
    if grep -qi "device not supported" <<<"$out"; then
      stage_skip "compute-sanitizer cannot check this device: $(grep -i -m1 'not supported' <<<"$out" | head -c 200)"
      return 0
    fi
    if grep -q "\[  SKIPPED \]" <<<"$out" && ! grep -q "\[  PASSED  \] [1-9]" <<<"$out"; then
      note "$exe: its tests skipped under compute-sanitizer"
      return 1
    fi
    ((rc == 0)) || { note "$tool: $exe --gtest_filter=$filter: exit $rc ($(grep -m1 'SUMMARY' <<<"$out"))"; return 1; }
  done
}
export -f st_sanitize

# Nsight Compute on the 8-bit kernels' warp form (the step and the codec; the bench's checks against the
# CPU run too): per kernel its DRAM throughput against the device's peak, its achieved occupancy and what
# limits it, so that a run that misses a bandwidth target also says why. Two launches under each
# benchmark command, after two warm-ups; skipped where there is no ncu or it cannot profile this device
# (no access to the performance counters: ERR_NVGPUCTRPERM).
st_profile() {
  set -uo pipefail
  export STAGE=profile
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  local ncu bench="$BUILD/benchmarks/zero8-bench" out rc args
  local refused='ERR_NVGPUCTRPERM\|not supported on this device\|No kernels were profiled'
  ncu=$(cuda_tool ncu)
  [[ -n "$ncu" ]] || { stage_skip "ncu (Nsight Compute) not found"; return 0; }
  [[ -x "$bench" ]] || { note "zero8-bench was not built"; return 1; }
  local kernels='regex:optim_step_warp_kernel|quant_encode_warp_kernel|quant_decode_warp_kernel'
  for args in "optimizer --numel 1e8 --repeat 3" "codec --numel 1e8 --repeat 3"; do
    echo "\$ ncu --kernel-name '$kernels' --launch-skip 2 --launch-count 2 zero8-bench $args --device cuda"
    # shellcheck disable=SC2086  # args is a list of zero8-bench arguments
    out=$("$ncu" --kernel-name "$kernels" --launch-skip 2 --launch-count 2 --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis "$bench" $args --device cuda 2>&1)
    rc=$?
    echo "$out"
    if grep -q "$refused" <<<"$out"; then
      stage_skip "ncu cannot profile here: $(grep -m1 "$refused" <<<"$out" | head -c 200)"
      return 0
    fi
    ((rc == 0)) || { note "ncu zero8-bench $args: exit $rc"; return 1; }
  done
  # The tensor-core per-block int8 product (Int8Linear's exact mode), its first five launches under
  # bench_gpu.py at the target shape (the layers' forwards at blocks 32 and 128, then a layer's three
  # products at block 32: the forward's storage order and both backward ones). Pipe use and warp stalls say
  # whether the CUDA-core scaling, the tensor cores or the memory latency bound it.
  if [[ ! -d "${SITE:-}/zero8" ]]; then
    echo "zero8 is not installed (python_build failed): the int8 product is not profiled"
    return 0
  fi
  echo "\$ ncu --kernel-name regex:block_gemm_tc_kernel --launch-count 5 bench_gpu.py --only linear ..."
  out=$(PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$ncu" --kernel-name regex:block_gemm_tc_kernel \
    --launch-count 5 --section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section MemoryWorkloadAnalysis "$PY" "$ROOT/benchmarks/bench_gpu.py" \
    --only linear --shapes 4096x16384 --tokens 8192 --repeat 1 --warmup 1 2>&1)
  rc=$?
  echo "$out"
  ((rc == 0)) || { note "ncu bench_gpu.py --only linear: exit $rc"; return 1; }
}
export -f st_profile

st_pytest() {
  set -uo pipefail
  export STAGE=pytest_cuda
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  [[ -d "$SITE/zero8" ]] || { note "zero8 is not installed (python_build failed)"; return 1; }
  cd "$ROOT" || return 1
  # Test files side by side where pytest-xdist is there (the GPU image has it): the files that start
  # mpirun jobs (the engine's, the pipeline's) and the in-process ones then share the stage's time.
  local parallel=()
  if "$PY" -c "import xdist" 2>/dev/null; then parallel=(-n 4 --dist loadfile); fi
  # A rank that crashes (the tests start some under mpirun) prints its Python stack to its stderr.
  export PYTHONFAULTHANDLER=1
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest tests/python -m cuda -q -rs -p no:cacheprovider \
    "${parallel[@]}" --continue-on-collection-errors --junitxml="$WORK/results/pytest.xml"
  local rc=$?
  ((rc == 5)) && note "no test is marked cuda"
  return $rc
}

# st_bench_cpp STAGE ARGS...: zero8-bench ARGS on the device; its JSON line goes to results/STAGE.json.
st_bench_cpp() {
  set -uo pipefail
  export STAGE=$1
  shift
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  local bench="$BUILD/benchmarks/zero8-bench"
  [[ -x "$bench" ]] || { note "zero8-bench was not built"; return 1; }
  "$bench" "$@" --device cuda | tee "$WORK/results/$STAGE.out"
  local rc=${PIPESTATUS[0]}
  tail -1 "$WORK/results/$STAGE.out" | grep '^{' >"$WORK/results/$STAGE.json"
  return "$rc"
}
export -f st_bench_cpp

st_bench_python() {
  set -uo pipefail
  export STAGE=bench_python
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  [[ -d "$SITE/zero8" ]] || { note "zero8 is not installed (python_build failed)"; return 1; }
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$ROOT/benchmarks/bench_gpu.py" --max-seconds 150 \
    --json-out "$WORK/results/bench_python.json"
}

st_example() {
  set -uo pipefail
  export STAGE=example
  # shellcheck disable=SC1090
  source "$DEPS_ENV"
  [[ -d "$SITE/zero8" ]] || { note "zero8 is not installed (python_build failed)"; return 1; }
  cd "$ROOT" || return 1
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" examples/pretrain_gpt.py --device cuda --steps 200 \
    --config examples/configs/gpt_zero8_stage2.json --out_dir "$WORK/example" --save_interval 0 \
    --no_progress --no_plot
}
export -f st_deps st_configure st_build st_python_build st_ctest st_pytest st_bench_python st_example

# ---------------------------------------------------------------------------------------------------
# Main: the whole body is parsed before it runs, so editing this file during a run cannot derail the run.

main() {
  # Arguments

  MODE=full PREPARE_DIR="" DEPS_DIR="" OUT_DIR="$ROOT/out/gpu_check" WORK="" NO_GPU_OK=0 CUDA_ARCH="" BUDGET=560
  STOP_AFTER=""
  JOBS="$(nproc 2>/dev/null || echo 4)"
  while (($# > 0)); do
    case "$1" in
      -h | --help) usage; exit 0 ;;
      --prepare) [[ $# -ge 2 ]] || die_usage "--prepare needs a directory"; PREPARE_DIR=$2; shift ;;
      --deps) [[ $# -ge 2 ]] || die_usage "--deps needs a directory"; DEPS_DIR=$2; shift ;;
      --out) [[ $# -ge 2 ]] || die_usage "--out needs a directory"; OUT_DIR=$2; shift ;;
      --work) [[ $# -ge 2 ]] || die_usage "--work needs a directory"; WORK=$2; shift ;;
      --cuda-arch) [[ $# -ge 2 ]] || die_usage "--cuda-arch needs a value"; CUDA_ARCH=$2; shift ;;
      --budget)
        [[ $# -ge 2 && $2 =~ ^[0-9]+$ && $2 -ge 60 ]] || die_usage "--budget needs a number of seconds >= 60, got '${2:-}'"
        BUDGET=$2; shift ;;
      --jobs)
        [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || die_usage "--jobs needs a positive integer, got '${2:-}'"
        JOBS=$2; shift ;;
      --quick) MODE=quick ;;
      --stop-after)
        [[ $# -ge 2 && $2 =~ ^(deps|configure|build)$ ]] || die_usage "--stop-after takes deps, configure or build, got '${2:-}'"
        STOP_AFTER=$2; shift ;;
      --no-gpu-ok) NO_GPU_OK=1 ;;
      *) die_usage "unknown argument '$1'" ;;
    esac
    shift
  done

  if [[ -n "$PREPARE_DIR" ]]; then
    prepare "$PREPARE_DIR"
    exit $?
  fi
  if [[ -n "$DEPS_DIR" ]]; then
    [[ -d "$DEPS_DIR" ]] || die_usage "--deps $DEPS_DIR: no such directory (make it with --prepare)"
    compgen -G "$DEPS_DIR/*.deb" >/dev/null || die_usage "--deps $DEPS_DIR holds no .deb files (make it with --prepare)"
    DEPS_DIR=$(cd "$DEPS_DIR" && pwd)
  fi
  [[ -z "$CUDA_ARCH" || "$CUDA_ARCH" =~ ^[0-9]+[a-z]?(\;[0-9]+[a-z]?)*$ ]] ||
    die_usage "--cuda-arch must look like 90 or 80;90, got '$CUDA_ARCH'"

  mkdir -p "$OUT_DIR" || die_usage "cannot create --out $OUT_DIR"
  OUT_DIR=$(cd "$OUT_DIR" && pwd)
  if [[ -z "$WORK" ]]; then
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/zero8-gpu-check.XXXXXX") || die_usage "cannot create a work directory"
  else
    mkdir -p "$WORK" || die_usage "cannot create --work $WORK"
    WORK=$(cd "$WORK" && pwd)
  fi
  # What a previous run in the same work directory recorded is not this run's.
  rm -rf "$WORK/results" "$WORK/logs" "$WORK/example"
  mkdir -p "$WORK/results" "$WORK/logs"
  STAGES="$WORK/results/stages.jsonl"
  ENVF="$WORK/results/env.txt"
  : >"$STAGES"
  : >"$ENVF"
  PY=${PYTHON:-python3}
  T0=$(date +%s)
  DEADLINE=$((T0 + BUDGET))

  HAVE_GPU=0
  if gpu_line=$(gpu_query); then
    HAVE_GPU=1
    gpu_first=$(head -1 <<<"$gpu_line")
    IFS=',' read -r GPU_NAME GPU_DRIVER GPU_CC GPU_MEM GPU_MODE <<<"$gpu_first"
    env_set gpu "${GPU_NAME# }"
    env_set gpu_count "$(wc -l <<<"$gpu_line")"
    env_set driver "${GPU_DRIVER# }"
    env_set compute_capability "${GPU_CC# }"
    env_set gpu_memory "${GPU_MEM# }"
    # The 2-rank tests share the one GPU (MPI staging device buffers): an exclusive compute mode fails them all.
    env_set compute_mode "${GPU_MODE# }"
    [[ "${GPU_MODE# }" == "Default" ]] ||
      echo "gpu_check: compute mode '${GPU_MODE# }': the tests where 2 ranks share the GPU will fail" >&2
    [[ -n "$CUDA_ARCH" ]] || CUDA_ARCH=$(tr -d ' .' <<<"$GPU_CC")
  else
    env_set gpu "none ($gpu_line)"
  fi
  [[ -n "$CUDA_ARCH" ]] || CUDA_ARCH=90  # no GPU: the lent machine's H200, so the same code is compiled
  env_set no_gpu "$((1 - HAVE_GPU))"
  env_set no_gpu_ok "$NO_GPU_OK"
  env_set mode "$MODE"
  env_set cuda_arch "$CUDA_ARCH"
  env_set host "$(hostname 2>/dev/null || echo unknown), $(nproc) cores, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo 2>/dev/null)"
  env_set date "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  # ZERO8_COMMIT first: a copied working tree may carry a .git that is not the tree's (the first GPU run's
  # report named an older commit "+ uncommitted changes").
  if [[ -n "${ZERO8_COMMIT:-}" ]]; then
    commit="$ZERO8_COMMIT (ZERO8_COMMIT)"
  elif commit=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null); then
    [[ -z "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]] || commit+=" + uncommitted changes"
  else
    commit="unknown (no .git here; set ZERO8_COMMIT)"
  fi
  env_set commit "$commit"
  env_set deps "${DEPS_DIR:-system packages}$([[ -f "$DEPS_DIR/manifest.txt" ]] && sed -n 's/^prepared_commit=/, prepared at /p' "$DEPS_DIR/manifest.txt")"
  NVCC=$(command -v nvcc || { [[ -x /usr/local/cuda/bin/nvcc ]] && echo /usr/local/cuda/bin/nvcc; } || true)
  if [[ -n "$NVCC" ]]; then
    env_set nvcc "$("$NVCC" --version 2>/dev/null | grep -i release | sed 's/.*release //') ($NVCC)"
  else
    env_set nvcc "not found"
  fi
  env_set cmake "$(cmake --version 2>/dev/null | head -1 || echo 'not found')"
  env_set cxx "$(c++ --version 2>/dev/null | head -1 || echo 'not found')"
  env_set python "$("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>&1 | tail -1)"
  env_set torch "$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "device available:", torch.cuda.is_available())' 2>&1 | tail -1)"

  if ((HAVE_GPU == 0)); then
    if ((NO_GPU_OK == 0)); then
      echo "gpu_check: no GPU on this machine ($gpu_line); this check needs one." >&2
      echo "gpu_check: --no-gpu-ok runs the same pipeline anyway (build, tests that skip, no figures)." >&2
      record gpu failed 2 0 "no GPU: $gpu_line (run with --no-gpu-ok to build and test without one)"
      write_report
      exit 2
    fi
    echo "gpu_check: no GPU ($gpu_line): running the pipeline without one (--no-gpu-ok); CUDA tests will skip"
  fi

  # NCCL's folder on the loader's path: the Python extension, installed without a run path, links it too.
  local nccl
  if nccl=$(find_nccl); then
    env_set nccl "${nccl#* }"
    LD_LIBRARY_PATH="$(dirname "${nccl#* }")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
  else
    env_set nccl "not found (system, CUDA toolkit, nvidia-nccl wheel): no NCCL backend"
  fi

  # Everything the stage functions read.
  export ROOT WORK PY JOBS CUDA_ARCH DEPS_DIR NVCC MODE HAVE_GPU BASE_SONAMES OWN_LIB_RE
  export BUILD="$WORK/build" PYBUILD="$WORK/pybuild" SITE="$WORK/site" DEPS_ROOT="$WORK/deps"
  export -f elf_needed elf_soname is_elf deb_extract
  # mpirun as root (the lent machine runs commands as root) and several ranks per core, as in scripts/test.sh.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  # Ranks on this machine only, started by mpirun itself: its default launcher first demands ssh or rsh,
  # which the lent machine does not have ("plm_rsh_agent ... could not be found", seen here without them).
  export OMPI_MCA_plm="${OMPI_MCA_plm:-isolated}"
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONUNBUFFERED=1
  # A CMake 4 (pip's) refuses package files written for old CMake versions unless told which policies to use.
  export CMAKE_POLICY_VERSION_MINIMUM="${CMAKE_POLICY_VERSION_MINIMUM:-3.5}"
  if [[ -n "$NVCC" ]]; then PATH="$(dirname "$NVCC"):$PATH"; export PATH; fi

  # The environment the stages after `deps` source: the unpacked prefix on every search path.
  DEPS_ENV="$WORK/results/deps_env.sh"
  export DEPS_ENV
  : >"$DEPS_ENV"

  # The pipeline

  echo "gpu_check: $MODE check of $ROOT; work $WORK; report $OUT_DIR; deadline ${BUDGET} s"
  if ((HAVE_GPU)); then
    record gpu ok 0 0 "$gpu_first"
  else
    record gpu skipped 0 0 "no GPU ($gpu_line): --no-gpu-ok, the CUDA tests skip and nothing is measured"
  fi
  write_report

  if [[ -n "$DEPS_DIR" ]]; then
    run_stage deps 90 st_deps
  else
    skip_stage deps "no --deps: the system's packages are used"
  fi
  [[ $STOP_AFTER == deps ]] && finish
  write_report
  if run_stage configure 180 st_configure; then :; fi
  [[ $STOP_AFTER == configure ]] && finish
  write_report

  # The C++ build and the Python extension's build run side by side (each with -j JOBS).
  run_stage python_build 420 st_python_build &
  py_pid=$!
  run_stage build 420 st_build
  wait "$py_pid"
  [[ $STOP_AFTER == build ]] && finish
  write_report

  run_stage ctest_cuda 300 st_ctest
  write_report
  run_stage pytest_cuda 300 st_pytest
  write_report

  if [[ $MODE == full ]]; then
    if ((HAVE_GPU)); then
      run_stage bench_bandwidth 60 "st_bench_cpp bench_bandwidth bandwidth"
      run_stage bench_codec 60 "st_bench_cpp bench_codec codec"
      # the int8 gradients' wire block (zero8.wire_block_size's default)
      run_stage bench_codec_2048 60 "st_bench_cpp bench_codec_2048 codec --block 2048"
      run_stage bench_optimizer_1e8 90 "st_bench_cpp bench_optimizer_1e8 optimizer --numel 1e8"
      run_stage bench_optimizer_1e9 150 "st_bench_cpp bench_optimizer_1e9 optimizer --numel 1e9"
      write_report
      run_stage bench_python 200 st_bench_python
      write_report
      run_stage profile 150 st_profile
    else
      for s in bench_bandwidth bench_codec bench_codec_2048 bench_optimizer_1e8 bench_optimizer_1e9 bench_python profile; do
        skip_stage "$s" "no GPU: nothing to measure"
      done
    fi
    if ((HAVE_GPU)); then
      run_stage example 200 st_example
    else
      skip_stage example "no GPU: the --device cuda run needs one"
    fi
  fi
  # Last: the figures above are the scarcer result when the deadline is near.
  if ((HAVE_GPU)); then
    run_stage memcheck 90 "st_sanitize memcheck"
    # Not in --quick, whose bound is 4 minutes: racecheck replays every shared-memory access.
    [[ $MODE == full ]] && run_stage racecheck 120 "st_sanitize racecheck"
  else
    skip_stage memcheck "no GPU: nothing to check"
    [[ $MODE == full ]] && skip_stage racecheck "no GPU: nothing to check"
  fi
  finish
}

# Run when executed; sourced (tests/python/test_gpu_check.py), it only defines the functions.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then main "$@"; fi
