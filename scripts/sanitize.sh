#!/usr/bin/env bash
# The C++ library and its tests under sanitizers, and the fuzz targets (docs/TESTING.md), each part in
# its own clang build without CUDA:
#   asan  build-asan/: AddressSanitizer + UndefinedBehaviorSanitizer, every ctest test (mpirun ones
#         included; not the demo training run) and the replay of each fuzz corpus (tests/fuzz/corpus/).
#   tsan  build-tsan/: ThreadSanitizer over the threaded communicator tests (test_comm_single's
#         CommThreads, test_liveness, test_comm_tcp whose ranks are threads of one process) and, under
#         mpirun on 2 and 3 ranks, the multi-rank communicator and sharded-optimizer tests (test_dist_comm,
#         test_dist_sharded: the overlap thread and the deferred all-gather over real MPI; OpenMPI's own
#         code suppressed, tests/sanitize/tsan_mpi.supp).
#   fuzz  each libFuzzer target of build-asan/ for ZERO8_FUZZ_SECONDS (default 20) from its corpus and
#         the test data, ZERO8_CTEST_JOBS of them at a time; new inputs go to build-asan/fuzz/corpus/<target>/,
#         crashes to build-asan/fuzz/.
# Usage: scripts/sanitize.sh [asan] [tsan] [fuzz] (default: all three, in that order). Each part prints
# one summary line "sanitize: <part>: ..." (also appended to $ZERO8_SANITIZE_SUMMARY when set) and the
# script exits non-zero if any part failed. Environment: ZERO8_BUILD_DIR (the build dirs are
# <it>-asan and <it>-tsan; default build/), ZERO8_CTEST_JOBS (default 2), ZERO8_FUZZ_SECONDS,
# ZERO8_SANITIZE_CTEST_ARGS (more ctest arguments for the asan part, e.g. -E resize to trim it).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="${ZERO8_BUILD_DIR:-$root/build}"
asan_dir="$base-asan" tsan_dir="$base-tsan"
jobs="${ZERO8_CTEST_JOBS:-2}"
fuzz_seconds="${ZERO8_FUZZ_SECONDS:-20}"
parts=("$@")
((${#parts[@]} > 0)) || parts=(asan tsan fuzz)

if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=1
# Reports name source lines (llvm-symbolizer, from clang's packages); a finding fails the process that hits it. LSan's only
# suppressions are OpenMPI's own allocations, see the file.
supp="$root/tests/sanitize"
export ASAN_OPTIONS="detect_leaks=1:check_initialization_order=1"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"

status=0
summary() {
  echo "sanitize: $1"
  if [[ -n "${ZERO8_SANITIZE_SUMMARY:-}" ]]; then echo "$1" >>"$ZERO8_SANITIZE_SUMMARY"; fi
}

# configure DIR SANITIZERS [cmake args...]: a clang build of zero8 without CUDA in DIR.
configure() {
  local dir=$1 san=$2
  shift 2
  CC=clang CXX=clang++ cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZERO8_CUDA=OFF \
    -DZERO8_SANITIZE="$san" "$@" >"$dir/configure.log" 2>&1 ||
    { cat "$dir/configure.log" >&2; return 1; }
}

run_asan() {
  local t0 log rc=0 line
  t0=$(date +%s)
  mkdir -p "$asan_dir"
  if ! configure "$asan_dir" address,undefined -DZERO8_FUZZ=ON || ! cmake --build "$asan_dir" --parallel "$jobs"; then
    summary "asan: build failed ($(( $(date +%s) - t0 )) s)"
    return 1
  fi
  # The mpirun tests (label dist) apart, with tests/sanitize/keep_loaded.c preloaded: OpenMPI's
  # components stay mapped after MPI_Finalize, so its leaks name the libraries tests/sanitize/lsan.supp
  # lists (see those files). Not the demo (label example): a training run whose quality check needs
  # 150 steps, past its timeout at -O1 with ASan, over the codec and optimizer code that the unit tests
  # run. Nor their 4-rank repeats (names ending _np4): 4 ranks on CI's 2 cores under ASan take minutes
  # (dist_sharded_np4 alone 86 s) over the code the 1- to 3-rank runs take through, and the plain ctest
  # stage runs them. Nor the CMake package test (label package): it builds a consumer project, which
  # checks the install, not zero8's code.
  local keep="$asan_dir/keep_loaded.so"
  if ! clang -shared -fPIC -O1 -o "$keep" "$supp/keep_loaded.c"; then
    summary "asan: build of tests/sanitize/keep_loaded.c failed ($(( $(date +%s) - t0 )) s)"
    return 1
  fi
  local -a kinds=("-LE dist|example|package" "-L dist -E _np4$") preload=("" "$keep") lines=()
  local i
  for i in 0 1; do
    log="$asan_dir/ctest${i}.log"
    # shellcheck disable=SC2086  # kinds[i] and ZERO8_SANITIZE_CTEST_ARGS are lists of ctest arguments
    LD_PRELOAD="${preload[i]}" ctest --test-dir "$asan_dir" --output-on-failure -j "$jobs" ${kinds[i]} \
      ${ZERO8_SANITIZE_CTEST_ARGS:-} >"$log" 2>&1 || rc=1
    line=$(grep -E '^[0-9]+% tests passed' "$log" | tail -1)
    lines+=("${line:-ctest printed no summary ($log)}")
    if grep -qE 'Test +#[0-9]+: .*\*\*\*(Failed|Exception|Timeout)|Not Run' "$log"; then
      grep -E 'Test +#[0-9]+: .*\*\*\*(Failed|Exception|Timeout)|Not Run' "$log" >&2
      echo "sanitize: the ASan/UBSan test output: $log" >&2
    fi
  done
  summary "asan: ${lines[0]}; mpirun tests: ${lines[1]}, $(( $(date +%s) - t0 )) s"
  return $rc
}

run_tsan() {
  local t0 rc=0 exe log np
  local -a mpi_exes=()
  t0=$(date +%s)
  mkdir -p "$tsan_dir"
  # Only the test executables that run threads of the communicator (and the library they link); the
  # mpirun ones where zero8 has MPI (configure found it) and mpirun is there.
  if ! configure "$tsan_dir" thread ||
    ! cmake --build "$tsan_dir" --parallel "$jobs" --target test_comm_single test_liveness test_comm_tcp; then
    summary "tsan: build failed ($(( $(date +%s) - t0 )) s)"
    return 1
  fi
  # grep reads the whole list (no -q): quitting at the first match would end cmake with SIGPIPE, which
  # pipefail turns into "no such target", and the mpirun tests would be left out without a word.
  if command -v mpirun >/dev/null && cmake --build "$tsan_dir" --target help | grep -w test_dist_sharded >/dev/null; then
    if cmake --build "$tsan_dir" --parallel "$jobs" --target test_dist_comm test_dist_sharded; then
      mpi_exes=(test_dist_comm test_dist_sharded)
    else
      summary "tsan: build of the mpirun tests failed ($(( $(date +%s) - t0 )) s)"
      return 1
    fi
  fi
  # One OpenMP thread: Debian's libomp is not built with TSan, so its barriers would read as races; the
  # threads under test are the communicator's own.
  for exe in test_comm_single test_liveness test_comm_tcp; do
    log="$tsan_dir/$exe.log"
    if ! OMP_NUM_THREADS=1 "$tsan_dir/tests/$exe" --gtest_brief=1 >"$log" 2>&1; then
      rc=1
      tail -40 "$log" >&2
      echo "sanitize: the TSan output of $exe: $log" >&2
    fi
  done
  for exe in "${mpi_exes[@]}"; do
    for np in 2 3; do
      log="$tsan_dir/$exe.np$np.log"
      # ignore_noninstrumented_modules: the interceptors (free, mutexes) that OpenMPI's and PMIx's own
      # threads call are not checked; a report from PMIx's progress thread while MPI_Finalize dlclose()s
      # its components deadlocked TSan's report against the loader's lock.
      # A time limit too: a hang is a failure to report, never a CI run that waits forever.
      if ! OMP_NUM_THREADS=1 TSAN_OPTIONS="$TSAN_OPTIONS:ignore_noninstrumented_modules=1:suppressions=$supp/tsan_mpi.supp" \
           timeout -k 10 300 mpirun -np "$np" --oversubscribe -x OMP_NUM_THREADS -x TSAN_OPTIONS \
           "$tsan_dir/tests/dist/$exe" --gtest_brief=1 >"$log" 2>&1; then
        rc=1
        tail -40 "$log" >&2
        echo "sanitize: the TSan output of $exe on $np ranks: $log" >&2
      fi
    done
  done
  local what="test_comm_single, test_liveness, test_comm_tcp"
  ((${#mpi_exes[@]} > 0)) && what+=", test_dist_comm and test_dist_sharded on 2 and 3 ranks"
  summary "tsan: $what: $( ((rc == 0)) && echo passed || echo FAILED), $(( $(date +%s) - t0 )) s"
  return $rc
}

run_fuzz() {
  local t0 rc=0 name exe dirs dict work log results=()
  t0=$(date +%s)
  if [[ ! -f "$asan_dir/build.ninja" ]]; then
    summary "fuzz: needs the asan part's build ($asan_dir)"
    return 1
  fi
  cmake --build "$asan_dir" --parallel "$jobs" --target fuzz_config fuzz_manifest fuzz_safetensors fuzz_shard \
    fuzz_dequant >/dev/null || { summary "fuzz: build failed"; return 1; }
  local -a names=(fuzz_config fuzz_manifest fuzz_safetensors fuzz_shard fuzz_dequant)
  # $jobs targets at a time (a libFuzzer process is one thread); each writes its exit status next to its log.
  for name in "${names[@]}"; do
    exe="$asan_dir/tests/fuzz/$name"
    work="$asan_dir/fuzz/corpus/$name"
    log="$asan_dir/fuzz/$name.log"
    mkdir -p "$work"
    rm -f "$log.rc"
    mapfile -t dirs <"$asan_dir/tests/fuzz/$name.dirs"
    dict=()
    case "$name" in fuzz_config | fuzz_manifest | fuzz_safetensors) dict=(-dict="$root/tests/fuzz/json.dict") ;; esac
    while (($(jobs -rp | wc -l) >= jobs)); do wait -n || true; done
    # -timeout: an input that takes 10 s is a finding too (a hang); the first directory takes new inputs.
    { "$exe" "${dict[@]}" -max_total_time="$fuzz_seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$asan_dir/fuzz/$name-" "$work" "${dirs[@]}" >"$log" 2>&1; echo $? >"$log.rc"; } &
  done
  wait
  for name in "${names[@]}"; do
    log="$asan_dir/fuzz/$name.log"
    if [[ "$(cat "$log.rc" 2>/dev/null)" == 0 ]]; then
      results+=("$name $(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$') runs")
    else
      rc=1
      results+=("$name FAILED")
      grep -E '^==[0-9]+==ERROR|^SUMMARY|^fuzz:|Test unit written to' "$log" >&2 || tail -20 "$log" >&2
      echo "sanitize: $name found a crash (log: $log); once fixed, add the input to tests/fuzz/corpus/$name/" >&2
    fi
  done
  summary "fuzz: $(printf '%s; ' "${results[@]}")${fuzz_seconds} s each, $(( $(date +%s) - t0 )) s"
  return $rc
}

for part in "${parts[@]}"; do
  case "$part" in
    asan) run_asan || status=1 ;;
    tsan) run_tsan || status=1 ;;
    fuzz) run_fuzz || status=1 ;;
    *) echo "sanitize: unknown part '$part' (expected asan, tsan or fuzz)" >&2; exit 2 ;;
  esac
done
exit $status
