// zero8's CUDA simulator: a kernel's CUDA threads. Each block's threads are fibers on the host thread that
// runs the stream (each with its own stack); a fiber runs until it reaches a barrier (__syncthreads, a warp
// shuffle or vote), and the scheduler releases a barrier once every thread it waits for has reached it. The
// order in which the fibers run alternates between rounds and blocks (first to last, last to first), so a
// kernel that reads shared memory another thread writes without a barrier between them sees the stale value
// in one of the orders. Undefined behaviour that a GPU would hang on or hide (a barrier some threads never
// reach, a shuffle naming an absent lane, lanes that disagree on a mask) is reported and aborts.
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <vector>

#include "sim.h"
#include "zero8_cudasim.h"

namespace zero8_cudasim {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
enum class State { ready, block_barrier, warp_barrier, done };

// A fiber's saved execution context: context_make sets it to start `entry` on a stack, context_switch saves
// the running one into `from` and resumes `to`.
#if defined(__x86_64__)
// swapcontext saves and restores the signal mask, a system call each time, and a kernel's fibers switch at
// every barrier: that made the simulator's CUDA tests spend most of their time in the kernel. This switch
// keeps what the System V ABI says a call preserves (rbx, rbp, r12-r15, MXCSR's and the x87 control word's
// control bits) on the stack it leaves and stores that stack's pointer.
extern "C" void zero8_cudasim_switch(void** from_sp, void* to_sp);
asm(R"(
  .text
  .globl zero8_cudasim_switch
  .type zero8_cudasim_switch, @function
zero8_cudasim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size zero8_cudasim_switch, .-zero8_cudasim_switch
)");

struct Context {
  void* sp = nullptr;
};

// The new stack as zero8_cudasim_switch leaves one, so that the first switch to it "returns" into entry
// with the stack aligned as after a call (entry never returns: a fiber's last act is a switch away).
void context_make(Context& c, char* stack, size_t bytes, void (*entry)()) {
  uint64_t* p = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15));
  *--p = 0;                                  // entry's return address
  *--p = reinterpret_cast<uint64_t>(entry);  // where the first switch returns to
  for (int i = 0; i < 6; ++i) *--p = 0;      // rbp, rbx, r12-r15
  uint32_t mxcsr = 0;
  uint16_t fpucw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  uint64_t control = 0;
  std::memcpy(&control, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(&control) + 4, &fpucw, 2);
  *--p = control;
  c.sp = p;
}
void context_switch(Context& from, Context& to) { zero8_cudasim_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc{};
};
void context_make(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
void context_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

struct Fiber {
  Context ctx;
  char* stack = nullptr;
  uint3 tid{};
  int lane = 0, warp = 0;
  State state = State::ready;
  int bar_value = 0;
  unsigned bar_gen = 0, warp_gen = 0;
};

// Storage of shared memory: 128-byte aligned, more than any access needs (wmma's 256-bit pointers).
struct alignas(128) SmemChunk {
  unsigned char bytes[128];
};

// v as `bytes` of fresh shared memory: garbage on a GPU, NaN bytes here, so a read before a write shows.
void fresh_smem(std::vector<SmemChunk>& v, size_t bytes) {
  v.assign((bytes + sizeof(SmemChunk) - 1) / sizeof(SmemChunk), SmemChunk{});
  if (!v.empty()) std::memset(v.data(), 0xff, v.size() * sizeof(SmemChunk));
}

struct Warp {
  unsigned gen = 0, arrived = 0, mask = 0;
  unsigned took_part[2] = {0, 0};
  uint64_t slots[2][32] = {};
};

// One grid's execution on this host thread.
struct Exec {
  const char* name = "";
  dim3 grid, block;
  uint3 block_idx{};
  std::vector<SmemChunk> smem;
  std::map<const char*, std::vector<SmemChunk>> shared;  // __shared__ variables of the running block
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Fiber* cur = nullptr;
  Context sched;
  const std::function<void()>* body = nullptr;
  unsigned bar_gen = 0;
  int bar_result[2] = {0, 0};
};

thread_local Exec* tl_exec = nullptr;

// Fiber stacks, kept for the next grid on this host thread (with a guard page below each).
struct StackPool {
  std::vector<char*> stacks;
  ~StackPool() {
    for (char* s : stacks) munmap(s - getpagesize(), kStackBytes + size_t(getpagesize()));
  }
  char* get(size_t i) {
    while (stacks.size() <= i) {
      const size_t page = size_t(getpagesize());
      void* m =
          mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) fatal("cannot map a fiber stack");
      mprotect(m, page, PROT_NONE);
      stacks.push_back(static_cast<char*>(m) + page);
    }
    return stacks[i];
  }
};
thread_local StackPool tl_stacks;

