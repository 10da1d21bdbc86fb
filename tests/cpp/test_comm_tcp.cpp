// The tcp backend (comm/src/comm_tcp.cpp): ranks as threads of this process, each with its own world made
// by tcp_create over an in-memory exchange, on 1 to 4 ranks: every op against the obvious answer (sums
// bit for bit equal to a serial left fold), the byte counters' formulas, splits, large transfers both
// ways at once; mismatched sizes and collectives, a timeout; and, with ranks as fork()ed processes, a
// death, a normal shutdown, a forked child of a rank, and a live peer that leaves its receive window shut
// for longer than the link timeout (not a lost host; tests/python/test_multinode.py cuts real links).
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "comm_op_checks.h"
#include "zero8/comm/communicator.h"
#include "zero8/error.h"
#include "zero8/kernels/hd.h"

namespace zero8::comm {
namespace {

// This host's name, as the tcp backend publishes it.
std::string detail_host() {
  char buf[256] = {0};
  return gethostname(buf, sizeof(buf) - 1) == 0 ? std::string(buf) : std::string("localhost");
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The rendezvous of ranks that are threads: each posts its contact string and waits for all of them.
class Board {
 public:
  explicit Board(int n) : slots_(static_cast<size_t>(n)) {}
  std::vector<std::string> exchange(int rank, const std::string& mine) {
    std::unique_lock<std::mutex> lk(mu_);
    slots_[size_t(rank)] = mine;
    ++posted_;
    cv_.notify_all();
    if (!cv_.wait_for(lk, std::chrono::seconds(30), [&] { return posted_ == int(slots_.size()); }))
      throw std::runtime_error("board: not every rank posted its contact string within 30 s");
    return slots_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> slots_;
  int posted_ = 0;
};

// Runs fn on n ranks, each a thread with its own world.
void run_ranks(int n, const std::function<void(Communicator&)>& fn) {
  Board board(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<Communicator> c =
            tcp_create(r, n, [&](const std::string& mine) { return board.exchange(r, mine); });
        fn(*c);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << " of " << n << ": " << e.what();
      }
    });
  for (std::thread& t : threads) t.join();
}

// Error(comm) whose message holds every one of `parts`.
void expect_comm_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected Error(comm) with '" << parts[0] << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::comm) << e.what();
    for (const std::string& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(CommTcp, BasicsOnOneToFourRanks) {
  for (int n = 1; n <= 4; ++n)
    run_ranks(n, [n](Communicator& c) {
      EXPECT_EQ(c.size(), n);
      EXPECT_STREQ(c.backend(), "tcp");
      EXPECT_EQ(c.memory(), MemSpace::host);
      EXPECT_TRUE(c.calls_from_any_thread());
      EXPECT_EQ(c.device(), -1);
      EXPECT_EQ(c.name(), "world");
      for (int r = 0; r < n; ++r) EXPECT_EQ(c.world_rank(r), r);
      const std::string d = c.description();
      EXPECT_EQ(
          d.rfind("tcp communicator 'world' (rank " + std::to_string(c.rank()) + " of " + std::to_string(n) + ", host ",
                  0),
          0u)
          << d;
      EXPECT_NE(d.find(", listening "), std::string::npos) << d;
      c.barrier();
      EXPECT_EQ(c.stats().op(OpKind::barrier).calls, 1u);
      EXPECT_EQ(c.stats().bytes(), 0u);
    });
}

TEST(CommTcp, FactoryNamesTheRendezvous) {
  EXPECT_TRUE(comm_backend_available("tcp"));
  try {
    comm_create("tcp");
    ADD_FAILURE() << "comm_create(\"tcp\"): expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("needs a rendezvous"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("tcp_create"), std::string::npos) << e.what();
  }
  try {
    comm_create("gloo");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mpi, nccl or tcp"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tcp_create(2, 2, [](const std::string& s) { return std::vector<std::string>{s, s}; }), Error);
  EXPECT_THROW(tcp_create(0, 1, AddressExchange()), Error);
}

// What comes back from the exchange is checked: the count, the format, this rank's own string.
TEST(CommTcp, ExchangeResultsAreChecked) {
  auto fails_with = [](const AddressExchange& x, const std::string& part) {
    try {
      tcp_create(0, 2, x);
      ADD_FAILURE() << "expected an error with '" << part << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::comm) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  fails_with([](const std::string& s) { return std::vector<std::string>{s}; }, "returned 1 contact strings for 2");
  fails_with(
      [](const std::string& s) {
        return std::vector<std::string>{s, "hello"};
      },
      "rank 1's contact string 'hello' is not a zero8 tcp address");
  fails_with([](const std::string& s) { return std::vector<std::string>{s + "x", s}; }, "must come back in rank order");
  // A rank that could not listen publishes why; every other rank raises it.
  fails_with(
      [](const std::string& s) {
        return std::vector<std::string>{s, "zero8-tcp/1 - 0123456789abcdef host9 cannot listen on 10.9.9.9"};
      },
      "rank 1 cannot join: cannot listen on 10.9.9.9");
  // A bad address of this host: published, then raised as the invalid setting it is.
  setenv("ZERO8_COMM_IFADDR", "not-an-ip", 1);
  std::string published;
  try {
    tcp_create(0, 1, [&](const std::string& s) {
      published = s;
      return std::vector<std::string>{s};
    });
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
  }
  unsetenv("ZERO8_COMM_IFADDR");
  EXPECT_EQ(published.rfind("zero8-tcp/1 - ", 0), 0u) << published;
  EXPECT_NE(published.find("ZERO8_COMM_IFADDR"), std::string::npos) << published;
}

// A stale address in the rendezvous, now another job's: refused by the handshake, naming it.
TEST(CommTcp, AnotherJobsRankIsRefused) {
  Board other(2);
  setenv("ZERO8_COMM_TIMEOUT", "1.5", 1);
  std::thread a0([&] {
    // Job A's rank 0 waits for a rank 1 that never comes; job B's rank 1 knocks instead.
    try {
      tcp_create(0, 2, [&](const std::string& mine) { return other.exchange(0, mine); });
      ADD_FAILURE() << "job A rank 0: expected a timeout";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 did not connect to this rank at "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("its job token differs"), std::string::npos) << e.what();
    }
  });
  try {
    tcp_create(1, 2, [&](const std::string& mine) {
      std::vector<std::string> a = other.exchange(1, mine);
      // Job B's rank 0 "is" job A's rank 0, with another token.
      std::string b0 = a[0];
      b0.replace(b0.find(' ', 12) + 1, 16, "00000000deadbeef");
      return std::vector<std::string>{b0, mine};
    });
    ADD_FAILURE() << "job B rank 1: expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to another job"), std::string::npos) << e.what();
  }
  a0.join();
  unsetenv("ZERO8_COMM_TIMEOUT");
}

// A loopback address published where ranks run on different hosts (Debian's "127.0.1.1 hostname", a
// MASTER_ADDR of localhost): every rank fails at once naming the rank, its host and ZERO8_COMM_IFADDR,
// instead of the other hosts retrying it until the timeout. Here each rank is told the other's host
// differs (its own string must come back unchanged).
TEST(CommTcp, LoopbackAddressOfAnotherHostFailsAtOnce) {
  Board board(2);
  setenv("ZERO8_COMM_TIMEOUT", "30", 1);
  setenv("ZERO8_COMM_IFADDR", "127.0.0.1", 1);
  auto elsewhere = [](const std::string& s) { return s.substr(0, s.rfind(' ') + 1) + "elsewhere"; };
  std::vector<std::string> errors(2);
  std::vector<double> took(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      const double t0 = now_s();
      try {
        tcp_create(r, 2, [&](const std::string& mine) {
          std::vector<std::string> all = board.exchange(r, mine);
          all[size_t(1 - r)] = elsewhere(all[size_t(1 - r)]);
          return all;
        });
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::comm) << e.what();
        errors[size_t(r)] = e.what();
      }
      took[size_t(r)] = now_s() - t0;
    });
  for (std::thread& t : threads) t.join();
  unsetenv("ZERO8_COMM_TIMEOUT");
  unsetenv("ZERO8_COMM_IFADDR");
  // Both listen on loopback; each names the first such rank, and a rank on another host than its.
  for (int r = 0; r < 2; ++r) {
    const std::string& what = errors[size_t(r)];
    const std::string host0 = r == 0 ? detail_host() : "elsewhere", host1 = r == 0 ? "elsewhere" : detail_host();
    EXPECT_NE(what.find("tcp_create (rank " + std::to_string(r) + " of 2): rank 0 on host " + host0 +
                        " listens on the loopback address 127.0.0.1:"),
              std::string::npos)
        << "rank " << r << ": " << what;
    EXPECT_NE(what.find("which rank 1 on host " + host1 + " cannot reach: set ZERO8_COMM_IFADDR on " + host0),
              std::string::npos)
        << what;
    EXPECT_LT(took[size_t(r)], 10.0) << what;
  }
}

// The op checks every host backend runs (comm_op_checks.h), on 1 to 4 ranks.
void run_on_one_to_four_ranks(const std::function<void(Communicator&)>& fn) {
  for (int n = 1; n <= 4; ++n) run_ranks(n, fn);
}
TEST(CommTcp, AllToAll) { run_on_one_to_four_ranks(test::check_all_to_all); }
TEST(CommTcp, AllToAllVUnevenSizesWithZeros) { run_on_one_to_four_ranks(test::check_all_to_all_v); }
TEST(CommTcp, AllGatherAndAllGatherVInPlace) { run_on_one_to_four_ranks(test::check_all_gather); }
TEST(CommTcp, BroadcastFromEveryRoot) { run_on_one_to_four_ranks(test::check_broadcast_from_every_root); }
TEST(CommTcp, ReductionsEqualASerialLeftFoldBitForBit) { run_on_one_to_four_ranks(test::check_reductions); }
TEST(CommTcp, NanPropagates) { run_on_one_to_four_ranks(test::check_nan_propagation); }

// Messages with different tags may be received in another order than sent; the same tag keeps its order.
TEST(CommTcp, SendRecvWithInterleavedTags) {
  for (int n = 2; n <= 4; ++n)
    run_ranks(n, [n](Communicator& c) {
      const int me = c.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
      auto payload = [](int src, int tag, int k) {
        std::vector<uint8_t> v(size_t(100 + 17 * k + tag));
        for (size_t i = 0; i < v.size(); ++i) v[i] = test::byte_of(src, tag * 10 + k, int64_t(i));
        return v;
      };
      c.stats_reset();
      uint64_t sent = 0;
      // Small messages: every send completes into the socket buffers, so all ranks may send first.
      for (int k = 0; k < 3; ++k)
        for (int tag : {7, 3}) {
          const std::vector<uint8_t> v = payload(me, tag, k);
          c.send(v.data(), int64_t(v.size()), next, tag);
          sent += v.size();
        }
      for (int tag : {3, 7})
        for (int k = 0; k < 3; ++k) {
          const std::vector<uint8_t> want = payload(prev, tag, k);
          std::vector<uint8_t> got(want.size());
          c.recv(got.data(), int64_t(got.size()), prev, tag);
          ASSERT_EQ(got, want) << "tag " << tag << " message " << k;
        }
      std::vector<uint64_t> want(static_cast<size_t>(n), 0);
      want[size_t(next)] = sent;
      test::expect_peer_bytes(c, OpKind::send, want);
      EXPECT_EQ(c.stats().op(OpKind::recv).calls, 6u);
      EXPECT_EQ(c.stats().op(OpKind::recv).bytes, 0u);
      // A collective between point-to-point calls takes only its own messages.
      const std::vector<uint8_t> v = payload(me, 0, 9);
      c.send(v.data(), int64_t(v.size()), next, 0);
      EXPECT_EQ(c.all_reduce_value<int32_t>(1, ReduceOp::sum), n);
      std::vector<uint8_t> got(v.size());
      c.recv(got.data(), int64_t(got.size()), prev, 0);
      EXPECT_EQ(got, payload(prev, 0, 9));
    });
}

// Calls on a child and its parent interleaved (the child's calls counted apart from the parent's),
// point-to-point in a sub-communicator, topology groups; the shared split checks first.
TEST(CommTcp, SplitsNestedOptOutAndInterleavedCalls) {
  for (int n = 1; n <= 4; ++n)
    run_ranks(n, [n](Communicator& c) {
      const int me = c.rank();
      test::check_split(c);
      c.stats_reset();
      std::unique_ptr<Communicator> child = c.split(me % 2, -me, "parity");
      std::vector<int> members;
      for (int r = n - 1; r >= 0; --r)
        if (r % 2 == me % 2) members.push_back(r);
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(child->all_reduce_value<int64_t>(me, ReduceOp::sum),
                  std::accumulate(members.begin(), members.end(), int64_t(0)));
        EXPECT_EQ(c.all_reduce_value<int64_t>(me, ReduceOp::sum), int64_t(n) * (n - 1) / 2);
        if (me % 2 == 0) child->barrier();  // one child calls more often than the other
      }
      EXPECT_EQ(c.stats().op(OpKind::split).bytes, 0u);
      EXPECT_EQ(c.stats().op(OpKind::split).calls, 1u);
      // A grandchild's point-to-point maps its ranks to the world's.
      std::unique_ptr<Communicator> grand = child->split(0, 0, "grand");
      child.reset();
      if (grand->size() >= 2) {
        int32_t v = grand->rank() == 0 ? 1234 : 0;
        if (grand->rank() == 0) grand->send(&v, sizeof(v), 1, 5);
        if (grand->rank() == 1) grand->recv(&v, sizeof(v), 0, 5);
        if (grand->rank() <= 1) {
          EXPECT_EQ(v, 1234);
        }
      }
      Topology t = topology_split(c, n % 2 == 0 ? 2 : 1);
      EXPECT_EQ(t.dp_group->all_reduce_value<int32_t>(1, ReduceOp::sum), t.dp);
      EXPECT_EQ(t.pp_group->all_reduce_value<int32_t>(1, ReduceOp::sum), t.pp);
      c.barrier();
    });
}

