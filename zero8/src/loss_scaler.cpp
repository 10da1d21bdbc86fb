// Dynamic loss scaling (see loss_scaler.h for the rules and their source).
#include "zero8/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "zero8/error.h"

namespace zero8 {

LossScaler::LossScaler(const LossScalerConfig& cfg) : cfg_(cfg) {
  ZERO8_CHECK_ARG(cfg.hysteresis >= 1, "hysteresis", "must be >= 1, got " << cfg.hysteresis);
  ZERO8_CHECK_ARG(cfg.scale_window >= 1, "loss_scale_window", "must be >= 1, got " << cfg.scale_window);
  ZERO8_CHECK_ARG(cfg.min_scale > 0 && std::isfinite(cfg.min_scale), "min_loss_scale",
                  "must be a positive number, got " << cfg.min_scale);
  ZERO8_CHECK_ARG(cfg.initial_scale_power >= 0 && cfg.initial_scale_power < 64, "initial_scale_power",
                  "must be in 0..63, got " << cfg.initial_scale_power);
  ZERO8_CHECK_ARG(cfg.static_scale > 0 && std::isfinite(cfg.static_scale), "loss_scale",
                  "must be a positive number, got " << cfg.static_scale);
  st_.scale = cfg.dynamic ? std::ldexp(1.0, cfg.initial_scale_power) : cfg.static_scale;
  st_.cur_hysteresis = cfg.hysteresis;
}

void LossScaler::update(bool overflow) {
  if (!cfg_.dynamic) {
    ++st_.cur_iter;
    return;
  }
  if (overflow) {
    if (cfg_.hysteresis == 1 || st_.cur_hysteresis == 1) {
      if (st_.scale == cfg_.min_scale && cfg_.raise_error_at_min_scale)
        ZERO8_THROW(invalid_argument, "gradient overflow at the minimum loss scale " << cfg_.min_scale
                                          << " (step " << st_.cur_iter << "): training has diverged");
      st_.scale = std::max(st_.scale / 2.0, cfg_.min_scale);
    } else {
      --st_.cur_hysteresis;
    }
    st_.last_overflow_iter = st_.cur_iter;
  } else {
    if (cfg_.consecutive_hysteresis) st_.cur_hysteresis = cfg_.hysteresis;
    const int64_t stable = st_.cur_iter - st_.last_overflow_iter - 1;
    if (stable > 0 && stable % cfg_.scale_window == 0) {
      if (!cfg_.consecutive_hysteresis) st_.cur_hysteresis = cfg_.hysteresis;
      st_.scale *= 2.0;
    }
  }
  ++st_.cur_iter;
}

}  // namespace zero8
