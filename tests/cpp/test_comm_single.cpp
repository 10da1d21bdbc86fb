// The single-process communicator: every op is a local copy with the MPI semantics of size 1, no
// byte is counted as sent, splits and topology helpers degenerate correctly; the factory's choices and
// errors; bucket collectives at size 1 (the owner's own range is exact, all-gather round-trips).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "zero8/comm/communicator.h"
#include "zero8/comm/quantized.h"
#include "zero8/error.h"
#include "zero8/kernels/codec.h"
#include "zero8/kernels/dispatch.h"
#include "zero8/sharded.h"

namespace zero8::comm {
namespace {

std::unique_ptr<Communicator> make_single() { return comm_create("single"); }

// A communicator that says its buffers are device memory (as NCCL does) and fails any transfer: code
// that would hand it host buffers must refuse it before the first call (NCCL would crash on them).
class FakeDeviceComm final : public Communicator {
 public:
  FakeDeviceComm() : Communicator(0, 1, "world", {0}, 300.0) {}
  std::string description() const override { return "fake device communicator"; }
  const char* backend() const override { return "nccl"; }
  MemSpace memory() const override { return MemSpace::device; }
  [[noreturn]] void abort(int) override { std::abort(); }

 protected:
  [[noreturn]] static void called() { ZERO8_THROW(internal, "a host buffer reached the device communicator"); }
  void do_all_to_all_v(const void*, const int64_t*, const int64_t*, void*, const int64_t*, const int64_t*,
                       OpKind) override { called(); }
  void do_all_gather_v(const void*, int64_t, void*, const int64_t*, const int64_t*, OpKind) override { called(); }
  void do_broadcast(void*, int64_t, int) override { called(); }
  void do_barrier() override { called(); }
  void do_send(const void*, int64_t, int, int) override { called(); }
  void do_recv(void*, int64_t, int, int) override { called(); }
  std::unique_ptr<Communicator> do_split(int, int, const std::string&) override { called(); }
};

void expect_host_memory_refused(const std::function<void()>& f, const std::string& arg, const std::string& user) {
  try {
    f();
    ADD_FAILURE() << user << ": expected an error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << m;
    EXPECT_NE(m.find("invalid argument '" + arg + "': " + user + " passes host buffers to the communicator, but "
                     "'world' (nccl) takes device memory only"),
              std::string::npos) << m;
  }
}

TEST(CommHostMemory, DeviceCommunicatorIsRefusedWhereHostBuffersAreUsed) {
  FakeDeviceComm dev;
  expect_host_memory_refused([&] { node_groups(dev); }, "world", "node_groups");
  shard::ShardConfig cfg;
  const std::vector<shard::ParamSpec> params = {{"w", {64}}};
  expect_host_memory_refused([&] { shard::ShardedOptimizer opt(params, cfg, dev); }, "dp", "ShardedOptimizer");
  auto single = make_single();
  EXPECT_NO_THROW(check_host_memory(*single, "comm", "test"));
  EXPECT_NO_THROW(shard::ShardedOptimizer(params, cfg, *single));
}

TEST(CommSingle, Basics) {
  auto c = make_single();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_STREQ(c->backend(), "single");
  EXPECT_EQ(c->memory(), MemSpace::host);
  EXPECT_EQ(c->name(), "world");
  EXPECT_EQ(c->world_rank(0), 0);
  EXPECT_NE(c->description().find("single"), std::string::npos);
}

// What "auto" stands for: the single backend outside an MPI launcher; under one, MPI, and for device
// buffers NCCL when it started several processes and zero8 has NCCL.
TEST(CommSingle, AutoBackendByMemory) {
  unsetenv("OMPI_COMM_WORLD_SIZE");
  unsetenv("PMI_SIZE");
  EXPECT_EQ(comm_auto_backend(MemSpace::host), "single");
  EXPECT_EQ(comm_auto_backend(MemSpace::device), "single");
  setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
  const std::string one = ZERO8_WITH_MPI ? "mpi" : "single";
  EXPECT_EQ(comm_auto_backend(MemSpace::host), one);
  EXPECT_EQ(comm_auto_backend(MemSpace::device), one);  // one process: no NCCL
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  EXPECT_EQ(comm_auto_backend(MemSpace::host), "mpi");
  EXPECT_EQ(comm_auto_backend(MemSpace::device), ZERO8_WITH_NCCL ? "nccl" : "mpi");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  setenv("PMI_SIZE", "2", 1);
  EXPECT_EQ(comm_auto_backend(MemSpace::device), ZERO8_WITH_NCCL ? "nccl" : "mpi");
  unsetenv("PMI_SIZE");
  // srun --mpi=pmix: PMIX_RANK, and SLURM's task count as the size.
  setenv("PMIX_RANK", "0", 1);
  setenv("SLURM_NTASKS", "2", 1);
  EXPECT_EQ(comm_auto_backend(MemSpace::host), "mpi");
  EXPECT_EQ(comm_auto_backend(MemSpace::device), ZERO8_WITH_NCCL ? "nccl" : "mpi");
  unsetenv("PMIX_RANK");
  unsetenv("SLURM_NTASKS");
  EXPECT_EQ(comm_create("single")->device(), -1);
}

TEST(CommSingle, FactoryChoicesAndErrors) {
  // Outside any MPI launcher, "auto" is the single-process backend.
  unsetenv("OMPI_COMM_WORLD_SIZE");
  unsetenv("PMI_SIZE");
  EXPECT_STREQ(comm_create("auto")->backend(), "single");
  EXPECT_STREQ(comm_create()->backend(), "single");
  try {
    comm_create("gloo");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("gloo"), std::string::npos);
  }
  EXPECT_TRUE(comm_backend_available("single"));
  EXPECT_EQ(comm_backend_available("mpi"), ZERO8_WITH_MPI != 0);
  EXPECT_EQ(comm_backend_available("nccl"), ZERO8_WITH_NCCL != 0);
  EXPECT_FALSE(comm_backend_available("gloo"));
#if !ZERO8_WITH_MPI
  try {
    comm_create("mpi");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("not built with MPI"), std::string::npos) << e.what();
  }
  // Started by mpirun with 4 processes but unable to talk: refusing beats 4 silent solo runs.
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  try {
    comm_create("auto");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("not built with MPI"), std::string::npos) << e.what();
  }
  setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
  EXPECT_STREQ(comm_create("auto")->backend(), "single");
  unsetenv("OMPI_COMM_WORLD_SIZE");