// 64 MB each way at once, more than the sockets buffer: the poll loop must read while it writes.
TEST(CommTcp, LargeAllToAllBothWaysDoesNotDeadlock) {
  constexpr int64_t bytes = int64_t(64) << 20;
  run_ranks(2, [](Communicator& c) {
    const int me = c.rank(), other = 1 - me;
    const int64_t words = bytes / 8;
    std::vector<uint64_t> send(static_cast<size_t>(words)), recv(size_t(words), 0);
    for (int64_t i = 0; i < words; ++i) send[size_t(i)] = rng_mix(uint64_t(me), uint64_t(i));
    std::vector<int64_t> sb(2, 0), sd(2, 0), rb(2, 0), rd(2, 0);
    sb[size_t(other)] = bytes;
    rb[size_t(other)] = bytes;
    const double t0 = now_s();
    c.all_to_all_v(send.data(), sb, sd, recv.data(), rb, rd);
    const double seconds = now_s() - t0;
    for (int64_t i = 0; i < words; i += 1021) ASSERT_EQ(recv[size_t(i)], rng_mix(uint64_t(other), uint64_t(i))) << i;
    ASSERT_EQ(recv[size_t(words - 1)], rng_mix(uint64_t(other), uint64_t(words - 1)));
    if (me == 0)
      std::printf("[ info ] 64 MB each way on 2 ranks: %.3f s (%.2f GB/s per direction)\n", seconds,
                  double(bytes) / seconds / 1e9);
  });
}