Exec& exec() {
  if (tl_exec == nullptr || tl_exec->cur == nullptr) fatal("a device function was called outside a kernel");
  return *tl_exec;
}

void fiber_entry() {
  Exec& e = *tl_exec;
  (*e.body)();
  e.cur->state = State::done;
  context_switch(e.cur->ctx, e.sched);  // never resumed
}

void yield() {
  Exec& e = *tl_exec;
  context_switch(e.cur->ctx, e.sched);
}

std::string describe(const uint3& v) {
  std::ostringstream s;
  s << "(" << v.x << "," << v.y << "," << v.z << ")";
  return s.str();
}

const char* state_name(State s) {
  switch (s) {
    case State::ready: return "running";
    case State::block_barrier: return "at __syncthreads";
    case State::warp_barrier: return "at a warp shuffle/vote/__syncwarp";
    case State::done: return "exited";
  }
  return "?";
}

[[noreturn]] void deadlock(Exec& e, const std::string& why) {
  std::ostringstream s;
  s << why << "; the block's threads:";
  State last = State::ready;
  size_t from = 0;
  auto flush = [&](size_t to) { s << "\n    threads " << from << ".." << to - 1 << ": " << state_name(last); };
  for (size_t i = 0; i < e.fibers.size(); ++i) {
    if (i > 0 && e.fibers[i].state != last) {
      flush(i);
      from = i;
    }
    last = e.fibers[i].state;
  }
  flush(e.fibers.size());
  e.cur = nullptr;
  fatal(s.str());
}

// Completes warp w's pending shuffle/vote once every lane of its mask has reached it; false if it cannot yet.
bool release_warp(Exec& e, size_t w) {
  Warp& wp = e.warps[w];
  if (wp.arrived == 0) return false;
  if ((wp.arrived & wp.mask) != wp.mask) {
    for (int l = 0; l < 32; ++l) {
      const size_t i = w * 32 + size_t(l);
      if ((wp.mask >> l & 1u) && (i >= e.fibers.size() || e.fibers[i].state == State::done)) {
        std::ostringstream s;
        s << "warp " << w << ": a shuffle/vote with mask 0x" << std::hex << wp.mask << std::dec << " names lane " << l
          << ", which has exited or does not exist";
        deadlock(e, s.str());
      }
    }
    return false;
  }
  wp.took_part[wp.gen & 1] = wp.mask;
  ++wp.gen;
  for (int l = 0; l < 32; ++l)
    if (wp.mask >> l & 1u) e.fibers[w * 32 + size_t(l)].state = State::ready;
  wp.arrived = 0;
  return true;
}

// Releases __syncthreads once every thread has reached it; false if it cannot yet.
bool release_block(Exec& e) {
  size_t at_bar = 0, done = 0;
  for (const Fiber& f : e.fibers) {
    at_bar += f.state == State::block_barrier;
    done += f.state == State::done;
  }
  if (at_bar == 0 || at_bar + done != e.fibers.size()) return false;
  if (done > 0) deadlock(e, "__syncthreads after some of the block's threads exited (undefined in CUDA)");
  int and_v = 1, or_v = 0, count = 0;
  for (const Fiber& f : e.fibers) {
    and_v &= f.bar_value != 0;
    or_v |= f.bar_value != 0;
    count += f.bar_value != 0;
  }
  // and, or and count at once: each thread's call says which one it returns.
  e.bar_result[e.bar_gen & 1] = and_v | (or_v << 1) | (count << 2);
  ++e.bar_gen;
  for (Fiber& f : e.fibers) f.state = State::ready;
  return true;
}

// Each warp runs on (its lanes, its shuffles and votes) until it waits at __syncthreads or has exited, before
// the next warp starts: warps of a GPU block progress independently, so a warp that reads shared memory
// which another warp has not written yet (a missing __syncthreads) reads NaN bytes here.
void run_block(Exec& e, bool reverse_first) {
  const size_t n = e.fibers.size();
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = e.fibers[i];
    f.state = State::ready;
    f.stack = tl_stacks.get(i);
    context_make(f.ctx, f.stack, kStackBytes, fiber_entry);
  }
  for (Warp& w : e.warps) w = Warp{};
  e.bar_gen = 0;
  const size_t nwarps = e.warps.size();
  bool reverse = reverse_first;
  for (;;) {
    bool progress = false;
    for (size_t k = 0; k < nwarps; ++k) {
      const size_t w = reverse ? nwarps - 1 - k : k;
      const size_t lo = w * 32, hi = std::min(n, lo + 32);
      for (;;) {
        for (size_t j = lo; j < hi; ++j) {
          Fiber& f = e.fibers[reverse ? hi - 1 - (j - lo) : j];
          if (f.state != State::ready) continue;
          e.cur = &f;
          context_switch(e.sched, f.ctx);
          progress = true;
        }
        e.cur = nullptr;
        if (!release_warp(e, w)) break;
        progress = true;
      }
    }
    reverse = !reverse;
    progress |= release_block(e);
    bool all_done = true;
    for (const Fiber& f : e.fibers) all_done &= f.state == State::done;
    if (all_done) return;
    if (!progress) deadlock(e, "no thread can go on (a barrier that some threads never reach)");
  }
}

}  // namespace