#endif
#if !ZERO8_WITH_NCCL || !ZERO8_WITH_MPI
  // Without NCCL, or with NCCL but without MPI to bootstrap it, "nccl" is unsupported, saying why.
  try {
    comm_create("nccl");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find(ZERO8_WITH_NCCL ? "without MPI" : "not built with NCCL"), std::string::npos)
        << e.what();
  }
#endif
}

// NCCL is bootstrapped over a tcp or MPI world only: another host (or none) is refused by name, before
// anything else (a device, NCCL itself) is looked at.
TEST(CommSingle, NcclOverAnotherHostIsRefused) {
  for (bool null_host : {true, false}) {
    try {
      nccl_create_over(null_host ? nullptr : comm_create("single"));
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      const std::string what = e.what();
      EXPECT_NE(what.find("invalid argument 'host'"), std::string::npos) << what;
      EXPECT_NE(what.find(null_host ? "null" : "single-process communicator 'world' (rank 0 of 1"), std::string::npos)
          << what;
      const std::string why =
          null_host ? "" : "cannot bootstrap NCCL: pass a communicator of the 'tcp' or 'mpi' backend";
      EXPECT_NE(what.find(why), std::string::npos) << what;
    }
  }
}

// torchrun and DeepSpeed's launcher set WORLD_SIZE but start no MPI: each rank would make a world of one
// and train alone. Refused by name for the backends that would do so; "single" by name, and WORLD_SIZE 1,
// still work, and under an MPI launcher WORLD_SIZE is zero8-launch's own.
TEST(CommSingle, SeveralRanksWithoutAnMpiLauncherAreRefused) {
  unsetenv("OMPI_COMM_WORLD_SIZE");
  unsetenv("PMI_SIZE");
  setenv("WORLD_SIZE", "2", 1);
  for (const char* backend : {"auto", "mpi", "nccl"}) {
    try {
      comm_create(backend);
      ADD_FAILURE() << backend << ": expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << backend;
      const std::string what = e.what();
      EXPECT_NE(what.find(std::string("communicator backend '") + backend + "': WORLD_SIZE is 2, but no MPI "
                                                                            "launcher started this process"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("zero8-launch --num_procs 2"), std::string::npos) << what;
    }
  }
  EXPECT_STREQ(comm_create("single")->backend(), "single");
  setenv("WORLD_SIZE", "1", 1);
  EXPECT_STREQ(comm_create("auto")->backend(), "single");
  unsetenv("WORLD_SIZE");
}

// torchrun under an MPI launcher (`mpirun -np 1 torchrun --nproc_per_node 2`, `srun --mpi=pmix torchrun`):
// its workers inherit the launcher's variables, but their world is torchrun's. Not MPI ranks where
// TORCHELASTIC_RUN_ID is set or RANK/WORLD_SIZE differ from the launcher's; zero8-launch's wrapper sets
// equal ones, and stays MPI.
TEST(CommSingle, TorchrunUnderAnMpiLauncherIsNotAnMpiRank) {
  struct Case {
    std::vector<std::pair<const char*, const char*>> env;
    bool mpi_rank;
    std::string why;
  };
  const std::vector<Case> cases = {
      {{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}, {"TORCHELASTIC_RUN_ID", "j"}, {"RANK", "0"},
        {"WORLD_SIZE", "2"}},
       false, "TORCHELASTIC_RUN_ID is set: torchrun started it"},
      {{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}},
       false, "RANK 1 is not the MPI launcher's OMPI_COMM_WORLD_RANK 0"},
      {{{"PMIX_RANK", "1"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"RANK", "1"}, {"WORLD_SIZE", "8"}},
       false, "WORLD_SIZE 8 is not the MPI launcher's SLURM_STEP_NUM_TASKS 2"},
      {{{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"RANK", "3"}, {"WORLD_SIZE", "4"}}, true, ""},  // zero8-launch
      {{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}}, true, ""},
      {{{"PMIX_RANK", "0"}, {"SLURM_NTASKS", "2"}}, true, ""},
  };
  const char* vars[] = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK",
                        "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"};
  for (const Case& c : cases) {
    for (const char* v : vars) unsetenv(v);
    for (const auto& [k, v] : c.env) setenv(k, v, 1);
    // Without MPI "auto" still says "mpi" for several ranks, so that creating it names what is missing.
    EXPECT_EQ(comm_auto_backend(MemSpace::host), c.mpi_rank ? "mpi" : "single") << c.why;
    if (c.mpi_rank) continue;
    for (const char* backend : {"auto", "mpi"}) {
      try {
        comm_create(backend);
        ADD_FAILURE() << backend << ": expected an error (" << c.why << ")";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
        const std::string what = e.what();
        EXPECT_NE(what.find("is not one of the ranks of the MPI launcher whose variables it has (" + c.why),
                  std::string::npos)
            << what;
        EXPECT_NE(what.find("use the 'tcp' backend"), std::string::npos) << what;
      }
    }
  }
  for (const char* v : vars) unsetenv(v);
}