// Calls of one rank's world from several threads, handed over by joins (calls_from_any_thread).
TEST(CommTcp, CallsFromAnotherThread) {
  run_ranks(2, [](Communicator& c) {
    for (int i = 0; i < 3; ++i) {
      int64_t v = 0;
      std::thread t([&] { v = c.all_reduce_value<int64_t>(c.rank() + i, ReduceOp::sum); });
      t.join();
      EXPECT_EQ(v, 1 + 2 * i);
    }
  });
}

// Sizes that do not match and different collectives at one place fail at once on both sides, naming
// the call and the peer; later calls fail fast with the first reason.
TEST(CommTcp, MismatchesFailAtOnceNamingBothSides) {
  run_ranks(2, [](Communicator& c) {
    c.set_timeout(20);
    const double t0 = now_s();
    std::vector<uint8_t> buf(64, 1), out(128);
    if (c.rank() == 0) {
      expect_comm_error([&] { c.all_gather(buf.data(), out.data(), 64); },
                        {"all_gather #1 on 'world' (rank 0 of 2): mismatched collectives: this rank called all_gather "
                         "#1 on 'world', rank 1 (",
                         "called all_reduce #1 on 'world'"});
    } else {
      expect_comm_error([&] { c.all_reduce(reinterpret_cast<float*>(buf.data()), 16, ReduceOp::sum); },
                        {"all_reduce #1 on 'world' (rank 1 of 2): "});
    }
    EXPECT_LT(now_s() - t0, 5.0);
    expect_comm_error([&] { c.barrier(); }, {"barrier #2 on 'world'", "unusable after an earlier failure"});
  });
  run_ranks(2, [](Communicator& c) {
    std::vector<uint8_t> buf(100, 1);
    if (c.rank() == 0) {
      c.send(buf.data(), 100, 1, 4);
    } else {
      expect_comm_error([&] { c.recv(buf.data(), 96, 0, 4); }, {"recv #1 on 'world' (rank 1 of 2): rank 0 (",
                                                                "sent 100 bytes with tag 4, this rank expected 96"});
    }
  });
}

