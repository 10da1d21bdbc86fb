// The single-process backend: size 1, every collective is a local copy and nothing is sent, so a
// program written for N ranks runs unchanged (and its byte counters read 0) with one process. Device
// buffers are copied on the device (cudaMemcpyAsync on the communicator's stream, waited for).
#include <cstdlib>
#include <cstring>

#include "backends.h"
#include "comm_env.h"
#include "zero8/error.h"
#include "zero8/kernels/device.h"

namespace zero8::comm {
namespace {

class SingleComm final : public Communicator {
 public:
  explicit SingleComm(std::string name, double timeout_s) : Communicator(0, 1, std::move(name), {0}, timeout_s) {}

  std::string description() const override {
    return "single-process communicator '" + name() + "' (rank 0 of 1, host " + detail::host_name() + ")";
  }
  const char* backend() const override { return "single"; }
  MemSpace memory() const override { return MemSpace::host; }
  [[noreturn]] void abort(int exit_code) override { std::_Exit(exit_code); }

 protected:
  bool native_device_buffers() const override { return true; }
  void do_all_to_all_v(const void* send, const int64_t* send_bytes, const int64_t* send_displs, void* recv,
                       const int64_t* recv_bytes, const int64_t* recv_displs, OpKind) override {
    (void)recv_bytes;  // == send_bytes[0], checked by the caller
    copy(static_cast<char*>(recv) + recv_displs[0], static_cast<const char*>(send) + send_displs[0], send_bytes[0]);
  }
  void do_all_gather_v(const void* send, int64_t send_bytes, void* recv, const int64_t*, const int64_t* recv_displs,
                       OpKind) override {
    copy(static_cast<char*>(recv) + recv_displs[0], send, send_bytes);
  }
  void do_broadcast(void*, int64_t, int) override {}
  void do_barrier() override {}
  // Size 1 has no peer: Communicator::send/recv reject every peer before getting here.
  void do_send(const void*, int64_t, int, int) override { ZERO8_ASSERT(false); }
  void do_recv(void*, int64_t, int, int) override { ZERO8_ASSERT(false); }
  std::unique_ptr<Communicator> do_split(int color, int, const std::string& name) override {
    if (color < 0) return nullptr;
    return std::make_unique<SingleComm>(name, timeout());
  }
  // A reduction over one rank is its value, whatever the op (and the memory).
  void do_reduce_scatter(const void* send, void* recv, const int64_t* counts, ScalarType type, ReduceOp) override {
    copy(recv, send, counts[0] * scalar_type_size(type));
  }
  void do_all_reduce(const void* send, void* recv, int64_t count, ScalarType type, ReduceOp) override {
    copy(recv, send, count * scalar_type_size(type));
  }

 private:
  // memmove: in-place all_gather_v passes the same pointer for both (the only overlap callers may make).
  void copy(void* dst, const void* src, int64_t bytes) {
    if (bytes <= 0 || dst == src) return;
    if (device::on_device(dst) || device::on_device(src)) {
      const std::string where = "single-process communicator '" + name() + "'";
      device::copy(dst, src, bytes, stream(), where);
      device::synchronize(stream(), where);
      return;
    }
    std::memmove(dst, src, size_t(bytes));
  }
};

}  // namespace

namespace detail {
std::unique_ptr<Communicator> single_create() { return std::make_unique<SingleComm>("world", env_comm_timeout()); }
}  // namespace detail

}  // namespace zero8::comm