// srun without PMI (MpiDefault=none, no --mpi) sets SLURM_PROCID but neither PMI's variables nor
// WORLD_SIZE: "auto" would make a world of one on every task. Refused when the step has several tasks,
// naming the ways out; a batch script's own python (a step of one task), and "single" by name, work.
TEST(CommSingle, SrunTasksWithoutPmiAreRefused) {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"})
    unsetenv(v);
  setenv("SLURM_PROCID", "2", 1);
  setenv("SLURM_STEP_NUM_TASKS", "4", 1);
  EXPECT_EQ(comm_auto_backend(MemSpace::host), "single");
  for (const char* backend : {"auto", "mpi", "nccl"}) {
    try {
      comm_create(backend);
      ADD_FAILURE() << backend << ": expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
      const std::string what = e.what();
      for (const std::string& part :
           {std::string("communicator backend '") + backend + "': srun started this process as task 2 of 4 "
                                                              "(SLURM_PROCID, SLURM_STEP_NUM_TASKS) without PMI",
            std::string("srun --mpi=pmix"), std::string("torchrun under srun"),
            std::string("zero8-launch --launcher slurm"), std::string("\"comm_backend\": \"single\"")})
        EXPECT_NE(what.find(part), std::string::npos) << what;
    }
  }
  EXPECT_STREQ(comm_create("single")->backend(), "single");
  setenv("SLURM_STEP_NUM_TASKS", "1", 1);  // the batch step
  EXPECT_STREQ(comm_create("auto")->backend(), "single");
  unsetenv("SLURM_STEP_NUM_TASKS");
  setenv("SLURM_NTASKS", "4", 1);  // the allocation's count, in the batch script
  EXPECT_STREQ(comm_create("auto")->backend(), "single");
  unsetenv("SLURM_NTASKS");
  unsetenv("SLURM_PROCID");
}

