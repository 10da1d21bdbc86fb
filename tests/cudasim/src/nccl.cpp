// zero8's CUDA simulator: NCCL between the processes of one machine (ZERO8_CUDA=SIM, tests only). Each call
// is queued on its stream like a kernel and runs when the stream does; a rank's part of a collective is a
// file in /dev/shm (or ZERO8_CUDASIM_NCCL_DIR) named by the communicator's unique id, the call's sequence
// number and the rank (written under another name, then renamed, so a reader never sees half of it), and
// every rank reads all parts and
// computes its result itself, folding the ranks in rank order. A send is a file per (sender, receiver,
// count of messages between them), which the receiver deletes. Calls between ncclGroupStart and
// ncclGroupEnd run together: sends first, then collectives in call order, then receives, so a group's
// exchange cannot wait on itself. A call whose peer's part is not there yet stays queued and its stream
// not ready (as a GPU's NCCL kernel spins), so the host's polling waits run, and a dead peer is seen by
// zero8's own watch; ncclCommAbort cancels the calls still queued. A rank that waits more than
// ZERO8_CUDASIM_NCCL_TIMEOUT seconds (default 120) for a peer's part aborts, naming the call. Like NCCL,
// two ranks on one device are refused at init.
#include <dirent.h>
#include <nccl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "sim.h"

struct ncclComm {
  std::string prefix;  // /dev/shm/zero8sim-nccl-<id>-
  int rank = 0, nranks = 1;
  uint64_t seq = 0;                      // collectives called
  std::vector<uint64_t> sent, received;  // messages per peer
  bool tell_in_progress = false;         // the next ncclCommGetAsyncError says ncclInProgress (non-blocking mode)
  std::string last_error;
  // Set by ncclCommAbort / ncclCommDestroy: the calls still queued end without effect.
  std::shared_ptr<std::atomic<bool>> ended = std::make_shared<std::atomic<bool>>(false);
};

namespace {

thread_local std::string tl_error;

struct Call {
  enum Kind { send, recv, collective } kind;
  cudaStream_t stream;
  std::function<bool()> run;  // false: a peer's part is not there yet (run again later)
};
thread_local int tl_group_depth = 0;
thread_local std::vector<Call> tl_group;

ncclResult_t fail(ncclComm* c, ncclResult_t r, const std::string& why) {
  tl_error = why;
  if (c != nullptr) c->last_error = why;
  return r;
}

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
  }
  return 0;
}

// Where the parts go: ZERO8_CUDASIM_NCCL_DIR, else /dev/shm (memory), else /tmp.
std::string parts_dir() {
  static const std::string d = [] {
    if (const char* v = std::getenv("ZERO8_CUDASIM_NCCL_DIR")) return std::string(v);
    struct stat sb {};
    return std::string(stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) ? "/dev/shm" : "/tmp");
  }();
  return d;
}

double timeout_s() {
  static const double t = zero8_cudasim::env_number("ZERO8_CUDASIM_NCCL_TIMEOUT", 120, 1e-3, 1e6);
  return t;
}

