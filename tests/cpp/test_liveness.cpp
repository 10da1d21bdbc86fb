// The liveness mesh's frame writer (comm/src/liveness.h, FrameSender): a peer that stops reading
// until its socket buffers fill must still read whole frames, in order, once it reads again; and
// no send blocks longer than its timeout.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "../../comm/src/liveness.h"

namespace zero8::comm::detail {
namespace {

// The mesh's framing: {u32 type, u32 length, payload}. Frame i has type 100 + i and a payload of
// (i * 7919) % 30000 + 1 bytes, each (i + offset) & 0xff, so a frame read from a misaligned place fails.
std::string frame_of(uint32_t i) {
  const uint32_t type = 100 + i, len = (i * 7919) % 30000 + 1;
  std::string f(8 + len, '\0');
  std::memcpy(&f[0], &type, 4);
  std::memcpy(&f[4], &len, 4);
  for (uint32_t k = 0; k < len; ++k) f[8 + k] = char((i + k) & 0xff);
  return f;
}

std::string drain(int fd) {
  std::string got;
  char buf[4096];
  for (;;) {
    const ssize_t k = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (k <= 0) break;
    got.append(buf, size_t(k));
  }
  return got;
}

// A TCP connection over loopback, as the mesh's (TCP sends take part of a frame when the buffers
// fill; a Unix socket would take whole small frames or nothing), with the smallest buffers the
// kernel allows so that a few frames fill them: sv[0] writes, sv[1] reads.
void tcp_pair(int sv[2]) {
  const int small = 4096;
  const int lfd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(lfd, 0);
  setsockopt(lfd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));  // inherited by the accepted socket
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(lfd, 1), 0);
  socklen_t len = sizeof(a);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  sv[0] = socket(AF_INET, SOCK_STREAM, 0);
  setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  ASSERT_EQ(connect(sv[0], reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  sv[1] = accept(lfd, nullptr, nullptr);
  ASSERT_GE(sv[1], 0);
  close(lfd);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

TEST(Liveness, FrameSenderKeepsTheStreamWholeWhenThePeerStopsReading) {
  int sv[2] = {-1, -1};
  ASSERT_NO_FATAL_FAILURE(tcp_pair(sv));
  FrameSender sender;
  std::vector<bool> accepted;
  int refused = 0;
  const double timeout = 0.05;
  // The reader does not read: frames go in until the socket takes no more (a frame sent in part,
  // its tail pending, then two refused), as a SIGSTOPped peer's would.
  for (uint32_t i = 0; i < 1000 && refused < 2; ++i) {
    const double t0 = now_s();
    const bool ok = sender.send(sv[0], frame_of(i), timeout);
    EXPECT_LT(now_s() - t0, timeout + 0.5) << "frame " << i << ": send blocked past its timeout";
    accepted.push_back(ok);
    refused += ok ? 0 : 1;
  }
  ASSERT_EQ(refused, 2) << "the socket never filled: the test proves nothing";
  // The reader resumes; the writer's next frames (the first one after the pending tail) go out.
  std::string got = drain(sv[1]);
  const uint32_t first_after = uint32_t(accepted.size());
  for (uint32_t i = first_after; i < first_after + 20; ++i) {
    accepted.push_back(sender.send(sv[0], frame_of(i), timeout));
    got += drain(sv[1]);
    if (accepted.back() && sender.pending() == 0) break;
  }
  EXPECT_EQ(sender.pending(), 0u);
  EXPECT_TRUE(accepted.back());
  std::vector<uint32_t> want;
  size_t total = 0;
  for (uint32_t i = 0; i < accepted.size(); ++i)
    if (accepted[i]) {
      want.push_back(i);
      total += frame_of(i).size();
    }
  // The last frames may still sit in the writer's socket buffer, waiting for the reader's window:
  // read until every byte the writer's socket took has come (or 5 s pass, which the checks below report).
  for (const double until = now_s() + 5; got.size() < total && now_s() < until;) {
    pollfd p{sv[1], POLLIN, 0};
    if (poll(&p, 1, 100) > 0) got += drain(sv[1]);
  }
  // Every byte the reader got parses as whole frames: the accepted ones, in order, nothing else.
  size_t off = 0, n = 0;
  while (off < got.size()) {
    ASSERT_GE(got.size() - off, 8u) << "a frame header cut short at byte " << off;
    ASSERT_LT(n, want.size()) << "more frames than were accepted";
    const std::string f = frame_of(want[n]);
    ASSERT_EQ(got.compare(off, f.size(), f), 0) << "frame #" << n << " (frame " << want[n] << ") at byte " << off
                                                << " does not parse as sent";
    off += f.size();
    ++n;
  }
  EXPECT_EQ(n, want.size());
  close(sv[0]);
  close(sv[1]);
}

TEST(Liveness, FrameSenderReportsAClosedPeer) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  close(sv[1]);
  FrameSender sender;
  EXPECT_FALSE(sender.send(sv[0], frame_of(1), 0.05));  // EPIPE, without SIGPIPE
  EXPECT_EQ(sender.pending(), 0u);
  close(sv[0]);
}

}  // namespace
}  // namespace zero8::comm::detail