TEST(CommSingle, TimeoutFromEnvironment) {
  setenv("ZERO8_COMM_TIMEOUT", "7.5", 1);
  EXPECT_EQ(make_single()->timeout(), 7.5);
  setenv("ZERO8_COMM_TIMEOUT", "soon", 1);
  EXPECT_THROW(make_single(), Error);
  setenv("ZERO8_COMM_TIMEOUT", "-3", 1);
  EXPECT_THROW(make_single(), Error);
  // The range set_timeout takes: an accepted value can be set back (1e300 was taken, then refused by it).
  setenv("ZERO8_COMM_TIMEOUT", "1e9", 1);
  auto c = make_single();
  c->set_timeout(c->timeout());
  EXPECT_EQ(c->timeout(), 1e9);
  setenv("ZERO8_COMM_TIMEOUT", "1e300", 1);
  try {
    make_single();
    ADD_FAILURE() << "ZERO8_COMM_TIMEOUT=1e300 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ZERO8_COMM_TIMEOUT='1e300' is not a number of seconds in (0, 1e9]"),
              std::string::npos) << e.what();
  }
  unsetenv("ZERO8_COMM_TIMEOUT");
  EXPECT_EQ(make_single()->timeout(), 600.0);  // torch's NCCL default, 10 minutes
}

TEST(CommSingle, DataMovementIsACopy) {
  auto c = make_single();
  std::vector<uint8_t> src(37), dst(37, 0);
  std::iota(src.begin(), src.end(), uint8_t(1));
  c->all_to_all(src.data(), dst.data(), 37);
  EXPECT_EQ(src, dst);
  std::fill(dst.begin(), dst.end(), 0);
  c->all_gather(src.data(), dst.data(), 37);
  EXPECT_EQ(src, dst);
  // v-variants honour displacements.
  std::vector<uint8_t> out(50, 0xAA);
  c->all_to_all_v(src.data(), {20}, {3}, out.data(), {20}, {9});
  for (int i = 0; i < 20; ++i) EXPECT_EQ(out[size_t(9 + i)], src[size_t(3 + i)]);
  EXPECT_EQ(out[8], 0xAA);
  EXPECT_EQ(out[29], 0xAA);
  std::vector<uint8_t> g(40, 0x11);
  c->all_gather_v(src.data(), 11, g.data(), {11}, {5});
  for (int i = 0; i < 11; ++i) EXPECT_EQ(g[size_t(5 + i)], src[size_t(i)]);
  c->all_gather_v(g.data() + 5, 11, g.data(), {11}, {5});  // in place
  for (int i = 0; i < 11; ++i) EXPECT_EQ(g[size_t(5 + i)], src[size_t(i)]);
  std::vector<uint8_t> b = src;
  c->broadcast(b.data(), 37, 0);
  EXPECT_EQ(b, src);
  c->barrier();
}