// One rank does not make the second call: the other's call times out within timeout() (+ slack) naming it
// and what it does (asked over the liveness mesh), and the silent rank's late call fails with that reason.
TEST(CommTcp, TimeoutNamesThePeerNotHeardFrom) {
  std::atomic<bool> timed_out{false};
  run_ranks(2, [&](Communicator& c) {
    c.set_timeout(1);
    EXPECT_EQ(c.all_reduce_value<int32_t>(1, ReduceOp::sum), 2);
    if (c.rank() == 0) {
      const double t0 = now_s();
      expect_comm_error(
          [&] { c.all_reduce_value<int32_t>(1, ReduceOp::sum); },
          {"all_reduce #2 on 'world' (rank 0 of 2): timed out after", "(timeout 1 s)", "not heard from: rank 1 (",
           ") [not in a communication call for ", " s (last: all_reduce #1 on 'world' (rank 1 of 2))]"});
      const double took = now_s() - t0;
      EXPECT_GE(took, 0.9);
      EXPECT_LT(took, 3.0);
      timed_out = true;
    } else {
      while (!timed_out) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      expect_comm_error([&] { c.all_reduce_value<int32_t>(1, ReduceOp::sum); },
                        {"all_reduce #2 on 'world' (rank 1 of 2): rank 0 (", "gave up: all_reduce #2"});
    }
  });
}

