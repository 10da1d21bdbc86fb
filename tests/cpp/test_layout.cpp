// Partition layout: a pure function of shapes, order, hyper groups, world size and block sizes (DESIGN.md, Sharding).
#include <gtest/gtest.h>

#include <numeric>

#include "zero8/error.h"
#include "zero8/layout.h"

using namespace zero8::shard;

static std::vector<ParamSpec> odd_params() {
  // Sizes that are multiples of nothing in particular, one below min_8bit_size, one marked fp32.
  return {{"embed", {1031, 37}}, {"ln.bias", {37}}, {"w1", {37, 997}}, {"emb.stable", {513, 11}, true},
          {"w2", {4099}}, {"tiny", {4095}}};
}

TEST(Layout, GroupsAreDecidedOnWholeParameters) {
  LayoutConfig cfg;
  cfg.world = 3;
  Layout l = Layout::build(odd_params(), cfg);
  EXPECT_EQ(l.slots[0].group, Group::q8);
  EXPECT_EQ(l.slots[1].group, Group::fp32);  // 37 < 4096
  EXPECT_EQ(l.slots[2].group, Group::q8);
  EXPECT_EQ(l.slots[3].group, Group::fp32);  // marked fp32 although 5643 >= 4096
  EXPECT_EQ(l.slots[4].group, Group::q8);    // 4099 >= 4096
  EXPECT_EQ(l.slots[5].group, Group::fp32);  // 4095 < 4096
  EXPECT_EQ(l.group(Group::q8).numel, 1031 * 37 + 37 * 997 + 4099);
  EXPECT_EQ(l.group(Group::fp32).numel, 37 + 513 * 11 + 4095);
}

TEST(Layout, PartitionsCoverEveryElementOnceAtBlockBoundaries) {
  for (int world : {1, 2, 3, 4, 7}) {
    for (int32_t sb : {64, 256, 4096}) {
      for (int32_t wb : {64, 2048}) {
        LayoutConfig cfg{world, sb, wb, 4096};
        Layout l = Layout::build(odd_params(), cfg);
        for (int g = 0; g < kNumGroups; ++g) {
          const GroupLayout& gl = l.groups[g];
          EXPECT_EQ(gl.chunk % sb, 0);
          EXPECT_EQ(gl.chunk % wb, 0);
          EXPECT_GE(gl.padded(), gl.numel);
          EXPECT_LT(gl.padded() - gl.numel, int64_t(world) * gl.align) << "padding is at most one aligned unit per rank";
          int64_t covered = 0;
          for (int r = 0; r < world; ++r) {
            if (gl.part_valid(r) > 0) {
              EXPECT_EQ(gl.part_begin(r), covered);
            }
            covered += gl.part_valid(r);
            if (gl.numel > 0 && gl.part_valid(r) > 0) {
              EXPECT_EQ(gl.owner(gl.part_begin(r)), r);
              EXPECT_EQ(gl.owner(gl.part_begin(r) + gl.part_valid(r) - 1), r);
            }
            if (r + 1 < world && gl.part_valid(r + 1) > 0) {
              EXPECT_EQ(gl.part_valid(r), gl.chunk) << "padding only at the end";
            }
          }
          EXPECT_EQ(covered, gl.numel);
        }
      }
    }
  }
}

TEST(Layout, IsAPureFunctionOfItsInputs) {
  LayoutConfig cfg{4, 256, 2048, 4096};
  Layout a = Layout::build(odd_params(), cfg), b = Layout::build(odd_params(), cfg);
  for (size_t i = 0; i < a.slots.size(); ++i) {
    EXPECT_EQ(a.slots[i].offset, b.slots[i].offset);
    EXPECT_EQ(a.slots[i].group, b.slots[i].group);
  }
  // Offsets are in model order within each group and contiguous.
  int64_t next[2] = {0, 0};
  for (size_t i = 0; i < a.slots.size(); ++i) {
    EXPECT_EQ(a.slots[i].offset, next[int(a.slots[i].group)]);
    next[int(a.slots[i].group)] += a.slots[i].numel;
  }
}

TEST(Layout, SegmentsSplitRangesAtTensorBoundaries) {
  LayoutConfig cfg{2, 256, 2048, 4096};
  Layout l = Layout::build(odd_params(), cfg);
  const GroupLayout& gl = l.group(Group::q8);
  int64_t total = 0;
  for (int r = 0; r < 2; ++r) {
    auto segs = l.segments(Group::q8, gl.part_begin(r), gl.part_end(r));
    int64_t prev_end = gl.part_begin(r);
    for (const Segment& s : segs) {
      EXPECT_EQ(s.begin, prev_end);
      EXPECT_LT(s.begin, s.end);
      EXPECT_GE(s.begin, l.slots[s.param].offset);
      EXPECT_LE(s.end, l.slots[s.param].offset + l.slots[s.param].numel);
      prev_end = s.end;
      total += s.end - s.begin;
    }
  }
  EXPECT_EQ(total, gl.numel);
}

