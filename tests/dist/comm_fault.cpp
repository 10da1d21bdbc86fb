// Failure scenarios for the MPI backend, run by run_fault.cmake under mpirun: one rank is killed
// (SIGKILL, no cleanup) or stalls, and every other rank must raise zero8::Error naming the call and
// the peer, promptly. Each rank prints one "ZERO8_FAULT rank=R ..." line that the driver checks.
//   kill      : rank 1 kills itself before the 3rd all_reduce of a loop on the world.
//   kill_forked: rank 1 forks a child that lives on, then dies; rank 0 must still see it at once.
//   kill_group: ranks form pairs {0,1}, {2,3}; rank 1 dies; ranks 2, 3 only talk within their pair
//               and must still fail ("world rank 1 (not in this communicator) died").
//   stall     : the last rank sleeps 4 s outside any call; the others time out (2 s) in all_reduce
//               and name it as not heard from; the sleeper's next call fails with their reason.
//   recv      : rank 0 waits in recv from rank 1, which sleeps 4 s; rank 0 times out naming rank 1,
//               and rank 1's send fails with rank 0's reason.
//   exit      : rank 1 destroys its communicator normally and returns 0 (prints nothing) while rank 0
//               waits in all_reduce; rank 0 fails about a second later, not at the timeout.
//   exit_throw: rank 1 throws outside any call, catches it, destroys its communicator and returns 1
//               while rank 0 waits in bucket_reduce_scatter (timeout 20 s): the same, a second later.
//   mismatch  : rank 0 calls all_gather where rank 1 calls all_reduce, sizes compatible: each op has
//               its own MPI communicator, so both wait; after 2 s they ask each other and name it.
//   mismatch_size: the same with sizes that would truncate (once MPI_ERR_TRUNCATE): named the same way.
//   mismatch_kind: rank 0 calls all_gather (8 bytes) where rank 1 calls all_to_all_v (136 bytes to each
//               rank), as one rank alone in engine.save_checkpoint: both wait and name the mismatch.
//   mismatch_kind_fit: the same with sizes that fit each other (64 bytes each way).
//   mismatch_bucket: both call bucket_reduce_scatter, rank 0 with 1000 elements, rank 1 with 2000:
//               MPI_ERR_TRUNCATE is returned (not fatal) and raised as zero8::Error naming the call.
//   overlap_kill: a sharded optimizer with overlap (its thread reduces the buckets during backward):
//               after one clean step, rank 1 dies at the start of a backward; rank 0 reports every
//               gradient, computes 50 ms, and gets the thread's error from backward_end (or grad_ready).
//   overlap_stall: the same, but rank 1 sleeps 4 s outside any call (timeout 2 s): rank 0's thread
//               times out naming it, and rank 1's thread then fails with rank 0's reason.
//   nccl_tcp_kill: NCCL bootstrapped over a tcp world of the same ranks (as zero8.initialize makes it
//               under torchrun); rank 1 kills itself before the 3rd all_reduce on NCCL: rank 0, waiting
//               in NCCL, must see the tcp connection close at once and name rank 1.
//   nccl_tcp_stall: the same, but rank 1 sleeps 4 s (timeout 2 s): rank 0 times out in NCCL's
//               all_reduce, and rank 1's next call fails with rank 0's reason (GIVEUP over tcp).
//   nccl_mpi_kill, nccl_mpi_stall: the same with NCCL bootstrapped over MPI (comm_create("nccl")),
//               watched by the MPI backend's liveness mesh.
//   nccl_tcp_queued_kill, nccl_mpi_queued_kill: a pipeline stage's messages (recv_queued on a stream,
//               returning at once): rank 0 queues a receive from rank 1, which then dies without sending;
//               rank 0's sync() must name that receive and rank 1 at once.
//   nccl_tcp_queued_stall, nccl_mpi_queued_stall: the same, but rank 1 sleeps 4 s and then sends, with
//               the timeout set to 2 s on the NCCL communicator alone: rank 0's sync() times out after 2 s
//               naming the receive and rank 1, and rank 1's send fails with rank 0's reason.
//   The nccl_* modes need a device per rank: registered for the CUDA simulator's build.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "zero8/comm/communicator.h"
#include "zero8/comm/quantized.h"
#include "zero8/error.h"
#include "zero8/kernels/device.h"
#include "zero8/sharded.h"

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// How long a stalling rank sleeps outside any call, with the others' timeout at 2 s: they give up
// at about 2 s (2.5 s when a status query goes unanswered), and the MPI backend keeps a rank that gave
// up alive 5 s more for the stalled one to print its error. 4 s leaves 1.5 to 2 s on either side for
// a loaded host (CI's 2 cores with another test's ranks beside these).
constexpr unsigned kStallSeconds = 4;
const char* code_name(zero8::ErrorCode c) {
  switch (c) {
    case zero8::ErrorCode::comm: return "comm";
    case zero8::ErrorCode::invalid_argument: return "invalid_argument";
    case zero8::ErrorCode::unsupported: return "unsupported";
    case zero8::ErrorCode::io: return "io";
    case zero8::ErrorCode::internal: return "internal";
  }
  return "?";
}
}  // namespace