// ---- ranks as processes ----

// What the rank processes of one test share with the test: the rendezvous and each rank's report.
struct Shared {
  static constexpr int kRanks = 4;
  std::atomic<int> posted[kRanks];
  char contact[kRanks][256];
  char text[kRanks][2048];  // the error a rank caught ("" if none)
  double seconds[kRanks];   // how long its failing call took
  int code[kRanks];         // the error's code
  int pid[kRanks];          // each rank's process id
};

class Processes {
 public:
  Processes() {
    void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    shared = new (p) Shared();
  }
  ~Processes() { munmap(shared, sizeof(Shared)); }

  // Forks n rank processes, each running fn with its world (timeout 20 s, after a first barrier; fn may
  // destroy it) and exiting with fn's value; waits for all (30 s at most, then kills them). Returns
  // their exit statuses. `before`, if given, runs in each rank process before it makes its world; a
  // world that cannot be made exits with 90, its error in text(r).
  std::vector<int> run(int n, const std::function<int(int rank, std::unique_ptr<Communicator>& c)>& fn,
                       const std::function<void(int rank)>& before = nullptr) {
    std::vector<pid_t> pids;
    for (int r = 0; r < n; ++r) {
      const pid_t pid = fork();
      if (pid == 0) {
        int code = 90;
        try {
          if (before) before(r);
          std::unique_ptr<Communicator> c =
              tcp_create(r, n, [&](const std::string& mine) { return exchange(r, n, mine); });
          shared->pid[r] = int(getpid());
          c->set_timeout(20);
          c->barrier();
          code = fn(r, c);
        } catch (const std::exception& e) {
          std::snprintf(shared->text[r], sizeof(shared->text[r]), "uncaught: %s", e.what());
        }
        _exit(code);
      }
      pids.push_back(pid);
    }
    std::vector<int> status(static_cast<size_t>(n), -1);
    const double deadline = now_s() + 30;
    for (int r = 0; r < n; ++r) {
      while (waitpid(pids[size_t(r)], &status[size_t(r)], WNOHANG) == 0) {
        if (now_s() > deadline) {
          kill(pids[size_t(r)], SIGKILL);
          waitpid(pids[size_t(r)], &status[size_t(r)], 0);
          status[size_t(r)] = -2;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
    return status;
  }

  // In a rank process: runs f, recording the Error it throws and how long it took.
  void record(int r, const std::function<void()>& f) {
    const double t0 = now_s();
    try {
      f();
      std::snprintf(shared->text[r], sizeof(shared->text[r]), "no error");
    } catch (const Error& e) {
      std::snprintf(shared->text[r], sizeof(shared->text[r]), "%s", e.what());
      shared->code[r] = int(e.code());
    }
    shared->seconds[r] = now_s() - t0;
  }
  std::string text(int r) const { return shared->text[r]; }

  Shared* shared;

 private:
  std::vector<std::string> exchange(int r, int n, const std::string& mine) {
    std::snprintf(shared->contact[r], sizeof(shared->contact[r]), "%s", mine.c_str());
    shared->posted[r].store(1, std::memory_order_release);
    const double deadline = now_s() + 20;
    std::vector<std::string> all;
    for (int q = 0; q < n; ++q) {
      while (shared->posted[q].load(std::memory_order_acquire) == 0) {
        if (now_s() > deadline) throw std::runtime_error("rank " + std::to_string(q) + " never posted");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      all.push_back(shared->contact[q]);
    }
    return all;
  }
};

bool exited_with(int status, int code) { return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == code; }

// A rank that dies (_Exit, no destructors: the kernel closes its sockets) fails the survivors' pending and
// next calls at once (a bound of 3 s, for loaded machines), naming it, whichever communicator they are in.
TEST(CommTcpProcesses, DeathFailsEverySurvivorNamingIt) {
  Processes ps;
  const std::vector<int> st = ps.run(3, [&](int r, std::unique_ptr<Communicator>& c) {
    std::unique_ptr<Communicator> pair = c->split(r < 2 ? 0 : Communicator::kNoColor, r, "pair");
    if (r == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::_Exit(7);
    }
    if (r == 0) ps.record(r, [&] { c->all_reduce_value<float>(1.0f, ReduceOp::sum); });
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(600));  // the death happens meanwhile
      ps.record(r, [&] { pair->barrier(); });
    }
    return 0;
  });
  EXPECT_TRUE(exited_with(st[2], 7)) << st[2];
  for (int r : {0, 1}) {
    EXPECT_TRUE(exited_with(st[size_t(r)], 0)) << "rank " << r << ": " << st[size_t(r)] << " " << ps.text(r);
    EXPECT_EQ(ps.shared->code[r], int(ErrorCode::comm)) << ps.text(r);
    EXPECT_LT(ps.shared->seconds[r], 3.0) << ps.text(r);  // the death itself, not the 20 s timeout
  }
  EXPECT_NE(ps.text(0).find("all_reduce #3 on 'world' (rank 0 of 3): rank 2 ("), std::string::npos) << ps.text(0);
  EXPECT_NE(ps.text(0).find("closed its connection (the process died or gave up)"), std::string::npos) << ps.text(0);
  EXPECT_NE(ps.text(1).find("barrier #1 on 'pair' (rank 1 of 2): world rank 2 (not in this communicator, "),
            std::string::npos)
      << ps.text(1);
  EXPECT_NE(ps.text(1).find("closed its connection (the process died or gave up)"), std::string::npos) << ps.text(1);
}

// A rank that destroys its world normally says so: a peer waiting on it fails at once with that, not as
// a death nor at the timeout.
// This process's open file descriptors (/proc/self/fd, less the one listing it).
int open_fds() {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n - 1;
}

// A world needs a connection per peer, twice: where the soft descriptor limit is too low for that and
// the hard one is not, the world raises the soft one and forms; where the hard one is too low too, every
// rank fails at once saying what it needs, the limits and the remedy (before, accept() failed with EMFILE
// in a loop until the timeout, and connect() blamed the address).
TEST(CommTcpProcesses, DescriptorLimitsAreRaisedOrNamed) {
  for (bool hard_too_low : {false, true}) {
    SCOPED_TRACE(hard_too_low ? "soft and hard limit too low" : "soft limit too low");
    Processes procs;
    const std::vector<int> status = procs.run(
        4,
        [](int, std::unique_ptr<Communicator>& c) {
          c->all_reduce_value<int32_t>(1, ReduceOp::sum);
          rlimit lim{};
          getrlimit(RLIMIT_NOFILE, &lim);
          return lim.rlim_cur >= rlim_t(open_fds() + 1024) ? 0 : 1;  // raised with room to spare
        },
        [hard_too_low](int) {
          rlimit lim{};
          getrlimit(RLIMIT_NOFILE, &lim);
          lim.rlim_cur = rlim_t(open_fds() + 6);  // too few for 2 x 3 connections, 2 listeners and a pipe
          if (hard_too_low) lim.rlim_max = lim.rlim_cur;
          if (setrlimit(RLIMIT_NOFILE, &lim) != 0) throw std::runtime_error("setrlimit failed");
        });
    for (int r = 0; r < 4; ++r) {
      if (!hard_too_low) {
        EXPECT_TRUE(exited_with(status[size_t(r)], 0)) << "rank " << r << ": " << procs.text(r);
        continue;
      }
      EXPECT_TRUE(exited_with(status[size_t(r)], 90)) << "rank " << r << ": " << procs.text(r);
      const std::string t = procs.text(r);
      for (const std::string& part : {"tcp_create (rank " + std::to_string(r) + " of 4): a world of 4 ranks",
                                      std::string("more file descriptors"), std::string("RLIMIT_NOFILE soft "),
                                      std::string("raise the hard limit to at least"), std::string("ulimit -n")})
        EXPECT_NE(t.find(part), std::string::npos) << "rank " << r << ": " << t;
    }
  }
}

TEST(CommTcpProcesses, NormalShutdownIsReportedAsSuch) {
  Processes ps;
  const std::vector<int> st = ps.run(2, [&](int r, std::unique_ptr<Communicator>& c) {
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      c.reset();
      return 0;
    }
    ps.record(r, [&] { c->all_reduce_value<float>(1.0f, ReduceOp::sum); });
    return 0;
  });
  EXPECT_TRUE(exited_with(st[0], 0) && exited_with(st[1], 0)) << st[0] << " " << st[1] << " " << ps.text(1);
  EXPECT_NE(ps.text(0).find("all_reduce #2 on 'world' (rank 0 of 2): rank 1 ("), std::string::npos) << ps.text(0);
  EXPECT_NE(ps.text(0).find("has shut down its communicators (it ended without joining this call)"), std::string::npos)
      << ps.text(0);
  EXPECT_LT(ps.shared->seconds[0], 3.0);  // at once, not at the 20 s timeout
}

// A fork()ed child of a rank (a data-loader worker) cannot use the world: its calls throw, write nothing
// to the files it opened (which reuse the closed sockets' numbers), its destructor and abort() leave
// the parent's connections alone, and the parent's world works on.
TEST(CommTcpProcesses, ForkedChildCannotUseTheWorldAndLeavesItAlone) {
  Processes ps;
  const std::vector<int> st = ps.run(2, [&](int r, std::unique_ptr<Communicator>& c) {
    int failures = 0;
    if (r == 0) {
      auto child = [](const std::function<void()>& f) {
        const pid_t pid = fork();
        if (pid == 0) {
          f();
          _exit(100);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      };
      const pid_t parent = getpid();
      // Exit codes: 0 the expected error, 1 none, 2 another error, 3 a file was written.
      const int call = child([&] {
        std::vector<int> files;
        for (int i = 0; i < 16; ++i) files.push_back(memfd_create("zero8_tcp_fork_test", 0));
        int code = 1;
        try {
          c->barrier();
        } catch (const Error& e) {
          const std::string want = "this communicator belongs to process " + std::to_string(parent) +
                                   " and cannot be used after fork() (this is its child, process " +
                                   std::to_string(getpid()) + ")";
          code = e.code() == ErrorCode::comm && std::string(e.what()).find(want) != std::string::npos ? 0 : 2;
        }
        for (int fd : files)
          if (fd >= 0 && lseek(fd, 0, SEEK_END) != 0) code = 3;
        _exit(code);
      });
      const int destroy = child([&] {
        c.reset();
        _exit(0);
      });
      const int aborted = child([&] { c->abort(3); });
      if (call != 0 || destroy != 0 || aborted != 3) {
        std::snprintf(ps.shared->text[r], sizeof(ps.shared->text[r]), "children: call %d, destroy %d, abort %d", call,
                      destroy, aborted);
        ++failures;
      }
    }
    // The parent's world is untouched (the peer waits in it meanwhile).
    if (c->all_reduce_value<int32_t>(1, ReduceOp::sum) != 2) ++failures;
    c->barrier();
    return failures;
  });
  EXPECT_TRUE(exited_with(st[0], 0)) << st[0] << ": " << ps.text(0);
  EXPECT_TRUE(exited_with(st[1], 0)) << st[1] << ": " << ps.text(1);
}

// A forked child that outlives its rank must not keep the rank's sockets open: the rank's death is seen at
// once, not when the child exits.
TEST(CommTcpProcesses, ForkedChildDoesNotHideItsParentsDeath) {
  Processes ps;
  const std::vector<int> st = ps.run(2, [&](int r, std::unique_ptr<Communicator>& c) {
    if (r == 1) {
      if (fork() == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));
        _exit(0);
      }
      std::_Exit(7);
    }
    ps.record(r, [&] { c->barrier(); });
    return 0;
  });
  EXPECT_TRUE(exited_with(st[1], 7)) << st[1];
  EXPECT_NE(ps.text(0).find("rank 1 ("), std::string::npos) << ps.text(0);
  EXPECT_NE(ps.text(0).find("closed its connection"), std::string::npos) << ps.text(0);
  EXPECT_LT(ps.shared->seconds[0], 1.0) << ps.text(0);
}