TEST(Layout, HyperGroupsAreRunsStartingOnStateBlocks) {
  // One hyper group: the parameters sit in model order with no gaps (the layout of every checkpoint
  // saved before hyper groups existed).
  const Layout one = Layout::build(odd_params(), LayoutConfig{2, 256, 2048, 4096});
  for (int g = 0; g < kNumGroups; ++g) {
    const GroupLayout& gl = one.groups[g];
    ASSERT_EQ(gl.runs.size(), 1u);
    int64_t off = 0;
    for (int p : gl.params) {
      EXPECT_EQ(one.slots[p].offset, off);
      off += one.slots[p].numel;
    }
    EXPECT_EQ(gl.numel, off);
    EXPECT_EQ(gl.runs[0].begin, 0);
    EXPECT_EQ(gl.runs[0].end, off);
  }
  EXPECT_EQ(one.num_hyper_groups, 1);
  // Groups 2, 0, 1 spread over the model: each group's parameters in model order, groups in index
  // order, each run on a state block, nothing overlapping.
  std::vector<ParamSpec> p = odd_params();
  const int hg[] = {2, 1, 0, 1, 2, 0};
  for (size_t i = 0; i < p.size(); ++i) p[i].hyper_group = hg[i];
  for (int32_t sb : {64, 256}) {
    const Layout l = Layout::build(p, LayoutConfig{3, sb, 2048, 4096});
    EXPECT_EQ(l.num_hyper_groups, 3);
    for (int g = 0; g < kNumGroups; ++g) {
      const GroupLayout& gl = l.groups[g];
      int64_t end = 0;
      int last_group = -1;
      for (const HyperRun& r : gl.runs) {
        EXPECT_GT(r.hyper_group, last_group);
        EXPECT_EQ(r.begin % sb, 0) << "run of hyper group " << r.hyper_group;
        EXPECT_GE(r.begin, end);
        EXPECT_LT(r.begin - end, sb);  // the padding is less than one block
        int64_t off = r.begin;
        for (int i : gl.params)
          if (p[size_t(i)].hyper_group == r.hyper_group) {
            EXPECT_EQ(l.slots[i].offset, off) << p[size_t(i)].name;
            off += l.slots[i].numel;
          }
        EXPECT_EQ(r.end, off);
        end = r.end;
        last_group = r.hyper_group;
      }
      EXPECT_EQ(gl.numel, end);
    }
    // q8: embed (2), w1 (0), w2 (2) -> runs of groups 0 and 2; fp32: ln.bias (1), emb.stable (1), tiny (0).
    EXPECT_EQ(l.group(Group::q8).runs.size(), 2u);
    EXPECT_EQ(l.slots[2].offset, 0);                                 // w1, group 0, first
    EXPECT_EQ(l.slots[0].offset, (37 * 997 + sb - 1) / sb * sb);     // embed, group 2, on the next block
    EXPECT_EQ(l.slots[4].offset, l.slots[0].offset + 1031 * 37);     // w2 follows embed
    EXPECT_EQ(l.slots[5].offset, 0);                                 // tiny, fp32 group 0
    EXPECT_EQ(l.slots[1].offset, (4095 + sb - 1) / sb * sb);         // ln.bias, fp32 group 1
  }
}

TEST(Layout, BadInputNamesTheProblem) {
  auto msg = [](std::vector<ParamSpec> p, LayoutConfig c) {
    try {
      Layout::build(p, c);
    } catch (const zero8::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg({{"a", {3}}, {"a", {4}}}, {}).find("duplicate parameter name 'a'"), std::string::npos);
  EXPECT_NE(msg({{"", {3}}}, {}).find("empty name"), std::string::npos);
  EXPECT_NE(msg({{"w", {3, -1}}}, {}).find("'w'"), std::string::npos);
  EXPECT_NE(msg({{"w", {3}, false, -1}}, {}).find("'w' has hyper_group -1"), std::string::npos);
  EXPECT_NE(msg({{"w", {3}, false, kMaxHyperGroups}}, {}).find("'w' has hyper_group 65536"), std::string::npos);
  EXPECT_NE(msg({{"w", {3}}}, {0, 256, 2048, 4096}).find("'world'"), std::string::npos);
  EXPECT_NE(msg({{"w", {3}}}, {1, 100, 2048, 4096}).find("'state_block'"), std::string::npos);
  EXPECT_NE(msg({{"w", {3}}}, {1, 256, 8192, 4096}).find("'wire_block'"), std::string::npos);
  // Shapes from a manifest may hold any int64: counts past 2^62 (per parameter or per group) are refused
  // instead of overflowing (found by tests/fuzz/fuzz_manifest under UBSan).
  const int64_t two32 = int64_t(1) << 32, two62 = int64_t(1) << 62;
  EXPECT_NE(msg({{"w", {two32, two32}}}, {}).find("'w' has more than 2^62 elements"), std::string::npos);
  EXPECT_NE(msg({{"a", {two62}}, {"b", {two62}}}, {}).find("8bit group's parameters hold more than 2^62"),
            std::string::npos);
  EXPECT_NO_THROW(Layout::build({{"a", {two62 / 2}}, {"b", {two62 / 2}}}, {}));
}
