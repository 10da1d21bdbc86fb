// MPI backend internals: the MPI communicator is also a HostComm (backends.h), which the NCCL backend
// can bootstrap, split and watch its peers through. Every MPI call that waits on other ranks is nonblocking and
// polled against a deadline and the liveness mesh, so no call can hang (see comm_mpi.cpp).
#pragma once

// The C API only: OpenMPI's and MPICH's C++ bindings would need their own library.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends.h"
#include "liveness.h"
#include "zero8/comm/communicator.h"

namespace zero8::comm::detail {

// Process-wide MPI state: initialization (owned or borrowed), a private duplicate of
// MPI_COMM_WORLD, the liveness mesh, and the one failure reason all communicators share.
class MpiWorld {
 public:
  static std::shared_ptr<MpiWorld> acquire();
  ~MpiWorld();

  MPI_Comm comm = MPI_COMM_NULL;  // dup of MPI_COMM_WORLD, errors returned (not fatal)
  int rank = 0, size = 1;
  bool owns_mpi = false;          // we called MPI_Init, so we call MPI_Finalize
  int thread_level = 0;           // MPI_Query_thread: MPI_THREAD_SERIALIZED lets any thread call (one at a time)
  std::unique_ptr<Liveness> live;
  std::string failure;            // first failure (any communicator of this process)
  // This process is a fork()ed child of the one that set MPI up: it must leave MPI alone (not even
  // free or finalize: that would act on the parent's MPI state and runtime connections).
  bool forked() const { return live && live->forked(); }

 private:
  MpiWorld() = default;
};

// What a wait is for: names in messages, the collective's identity for peer queries, and the peers
// that matter (a collective waits on every member; send/recv on one peer).
struct WaitSpec {
  std::string label;               // "all_reduce #3 on 'world' (rank 0 of 4)"
  std::string call;                // "all_reduce #3 on 'world'"
  std::string op;                  // "all_reduce": compared with the members' ops; "" (send/recv, setup): not
  uint64_t comm_id = 0, seq = 0;   // seq: Communicator::collective_seq(), equal on every member
  bool collective = true;
  double timeout_s = 300.0;
  const std::vector<int>* world_ranks = nullptr;  // comm rank -> world rank
  int comm_rank = 0;
  int p2p_peer = -1;               // comm rank of the peer of send/recv
};

// Polls done() until it returns true. Throws Error(comm) (after recording the failure in the
// world and telling every peer) when a peer dies or gives up, a member has shut down (said "bye")
// and the call still has not completed a second later, a member called another collective than
// this rank at the same place (spec.comm_id, spec.seq; checked after 2 s), or the deadline passes;
// the message names the call and the peers responsible or not heard from.
void mpi_wait(MpiWorld& w, const WaitSpec& spec, const std::function<bool()>& done);
[[noreturn]] void mpi_fail(MpiWorld& w, const WaitSpec& spec, const std::string& cause);

class MpiComm final : public HostComm {
 public:
  MpiComm(std::shared_ptr<MpiWorld> world, MPI_Comm comm, std::string name, std::vector<int> world_ranks,
          uint64_t id, double timeout_s);
  ~MpiComm() override;

  std::string description() const override;
  const char* backend() const override { return "mpi"; }
  MemSpace memory() const override { return MemSpace::host; }
  bool calls_from_any_thread() const override { return world_->thread_level >= MPI_THREAD_SERIALIZED; }
  [[noreturn]] void abort(int exit_code) override;

  MpiWorld& world() const { return *world_; }
  const std::shared_ptr<MpiWorld>& world_ptr() const { return world_; }
  MPI_Comm mpi_comm() const { return comm_; }  // send/recv (and the parent of the per-op duplicates)
  // The MPI communicator a collective of this kind runs on: its own duplicate of comm_ per logical op.
  MPI_Comm mpi_comm(OpKind kind) const;
  WaitSpec wait_spec(OpKind kind, int p2p_peer = -1) const;

  // HostComm: the device calls wait in mpi_wait, watched by the liveness mesh like MPI's own.
  uint64_t id() const override { return id_; }
  void watch(const DeviceCall& call, const std::function<bool()>& done) override;
  [[noreturn]] void fail_call(const DeviceCall& call, const std::string& cause) override;
  bool forked() const override { return world_->forked(); }
  void check_not_forked(const std::string& label) const override { world_->live->check_not_forked(label); }

  void set_failed(const std::string& reason) override;
  bool failed() const override { return !world_->failure.empty(); }
  std::string failure() const override { return world_->failure; }
  void check_process(OpKind kind) const override {
    if (forked()) check_not_forked(op_label(kind));
  }

 protected:
  void do_all_to_all_v(const void* send, const int64_t* send_bytes, const int64_t* send_displs, void* recv,
                       const int64_t* recv_bytes, const int64_t* recv_displs, OpKind kind) override;
  void do_all_gather_v(const void* send, int64_t send_bytes, void* recv, const int64_t* recv_bytes,
                       const int64_t* recv_displs, OpKind kind) override;
  void do_broadcast(void* buf, int64_t bytes, int root) override;
  void do_barrier() override;
  void do_send(const void* buf, int64_t bytes, int peer, int tag) override;
  void do_recv(void* buf, int64_t bytes, int peer, int tag) override;
  std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) override;

 private:
  void wait_requests(std::vector<MPI_Request>& reqs, OpKind kind, int p2p_peer = -1);
  WaitSpec device_spec(const DeviceCall& call) const;
  void check_mpi(int rc, OpKind kind, const char* call);

  std::shared_ptr<MpiWorld> world_;
  MPI_Comm comm_;
  uint64_t id_;
  // MPI matches collectives by communicator and call order only, not by operation: ranks calling
  // different ops at the same place on one communicator would exchange each other's messages
  // (OpenMPI 4.1's libnbc can then crash the process on the truncation). One duplicate per logical
  // op (all_to_all and all_to_all_v share one, as all_gather and all_gather_v do; all_reduce's and
  // reduce_scatter's phases run on their op's) makes a mismatch wait, and mpi_wait names it.
  static constexpr int kOpComms = 7;
  std::array<MPI_Comm, kOpComms> op_comms_;
};

}  // namespace zero8::comm::detail