int main(int argc, char** argv) {
  using namespace zero8::comm;
  const std::string mode = argc > 1 ? argv[1] : "";
  std::unique_ptr<Communicator> world = comm_create("mpi");
  const int me = world->rank(), n = world->size();
  double t_op = now_s();
  try {
    world->barrier();
    if (mode == "kill") {
      for (int i = 0; i < 6; ++i) {
        if (i == 2 && me == 1) raise(SIGKILL);
        t_op = now_s();
        std::vector<float> v(1000, float(me));
        world->all_reduce(v.data(), 1000, ReduceOp::sum);
      }
    } else if (mode == "kill_forked") {
      // Rank 1 forks a child (as a data-loader would) that outlives it by 3 s: the child must not
      // keep rank 1's liveness sockets open, or rank 0 would notice the death only when it exits.
      if (me == 1) {
        if (fork() == 0) {
          close(1);
          close(2);
          sleep(3);
          _exit(0);
        }
        usleep(100000);
        raise(SIGKILL);
      }
      t_op = now_s();
      world->barrier();
    } else if (mode == "kill_group") {
      std::unique_ptr<Communicator> pair = world->split(me / 2, me, "pair[" + std::to_string(me / 2) + "]");
      world->barrier();
      if (me == 1) {
        usleep(200000);
        raise(SIGKILL);
      }
      t_op = now_s();
      for (int i = 0; i < 1000000; ++i) {
        std::vector<double> v(64, 1.0);
        pair->all_reduce(v.data(), 64, ReduceOp::sum);
        usleep(1000);
      }
    } else if (mode == "stall") {
      if (me == n - 1) sleep(kStallSeconds);
      t_op = now_s();
      int64_t v = me;
      world->all_reduce(&v, 1, ReduceOp::max);
    } else if (mode == "recv") {
      char buf[64];
      if (me == 1) sleep(kStallSeconds);
      t_op = now_s();
      if (me == 0) world->recv(buf, sizeof(buf), 1, 5);
      if (me == 1) world->send(buf, sizeof(buf), 0, 5);
    } else if (mode == "exit") {
      if (me == 1) {
        world.reset();
        return 0;
      }
      t_op = now_s();
      std::vector<float> v(1000, 1.0f);
      world->all_reduce(v.data(), 1000, ReduceOp::sum);
    } else if (mode == "exit_throw") {
      // As `exit`, but as a program that fails on rank 1 (outside any call), returns 1 from main and
      // so destroys its communicators; rank 0 waits in an all_to_all_v-based collective, with the
      // timeout set on the communicator.
      world->set_timeout(20);
      if (me == 1) {
        try {
          throw std::runtime_error("rank 1 fails outside communication");
        } catch (const std::runtime_error&) {
          world.reset();
          return 1;
        }
      }
      t_op = now_s();
      std::vector<float> v(1000, 1.0f), out(500);
      const std::vector<int64_t> off = {0, 512, 1000};
      WireOptions o;
      o.block = 64;
      bucket_reduce_scatter(*world, v.data(), 1000, off, out.data(), o);
    } else if (mode == "mismatch") {
      // 1024 floats: all_reduce's all-to-all half exchanges 2048 bytes with rank 0, as much as rank
      // 0's all_gather: on one MPI communicator, MPI completed rank 0's call with garbage.
      std::vector<float> v(1024, 1.0f);
      t_op = now_s();
      if (me == 0) world->all_gather(v.data(), v.data(), 2048);
      if (me == 1) world->all_reduce(v.data(), 1024, ReduceOp::sum);
      world->barrier();
    } else if (mode == "mismatch_size") {
      // The same bytes on both ranks (1 KiB), but all_reduce's all-to-all half takes 512 from rank 0,
      // which sends 1024: on one MPI communicator, rank 1's call failed with MPI_ERR_TRUNCATE.
      std::vector<float> v(512, 1.0f);
      t_op = now_s();
      if (me == 0) world->all_gather(v.data(), v.data(), 1024);
      if (me == 1) world->all_reduce(v.data(), 256, ReduceOp::sum);
      world->barrier();
    } else if (mode == "mismatch_kind" || mode == "mismatch_kind_fit") {
      // Different collectives of tiny sizes. Sharing one MPI communicator, MPI matched rank 0's
      // all-gather with rank 1's all-to-all: OpenMPI 4.1.4 crashed rank 0 on the truncation
      // ("free(): invalid pointer"), or, with sizes that fit, both calls completed with wrong data.
      const int64_t gather = mode == "mismatch_kind" ? 8 : 64, chunk = mode == "mismatch_kind" ? 136 : 64;
      std::vector<char> send(static_cast<size_t>(chunk * n), 1), recv(static_cast<size_t>(chunk * n));
      t_op = now_s();
      if (me == 0) {
        world->all_gather(send.data(), recv.data(), gather);
      } else {
        std::vector<int64_t> bytes(static_cast<size_t>(n), chunk), displs(static_cast<size_t>(n));
        for (int p = 0; p < n; ++p) displs[size_t(p)] = chunk * p;
        world->all_to_all_v(send.data(), bytes, displs, recv.data(), bytes, displs);
      }
      world->barrier();
    } else if (mode == "mismatch_bucket") {
      // The same collective with different sizes (rank 0: 1000 elements, rank 1: 2000), as ranks
      // with different models would call it: rank 0 receives more than it posted (MPI_ERR_TRUNCATE).
      const int64_t len = me == 0 ? 1000 : 2000;
      std::vector<float> v(static_cast<size_t>(len), 1.0f), out(static_cast<size_t>(len));
      std::vector<int64_t> off(size_t(n) + 1);
      for (int p = 0; p <= n; ++p) off[size_t(p)] = len * p / n / 64 * 64;
      off[size_t(n)] = len;
      WireOptions o;
      o.block = 64;
      t_op = now_s();
      bucket_reduce_scatter(*world, v.data(), len, off, out.data(), o);
      world->barrier();
    } else if (mode == "overlap_kill" || mode == "overlap_stall") {
      using namespace zero8::shard;
      const int64_t len = int64_t(1) << 18;
      std::vector<ParamSpec> params;
      for (int p = 0; p < 4; ++p) params.push_back({"w" + std::to_string(p), {len}});
      ShardConfig c;
      c.overlap = true;
      c.reduce_bucket_size = len;  // a bucket per parameter
      ShardedOptimizer opt(params, c, *world);
      opt.init(0);
      std::vector<float> g(static_cast<size_t>(len), 0.01f * float(me + 1));
      auto backward = [&] {
        for (int p = 3; p >= 0; --p) {
          opt.grad_add(p, g.data(), zero8::DType::f32);
          opt.grad_ready(p);
        }
      };
      backward();
      opt.backward_end(true);
      opt.step();
      if (me == 1 && mode == "overlap_kill") raise(SIGKILL);
      if (me == 1) sleep(kStallSeconds);
      t_op = now_s();
      backward();
      // The rest of the backward's computation, during which the thread meets the death. Short: mpirun
      // ends the job soon after rank 1's death, and rank 0 must have reported before (under load, a
      // 0.3 s pause here lost that race).
      if (me == 0) usleep(50000);
      opt.backward_end(true);
      opt.step();
    } else if (mode.rfind("nccl_", 0) == 0 && mode.find("_queued_") != std::string::npos) {
      std::unique_ptr<Communicator> nccl =
          mode.rfind("nccl_tcp_", 0) == 0 ? nccl_create_over(tcp_create(*world)) : comm_create("nccl");
      const bool kill = mode.compare(mode.size() - 5, 5, "_kill") == 0;
      if (!kill) nccl->set_timeout(2);  // on this communicator only (the world's is 60 s)
      zero8::device::Stream stream("comm_fault's stream");
      nccl->set_stream(stream.get());
      zero8::device::Buffer buf(4000, "comm_fault's buffer");
      if (me == 0) {  // NCCL connects a pair, each way, at its first transfers, which wait for the peer
        nccl->send(buf.data(), 4000, 1, 0);
        nccl->recv(buf.data(), 4000, 1, 0);
      } else if (me == 1) {
        nccl->recv(buf.data(), 4000, 0, 0);
        nccl->send(buf.data(), 4000, 0, 0);
      }
      if (me == 0) nccl->recv_queued(buf.data(), 4000, 1, 0);  // returns while rank 1 lives
      nccl->barrier();  // over the host: not ordered after the queued receive
      if (me == 1) {
        if (kill) raise(SIGKILL);
        sleep(kStallSeconds);
      }
      t_op = now_s();
      if (me == 0) nccl->sync();
      else nccl->send_queued(buf.data(), 4000, 0, 0);
    } else if (mode.rfind("nccl_", 0) == 0) {
      const bool tcp = mode.rfind("nccl_tcp_", 0) == 0;
      std::unique_ptr<Communicator> nccl = tcp ? nccl_create_over(tcp_create(*world)) : comm_create("nccl");
      zero8::device::Buffer buf(4000, "comm_fault's buffer");
      for (int i = 0; i < 6; ++i) {
        if (i == 2 && me == 1) {
          if (mode.size() > 5 && mode.compare(mode.size() - 5, 5, "_kill") == 0) raise(SIGKILL);
          sleep(kStallSeconds);
        }
        t_op = now_s();
        nccl->all_reduce(buf.data(), buf.data(), 1000, ScalarType::f32, ReduceOp::sum);
      }
    } else {
      std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
      return 2;
    }
    std::fprintf(stderr, "ZERO8_FAULT rank=%d finished without error\n", me);
    return 0;
  } catch (const zero8::Error& e) {
    char line[4096];
    std::snprintf(line, sizeof(line), "ZERO8_FAULT rank=%d code=%s detect=%.3f error=%s\n", me, code_name(e.code()),
                  now_s() - t_op, e.what());
    std::fputs(line, stderr);
    std::fflush(stderr);
    // mpirun stops forwarding output as soon as it aborts the job (when the first rank exits
    // non-zero), so the driver reads each rank's line from a file as well.
    if (const char* dir = std::getenv("ZERO8_FAULT_DIR")) {
      const std::string path = std::string(dir) + "/rank" + std::to_string(me) + ".txt";
      if (FILE* f = std::fopen(path.c_str(), "w")) {
        std::fputs(line, f);
        std::fclose(f);
      }
    }
    return 1;
  }
}
