// Library version and build configuration, for error reports and `zero8-bench`.
#include "zero8/version.h"

namespace zero8 {

const char* version() { return "0.1.0"; }

BuildInfo build_info() {
  BuildInfo b;
  b.cuda = ZERO8_WITH_CUDA != 0;
  b.nccl = ZERO8_WITH_NCCL != 0;
  b.mpi = ZERO8_WITH_MPI != 0;
  b.x86_simd = ZERO8_WITH_X86_SIMD != 0;
  return b;
}

}  // namespace zero8
