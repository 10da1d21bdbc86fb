// fp16 dynamic loss scaling with DeepSpeed's rules (deepspeed/runtime/fp16/loss_scaler.py): start at
// 2^initial_scale_power, halve on overflow once hysteresis is used up, double at the first clean step
// after scale_window clean ones (DeepSpeed's stable_interval = cur_iter - last_overflow_iter - 1), never
// below min_scale. bf16 and fp32 use a static scale of 1.
#pragma once

#include <cstdint>

namespace zero8 {

struct LossScalerConfig {
  bool dynamic = true;
  double static_scale = 1.0;     // used when !dynamic (DeepSpeed "loss_scale" > 0)
  int initial_scale_power = 16;  // DeepSpeed default: 2^16
  int64_t scale_window = 1000;
  int hysteresis = 2;            // overflows tolerated before the scale drops ("delayed_shift")
  bool consecutive_hysteresis = false;
  double min_scale = 1.0;
  bool raise_error_at_min_scale = true;
};

struct LossScalerState {
  double scale = 65536.0;
  int64_t cur_iter = 0;
  int64_t last_overflow_iter = -1;
  int cur_hysteresis = 2;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScalerConfig& cfg = {});
  double scale() const { return st_.scale; }
  // Record one step's outcome (overflow on any rank). Throws zero8::Error when an overflow happens
  // at the minimum scale and raise_error_at_min_scale is set, as DeepSpeed does.
  void update(bool overflow);
  const LossScalerConfig& config() const { return cfg_; }
  const LossScalerState& state() const { return st_; }
  void set_state(const LossScalerState& s) { st_ = s; }

 private:
  LossScalerConfig cfg_;
  LossScalerState st_;
};

}  // namespace zero8
