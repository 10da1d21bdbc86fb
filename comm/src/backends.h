// Factories of the compiled backends, used by comm_create() (communicator.cpp), and what the backends'
// splits share. A backend's factory exists only when its source file is built (ZERO8_WITH_MPI /
// ZERO8_WITH_NCCL).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "zero8/comm/communicator.h"

namespace zero8::comm::detail {

std::unique_ptr<Communicator> single_create();

// The members of a split's child of `color` (>= 0) as ranks of the parent, in the child's rank order:
// by key, then by parent rank, as MPI_Comm_split orders them. `pairs` holds every parent rank's
// {color, key}, all-gathered (rank p's at 2p, 2p + 1).
std::vector<int> split_members(const std::vector<int32_t>& pairs, int color);
#if ZERO8_WITH_MPI
std::unique_ptr<Communicator> mpi_create();
#endif
#if ZERO8_WITH_NCCL
std::unique_ptr<Communicator> nccl_create();
#endif

}  // namespace zero8::comm::detail