// A peer waiting in another call is named with that call; one that is stopped (SIGSTOP: its watcher
// thread cannot answer either) with what it last sent. Both fail with the other's reason once they go on.
TEST(CommTcpProcesses, TimeoutNamesWhatEachSilentPeerDoes) {
  Processes ps;
  const std::vector<int> st = ps.run(3, [&](int r, std::unique_ptr<Communicator>& c) {
    if (r == 0) {
      c->set_timeout(1);
      ps.record(r, [&] { c->all_reduce_value<int32_t>(1, ReduceOp::sum); });
      kill(ps.shared->pid[2], SIGCONT);
    } else if (r == 1) {
      char byte = 0;
      ps.record(r, [&] { c->recv(&byte, 1, 2, 7); });  // rank 2 never sends it
    } else {
      raise(SIGSTOP);
      ps.record(r, [&] { c->all_reduce_value<int32_t>(1, ReduceOp::sum); });
    }
    return 0;
  });
  for (int r : {0, 1, 2}) EXPECT_TRUE(exited_with(st[size_t(r)], 0)) << "rank " << r << ": " << ps.text(r);
  const std::string t0 = ps.text(0);
  EXPECT_NE(t0.find("all_reduce #2 on 'world' (rank 0 of 3): timed out after"), std::string::npos) << t0;
  EXPECT_NE(t0.find(") [in recv #2 on 'world' (rank 1 of 3) for "), std::string::npos) << t0;
  EXPECT_NE(t0.find(") [no answer to a status query within 0.5 s; its last frame came "), std::string::npos) << t0;
  EXPECT_NE(t0.find(" s ago, from barrier #1 on 'world']"), std::string::npos) << t0;
  for (int r : {1, 2})
    EXPECT_NE(ps.text(r).find("rank 0 (127.0.0.1:"), std::string::npos) << "rank " << r << ": " << ps.text(r);
  EXPECT_NE(ps.text(1).find("gave up: all_reduce #2 on 'world' (rank 0 of 3): timed out"), std::string::npos)
      << ps.text(1);
}

