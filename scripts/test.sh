#!/usr/bin/env bash
# The whole test suite: installs what is missing (scripts/setup.sh), builds (scripts/build.sh), runs
# every ctest test (GoogleTest, multi-rank MPI tests, the package and CLI tests), then the Python
# tests when there are any. Prints a summary and exits non-zero if anything failed.
# Environment: ZERO8_BUILD_DIR (default build/), ZERO8_CTEST_JOBS (default 2), ZERO8_CTEST_ARGS;
# ZERO8_TEST_SANITIZE=0 skips the sanitizer/fuzz builds, ZERO8_TEST_CUDASIM=0 the CUDA simulator's build;
# ZERO8_PYTEST_WORKERS (default: the cores, at most 4; 1: serial) the Python tests' workers.
# The ASan+UBSan build is a clang build running every ctest test, so the plain clang build runs only
# without it (ZERO8_TEST_CLANG=1 forces it, 0 skips it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${ZERO8_BUILD_DIR:-$root/build}"
export ZERO8_BUILD_DIR="$build_dir"

# OpenMPI refuses to start as root unless told, and by default allows only one rank per core; the
# multi-rank tests run 2-4 ranks on this 2-core machine, as root in CI.
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=1

t0=$(date +%s)
bash "$root/scripts/setup.sh" || { echo "test: FAILED: setup (scripts/setup.sh)" >&2; exit 1; }
bash "$root/scripts/build.sh" || { echo "test: FAILED: build (scripts/build.sh)" >&2; exit 1; }
t_build=$(( $(date +%s) - t0 ))

# --- C++ (ctest) ---
ctest_log="$build_dir/ctest.log"
ctest_rc=0
t1=$(date +%s)
# shellcheck disable=SC2086  # ZERO8_CTEST_ARGS is a space-separated list of ctest arguments
ctest --test-dir "$build_dir" --output-on-failure -j "${ZERO8_CTEST_JOBS:-2}" ${ZERO8_CTEST_ARGS:-} \
  2>&1 | tee "$ctest_log" || ctest_rc=$?  # pipefail: ctest's exit status
t_ctest=$(( $(date +%s) - t1 ))

# ctest_counts LOG: "passed failed total skipped" from a ctest log, or nothing when it has no summary
# ("97% tests passed, 1 tests failed out of 40"). ctest counts a skipped test (GTEST_SKIP: no GPU) as
# not failed; it is reported apart.
ctest_counts() {
  local line failed total skipped
  line=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$1" | tail -1 || true)
  [[ -n "$line" ]] || return 0
  failed=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$line")
  total=$(sed -E 's/.* failed out of ([0-9]+).*/\1/' <<<"$line")
  skipped=$(grep -cE 'Test +#[0-9]+: .*\*\*\*Skipped' "$1" || true)
  echo "$(( total - failed - skipped )) $failed $total $skipped"
}
# ctest_stage LOG CTEST_ARGS...: ctest into LOG, only failures printed; sets stage_rc (0: all passed) and
# stage_note ("P passed, F failed of T (S skipped)").
ctest_stage() {
  local log=$1 counts p f t k
  shift
  stage_rc=0
  ctest "$@" --output-on-failure -j "${ZERO8_CTEST_JOBS:-2}" >"$log" 2>&1 || stage_rc=$?
  counts=$(ctest_counts "$log")
  if [[ -n "$counts" ]]; then
    read -r p f t k <<<"$counts"
    stage_note="$p passed, $f failed of $t ($k skipped)"
    ((f == 0)) || stage_rc=1
  else
    stage_rc=1 stage_note="ctest printed no summary (see $log)"
  fi
  if ((stage_rc != 0)); then
    grep -E 'Test +#[0-9]+: .*\*\*\*(Failed|Exception|Timeout)' "$log" >&2 || true
    echo "test: the test output: $log" >&2
  fi
}

counts=$(ctest_counts "$ctest_log")
if [[ -n "$counts" ]]; then
  read -r ctest_passed ctest_failed ctest_total ctest_skipped <<<"$counts"
else
  ctest_passed=0 ctest_failed=0 ctest_total=0 ctest_skipped=0
  if grep -q 'No tests were found' "$ctest_log"; then
    echo "test: ctest found no tests" >&2
  fi
  ctest_rc=1
fi

