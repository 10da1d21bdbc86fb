// The optimizer-algorithm table (zero8/kernels/optim_table.h), walked row by row: the table is consistent,
// every row names exactly the Hyper fields its kernel reads (a row that dropped a hyperparameter, or names
// one the math ignores, fails), and every DeepSpeed key of a row round-trips config JSON -> parse ->
// to_json -> parse with its value in its Hyper field. Nothing here lists an algorithm or a key.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "zero8/config.h"
#include "zero8/error.h"
#include "zero8/optim.h"

namespace {

namespace cfg = zero8::config;
namespace optim = zero8::optim;
using optim::AlgoSpec;
using optim::HyperField;
using optim::HyperRole;
using optim::HyperSpec;

constexpr HyperField kFields[] = {
    HyperField::lr, HyperField::beta1, HyperField::beta2, HyperField::eps, HyperField::weight_decay,
    HyperField::dampening, HyperField::nesterov, HyperField::bias_correction, HyperField::lr_decay,
    HyperField::initial_accumulator, HyperField::trust_coefficient, HyperField::max_trust_ratio,
    HyperField::min_trust_ratio};

bool is_value(const HyperSpec& e) { return e.role == HyperRole::value || e.role == HyperRole::init; }

std::string base_of(const char* key) {
  const char* b = std::strchr(key, '[');
  return b ? std::string(key, size_t(b - key)) : std::string(key);
}

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The entry of `row` that goes to field f, or null.
const HyperSpec* entry_of(const AlgoSpec& row, HyperField f) {
  for (int i = 0; i < row.num_hyper; ++i)
    if (is_value(row.hyper[i]) && row.hyper[i].field == f) return &row.hyper[i];
  return nullptr;
}

TEST(OptimTable, RowsAreConsistent) {
  std::set<std::string> names, classes, deepspeed;
  for (const AlgoSpec& row : optim::kAlgos) {
    SCOPED_TRACE(row.name);
    EXPECT_TRUE(names.insert(row.name).second);
    EXPECT_TRUE(classes.insert(row.class_name).second);
    if (row.deepspeed) {
      EXPECT_TRUE(deepspeed.insert(lower(row.deepspeed)).second);
    }
    EXPECT_STREQ(optim::algo_name(row.algo), row.name);
    ASSERT_TRUE(row.num_states == 1 || row.num_states == 2);
    for (int s = 0; s < row.num_states; ++s) {
      EXPECT_NE(row.torch_state[s], nullptr);
    }
    // The decoupled form of a row is a row whose own decoupled form is itself.
    EXPECT_EQ(optim::algo_spec(row.decoupled).decoupled, row.decoupled);
    EXPECT_EQ(optim::algo_spec(row.loads_from).num_states, row.num_states);
    std::set<std::string> keys;
    std::set<int> fields;
    int decouple = 0;
    for (int i = 0; i < row.num_hyper; ++i) {
      const HyperSpec& e = row.hyper[i];
      SCOPED_TRACE(e.key);
      // One name, one entry (get() and the parser look entries up by zero8's or DeepSpeed's key).
      EXPECT_TRUE(keys.insert(e.key).second) << "duplicate key";
      if (e.deepspeed && base_of(e.deepspeed) != base_of(e.key)) {
        EXPECT_TRUE(keys.insert(e.deepspeed).second) << "duplicate DeepSpeed key";
      }
      if (is_value(e)) {
        EXPECT_NE(e.field, HyperField::none);
        EXPECT_TRUE(fields.insert(int(e.field)).second) << "two entries write one field";
      } else {
        EXPECT_EQ(e.field, HyperField::none);
      }
      if (e.role == HyperRole::fixed || e.role == HyperRole::ignored) {
        EXPECT_NE(e.why, nullptr);
      }
      if (e.role == HyperRole::decouple) ++decouple;
      if (e.role == HyperRole::bnb_const) {
        EXPECT_NE(e.bnb, nullptr);
      }
      if (e.type == optim::HyperType::flag) {
        for (double d : {e.ds_default, e.torch_default, e.py_default}) {
          EXPECT_TRUE(d == 0.0 || d == 1.0);
        }
      } else if (is_value(e)) {
        for (double d : {e.ds_default, e.torch_default, e.py_default}) EXPECT_TRUE(e.range.contains(d)) << d;
        if (e.range.zero_off) {
          EXPECT_GT(e.ds_default, e.range.lo);
        }
      }
      // Element k of a sequence is the k-th entry of the row with that base name, in every library's naming.
      for (const char* k : {e.key, e.deepspeed, e.torch, e.bnb}) {
        const char* bracket = k ? std::strchr(k, '[') : nullptr;
        if (!bracket) continue;
        int before = 0;
        for (int j = 0; j < i; ++j) {
          const HyperSpec& o = row.hyper[j];
          const char* kj = k == e.key ? o.key : k == e.deepspeed ? o.deepspeed : k == e.torch ? o.torch : o.bnb;
          if (kj && base_of(kj) == base_of(k)) ++before;
        }
        EXPECT_EQ(std::atoi(bracket + 1), before) << k;
      }
    }
    // The rules between fields (Nesterov needs momentum and no dampening) find their partners.
    if (const HyperSpec* n = entry_of(row, HyperField::nesterov)) {
      for (HyperField partner : {HyperField::beta1, HyperField::dampening}) {
        const HyperSpec* q = entry_of(row, partner);
        ASSERT_NE(q, nullptr) << optim::hyper_field_name(partner);
        EXPECT_EQ(q->deepspeed != nullptr, n->deepspeed != nullptr);
      }
    }
    EXPECT_LE(decouple, 1);
    if (decouple == 0) {
      EXPECT_EQ(row.decoupled, row.algo);
    }
  }
}

// The parameter and states after one step of one tensor with 32-bit states set to nonzero values, at step 3,
// with Hyper h (a field may act on the states only: Lion's beta2).
std::vector<float> one_step(optim::Algo algo, const optim::Hyper& h) {
  const int64_t n = 300;
  optim::State state(optim::StateLayout(algo, n, 32), 0.0f);
  std::vector<float> param(n), grad(n);
  for (int64_t i = 0; i < n; ++i) {
    param[size_t(i)] = 2.0f + 0.5f * std::sin(0.37f * float(i));
    grad[size_t(i)] = 0.3f * std::cos(0.11f * float(i)) + (i % 7 == 0 ? 0.2f : -0.05f);
  }
  for (int s = 1; s <= state.layout().num_states; ++s)
    for (int64_t i = 0; i < n; ++i)
      state.fp32(s)[i] = s == 1 ? 0.05f + 0.02f * std::sin(0.23f * float(i)) : 0.02f + 0.01f * std::cos(0.05f * float(i));
  optim::step(state, h, param.data(), zero8::DType::f32, n, nullptr, grad.data(), zero8::DType::f32, n);
  for (int s = 1; s <= state.layout().num_states; ++s) param.insert(param.end(), state.fp32(s), state.fp32(s) + n);
  return param;
}

// A Hyper where every field is in play: momentum on, the trust-ratio clips off, step 3.
optim::Hyper probe_base() {
  optim::Hyper h;
  h.lr = 0.01f;
  h.beta1 = 0.5f;
  h.beta2 = 0.7f;
  h.eps = 1e-3f;
  h.weight_decay = 0.1f;
  h.dampening = 0.0f;
  h.nesterov = false;
  h.bias_correction = true;
  h.lr_decay = 0.0f;
  h.trust_coefficient = 0.01f;
  h.max_trust_ratio = 0.0f;
  h.min_trust_ratio = 0.0f;
  h.step = 3;
  return h;
}

// Another value of field f that changes any step that reads it (the clips: bounds every ratio hits).
optim::Hyper probe_changed(HyperField f) {
  optim::Hyper h = probe_base();
  optim::hyper_set(h, f, f == HyperField::max_trust_ratio   ? 1e-3
                         : f == HyperField::min_trust_ratio ? 1e3
                         : f == HyperField::nesterov || f == HyperField::bias_correction
                             ? 1.0 - optim::hyper_get(h, f)
                         : f == HyperField::dampening || f == HyperField::lr_decay ? 0.5
                         : f == HyperField::beta1 || f == HyperField::beta2 ? optim::hyper_get(h, f) + 0.1
                                                                            : 2.0 * optim::hyper_get(h, f));
  return h;
}

// A row names a field exactly when its kernel reads it: changing a field the row does not name leaves the
// step as it was, changing one it names moves it. (init entries are read by the state, not the step.)
TEST(OptimTable, EachRowNamesExactlyTheFieldsItsKernelReads) {
  for (const AlgoSpec& row : optim::kAlgos) {
    SCOPED_TRACE(row.name);
    const std::vector<float> base = one_step(row.algo, probe_base());
    for (HyperField f : kFields) {
      SCOPED_TRACE(optim::hyper_field_name(f));
      const HyperSpec* e = entry_of(row, f);
      const bool moved = one_step(row.algo, probe_changed(f)) != base;
      if (e && e->role == HyperRole::init) continue;
      EXPECT_EQ(moved, e != nullptr) << (e ? "the row names it but the step ignores it"
                                           : "the step reads it but the row does not name it");
    }
  }
}

// A value inside the entry's range that differs from its defaults and from the other entries' values.
double pick(const HyperSpec& e, int index) {
  if (e.type == optim::HyperType::flag) return e.ds_default != 0.0 ? 0.0 : 1.0;
  const double t = 0.2 + 0.07 * index;
  if (std::isfinite(e.range.hi)) return e.range.lo + (e.range.hi - e.range.lo) * t;
  return e.ds_default * 1.5 + t;
}

std::string number(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

// optimizer.params for `row` with every DeepSpeed value entry at pick() (Nesterov momentum needs momentum > 0
// and no dampening, by Hyper field, as the parser checks).
std::string params_json(const AlgoSpec& row, std::vector<double>& want) {
  want.assign(size_t(row.num_hyper), 0.0);
  const HyperSpec* nesterov = entry_of(row, HyperField::nesterov);
  const bool with_nesterov = nesterov && nesterov->deepspeed && pick(*nesterov, 0) != 0.0;
  std::string out;
  std::string open_seq;
  for (int i = 0; i < row.num_hyper; ++i) {
    const HyperSpec& e = row.hyper[i];
    want[size_t(i)] = e.ds_default;
    if (!e.deepspeed || !(is_value(e) || e.role == HyperRole::decouple)) continue;
    double v = pick(e, i);
    if (with_nesterov && e.field == HyperField::dampening) v = 0.0;
    want[size_t(i)] = e.role == HyperRole::decouple && row.decoupled == row.algo ? 1.0 : v;
    const std::string b = base_of(e.deepspeed);
    const std::string text = e.type == optim::HyperType::flag ? (v != 0.0 ? "true" : "false") : number(v);
    if (std::strchr(e.deepspeed, '[')) {
      if (open_seq == b) {
        out += ", " + text;
      } else {
        out += std::string(out.empty() ? "" : ", ") + "\"" + b + "\": [" + text;
        open_seq = b;
      }
      const bool last = i + 1 >= row.num_hyper || !row.hyper[i + 1].deepspeed ||
                        base_of(row.hyper[i + 1].deepspeed) != b;
      if (last) {
        out += "]";
        open_seq.clear();
      }
    } else {
      out += std::string(out.empty() ? "" : ", ") + "\"" + e.deepspeed + "\": " + text;
    }
  }
  return "{" + out + "}";
}

std::string config_json(const AlgoSpec& row, const std::string& params) {
  return std::string(R"({"train_batch_size": 8, "zero8": {}, "optimizer": {"type": ")") + row.deepspeed +
         R"(", "params": )" + params + "}}";
}

