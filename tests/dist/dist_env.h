// Shared state of the multi-rank GoogleTest executables: the world communicator created once by
// dist_main.cpp (every rank runs every test; each test makes the same collective calls on all ranks),
// deterministic per-rank test data every rank can regenerate for any other rank, and a temporary
// directory every rank sees.
#pragma once

#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "zero8/comm/communicator.h"
#include "zero8/kernels/hd.h"

#if ZERO8_WITH_NCCL
#include <cuda_runtime.h>

#include <vector>
#endif

namespace zero8::test {

comm::Communicator& world();

#if ZERO8_WITH_NCCL
// Whether any two ranks' devices, as the NCCL backend picks them (the rank's index on its node, modulo the
// devices it sees), are one GPU (by UUID: ranks that each see their own GPU as device 0 share nothing), which
// NCCL refuses. Collective: the ranks decide together (one that went on alone would wait in NCCL's
// initialisation).
inline bool ranks_share_a_gpu() {
  int devices = 0;
  cudaGetDeviceCount(&devices);
  const comm::NodeGroups nodes = comm::node_groups(world());
  const std::vector<int> owner = comm::gpu_owners(world(), nodes.local_rank % devices);
  for (int q = 0; q < int(owner.size()); ++q)
    if (owner[size_t(q)] != q) return true;
  return false;
}
#endif

// A value of rank r's data at index i: mixed signs and magnitudes over ~6 decades, so float sums
// depend on their order (a wrong summation order shows up as a bit difference).
inline float dist_value(uint64_t salt, int r, int64_t i) {
  const float u = rng_uniform(salt * 1000003ull + uint64_t(r), uint64_t(i)) - 0.5f;
  const int e = int((uint64_t(i) * 7 + uint64_t(r) * 3 + salt) % 20) - 10;
  return std::ldexp(u, e);
}

// Rank 0's text on every rank of world().
inline std::string broadcast_text(const std::string& s) {
  int64_t n = int64_t(s.size());
  world().broadcast(&n, sizeof(n), 0);
  std::string out = world().rank() == 0 ? s : std::string(size_t(n), '\0');
  if (n > 0) world().broadcast(out.data(), n, 0);
  return out;
}

// A fresh directory every rank sees (rank 0 makes it), removed when the test ends.
class TempDir {
 public:
  TempDir() {
    std::string p;
    if (world().rank() == 0) {
      const char* base = std::getenv("TMPDIR");
      std::string tmpl = std::string(base && *base ? base : "/tmp") + "/zero8_ckpt_XXXXXX";
      if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
      p = tmpl;
    }
    path = broadcast_text(p);
  }
  ~TempDir() {
    world().barrier();
    if (world().rank() == 0) std::filesystem::remove_all(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path;
};

}  // namespace zero8::test