# --- C++ again, built by clang (when the ASan build below does not run; ZERO8_TEST_CLANG=1|0) ---
# The library is built and tested with g++ above; this checks that it also builds and passes with clang
# (Debian's clang 14, OpenMP through libomp), as C++ users may build it. Only failures are printed (the
# whole log is in the build directory). CUDA is left out here: the g++ build compiles every .cu file.
clang_default=$([[ "${ZERO8_TEST_SANITIZE:-1}" != 0 ]] && echo 0 || echo 1)
clang_note="skipped (ZERO8_TEST_CLANG=0)" clang_rc=0
[[ $clang_default == 0 && -z "${ZERO8_TEST_CLANG:-}" ]] && clang_note="as the ASan+UBSan build below (ZERO8_TEST_CLANG=1 adds a plain one)"
if [[ "${ZERO8_TEST_CLANG:-$clang_default}" != 0 ]]; then
  clang_dir="$build_dir-clang"
  clang_log="$clang_dir/ctest.log"
  t2=$(date +%s)
  if ! CC=clang CXX=clang++ ZERO8_BUILD_DIR="$clang_dir" bash "$root/scripts/build.sh" -DZERO8_CUDA=OFF; then
    echo "test: FAILED: the clang build (scripts/build.sh into $clang_dir)" >&2
    clang_rc=1 clang_note="build failed"
  else
    # shellcheck disable=SC2086  # as above
    ctest_stage "$clang_log" --test-dir "$clang_dir" ${ZERO8_CTEST_ARGS:-}
    clang_rc=$stage_rc clang_note=$stage_note
  fi
  clang_note="$clang_note, $(( $(date +%s) - t2 )) s"
fi

# --- The CUDA tests on zero8's CUDA simulator (ZERO8_TEST_CUDASIM=0 skips them) ---
# A build with -DZERO8_CUDA=SIM in <build>-cudasim compiles kernels/cuda/*.cu as C++ against tests/cudasim
# and runs every test labelled cuda (ctest -L cuda): the kernels against the CPU reference in both forms,
# the device paths of the communicators (NCCL's calls on 1 to 3 ranks), the sharded optimizer and
# checkpoints, on the CPU. Not a GPU run (tests/cudasim/README.md says what it shows and what it cannot).
# At -O1: a build for correctness (the kernels are compared with the CPU reference compiled alike, with
# -ffp-contract=off as everywhere), which compiles in less than half the time of -O3 and runs its tests as fast.
sim_note="skipped (ZERO8_TEST_CUDASIM=0)" sim_rc=0
if [[ "${ZERO8_TEST_CUDASIM:-1}" != 0 ]]; then
  sim_dir="$build_dir-cudasim"
  sim_log="$sim_dir/ctest.log"
  t4=$(date +%s)
  if ! { cmake -S "$root" -B "$sim_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO8_CUDA=SIM \
           -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" >"$build_dir/cudasim-build.log" 2>&1 &&
         cmake --build "$sim_dir" --target cuda_tests --parallel "${ZERO8_JOBS:-$(nproc 2>/dev/null || echo 2)}" \
           >>"$build_dir/cudasim-build.log" 2>&1; }; then
    tail -30 "$build_dir/cudasim-build.log" >&2
    echo "test: FAILED: the CUDA simulator build (log: $build_dir/cudasim-build.log)" >&2
    sim_rc=1 sim_note="build failed"
  else
    ctest_stage "$sim_log" --test-dir "$sim_dir" -L cuda
    sim_rc=$stage_rc sim_note=$stage_note
  fi
  sim_note="$sim_note, $(( $(date +%s) - t4 )) s"
fi

