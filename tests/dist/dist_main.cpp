// main() of the multi-rank tests (run as `mpirun -np K test_dist_comm`): creates the MPI world
// communicator, runs every test on every rank, prints failures with the rank, and makes all ranks
// exit with the same status (any rank failing fails the job).
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>

#include "dist_env.h"
#include "zero8/error.h"

namespace zero8::test {

namespace {
comm::Communicator* g_world = nullptr;

// Ranks other than 0 print only failures, prefixed by their rank, to keep the log readable.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                 r.line_number(), r.summary());
  }

 private:
  int rank_;
};
}  // namespace

comm::Communicator& world() { return *g_world; }

}  // namespace zero8::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<zero8::comm::Communicator> comm;
  try {
    comm = zero8::comm::comm_create("mpi");
  } catch (const zero8::Error& e) {
    std::fprintf(stderr, "cannot create the MPI communicator: %s\n", e.what());
    return 2;
  }
  zero8::test::g_world = comm.get();
  if (comm->rank() != 0) {
    ::testing::TestEventListeners& l = ::testing::UnitTest::GetInstance()->listeners();
    delete l.Release(l.default_result_printer());
    l.Append(new zero8::test::RankFailurePrinter(comm->rank()));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  try {
    failed = comm->all_reduce_value<int32_t>(failed, zero8::comm::ReduceOp::max);
  } catch (const zero8::Error& e) {
    std::fprintf(stderr, "[rank %d] final result exchange failed: %s\n", comm->rank(), e.what());
    return 3;
  }
  if (failed && comm->rank() == 0) std::fprintf(stderr, "a test failed on at least one rank\n");
  zero8::test::g_world = nullptr;
  comm.reset();
  return failed;
}
