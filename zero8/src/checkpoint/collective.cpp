// How the ranks of a save or load stay together (collective.h): the agreement on failures, string
// broadcast and gather over the optimizer's communicator (host buffers on any backend, NCCL included:
// communicator.h's *_host calls), the raised timeout.
#include "checkpoint/collective.h"

#include <algorithm>
#include <cstdint>

namespace zero8::ckpt::detail {

void agree(comm::Communicator& c, const Failure& mine) {
  const int32_t first = comm::all_reduce_host_value<int32_t>(c, mine.failed ? c.rank() : c.size(), comm::ReduceOp::min);
  if (first == c.size()) return;
  int32_t code = int32_t(mine.code);
  comm::broadcast_host(c, &code, sizeof(code), first);
  const std::string what = broadcast_string(c, mine.what, first);
  throw Error(ErrorCode(code), c.size() > 1 ? "rank " + std::to_string(first) + ": " + what : what);
}

std::string broadcast_string(comm::Communicator& c, const std::string& s, int root) {
  int64_t n = c.rank() == root ? int64_t(s.size()) : 0;
  comm::broadcast_host(c, &n, sizeof(n), root);
  std::string out = c.rank() == root ? s : std::string(size_t(n), '\0');
  if (n > 0) comm::broadcast_host(c, out.data(), n, root);
  return out;
}

std::vector<std::string> all_gather_strings(comm::Communicator& c, const std::string& s) {
  const size_t w = size_t(c.size());
  std::vector<int64_t> lens(w);
  const int64_t mine = int64_t(s.size());
  comm::all_gather_host(c, &mine, lens.data(), sizeof(int64_t));
  std::vector<int64_t> displs(w, 0);
  for (size_t p = 1; p < w; ++p) displs[p] = displs[p - 1] + lens[p - 1];
  std::string all(size_t(displs[w - 1] + lens[w - 1]), '\0');
  comm::all_gather_v_host(c, s.data(), mine, all.data(), lens, displs);
  std::vector<std::string> out(w);
  for (size_t p = 0; p < w; ++p) out[p] = all.substr(size_t(displs[p]), size_t(lens[p]));
  return out;
}

TimeoutRaise::TimeoutRaise(comm::Communicator& c, double seconds) : c_(c), before_(c.timeout()) {
  c.set_timeout(std::max(before_, seconds));
}

}  // namespace zero8::ckpt::detail