# --- C++ under sanitizers, and fuzzing (ZERO8_TEST_SANITIZE=0 skips them) ---
# scripts/sanitize.sh: ASan+UBSan over every ctest test and the fuzz corpora, TSan over the threaded
# communicator tests, then each fuzz target for ZERO8_FUZZ_SECONDS (10 here, sanitize.sh's own default 20:
# the corpora are replayed under ASan anyway, and CI on 2 cores runs near its 45 minutes); clang builds
# without CUDA in <build>-asan and <build>-tsan. Only failures are printed here (logs in those directories).
san_lines=("skipped (ZERO8_TEST_SANITIZE=0)") san_rc=0
if [[ "${ZERO8_TEST_SANITIZE:-1}" != 0 ]]; then
  san_summary="$build_dir/sanitize.summary"
  : >"$san_summary"
  t3=$(date +%s)
  ZERO8_FUZZ_SECONDS="${ZERO8_FUZZ_SECONDS:-10}" ZERO8_SANITIZE_SUMMARY="$san_summary" \
    bash "$root/scripts/sanitize.sh" >/dev/null || san_rc=$?
  mapfile -t san_lines <"$san_summary"
  ((${#san_lines[@]} > 0)) || san_lines=("scripts/sanitize.sh printed no summary (exit $san_rc)")
  san_lines+=("all parts: $(( $(date +%s) - t3 )) s")
fi

# --- Python ---
py_passed=0 py_failed=0 py_skipped=0 py_rc=0 py_note="no Python tests yet"
shopt -s nullglob
py_tests=("$root"/tests/python/test_*.py)
shopt -u nullglob
if ((${#py_tests[@]} > 0)); then
  py_log="$build_dir/pytest.log"
  # The Python tests run against the installed package; python_setup.sh --test (re)installs it with the
  # test extra (pytest, bitsandbytes, deepspeed, transformers, accelerate).
  if [[ -f "$root/scripts/python_setup.sh" ]] && ! bash "$root/scripts/python_setup.sh" --test; then
    echo "test: scripts/python_setup.sh failed: the Python tests cannot run" >&2
    py_rc=1 py_failed=${#py_tests[@]} py_note="python_setup.sh failed"
  elif ! python3 -c 'import pytest' >/dev/null 2>&1; then
    echo "test: tests/python has tests but pytest is not installed (python3 -m pip install pytest)" >&2
    py_rc=1 py_failed=${#py_tests[@]} py_note="pytest missing"
  else
    # Whole files on ZERO8_PYTEST_WORKERS workers (pytest-xdist; default: the cores, at most 4): a file's
    # tests share its module fixtures (some train a model first) and run in order on one worker, as alone.
    # Files in collection order, where conftest.py puts the slow ones first (xdist's own order, most tests
    # first, left the longest files to run alone at the end).
    workers="${ZERO8_PYTEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}"
    ((workers <= 4)) || workers=4
    xdist=()
    if ((workers > 1)) && python3 -c 'import xdist' >/dev/null 2>&1; then
      xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
    fi
    python3 -m pytest -q "${xdist[@]}" "$root/tests/python" 2>&1 | tee "$py_log" || py_rc=$?
    # pytest's closing line, e.g. "1 failed, 116 passed, 2 skipped in 5.19s"
    py_line=$(grep -E '[0-9]+ (passed|failed|errors?|skipped).* in [0-9.]+s' "$py_log" | tail -1 || true)
    py_passed=$( (grep -oE '[0-9]+ passed' <<<"$py_line" || true) | grep -oE '[0-9]+' || echo 0)
    py_failed=$( (grep -oE '[0-9]+ (failed|errors?)' <<<"$py_line" || true) | awk '{s += $1} END {print s + 0}')
    py_skipped=$( (grep -oE '[0-9]+ skipped' <<<"$py_line" || true) | grep -oE '[0-9]+' || echo 0)
    py_note="pytest exit $py_rc, $( ((${#xdist[@]} > 0)) && echo "$workers workers" || echo serial)"
    if ((py_rc == 5)); then py_rc=1; py_note="pytest collected no tests"; fi
  fi
fi

t_total=$(( $(date +%s) - t0 ))
echo
echo "================ zero8 test summary ================"
echo "setup+build: ${t_build} s; ctest: ${t_ctest} s; total: ${t_total} s"
echo "C++ (ctest): ${ctest_passed} passed, ${ctest_failed} failed of ${ctest_total} (${ctest_skipped} skipped)"
echo "C++ (clang): ${clang_note}"
echo "CUDA (sim):  ${sim_note}"
for line in "${san_lines[@]}"; do echo "Sanitizers:  $line"; done
echo "Python:      ${py_passed} passed, ${py_failed} failed, ${py_skipped} skipped (${py_note})"
echo "===================================================="
status=0
if ((ctest_rc != 0 || ctest_failed != 0)); then status=1; fi
if ((py_rc != 0 || py_failed != 0)); then status=1; fi
if ((clang_rc != 0)); then status=1; fi
if ((sim_rc != 0)); then status=1; fi
if ((san_rc != 0)); then status=1; fi
echo "total: $(( ctest_passed + py_passed )) passed, $(( ctest_failed + py_failed )) failed, $(( ctest_skipped + py_skipped )) skipped"
if ((status != 0)); then echo "test: FAILED" >&2; fi
exit $status