TEST(OptimTable, EveryDeepSpeedKeyRoundTripsIntoItsHyperField) {
  for (const AlgoSpec& row : optim::kAlgos) {
    if (!row.deepspeed) continue;
    SCOPED_TRACE(row.name);
    std::vector<double> want;
    const std::string json = config_json(row, params_json(row, want));
    SCOPED_TRACE(json);
    const cfg::Config c = cfg::parse_string(json, 1, "t.json");
    EXPECT_TRUE(c.warnings.empty()) << c.warnings.front();
    ASSERT_EQ(c.optimizer.type, row.algo);
    const optim::Hyper h = cfg::optimizer_hyper(c.optimizer);
    const optim::Hyper defaults;
    for (HyperField f : kFields) {
      const HyperSpec* e = entry_of(row, f);
      const double expect = e ? want[size_t(e - row.hyper)] : optim::hyper_get(defaults, f);
      EXPECT_EQ(optim::hyper_get(h, f), double(float(expect))) << optim::hyper_field_name(f);
    }
    for (int i = 0; i < row.num_hyper; ++i) EXPECT_EQ(c.optimizer.values[size_t(i)], want[size_t(i)]) << row.hyper[i].key;
    const cfg::Config back = cfg::parse_string(cfg::to_json(c), 1, "back.json");
    EXPECT_TRUE(back.warnings.empty());
    EXPECT_EQ(back, c);
  }
}