TEST(CommSingle, ReductionsReturnTheInput) {
  auto c = make_single();
  std::vector<float> x = {1.5f, -2.0f, std::nanf(""), 3.0f};
  std::vector<float> y(4, 0.0f);
  c->all_reduce(x.data(), y.data(), 4, ScalarType::f32, ReduceOp::sum);
  EXPECT_EQ(std::memcmp(x.data(), y.data(), 16), 0);
  std::vector<double> d = {1.0, 2.0};
  c->all_reduce(d.data(), 2, ReduceOp::max);
  EXPECT_EQ(d, (std::vector<double>{1.0, 2.0}));
  std::vector<int64_t> rs_in = {4, 5, 6}, rs_out(3);
  c->reduce_scatter(rs_in.data(), rs_out.data(), {3}, ScalarType::i64);
  EXPECT_EQ(rs_out, rs_in);
  EXPECT_EQ(c->all_reduce_value<int32_t>(9, ReduceOp::min), 9);
}

TEST(CommSingle, StatsCountCallsButNoBytes) {
  auto c = make_single();
  std::vector<float> x(100, 1.0f);
  c->all_reduce(x.data(), 100, ReduceOp::sum);
  c->all_gather(x.data(), x.data(), 0);
  c->barrier();
  const CommStats s = c->stats();
  EXPECT_EQ(s.op(OpKind::all_reduce).calls, 1u);
  EXPECT_EQ(s.op(OpKind::all_gather).calls, 1u);
  EXPECT_EQ(s.op(OpKind::barrier).calls, 1u);
  EXPECT_EQ(s.bytes(), 0u);
  EXPECT_EQ(s.bytes_to_peer(), std::vector<uint64_t>{0});
  c->stats_reset();
  EXPECT_EQ(c->stats().op(OpKind::all_reduce).calls, 0u);
}

TEST(CommSingle, PointToPointHasNoPeer) {
  auto c = make_single();
  uint8_t b = 0;
  EXPECT_THROW(c->send(&b, 1, 0), Error);
  EXPECT_THROW(c->recv(&b, 1, 0), Error);
  EXPECT_THROW(c->send(&b, 1, 1), Error);
}

TEST(CommSingle, SplitAndTopology) {
  auto c = make_single();
  c->set_timeout(42.0);
  auto child = c->split(3, 0, "mine");
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(child->size(), 1);
  EXPECT_EQ(child->name(), "mine");
  EXPECT_EQ(child->timeout(), 42.0);
  EXPECT_EQ(c->split(Communicator::kNoColor, 0), nullptr);
  EXPECT_THROW(c->split(-2, 0), Error);
  Topology t = topology_split(*c, 1);
  EXPECT_EQ(t.dp, 1);
  EXPECT_EQ(t.pp, 1);
  EXPECT_EQ(t.dp_group->size(), 1);
  EXPECT_EQ(t.pp_group->size(), 1);
  EXPECT_EQ(t.dp_group->name(), "dp[stage 0]");
  EXPECT_THROW(topology_split(*c, 2), Error);
  NodeGroups g = node_groups(*c);
  EXPECT_EQ(g.nodes, 1);
  EXPECT_EQ(g.local_rank, 0);
  EXPECT_EQ(g.intra->size(), 1);
  EXPECT_EQ(g.inter->size(), 1);
}

