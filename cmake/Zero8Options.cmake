# Optional backends. Each is AUTO by default (built when found), ON demands it (FATAL_ERROR if
# absent), OFF skips it. Code that needs a missing backend says "not built with X" at run time.
set(ZERO8_CUDA AUTO CACHE STRING "CUDA kernels (AUTO, IF_GPU, ON, OFF, SIM)")
set(ZERO8_NCCL AUTO CACHE STRING "NCCL communicator backend, needs CUDA (AUTO, ON, OFF)")
set(ZERO8_MPI AUTO CACHE STRING "MPI communicator backend (AUTO, ON, OFF)")
set(ZERO8_DNNL AUTO CACHE STRING "oneDNN int8 GEMM for the C++ int8 API (AUTO, ON, OFF)")
set_property(CACHE ZERO8_NCCL ZERO8_MPI ZERO8_DNNL PROPERTY STRINGS AUTO ON OFF)
set_property(CACHE ZERO8_CUDA PROPERTY STRINGS AUTO IF_GPU ON OFF SIM)
if(NOT ZERO8_CUDA MATCHES "^(AUTO|IF_GPU|ON|OFF|SIM)$")
  message(FATAL_ERROR "ZERO8_CUDA=${ZERO8_CUDA}: expected AUTO, IF_GPU, ON, OFF or SIM")
endif()

find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(Threads REQUIRED)

# x86-64 SIMD variants are compiled on x86-64 only and chosen at run time.
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
  set(ZERO8_WITH_X86_SIMD 1)
else()
  set(ZERO8_WITH_X86_SIMD 0)
endif()

# --- CUDA ---
# AUTO: built when nvcc is found (the C++ build and CI compile every kernel). IF_GPU, the Python wheel's
# default (pyproject.toml): built only when nvcc is found and the CUDA driver of this machine sees a GPU,
# for the GPU it sees (CMAKE_CUDA_ARCHITECTURES native) unless architectures are given; so `pip install .`
# stays CPU-only, and minutes of nvcc shorter, on machines without a GPU such as CI.
set(ZERO8_WITH_CUDA 0)
set(ZERO8_WITH_CUDA_SIM 0)
set(_zero8_cuda_wanted ${ZERO8_CUDA})
# SIM: a test build without a GPU or nvcc. The .cu files are compiled as C++ against zero8's CUDA simulator
# (tests/cudasim: the CUDA runtime and the kernels' CUDA threads run on the CPU), so the CUDA tests run the
# kernels and the device code paths in CI. Never a build to train with.
if(ZERO8_CUDA STREQUAL "SIM")
  set(ZERO8_WITH_CUDA 1)
  set(ZERO8_WITH_CUDA_SIM 1)
  set(_zero8_cuda_wanted OFF)
  find_package(Python3 REQUIRED COMPONENTS Interpreter)  # tests/cudasim/rewrite_cu.py
