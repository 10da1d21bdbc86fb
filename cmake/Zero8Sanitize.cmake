# Sanitizer and fuzzing builds (scripts/sanitize.sh; docs/TESTING.md). ZERO8_SANITIZE is a clang/gcc
# -fsanitize list applied to every C++ target, e.g. "address,undefined" or "thread"; ZERO8_FUZZ adds the
# libFuzzer targets of tests/fuzz (clang only) and coverage instrumentation for them.
set(ZERO8_SANITIZE "" CACHE STRING "Sanitizers for every target, e.g. address,undefined or thread (empty: none)")
option(ZERO8_FUZZ "Build the libFuzzer targets of tests/fuzz (clang; use with ZERO8_SANITIZE=address,undefined)" OFF)

if(ZERO8_SANITIZE)
  if(ZERO8_WITH_CUDA)
    message(FATAL_ERROR "ZERO8_SANITIZE=${ZERO8_SANITIZE} with CUDA: nvcc objects are not instrumented; "
                        "configure with -DZERO8_CUDA=OFF")
  endif()
  # UBSan findings abort the test that hits them instead of printing and carrying on. -O1 and frame
  # pointers keep the stacks readable at about half the cost of -O0.
  set(_zero8_san -fsanitize=${ZERO8_SANITIZE} -fno-omit-frame-pointer)
  if(ZERO8_SANITIZE MATCHES "undefined")
    list(APPEND _zero8_san -fno-sanitize-recover=undefined)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${_zero8_san};-O1;-gline-tables-only>")
  add_link_options(-fsanitize=${ZERO8_SANITIZE})
  # Also on zero8_kernels' interface (kernels/CMakeLists.txt), so that the installed package tells a
  # consumer (tests/package) to link the sanitizer runtimes its instrumented objects call.
  set(ZERO8_SANITIZE_LINK_OPTIONS -fsanitize=${ZERO8_SANITIZE})
endif()

if(ZERO8_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "ZERO8_FUZZ=ON needs clang (libFuzzer); this is ${CMAKE_CXX_COMPILER_ID}: "
                        "configure with CXX=clang++")
  endif()
  if(NOT ZERO8_SANITIZE MATCHES "address")
    message(FATAL_ERROR "ZERO8_FUZZ=ON needs ZERO8_SANITIZE=address,undefined: a fuzzer without ASan "
                        "misses the out-of-bounds reads it is there to find")
  endif()
  # Coverage for every target (library code is what the fuzzers explore); only the fuzz targets link
  # libFuzzer's main (-fsanitize=fuzzer, tests/fuzz/CMakeLists.txt).
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link>")
endif()
