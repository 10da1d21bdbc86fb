// Flat-buffer layout and partitioning (see layout.h): a pure function of its inputs.
#include "zero8/layout.h"

#include <algorithm>
#include <set>

#include "zero8/error.h"

namespace zero8::shard {

// Most elements a group may hold, so that its size, rounded up to blocks and chunks, stays in int64_t
// (shapes come from manifests too, where a dimension may be any 64-bit number).
constexpr int64_t kMaxGroupNumel = int64_t(1) << 62;

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) {
    ZERO8_CHECK_ARG(d >= 0, "params", "parameter '" << name << "' has dimension " << d);
    ZERO8_CHECK_ARG(!__builtin_mul_overflow(n, d, &n) && n <= kMaxGroupNumel, "params",
                    "parameter '" << name << "' has more than 2^62 elements (dimension " << d << ")");
  }
  return n;
}

const char* group_name(Group g) { return g == Group::q8 ? "8bit" : "fp32"; }

int64_t GroupLayout::part_valid(int rank) const {
  const int64_t b = part_begin(rank), e = part_end(rank);
  return std::max<int64_t>(0, std::min(e, numel) - b);
}

static bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

Layout Layout::build(const std::vector<ParamSpec>& params, const LayoutConfig& cfg) {
  ZERO8_CHECK_ARG(cfg.world >= 1, "world", "must be >= 1, got " << cfg.world);
  ZERO8_CHECK_ARG(is_pow2(cfg.state_block) && cfg.state_block >= 64 && cfg.state_block <= 4096, "state_block",
                  "must be a power of two in 64..4096, got " << cfg.state_block);
  ZERO8_CHECK_ARG(is_pow2(cfg.wire_block) && cfg.wire_block >= 64 && cfg.wire_block <= 4096, "wire_block",
                  "must be a power of two in 64..4096, got " << cfg.wire_block);
  ZERO8_CHECK_ARG(cfg.min_8bit_size >= 0, "min_8bit_size", "must be >= 0, got " << cfg.min_8bit_size);
  Layout l;
  l.cfg = cfg;
  l.params = params;
  l.slots.resize(params.size());
  std::set<std::string> names;
  std::vector<int> members[kNumGroups];  // model order
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    ZERO8_CHECK_ARG(!p.name.empty(), "params", "parameter " << i << " has an empty name");
    ZERO8_CHECK_ARG(names.insert(p.name).second, "params", "duplicate parameter name '" << p.name << "'");
    ZERO8_CHECK_ARG(p.hyper_group >= 0 && p.hyper_group < kMaxHyperGroups, "params",
                    "parameter '" << p.name << "' has hyper_group " << p.hyper_group << " (0.." << kMaxHyperGroups - 1
                                  << " allowed)");
    l.num_hyper_groups = std::max(l.num_hyper_groups, p.hyper_group + 1);
    // Decided on the whole parameter, never on a shard (DESIGN.md, States).
    const Group g = (p.fp32_state || p.numel() < cfg.min_8bit_size) ? Group::fp32 : Group::q8;
    members[int(g)].push_back(int(i));
  }
  for (int g = 0; g < kNumGroups; ++g) {
    GroupLayout& gl = l.groups[g];
    std::stable_sort(members[g].begin(), members[g].end(),
                     [&](int a, int b) { return params[a].hyper_group < params[b].hyper_group; });
    for (int i : members[g]) {
      const int h = params[i].hyper_group;
      if (gl.runs.empty() || gl.runs.back().hyper_group != h) {
        if (!gl.runs.empty()) gl.numel = (gl.numel + cfg.state_block - 1) / cfg.state_block * cfg.state_block;
        gl.runs.push_back(HyperRun{h, gl.numel, gl.numel});
      }
      const int64_t n = params[i].numel();
      ZERO8_CHECK_ARG(gl.numel <= kMaxGroupNumel - n, "params",
                      "the " << group_name(Group(g)) << " group's parameters hold more than 2^62 elements");
      l.slots[i] = ParamSlot{Group(g), gl.numel, n};
      gl.params.push_back(i);
      gl.numel += n;
      gl.runs.back().end = gl.numel;
    }
  }
  for (int g = 0; g < kNumGroups; ++g) {
    GroupLayout& gl = l.groups[g];
    gl.group = Group(g);
    gl.world = cfg.world;
    // Both block sizes are powers of two, so the larger is a multiple of the smaller: no 8-bit block
    // and no wire block ever straddles two ranks.
    gl.align = std::max<int64_t>(cfg.state_block, cfg.wire_block);
    const int64_t per = gl.align * cfg.world;
    gl.chunk = (gl.numel + per - 1) / per * gl.align;
  }
  return l;
}

std::vector<Segment> Layout::segments(Group g, int64_t begin, int64_t end) const {
  std::vector<Segment> out;
  for (int idx : group(g).params) {
    const ParamSlot& s = slots[idx];
    const int64_t b = std::max(begin, s.offset), e = std::min(end, s.offset + s.numel);
    if (b < e) out.push_back(Segment{idx, b, e});
  }
  return out;
}

}  // namespace zero8::shard
