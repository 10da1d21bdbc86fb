# Optional backends. Each is AUTO by default (built when found), ON demands it (FATAL_ERROR if
# absent), OFF skips it. Code that needs a missing backend says "not built with X" at run time.
set(ZERO8_CUDA AUTO CACHE STRING "CUDA kernels (AUTO, ON, OFF)")
set(ZERO8_NCCL AUTO CACHE STRING "NCCL communicator backend, needs CUDA (AUTO, ON, OFF)")
set(ZERO8_MPI AUTO CACHE STRING "MPI communicator backend (AUTO, ON, OFF)")
set(ZERO8_DNNL AUTO CACHE STRING "oneDNN int8 GEMM for the C++ int8 API (AUTO, ON, OFF)")
set_property(CACHE ZERO8_CUDA ZERO8_NCCL ZERO8_MPI ZERO8_DNNL PROPERTY STRINGS AUTO ON OFF)
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 80 90)
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
set(ZERO8_WITH_CUDA 0)
if(NOT ZERO8_CUDA STREQUAL "OFF")
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
  endif()
endif()

# --- NCCL ---
set(ZERO8_WITH_NCCL 0)
if(NOT ZERO8_NCCL STREQUAL "OFF")
  if(ZERO8_WITH_CUDA)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
  endif()
  if(ZERO8_WITH_CUDA AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
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
