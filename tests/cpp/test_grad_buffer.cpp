// GradBuffer: zeros after zero() in both modes, released huge pages read as zeros and leave the
// resident set while the rest keeps its values; without release the values stay until zero().
#include <gtest/gtest.h>


#include "zero8/error.h"
#include "zero8/grad_buffer.h"

using zero8::shard::GradBuffer;

namespace {

constexpr int64_t kFloatsPerPage = GradBuffer::kPageBytes / int64_t(sizeof(float));

void fill(GradBuffer& b, float v) {
  for (int64_t i = 0; i < b.size(); ++i) b.data()[i] = v + float(i % 7);
}

int64_t count_zeros(const GradBuffer& b, int64_t begin, int64_t end) {
  int64_t z = 0;
  for (int64_t i = begin; i < end; ++i) z += b.data()[i] == 0.0f;
  return z;
}

}  // namespace

TEST(GradBuffer, StartsAtZeroAndZeroClearsInBothModes) {
  for (bool release : {false, true}) {
    GradBuffer b(3 * kFloatsPerPage + 123, release);
    EXPECT_EQ(b.releases(), release);
    EXPECT_EQ(count_zeros(b, 0, b.size()), b.size());
    fill(b, 1.0f);
    EXPECT_EQ(count_zeros(b, 0, b.size()), 0);
    b.zero();
    EXPECT_EQ(count_zeros(b, 0, b.size()), b.size()) << "release=" << release;
    fill(b, 2.0f);  // writable again after the pages went back
    EXPECT_EQ(b.data()[b.size() - 1], 2.0f + float((b.size() - 1) % 7));
  }
}

TEST(GradBuffer, ReleasedPagesReadAsZerosAndLeaveTheResidentSet) {
  const int64_t n = 4 * kFloatsPerPage + 1000;
  GradBuffer b(n, true);
  fill(b, 1.0f);
  const int64_t full = b.resident_bytes();
  EXPECT_GE(full, n * int64_t(sizeof(float)));
  // A range from the middle of page 0 to the middle of page 3: pages 1 and 2 go back, the partial
  // pages at both ends keep their values.
  const int64_t begin = kFloatsPerPage / 2, end = 3 * kFloatsPerPage + 10;
  b.release(begin, end);
  // Residency first: reading a released page maps the kernel's zero page, which mincore counts.
  EXPECT_LE(b.resident_bytes(), full - 2 * GradBuffer::kPageBytes);
  EXPECT_EQ(count_zeros(b, kFloatsPerPage, 3 * kFloatsPerPage), 2 * kFloatsPerPage);
  EXPECT_EQ(count_zeros(b, begin, kFloatsPerPage), 0);
  EXPECT_EQ(count_zeros(b, 3 * kFloatsPerPage, end), 0);
  EXPECT_EQ(b.data()[begin - 1], 1.0f + float((begin - 1) % 7));
  // A range that reaches the end releases the last page whole (its tail is padding).
  b.release(3 * kFloatsPerPage, n);
  EXPECT_EQ(count_zeros(b, 3 * kFloatsPerPage, n), n - 3 * kFloatsPerPage);
  b.zero();
  EXPECT_EQ(b.resident_bytes(), 0);
}

TEST(GradBuffer, WithoutReleaseTheValuesStayUntilZero) {
  GradBuffer b(2 * kFloatsPerPage, false);
  fill(b, 3.0f);
  b.release(0, b.size());
  EXPECT_EQ(count_zeros(b, 0, b.size()), 0);
  EXPECT_GE(b.resident_bytes(), b.size() * int64_t(sizeof(float)));
  b.zero();
  EXPECT_EQ(count_zeros(b, 0, b.size()), b.size());
}

TEST(GradBuffer, EmptyAndMoved) {
  GradBuffer e(0, true);
  EXPECT_EQ(e.data(), nullptr);
  EXPECT_EQ(e.resident_bytes(), 0);
  e.zero();
  e.release(0, 0);
  GradBuffer a(1000, true);
  a.data()[999] = 5.0f;
  GradBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.size(), 1000);
  EXPECT_EQ(b.data()[999], 5.0f);
  GradBuffer c;
  c = std::move(b);
  EXPECT_EQ(c.data()[999], 5.0f);
}

TEST(GradBuffer, BadRangeNamesTheProblem) {
  GradBuffer b(100, true);
  try {
    b.release(10, 101);
    FAIL() << "no error";
  } catch (const zero8::Error& e) {
    EXPECT_NE(std::string(e.what()).find("[10, 101) is outside the gradient buffer of 100 floats"), std::string::npos)
        << e.what();
  }
}
