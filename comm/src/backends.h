// Factories of the compiled backends, used by comm_create() (communicator.cpp). A backend's
// factory exists only when its source file is built (ZERO8_WITH_MPI / ZERO8_WITH_NCCL).
#pragma once

#include <memory>

#include "zero8/comm/communicator.h"

namespace zero8::comm::detail {

std::unique_ptr<Communicator> single_create();
#if ZERO8_WITH_MPI
std::unique_ptr<Communicator> mpi_create();
#endif
#if ZERO8_WITH_NCCL
std::unique_ptr<Communicator> nccl_create();
#endif

}  // namespace zero8::comm::detail