TEST(CommSingle, ArgumentChecks) {
  auto c = make_single();
  uint8_t b[4] = {0};
  EXPECT_THROW(c->all_to_all(b, b, -1), Error);
  EXPECT_THROW(c->all_to_all_v(b, {1, 1}, {0, 1}, b, {1, 1}, {0, 1}), Error);  // 2 entries for size 1
  EXPECT_THROW(c->all_to_all_v(b, {2}, {0}, b, {1}, {0}), Error);              // self chunk mismatch
  EXPECT_THROW(c->all_gather_v(b, 2, b, {3}, {0}), Error);
  EXPECT_THROW(c->broadcast(b, 1, 1), Error);
  EXPECT_THROW(c->reduce_scatter(b, b, {1}, ScalarType::u8), Error);  // recv overlaps send
  EXPECT_THROW(c->all_reduce(b, b + 1, 2, ScalarType::u8, ReduceOp::sum), Error);  // partial overlap
  EXPECT_THROW(c->all_reduce(b, b, 1, ScalarType(9), ReduceOp::sum), Error);
  EXPECT_THROW(c->set_timeout(0), Error);
}

// ---- bucket collectives at size 1 ----

std::vector<float> sample(int64_t n) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = std::ldexp(rng_uniform(5, uint64_t(i)) - 0.5f, int(i % 13) - 6);
  return x;
}

TEST(CommSingle, WireBytes) {
  EXPECT_EQ(wire_bytes(WireFormat::f32, 1000, 2048), 4000);
  EXPECT_EQ(wire_bytes(WireFormat::bf16, 1000, 2048), 2000);
  EXPECT_EQ(wire_bytes(WireFormat::int8, 2048 * 3 + 1, 2048), 2048 * 3 + 1 + 4 * 4);
  EXPECT_EQ(wire_bytes(WireFormat::int8, 0, 2048), 0);
}

TEST(CommSingle, BucketReduceScatterOfOneRankIsExact) {
  auto c = make_single();
  const int64_t n = 2048 * 2 + 99;
  const std::vector<float> x = sample(n);
  for (WireFormat f : {WireFormat::f32, WireFormat::bf16, WireFormat::int8}) {
    std::vector<float> out(static_cast<size_t>(n)), residual(static_cast<size_t>(n), 0.0f);
    WireOptions opt;
    opt.format = f;
    bucket_reduce_scatter(*c, x.data(), n, {0, n}, out.data(), opt, residual.data());
    // The owner's own contribution never crosses the wire, so it is never quantized.
    EXPECT_EQ(std::memcmp(out.data(), x.data(), size_t(n) * 4), 0) << wire_format_name(f);
    EXPECT_EQ(residual, std::vector<float>(size_t(n), 0.0f));
  }
}

TEST(CommSingle, BucketAllGatherRoundTripsThroughTheWireFormat) {
  auto c = make_single();
  const int64_t n = 2048 * 2 + 99;
  const std::vector<float> x = sample(n);
  // int8: the same bits as encoding and decoding the bucket directly with the codec.
  {
    std::vector<uint8_t> codes(static_cast<size_t>(n));
    std::vector<float> absmax(3), want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
    quant::EncodeArgs e;
    e.x = x.data();
    e.n = n;
    e.block = 2048;
    e.table = &quant::table_get(quant::MapKind::dynamic_signed);
    e.codes = codes.data();
    e.absmax = absmax.data();
    quant::quant_encode_ref(e);
    quant::DecodeArgs d;
    d.codes = codes.data();
    d.absmax = absmax.data();
    d.n = n;
    d.block = 2048;
    d.table = e.table;
    d.y = want.data();
    quant::quant_decode_ref(d);
    bucket_all_gather(*c, x.data(), n, {0, n}, got.data(), WireOptions{});
    EXPECT_EQ(std::memcmp(got.data(), want.data(), size_t(n) * 4), 0);
    EXPECT_NE(std::memcmp(got.data(), x.data(), size_t(n) * 4), 0) << "int8 wire should be lossy";
  }
  {
    WireOptions opt;
    opt.format = WireFormat::bf16;
    std::vector<float> got(static_cast<size_t>(n));
    bucket_all_gather(*c, x.data(), n, {0, n}, got.data(), opt);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[size_t(i)], bf16_to_f32(f32_to_bf16(x[size_t(i)])));
  }
  {
    WireOptions opt;
    opt.format = WireFormat::f32;
    std::vector<float> got(static_cast<size_t>(n));
    bucket_all_gather(*c, x.data(), n, {0, n}, got.data(), opt);
    EXPECT_EQ(got, x);
  }
}

