// Factories of the compiled backends, used by comm_create() (communicator.cpp), and what the backends'
// splits share. A backend's factory exists only when its source file is built (ZERO8_WITH_MPI /
// ZERO8_WITH_NCCL).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "zero8/comm/communicator.h"

namespace zero8::comm::detail {

std::unique_ptr<Communicator> single_create();

// A host communicator that carries a device backend (NCCL) for the same ranks: the device backend's set-up
// (rank 0's unique id), splits and barriers go through it, and while a device call waits, the host's
// connections are watched, so a peer that dies or fails anywhere in the world fails the device call as it
// would the host's own calls, naming it, and the failure is the one state both share. The MPI and tcp
// backends are; the device backend owns its host.
class HostComm : public Communicator {
 public:
  using Communicator::failed;
  using Communicator::failure;
  using Communicator::set_failed;

  // A device call as its waits and failures name it (the device communicator's op_label, op_call and
  // collective_seq, and an id for its calls that differs from the host's own).
  struct DeviceCall {
    OpKind kind = OpKind::barrier;
    std::string label, call;
    uint64_t comm_id = 0, seq = 0;
    int p2p_peer = -1;  // send/recv: the peer's rank
  };
  // Equal on every member, distinct between communicators of one world.
  virtual uint64_t id() const = 0;
  // Polls done() until it returns true; throws Error(comm) naming `call` (after failing the world and
  // telling the peers) when a peer dies or gives up, a member the call waits on has shut down, or
  // timeout() passes.
  virtual void watch(const DeviceCall& call, const std::function<bool()>& done) = 0;
  // Fails the world with `call`'s label and `cause`, tells the peers, and throws Error(comm).
  [[noreturn]] virtual void fail_call(const DeviceCall& call, const std::string& cause) = 0;
  // This process is a fork()ed child of the one that made the world: it may not use it.
  virtual bool forked() const = 0;
  // Throws the fork error for the call `label` (of this communicator or one built on it).
  virtual void check_not_forked(const std::string& label) const = 0;
  // split(), as the backend's own type (nullptr when color < 0).
  std::unique_ptr<HostComm> split_host(int color, int key, const std::string& name) {
    std::unique_ptr<Communicator> c = split(color, key, name);
    return std::unique_ptr<HostComm>(static_cast<HostComm*>(c.release()));  // a HostComm splits into its own kind
  }

 protected:
  using Communicator::Communicator;
};

// The members of a split's child of `color` (>= 0) as ranks of the parent, in the child's rank order:
// by key, then by parent rank, as MPI_Comm_split orders them. `pairs` holds every parent rank's
// {color, key}, all-gathered (rank p's at 2p, 2p + 1).
std::vector<int> split_members(const std::vector<int32_t>& pairs, int color);
#if ZERO8_WITH_MPI
std::unique_ptr<Communicator> mpi_create();
#endif
#if ZERO8_WITH_NCCL
// Over MPI (comm_create("nccl")); host_if_shared: see comm::nccl_create_over.
std::unique_ptr<Communicator> nccl_create(bool host_if_shared = false);
std::unique_ptr<Communicator> nccl_create_over(std::unique_ptr<HostComm> host, bool host_if_shared = false);
std::vector<int> gpu_owners(Communicator& comm, int device);  // comm::gpu_owners
#endif

}  // namespace zero8::comm::detail