void post(const std::string& path, const void* data, size_t bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    f.write(static_cast<const char*>(data), std::streamsize(bytes));
    if (!f) zero8_cudasim::fatal("NCCL: cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) zero8_cudasim::fatal("NCCL: cannot rename " + tmp);
}

// How long a call has waited for a peer's part: the simulator's own bound on a hang.
struct Waiting {
  bool started = false;
  std::chrono::steady_clock::time_point since;
};

// Reads a peer's part into *out if it is there (true); else false, or aborts after timeout_s() of waiting.
bool arrived(const std::string& path, std::vector<char>* out, const std::string& what, Waiting* w) {
  std::ifstream f(path, std::ios::binary);
  if (f) {
    out->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    return true;
  }
  const auto now = std::chrono::steady_clock::now();
  if (!w->started) {
    w->started = true;
    w->since = now;
  } else if (now - w->since > std::chrono::duration<double>(timeout_s())) {
    zero8_cudasim::fatal("NCCL: " + what + ": no part from a peer after " + std::to_string(timeout_s()) + " s (" +
                         path + ")");
  }
  return false;
}

// The bytes of a peer's part once it is there (blocking: the set-up).
std::vector<char> await(const std::string& path, const std::string& what) {
  Waiting w;
  std::vector<char> out;
  auto pause = std::chrono::microseconds(20);
  while (!arrived(path, &out, what, &w)) {
    std::this_thread::sleep_for(pause);
    if (pause < std::chrono::milliseconds(2)) pause *= 2;
  }
  return out;
}

template <class T>
void fold_typed(T* acc, const T* x, size_t n, ncclRedOp_t op) {
  for (size_t i = 0; i < n; ++i) switch (op) {
      case ncclSum: acc[i] = T(acc[i] + x[i]); break;
      case ncclProd: acc[i] = T(acc[i] * x[i]); break;
      case ncclMax: acc[i] = acc[i] < x[i] ? x[i] : acc[i]; break;
      case ncclMin: acc[i] = x[i] < acc[i] ? x[i] : acc[i]; break;
      case ncclAvg: acc[i] = T(acc[i] + x[i]); break;
    }
}

// acc = op(acc, x) element-wise (the 16-bit floats are not simulated: zero8 never reduces them over NCCL).
void fold(void* acc, const void* x, size_t count, ncclDataType_t t, ncclRedOp_t op) {
  switch (t) {
    case ncclInt8: fold_typed(static_cast<int8_t*>(acc), static_cast<const int8_t*>(x), count, op); return;
    case ncclUint8: fold_typed(static_cast<uint8_t*>(acc), static_cast<const uint8_t*>(x), count, op); return;
    case ncclInt32: fold_typed(static_cast<int32_t*>(acc), static_cast<const int32_t*>(x), count, op); return;
    case ncclUint32: fold_typed(static_cast<uint32_t*>(acc), static_cast<const uint32_t*>(x), count, op); return;
    case ncclInt64: fold_typed(static_cast<int64_t*>(acc), static_cast<const int64_t*>(x), count, op); return;
    case ncclUint64: fold_typed(static_cast<uint64_t*>(acc), static_cast<const uint64_t*>(x), count, op); return;
    case ncclFloat32: fold_typed(static_cast<float*>(acc), static_cast<const float*>(x), count, op); return;
    case ncclFloat64: fold_typed(static_cast<double*>(acc), static_cast<const double*>(x), count, op); return;
    default: zero8_cudasim::fatal("NCCL: reductions of 16-bit floats are not simulated");
  }
}

// One collective, run in stream order: this rank's part posted, every rank's read (in rank order; until a
// part is there the call waits, returning false), then `finish` computes this rank's result from them. The
// part of call seq - 2 is removed: every rank has read it once it has posted seq - 1, which it did before
// this one.
std::function<bool()> collective(ncclComm* c, const void* mine, size_t bytes, std::string what,
                                 std::function<void(const std::vector<std::vector<char>>&)> finish) {
  const uint64_t seq = c->seq++;
  struct Progress {
    bool posted = false;
    int got = 0;
    std::vector<std::vector<char>> parts;
    Waiting waiting;
  };
  auto at = std::make_shared<Progress>();
  return [prefix = c->prefix, rank = c->rank, nranks = c->nranks, ended = c->ended, at, mine, bytes, seq,
          what = std::move(what), finish = std::move(finish)] {
    if (*ended) return true;
    auto name = [&](uint64_t k, int r) { return prefix + "c" + std::to_string(k) + "-r" + std::to_string(r); };
    if (!at->posted) {
      post(name(seq, rank), mine, bytes);
      at->posted = true;
      at->parts.resize(size_t(nranks));
    }
    for (; at->got < nranks; ++at->got)
      if (!arrived(name(seq, at->got), &at->parts[size_t(at->got)], what + " (call " + std::to_string(seq) + ")",
                   &at->waiting))
        return false;
    if (seq >= 2) std::remove(name(seq - 2, rank).c_str());
    finish(at->parts);
    return true;
  };
}

ncclResult_t submit(ncclComm* c, Call call) {
  if (tl_group_depth > 0) {
    tl_group.push_back(std::move(call));
    return ncclSuccess;
  }
  const cudaError_t e = zero8_cudasim::enqueue_waiting(call.stream, "nccl", std::move(call.run));
  return e == cudaSuccess ? ncclSuccess : fail(c, ncclUnhandledCudaError, "invalid stream");
}

ncclResult_t check(ncclComm* c, const void* p, size_t bytes, const char* arg) {
  if (c == nullptr) return fail(nullptr, ncclInvalidArgument, "null communicator");
  if (bytes > 0 && !zero8_cudasim::device_range(p, bytes))
    return fail(c, ncclInvalidArgument, std::string(arg) + " is not a device buffer of the call's size");
  return ncclSuccess;
}

void leave(const std::string& prefix, int rank, int nranks);

}  // namespace

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

