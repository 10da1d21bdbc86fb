// How the ranks of a save or load stay together: attempt() and agree() turn any rank's failure of a
// phase into the same error on every rank (none goes on to a collective the others skip); strings
// broadcast and gathered; the communicator's timeout raised while ranks wait on each other's file I/O.
#pragma once

#include <string>
#include <vector>

#include "zero8/comm/communicator.h"
#include "zero8/error.h"

namespace zero8::ckpt::detail {

// One rank's outcome of a phase.
struct Failure {
  bool failed = false;
  ErrorCode code = ErrorCode::io;
  std::string what;
};

template <class F>
Failure attempt(F&& f) {
  try {
    f();
    return {};
  } catch (const Error& e) {
    return {true, e.code(), e.what()};
  } catch (const std::exception& e) {
    return {true, ErrorCode::io, e.what()};
  }
}

// Collective: every rank passes its own outcome; when any rank failed, every rank throws the first
// failing rank's error ("rank R: ..." when there are several ranks).
void agree(comm::Communicator& c, const Failure& mine);

// Collective: root's s on every rank.
std::string broadcast_string(comm::Communicator& c, const std::string& s, int root);
// Collective: every rank's s, in rank order.
std::vector<std::string> all_gather_strings(comm::Communicator& c, const std::string& s);

// While ranks wait for each other's file I/O (rank 0 writes the model file and the manifest), a
// collective may take much longer than a training step: the communicator's timeout is raised to
// ZERO8_CKPT_TIMEOUT for the save or load. A dead peer is still detected at once (comm liveness).
class TimeoutRaise {
 public:
  TimeoutRaise(comm::Communicator& c, double seconds);
  ~TimeoutRaise() { c_.set_timeout(before_); }
  TimeoutRaise(const TimeoutRaise&) = delete;
  TimeoutRaise& operator=(const TimeoutRaise&) = delete;

 private:
  comm::Communicator& c_;
  double before_;
};

}  // namespace zero8::ckpt::detail