TEST(CommSingle, BucketArgumentChecks) {
  auto c = make_single();
  std::vector<float> x(100), out(100);
  WireOptions opt;
  EXPECT_THROW(bucket_reduce_scatter(*c, x.data(), 100, {0, 99}, out.data(), opt), Error);   // does not end at n
  EXPECT_THROW(bucket_reduce_scatter(*c, x.data(), 100, {0}, out.data(), opt), Error);       // too few offsets
  EXPECT_THROW(bucket_reduce_scatter(*c, x.data(), 100, {0, 100}, x.data(), opt), Error);    // out overlaps
  opt.block = 1000;                                                                            // not a power of two
  EXPECT_THROW(bucket_all_gather(*c, x.data(), 100, {0, 100}, out.data(), opt), Error);
  opt.block = 2048;
  opt.format = WireFormat(7);
  EXPECT_THROW(bucket_all_gather(*c, x.data(), 100, {0, 100}, out.data(), opt), Error);
}

// A one-rank communicator whose broadcast waits at a gate until the test opens it, so a test can
// hold one thread inside a call as long as it likes; other ops are the one-rank local copies.
class GateComm final : public Communicator {
 public:
  GateComm() : Communicator(0, 1, "world", {0}, 300.0) {}
  std::string description() const override { return "gate communicator"; }
  const char* backend() const override { return "single"; }
  MemSpace memory() const override { return MemSpace::host; }
  [[noreturn]] void abort(int) override { std::abort(); }
  void wait_entered() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return entered_; });
  }
  std::atomic<bool> forked{false};
  void open() {
    std::lock_guard<std::mutex> lk(mu_);
    open_ = true;
    cv_.notify_all();
  }

 protected:
  void do_all_to_all_v(const void* send, const int64_t* sb, const int64_t* sd, void* recv, const int64_t*,
                       const int64_t* rd, OpKind) override {
    std::memmove(static_cast<char*>(recv) + rd[0], static_cast<const char*>(send) + sd[0], size_t(sb[0]));
  }
  void do_all_gather_v(const void* send, int64_t bytes, void* recv, const int64_t*, const int64_t* rd,
                       OpKind) override {
    std::memmove(static_cast<char*>(recv) + rd[0], send, size_t(bytes));
  }
  void do_broadcast(void*, int64_t, int) override {
    std::unique_lock<std::mutex> lk(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lk, [&] { return open_; });
  }
  // As MpiComm in a fork()ed child, when `forked` is set.
  void check_process(OpKind kind) const override {
    if (forked) ZERO8_THROW(comm, op_label(kind) << ": this communicator cannot be used after fork()");
  }
  void do_barrier() override {}
  void do_send(const void*, int64_t, int, int) override {}
  void do_recv(void*, int64_t, int, int) override {}
  std::unique_ptr<Communicator> do_split(int, int, const std::string&) override { return nullptr; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false, open_ = false;
};

// Background work (a sharded optimizer's deferred all-gather): a call from any thread but the one that
// runs it waits for it first, on any communicator; the runner's own calls do not; removed, nothing waits.
TEST(CommThreads, CallsFromOtherThreadsWaitForBackgroundWork) {
  GateComm c, other;
  int owner = 0, waits = 0;
  std::thread runner;  // stands for the optimizer's thread
  std::mutex mu;
  std::condition_variable cv;
  bool go = false, done = false;
  runner = std::thread([&] {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return go; });
    c.barrier();  // the runner's own call: must not wait for its own work
    done = true;
    cv.notify_all();
  });
  add_background_work(&owner, runner.get_id(), [&] { ++waits; });
  c.barrier();
  other.barrier();
  EXPECT_EQ(waits, 2);
  {
    std::unique_lock<std::mutex> lk(mu);
    go = true;
    cv.notify_all();
    cv.wait(lk, [&] { return done; });
  }
  runner.join();
  EXPECT_EQ(waits, 2);
  remove_background_work(&owner);
  c.barrier();
  EXPECT_EQ(waits, 2);
  EXPECT_EQ(c.stats().op(OpKind::barrier).calls, 3u);
}