const char* ncclGetLastError(ncclComm_t comm) { return comm != nullptr ? comm->last_error.c_str() : tl_error.c_str(); }

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return fail(nullptr, ncclInvalidArgument, "null id");
  std::memset(id, 0, sizeof(*id));
  std::random_device rd;
  std::snprintf(id->internal, sizeof id->internal, "%08x%08x%d", rd(), rd(), int(getpid()));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  if (comm == nullptr || nranks < 1 || rank < 0 || rank >= nranks)
    return fail(nullptr, ncclInvalidArgument, "bad rank or count");
  id.internal[sizeof id.internal - 1] = 0;
  if (id.internal[0] == 0) return fail(nullptr, ncclInvalidArgument, "an empty unique id");
  auto c = std::make_unique<ncclComm>();
  c->prefix = parts_dir() + "/zero8sim-nccl-" + id.internal + "-";
  c->rank = rank;
  c->nranks = nranks;
  c->sent.assign(size_t(nranks), 0);
  c->received.assign(size_t(nranks), 0);
  // The handshake: every rank's device, as NCCL compares them (the machine's device, not this process's
  // index of it).
  int device = 0;
  cudaGetDevice(&device);
  device = zero8_cudasim::machine_device(device);
  const std::string me = c->prefix + "init-r" + std::to_string(rank);
  post(me, &device, sizeof device);
  std::vector<int> devs(static_cast<size_t>(nranks));
  for (int r = 0; r < nranks; ++r) {
    const std::vector<char> b = await(c->prefix + "init-r" + std::to_string(r), "ncclCommInitRankConfig");
    std::memcpy(&devs[size_t(r)], b.data(), sizeof(int));
  }
  for (int r = 0; r < nranks; ++r)
    if (r != rank && devs[size_t(r)] == device) {
      leave(c->prefix, rank, nranks);
      return fail(nullptr, ncclInvalidUsage,
                  "Duplicate GPU detected: rank " + std::to_string(rank) + " and rank " + std::to_string(r) +
                      " both on CUDA device " + std::to_string(device));
    }
  c->tell_in_progress = config != nullptr && config->blocking == 0;
  *comm = c.release();
  return (*comm)->tell_in_progress ? ncclInProgress : ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (comm == nullptr || state == nullptr) return fail(comm, ncclInvalidArgument, "null argument");
  *state = comm->tell_in_progress ? ncclInProgress : ncclSuccess;
  comm->tell_in_progress = false;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (comm == nullptr) return fail(nullptr, ncclInvalidArgument, "null communicator");
  comm->tell_in_progress = true;  // the flush completes at the next query
  return ncclSuccess;
}