// A live peer that does not read for five link timeouts (busy computing) leaves this rank's send blocked
// on a shut receive window, its acknowledgements seconds apart (window probes back off: 3 s and more
// between answers after the first 6 s): not a lost host. The transfer completes, whole, once it reads.
TEST(CommTcpProcesses, PeerThatLeavesItsWindowShutIsNotLost) {
  setenv("ZERO8_COMM_LINK_TIMEOUT", "2", 1);
  Processes ps;
  constexpr int64_t kBytes = int64_t(64) << 20;  // far more than loopback's socket buffers hold
  const std::vector<int> st = ps.run(2, [&](int r, std::unique_ptr<Communicator>& c) {
    // Filled in words (fast under sanitizers), before the barrier: rank 1's sleep must start when rank 0's
    // send does.
    std::vector<uint64_t> data(size_t(kBytes) / 8, 0);
    auto word = [](size_t i) { return uint64_t(i) * 0x9e3779b97f4a7c15ull; };
    if (r == 0)
      for (size_t i = 0; i < data.size(); ++i) data[i] = word(i);
    c->barrier();
    if (r == 0) {
      ps.record(r, [&] { c->send(data.data(), kBytes, 1, 5); });
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(10));
      ps.record(r, [&] { c->recv(data.data(), kBytes, 0, 5); });
      for (size_t i = 0; i < data.size(); ++i)
        if (data[i] != word(i)) return 1;
    }
    c->barrier();
    return 0;
  });
  unsetenv("ZERO8_COMM_LINK_TIMEOUT");
  for (int r : {0, 1}) {
    EXPECT_TRUE(exited_with(st[size_t(r)], 0)) << "rank " << r << ": " << st[size_t(r)] << " " << ps.text(r);
    EXPECT_EQ(ps.text(r), "no error");
  }
  EXPECT_GT(ps.shared->seconds[0], 9.0);  // the send waited on the sleeping peer
}

}  // namespace
}  // namespace zero8::comm