// A wait that another thread runs when its owner removes the entry ends before the removal returns, so
// the owner may go away right after (a sharded optimizer's destructor); a wait may remove its own entry.
TEST(CommThreads, RemovingBackgroundWorkWaitsForOtherThreadsRunningIt) {
  GateComm c;
  std::atomic<bool> alive{true}, started{false}, ran_after_death{false};
  int owner = 0;
  add_background_work(&owner, std::thread::id{}, [&] {
    started = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (!alive) ran_after_death = true;
  });
  std::thread caller([&] { c.barrier(); });  // runs the wait
  while (!started) std::this_thread::yield();
  remove_background_work(&owner);
  alive = false;  // the owner is gone
  caller.join();
  EXPECT_FALSE(ran_after_death);

  int self_removing = 0, runs = 0;
  add_background_work(&self_removing, std::thread::id{}, [&] {
    ++runs;
    remove_background_work(&self_removing);
  });
  c.barrier();
  c.barrier();
  EXPECT_EQ(runs, 1);
}

// Two threads' calls on one communicator must not overlap (MPI needs every rank's collectives in
// one order): the second is refused, naming both ops, and the first completes untouched.
TEST(CommThreads, OverlappingCallFromAnotherThreadIsRefused) {
  GateComm c;
  int32_t value = 7;
  std::string first_error;
  std::thread first([&] {
    try {
      c.broadcast(&value, sizeof(value), 0);
    } catch (const std::exception& e) {
      first_error = e.what();
    }
  });
  c.wait_entered();
  int32_t x = 5, y = 0;
  try {
    c.all_reduce(&x, &y, 1, ScalarType::i32, ReduceOp::sum);
    ADD_FAILURE() << "all_reduce during another thread's broadcast: expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("all_reduce called while broadcast is still running on communicator "
                                         "'world' (rank 0 of 1) from another thread; zero8 calls on one "
                                         "communicator must not overlap"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(c.barrier(), Error);
  c.open();
  first.join();
  EXPECT_EQ(first_error, "");
  EXPECT_EQ(value, 7);
  // The refused calls did nothing: not counted, not numbered, and the communicator works on.
  EXPECT_EQ(c.stats().op(OpKind::all_reduce).calls, 0u);
  EXPECT_EQ(c.stats().op(OpKind::barrier).calls, 0u);
  EXPECT_EQ(c.all_reduce_value<int32_t>(5, ReduceOp::sum), 5);
  c.barrier();
  EXPECT_EQ(c.stats().op(OpKind::barrier).calls, 1u);
}

// A fork()ed child inherits the communicator as it was at fork(), with the call another thread of the
// parent was running then: the child's calls must report the fork, not an overlap with that call.
TEST(CommThreads, ForkedChildIsToldOfTheForkNotOfAnInheritedCall) {
  GateComm c;
  int32_t value = 7;
  std::thread first([&] {
    try {
      c.broadcast(&value, sizeof(value), 0);
    } catch (const std::exception&) {
    }
  });
  c.wait_entered();
  c.forked = true;
  try {
    c.barrier();
    ADD_FAILURE() << "barrier in the \"forked\" communicator: expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::comm) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot be used after fork()"), std::string::npos) << e.what();
  }
  c.forked = false;
  c.open();
  first.join();
  c.barrier();
  EXPECT_EQ(c.stats().op(OpKind::barrier).calls, 1u);
}

}  // namespace
}  // namespace zero8::comm
