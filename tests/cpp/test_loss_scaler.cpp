// Dynamic loss scaling follows DeepSpeed's rules: hysteresis, window, minimum.
#include <gtest/gtest.h>

#include "zero8/error.h"
#include "zero8/loss_scaler.h"

using zero8::LossScaler;
using zero8::LossScalerConfig;

TEST(LossScaler, DeepSpeedDefaults) {
  LossScaler s;
  EXPECT_EQ(s.scale(), 65536.0);
  // First overflow only uses up hysteresis (2 -> 1); the second halves the scale.
  s.update(true);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0);
  // The scale doubles after scale_window (1000) clean steps following the last overflow, not before.
  for (int i = 0; i < 1000; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 32768.0);
  s.update(false);
  EXPECT_EQ(s.scale(), 65536.0);
  // Hysteresis was refilled when the scale grew: one overflow is tolerated again.
  s.update(true);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0);
}

TEST(LossScaler, NeverBelowMinimumAndFailsThere) {
  LossScalerConfig c;
  c.initial_scale_power = 2;
  c.hysteresis = 1;
  c.min_scale = 1.0;
  LossScaler s(c);
  s.update(true);
  EXPECT_EQ(s.scale(), 2.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_THROW(s.update(true), zero8::Error);
  c.raise_error_at_min_scale = false;
  LossScaler t(c);
  for (int i = 0; i < 5; ++i) t.update(true);
  EXPECT_EQ(t.scale(), 1.0);
}

TEST(LossScaler, StaticScaleNeverChanges) {
  LossScalerConfig c;
  c.dynamic = false;
  c.static_scale = 128.0;
  LossScaler s(c);
  for (int i = 0; i < 3000; ++i) s.update(i % 7 == 0);
  EXPECT_EQ(s.scale(), 128.0);
}

TEST(LossScaler, BadConfigNamesTheKey) {
  LossScalerConfig c;
  c.hysteresis = 0;
  try {
    LossScaler s(c);
    FAIL() << "no error";
  } catch (const zero8::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'hysteresis'"), std::string::npos);
  }
}