endif()
if(ZERO8_CUDA STREQUAL "IF_GPU")
  unset(_zero8_gpu_probe_run CACHE)  # probe at every configure: the machine may have changed
  try_run(_zero8_gpu_probe_run _zero8_gpu_probe_compiled ${CMAKE_BINARY_DIR}/zero8_gpu_probe
          ${CMAKE_CURRENT_LIST_DIR}/cuda_gpu_probe.cpp LINK_LIBRARIES ${CMAKE_DL_LIBS}
          RUN_OUTPUT_VARIABLE _zero8_gpu_probe_out)
  if(_zero8_gpu_probe_compiled AND _zero8_gpu_probe_run EQUAL 0)
    message(STATUS "ZERO8_CUDA=IF_GPU: the CUDA driver sees ${_zero8_gpu_probe_out} GPU(s): building the CUDA kernels")
    set(_zero8_cuda_wanted AUTO)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES native)
    endif()
  else()
    if(NOT _zero8_gpu_probe_compiled)
      set(_zero8_gpu_probe_out "the probe cmake/cuda_gpu_probe.cpp did not build")
    endif()
    message(STATUS "ZERO8_CUDA=IF_GPU: no GPU (${_zero8_gpu_probe_out}): building without CUDA")
    set(_zero8_cuda_wanted OFF)
  endif()
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 80 90)
endif()
if(NOT _zero8_cuda_wanted STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(ZERO8_WITH_CUDA 1)
  elseif(ZERO8_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ZERO8_CUDA=ON but no CUDA compiler (nvcc) was found; install the CUDA toolkit "
                        "or configure with -DZERO8_CUDA=OFF")
  elseif(ZERO8_CUDA STREQUAL "IF_GPU")
    message(WARNING "ZERO8_CUDA=IF_GPU: a GPU is visible but no CUDA compiler (nvcc) was found, so zero8 is "
                    "built without its CUDA kernels; install the CUDA toolkit (or set CUDACXX) and reinstall")
  endif()
endif()

# --- NCCL ---
set(ZERO8_WITH_NCCL 0)
if(NOT ZERO8_NCCL STREQUAL "OFF")
  if(ZERO8_WITH_CUDA AND NOT ZERO8_WITH_CUDA_SIM)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
  endif()
  if(ZERO8_WITH_CUDA_SIM)  # the simulator's NCCL (tests/cudasim/src/nccl.cpp)
    set(ZERO8_WITH_NCCL 1)
    set(NCCL_INCLUDE_DIR ${CMAKE_CURRENT_SOURCE_DIR}/tests/cudasim/include)
    set(NCCL_LIBRARY zero8_cudasim)
  elseif(ZERO8_WITH_CUDA AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(ZERO8_WITH_NCCL 1)
  elseif(ZERO8_NCCL STREQUAL "ON")
    message(FATAL_ERROR "ZERO8_NCCL=ON but NCCL was not found (needs CUDA: ${ZERO8_WITH_CUDA}, "
                        "nccl.h: ${NCCL_INCLUDE_DIR}, libnccl: ${NCCL_LIBRARY})")
  endif()
endif()

# --- MPI ---
set(ZERO8_WITH_MPI 0)
if(NOT ZERO8_MPI STREQUAL "OFF")
  find_package(MPI COMPONENTS C QUIET)
  if(MPI_C_FOUND)
    set(ZERO8_WITH_MPI 1)
  elseif(ZERO8_MPI STREQUAL "ON")
    message(FATAL_ERROR "ZERO8_MPI=ON but MPI was not found; install OpenMPI (scripts/setup.sh does: "
                        "apt-get install libopenmpi-dev openmpi-bin) or configure with -DZERO8_MPI=OFF")
  endif()
endif()

# --- oneDNN (Debian's libdnnl-dev): the CPU int8 GEMM behind zero8::int8::int8_gemm; without it
# that call uses the scalar reference (docs/INT8.md) ---
# Found by header and library rather than dnnl-config.cmake, which demands the OpenCL headers of its
# GPU runtime even for CPU use.
set(ZERO8_WITH_DNNL 0)
if(NOT ZERO8_DNNL STREQUAL "OFF")
  find_path(DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
  find_library(DNNL_LIBRARY dnnl)
  if(DNNL_INCLUDE_DIR AND DNNL_LIBRARY)
    set(ZERO8_WITH_DNNL 1)
  elseif(ZERO8_DNNL STREQUAL "ON")
    message(FATAL_ERROR "ZERO8_DNNL=ON but oneDNN was not found; install it (apt-get install libdnnl-dev) "
                        "or configure with -DZERO8_DNNL=OFF")
  endif()
endif()

# Per-file ISA flags, by file name suffix: foo_avx2.cpp, foo_avx512.cpp, foo_avx512vbmi.cpp (AVX-512
# plus the VBMI byte permutes; its code runs only where cpuid reports AVX512_VBMI, see dispatch.cpp).
function(zero8_set_isa_flags)
  foreach(src ${ARGN})
    if(src MATCHES "_avx512vbmi\\.cpp$")
      set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS
        "-mavx512f;-mavx512bw;-mavx512dq;-mavx512vl;-mavx512vbmi;-mavx2;-mfma;-mf16c;-mbmi2")
    elseif(src MATCHES "_avx512\\.cpp$")
      set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS
        "-mavx512f;-mavx512bw;-mavx512dq;-mavx512vl;-mavx2;-mfma;-mf16c;-mbmi2")
    elseif(src MATCHES "_avx2\\.cpp$")
      set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c;-mbmi2")
    endif()
  endforeach()
endfunction()