TEST(OptimTable, DefaultsAreDeepSpeeds) {
  for (const AlgoSpec& row : optim::kAlgos) {
    if (!row.deepspeed) continue;
    SCOPED_TRACE(row.name);
    const cfg::Config c = cfg::parse_string(config_json(row, "{}"), 1, "t.json");
    const optim::Hyper h = cfg::optimizer_hyper(c.optimizer);
    for (int i = 0; i < row.num_hyper; ++i) {
      const HyperSpec& e = row.hyper[i];
      EXPECT_EQ(c.optimizer.get(e.key), e.ds_default) << e.key;
      if (is_value(e)) {
        EXPECT_EQ(optim::hyper_get(h, e.field), double(float(e.ds_default))) << e.key;
      }
    }
  }
}

TEST(OptimTable, DecoupleFixedIgnoredAndRangesInAConfig) {
  for (const AlgoSpec& row : optim::kAlgos) {
    if (!row.deepspeed) continue;
    SCOPED_TRACE(row.name);
    for (int i = 0; i < row.num_hyper; ++i) {
      const HyperSpec& e = row.hyper[i];
      if (!e.deepspeed) continue;
      SCOPED_TRACE(e.deepspeed);
      const bool flag = e.type == optim::HyperType::flag;
      const std::string other = flag ? (e.ds_default != 0.0 ? "false" : "true") : number(e.ds_default + 1.0);
      const std::string path = "t.json: optimizer.params." + std::string(e.deepspeed);
      if (e.role == HyperRole::decouple) {
        for (const char* v : {"true", "false"}) {
          const cfg::Config c = cfg::parse_string(config_json(row, "{\"" + std::string(e.deepspeed) + "\": " + v + "}"), 1);
          const bool on = std::strcmp(v, "true") == 0;
          EXPECT_EQ(cfg::optimizer_algo(c.optimizer), on ? row.decoupled : row.algo) << v;
        }
      } else if (e.role == HyperRole::fixed) {
        try {
          cfg::parse_string(config_json(row, "{\"" + std::string(e.deepspeed) + "\": " + other + "}"), 1, "t.json");
          ADD_FAILURE() << "accepted";
        } catch (const zero8::Error& err) {
          EXPECT_EQ(err.code(), zero8::ErrorCode::unsupported);
          EXPECT_NE(std::string(err.what()).find(path + ": "), std::string::npos) << err.what();
          EXPECT_NE(std::string(err.what()).find(e.why), std::string::npos) << err.what();
        }
      } else if (e.role == HyperRole::ignored) {
        const cfg::Config c = cfg::parse_string(config_json(row, "{\"" + std::string(e.deepspeed) + "\": " + other + "}"), 1, "t.json");
        ASSERT_EQ(c.warnings.size(), 1u);
        EXPECT_NE(c.warnings[0].find(path + ": ignored: " + e.why), std::string::npos) << c.warnings[0];
      } else if (is_value(e) && !flag && !std::strchr(e.deepspeed, '[')) {
        // Just outside the range (0 itself where 0 means off in zero8 but is a value in DeepSpeed).
        const double lo = e.range.lo, hi = e.range.hi;
        std::vector<double> bad;
        if (std::isfinite(lo)) bad.push_back(e.range.lo_open || e.range.zero_off ? lo : lo - 0.5);
        if (std::isfinite(hi)) bad.push_back(e.range.hi_open ? hi : hi + 0.5);
        for (double x : bad) {
          try {
            cfg::parse_string(config_json(row, "{\"" + std::string(e.deepspeed) + "\": " + number(x) + "}"), 1, "t.json");
            ADD_FAILURE() << "accepted " << x;
          } catch (const zero8::Error& err) {
            EXPECT_EQ(err.code(), zero8::ErrorCode::invalid_argument);
            EXPECT_NE(std::string(err.what()).find(path + ": expected a number"), std::string::npos) << err.what();
          }
        }
      }
    }
  }
}

}  // namespace