void run_grid(const char* name, dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  Exec e;
  e.name = name;
  e.grid = grid;
  e.block = block;
  e.body = &body;
  const size_t n = size_t(block.x) * block.y * block.z;
  e.fibers.resize(n);
  e.warps.resize((n + 31) / 32);
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = e.fibers[i];
    f.tid = uint3{unsigned(i % block.x), unsigned(i / block.x % block.y), unsigned(i / (size_t(block.x) * block.y))};
    f.lane = int(i % 32);
    f.warp = int(i / 32);
  }
  Exec* outer = tl_exec;
  tl_exec = &e;
  uint64_t count = 0;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        e.block_idx = uint3{x, y, z};
        fresh_smem(e.smem, smem);
        e.shared.clear();
        run_block(e, (count++ & 1) == 0);  // last warp first in the first block: thread 0 often writes for all
      }
  tl_exec = outer;
}

std::string where_in_kernel() {
  if (tl_exec == nullptr) return "";
  std::ostringstream s;
  s << "kernel " << tl_exec->name << ", block " << describe(tl_exec->block_idx);
  if (tl_exec->cur != nullptr) s << ", thread " << describe(tl_exec->cur->tid);
  return s.str();
}

const uint3& thread_idx() { return exec().cur->tid; }
const uint3& block_idx() { return exec().block_idx; }
const dim3& block_dim() { return exec().block; }
const dim3& grid_dim() { return exec().grid; }
unsigned char* dynamic_smem() { return exec().smem.empty() ? nullptr : exec().smem.front().bytes; }
int lane_id() { return exec().cur->lane; }

void* shared_storage(const char* key, size_t bytes) {
  auto& v = exec().shared[key];
  if (v.empty()) fresh_smem(v, bytes);
  return v.data();
}

int sync_block(int value, int op) {
  Exec& e = exec();
  Fiber& f = *e.cur;
  f.bar_value = value;
  f.bar_gen = e.bar_gen;
  f.state = State::block_barrier;
  yield();
  const int r = e.bar_result[f.bar_gen & 1];
  switch (op) {
    case 1: return r & 1;
    case 2: return (r >> 1) & 1;
    case 3: return r >> 2;
    default: return 0;
  }
}

uint64_t sync_warp_exchange(unsigned mask, uint64_t value, unsigned* gen_out) {
  Exec& e = exec();
  Fiber& f = *e.cur;
  Warp& w = e.warps[size_t(f.warp)];
  if (!(mask >> f.lane & 1u)) {
    std::ostringstream s;
    s << "a warp shuffle/vote with mask 0x" << std::hex << mask << std::dec << " from lane " << f.lane
      << ", which the mask leaves out (undefined in CUDA)";
    fatal(s.str());
  }
  if (w.arrived != 0 && w.mask != mask) {
    std::ostringstream s;
    s << "lanes of warp " << f.warp << " reach warp shuffles/votes with different masks (0x" << std::hex << w.mask
      << " and 0x" << mask << ")";
    fatal(s.str());
  }
  w.mask = mask;
  w.slots[w.gen & 1][f.lane] = value;
  w.arrived |= 1u << f.lane;
  f.warp_gen = w.gen;
  f.state = State::warp_barrier;
  yield();
  *gen_out = f.warp_gen;
  return value;
}

void wmma_fatal(const std::string& what) { fatal(what); }

uint64_t shfl_value(unsigned mask, unsigned gen, int src) {
  Exec& e = exec();
  const Warp& w = e.warps[size_t(e.cur->warp)];
  if (src < 0 || src > 31 || !(w.took_part[gen & 1] >> src & 1u)) {
    std::ostringstream s;
    s << "a shuffle (mask 0x" << std::hex << mask << std::dec << ") reads lane " << src
      << ", which did not take part (undefined in CUDA)";
    fatal(s.str());
  }
  return w.slots[gen & 1][src];
}

}  // namespace zero8_cudasim

unsigned __ballot_sync(unsigned mask, int p) {
  unsigned gen = 0;
  zero8_cudasim::sync_warp_exchange(mask, p != 0 ? 1u : 0u, &gen);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && zero8_cudasim::shfl_value(mask, gen, l) != 0) r |= 1u << l;
  return r;
}