namespace {
// A peer may still read this rank's last parts, so each rank leaves a "bye" part, and the last to leave
// removes every file of the communicator (an aborted rank never leaves: its files stay).
void leave(const std::string& prefix, int rank, int nranks) {
  const char one = 1;
  post(prefix + "bye-r" + std::to_string(rank), &one, 1);
  bool last = true;
  for (int r = 0; r < nranks && last; ++r) last = access((prefix + "bye-r" + std::to_string(r)).c_str(), F_OK) == 0;
  if (last) {
    const std::string dir = parts_dir(), stem = prefix.substr(dir.size() + 1);
    if (DIR* d = opendir(dir.c_str())) {
      while (const dirent* e = readdir(d))
        if (std::strncmp(e->d_name, stem.c_str(), stem.size()) == 0) std::remove((dir + "/" + e->d_name).c_str());
      closedir(d);
    }
  }
}

ncclResult_t destroy(ncclComm_t comm) {
  if (comm == nullptr) return fail(nullptr, ncclInvalidArgument, "null communicator");
  *comm->ended = true;
  leave(comm->prefix, comm->rank, comm->nranks);
  delete comm;
  return ncclSuccess;
}
}  // namespace

ncclResult_t ncclCommDestroy(ncclComm_t comm) { return destroy(comm); }
ncclResult_t ncclCommAbort(ncclComm_t comm) { return destroy(comm); }

