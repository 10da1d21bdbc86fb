// Flat-buffer layout and ZeRO partitioning: which rank owns which range of which state group (8-bit or fp32 states).
// A pure function of (parameter shapes, order, hyper groups, world size, block sizes), so every process, and a
// checkpoint loader at another world size, computes the same answer without talking to anyone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zero8::shard {

// One model parameter, in model order.
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool fp32_state = false;  // force 32-bit optimizer state (e.g. the StableEmbedding weight)
  int hyper_group = 0;      // which hyperparameter set steps it (the engine's param group index)
  int64_t numel() const;  // Error(invalid_argument) for a negative dimension or more than 2^62 elements
};

// The two parameter groups: 8-bit optimizer state, and fp32 state (small or marked parameters).
enum class Group : int { q8 = 0, fp32 = 1 };
constexpr int kNumGroups = 2;
constexpr int kMaxHyperGroups = 65536;  // ParamSpec::hyper_group is below this
const char* group_name(Group g);

struct LayoutConfig {
  int world = 1;                 // ranks sharing the optimizer state (the data-parallel group)
  int32_t state_block = 256;     // 8-bit state block
  int32_t wire_block = 2048;     // int8 communication block
  int64_t min_8bit_size = 4096;  // parameters with fewer elements keep fp32 state (whole parameter)
};

// Where one parameter lives.
struct ParamSlot {
  Group group = Group::q8;
  int64_t offset = 0;  // first element in the group's flat buffer
  int64_t numel = 0;
};

// The flat range of one hyperparameter set inside a group. Within a group the parameters are placed
// by hyper group (model order within each), and each run starts on a state block, so no 8-bit block
// holds states that two sets of hyperparameters update; the gap before a run is padding (zeros).
// With one hyper group there is one run and no padding: the layout is the model order, as before.
struct HyperRun {
  int hyper_group = 0;
  int64_t begin = 0;  // flat offsets within the group
  int64_t end = 0;
};

// A contiguous piece of one tensor inside a flat range (used for per-tensor norms, e.g. LAMB).
struct Segment {
  int param = 0;        // index into the ParamSpec list
  int64_t begin = 0;    // flat offsets within the group
  int64_t end = 0;
};

struct GroupLayout {
  Group group = Group::q8;
  std::vector<int> params;  // parameter indices in flat order
  std::vector<HyperRun> runs;  // in flat order: one per hyper group with parameters in this group
  int64_t numel = 0;        // end of the last parameter: their elements plus the padding between runs
  int64_t align = 0;        // partition boundaries are multiples of this (state and wire blocks)
  int64_t chunk = 0;        // elements per partition (a multiple of align); padded = chunk * world
  int world = 1;

  int64_t padded() const { return chunk * world; }
  int64_t part_begin(int rank) const { return chunk * rank; }
  int64_t part_end(int rank) const { return chunk * (rank + 1); }
  // Elements of rank's partition that hold parameters (the rest is padding at the end).
  int64_t part_valid(int rank) const;
  int owner(int64_t flat) const { return chunk == 0 ? 0 : int(flat / chunk); }
};

struct Layout {
  LayoutConfig cfg;
  std::vector<ParamSpec> params;
  std::vector<ParamSlot> slots;  // one per parameter
  GroupLayout groups[kNumGroups];
  int num_hyper_groups = 1;  // 1 + the largest ParamSpec::hyper_group


  // Builds and validates (names unique and non-empty, dims >= 0, hyper_group >= 0, block sizes powers of
  // two, world >= 1).
  static Layout build(const std::vector<ParamSpec>& params, const LayoutConfig& cfg);
  const GroupLayout& group(Group g) const { return groups[int(g)]; }
  // Segments of the parameters overlapping [begin, end) of group g, clipped to it, in flat order.
  std::vector<Segment> segments(Group g, int64_t begin, int64_t end) const;
};

}  // namespace zero8::shard
