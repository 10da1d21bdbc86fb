// What this build of zero8 contains: version and compiled-in backends.
#pragma once

namespace zero8 {

struct BuildInfo {
  bool cuda = false, nccl = false, mpi = false, x86_simd = false;
};
const char* version();
BuildInfo build_info();

}  // namespace zero8