ncclResult_t ncclGroupStart() {
  ++tl_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (tl_group_depth == 0) return fail(nullptr, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--tl_group_depth > 0) return ncclSuccess;
  std::vector<Call> calls = std::move(tl_group);
  tl_group.clear();
  if (calls.empty()) return ncclSuccess;
  const cudaStream_t st = calls.front().stream;
  for (const Call& c : calls)
    if (c.stream != st) return fail(nullptr, ncclInvalidUsage, "a group's calls on different streams (not simulated)");
  // The group's calls in that order, each once it has finished; the group waits where one waits.
  auto all = std::make_shared<std::vector<Call>>(std::move(calls));
  auto finished = std::make_shared<std::vector<bool>>(all->size(), false);
  const cudaError_t e = zero8_cudasim::enqueue_waiting(st, "nccl group", [all, finished] {
    for (Call::Kind k : {Call::send, Call::collective, Call::recv})
      for (size_t i = 0; i < all->size(); ++i) {
        if ((*all)[i].kind != k || (*finished)[i]) continue;
        if (!(*all)[i].run()) return false;
        (*finished)[i] = true;
      }
    return true;
  });
  return e == cudaSuccess ? ncclSuccess : fail(nullptr, ncclUnhandledCudaError, "invalid stream");
}

ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t s) {
  const size_t bytes = count * type_size(type);
  if (ncclResult_t r = check(comm, buf, bytes, "sendbuff"); r != ncclSuccess) return r;
  if (peer < 0 || peer >= comm->nranks || peer == comm->rank) return fail(comm, ncclInvalidArgument, "bad peer");
  const uint64_t k = comm->sent[size_t(peer)]++;
  const std::string path =
      comm->prefix + "p" + std::to_string(comm->rank) + "to" + std::to_string(peer) + "-" + std::to_string(k);
  return submit(comm, {Call::send, s, [path, buf, bytes, ended = comm->ended] {
                         if (!*ended) post(path, buf, bytes);
                         return true;
                       }});
}

ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t s) {
  const size_t bytes = count * type_size(type);
  if (ncclResult_t r = check(comm, buf, bytes, "recvbuff"); r != ncclSuccess) return r;
  if (peer < 0 || peer >= comm->nranks || peer == comm->rank) return fail(comm, ncclInvalidArgument, "bad peer");
  const uint64_t k = comm->received[size_t(peer)]++;
  const std::string path =
      comm->prefix + "p" + std::to_string(peer) + "to" + std::to_string(comm->rank) + "-" + std::to_string(k);
  auto waiting = std::make_shared<Waiting>();
  return submit(comm, {Call::recv, s, [path, buf, bytes, ended = comm->ended, waiting] {
                         if (*ended) return true;
                         std::vector<char> b;
                         if (!arrived(path, &b, "ncclRecv", waiting.get())) return false;
                         if (b.size() != bytes)
                           zero8_cudasim::fatal("NCCL: ncclRecv of " + std::to_string(bytes) + " bytes got a send of " +
                                                std::to_string(b.size()));
                         std::memcpy(buf, b.data(), bytes);
                         std::remove(path.c_str());
                         return true;
                       }});
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t s) {
  const size_t bytes = count * type_size(type);
  if (ncclResult_t r = check(comm, send, bytes, "sendbuff"); r != ncclSuccess) return r;
  if (ncclResult_t r = check(comm, recv, bytes, "recvbuff"); r != ncclSuccess) return r;
  return submit(comm, {Call::collective, s, collective(comm, send, bytes, "ncclAllReduce", [=](const auto& parts) {
                         std::memcpy(recv, parts[0].data(), bytes);
                         for (size_t r = 1; r < parts.size(); ++r) fold(recv, parts[r].data(), count, type, op);
                       })});
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s) {
  const size_t bytes = recv_count * type_size(type);
  if (ncclResult_t r = check(comm, recv, bytes, "recvbuff"); r != ncclSuccess) return r;
  if (ncclResult_t r = check(comm, send, bytes * size_t(comm->nranks), "sendbuff"); r != ncclSuccess) return r;
  const size_t me = size_t(comm->rank);
  return submit(comm,
                {Call::collective, s,
                 collective(comm, send, bytes * size_t(comm->nranks), "ncclReduceScatter", [=](const auto& parts) {
                   std::memcpy(recv, parts[0].data() + me * bytes, bytes);
                   for (size_t r = 1; r < parts.size(); ++r)
                     fold(recv, parts[r].data() + me * bytes, recv_count, type, op);
                 })});
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t s) {
  const size_t bytes = send_count * type_size(type);
  if (ncclResult_t r = check(comm, send, bytes, "sendbuff"); r != ncclSuccess) return r;
  if (ncclResult_t r = check(comm, recv, bytes * size_t(comm->nranks), "recvbuff"); r != ncclSuccess) return r;
  return submit(comm, {Call::collective, s, collective(comm, send, bytes, "ncclAllGather", [=](const auto& parts) {
                         for (size_t r = 0; r < parts.size(); ++r)
                           std::memcpy(static_cast<char*>(recv) + r * bytes, parts[r].data(), bytes);
                       })});
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                           cudaStream_t s) {
  const size_t bytes = count * type_size(type);
  if (ncclResult_t r = check(comm, recv, bytes, "recvbuff"); r != ncclSuccess) return r;
  if (root < 0 || root >= comm->nranks) return fail(comm, ncclInvalidArgument, "bad root");
  const bool is_root = root == comm->rank;
  if (is_root)
    if (ncclResult_t r = check(comm, send, bytes, "sendbuff"); r != ncclSuccess) return r;
  return submit(comm, {Call::collective, s,
                       collective(comm, is_root ? send : nullptr, is_root ? bytes : 0, "ncclBroadcast",
                                  [=](const auto& parts) { std::memmove(recv, parts[size_t(root)].data(), bytes); })});
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t s) {
  const size_t bytes = count * type_size(type);
  if (ncclResult_t r = check(comm, send, bytes, "sendbuff"); r != ncclSuccess) return r;
  if (root < 0 || root >= comm->nranks) return fail(comm, ncclInvalidArgument, "bad root");
  const bool is_root = root == comm->rank;
  if (is_root)
    if (ncclResult_t r = check(comm, recv, bytes, "recvbuff"); r != ncclSuccess) return r;
  return submit(comm, {Call::collective, s, collective(comm, send, bytes, "ncclReduce", [=](const auto& parts) {
                         if (!is_root) return;
                         std::memcpy(recv, parts[0].data(), bytes);
                         for (size_t r = 1; r < parts.size(); ++r) fold(recv, parts[r].data(), count, type, op);
                       })});
}
