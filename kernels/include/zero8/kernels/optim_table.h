// The optimizer-algorithm table: for each algorithm zero8 runs, its names in DeepSpeed configs, torch.optim
// and bitsandbytes, its states, and every hyperparameter with its key in each library, its defaults, its
// valid range and the Hyper field (kernel argument) it goes to. The config parser and dumper
// (zero8/config.h), the Python optimizers and the engine's translation of client optimizers (through
// _C.algo_table()) read it; adding an optimizer is a row here, its element rule (optim_math.h) and kernel
// dispatch, and its tests (docs/ARCHITECTURE.md, "Adding an optimizer").
//
// Arrays of aggregates rather than an X-macro: a row holds a variable-length list of hyperparameters,
// which an X-macro can only spell as one more macro per row; as data, every column is typed and named in
// one legend, code and tests walk the rows at run time, and the accessors below stay constexpr, so the
// kernels' `if constexpr` branches read the same rows. The enum is the one list of identifiers; a
// static_assert checks that row i describes Algo(i).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>

#include "zero8/kernels/quant_map.h"

namespace zero8::optim {

// The algorithms of the fused kernels. The values are part of the kernel ABI (StepArgs::algo); new ones
// go at the end.
enum class Algo : uint8_t { adam = 0, adamw, sgd, lion, rmsprop, adagrad, lamb, lars };

// The Hyper member an entry's value goes to (none: it selects or constrains, see HyperRole).
enum class HyperField : uint8_t {
  none, lr, beta1, beta2, eps, weight_decay, dampening, nesterov, bias_correction, lr_decay, initial_accumulator,
  trust_coefficient, max_trust_ratio, min_trust_ratio,
};

enum class HyperType : uint8_t { real, flag };  // a number; a boolean (stored as 0 or 1)

enum class HyperRole : uint8_t {
  value,      // a hyperparameter of every step: goes to `field`
  init,       // read when a state is made (Adagrad's initial accumulator); also recorded in `field`
  decouple,   // a flag: true runs the row's `decoupled` algorithm (DeepSpeed's adam_w_mode, torch's
              // decoupled_weight_decay)
  fixed,      // an argument zero8 accepts only at its default (amsgrad, centered): others are refused with `why`
  ignored,    // accepted without effect: a value other than the default warns with `why`
  bnb_const,  // a key bitsandbytes' groups hold for this algorithm with a constant it ignores (SGD's eps = 0):
              // zero8's state dicts write it so that bitsandbytes loads them, loads drop it
};

// Where an entry is a zero8.optim constructor argument (bitsandbytes' order): positional after params;
// keyword-only after min_8bit_size (bitsandbytes' own keyword arguments); keyword-only after block_size
// (zero8's additions); or not an argument.
enum class PyArg : uint8_t { none, positional, keyword, keyword_last };

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// The valid values of a real entry. zero_off: 0 turns the feature off in zero8 (max_trust_ratio 0: no
// clip); DeepSpeed's key has no such value (FusedLamb clips at max_coeff = 0), so a config needs > lo.
struct HyperRange {
  double lo = -kInf, hi = kInf;
  bool lo_open = false, hi_open = false;
  bool zero_off = false;
  constexpr bool contains(double x) const {
    return (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi);
  }
};

// One argument of an algorithm. `key` is the canonical name: zero8.optim's (and torch.optim's) param-group
// key, and the engine's; "betas[1]" is element 1 of the sequence "betas" (element k is the k-th entry whose
// key names that sequence). nullptr as a library's key: that library has no such argument.
struct HyperSpec {
  const char* key;
  const char* deepspeed;  // key in the config's "optimizer": {"params"}
  const char* torch;      // torch.optim's argument and group key
  const char* bnb;        // bitsandbytes' group key ("betas[0]" for SGD's momentum; its argument is `key`)
  HyperRole role;
  HyperField field;
  HyperType type;
  double ds_default;      // the optimizer DeepSpeed builds for the type (FusedAdam, FusedLamb, torch.optim...)
  double torch_default;   // torch.optim's class (bitsandbytes' where torch.optim has none)
  double py_default;      // zero8.optim's constructor (bitsandbytes' behaviour)
  HyperRange range;
  PyArg py;
  const char* why;        // fixed / ignored: why another value is refused / has no effect
};

struct AlgoSpec {
  Algo algo;
  const char* name;        // canonical: algo_name, _C.Algo, checkpoint manifests
  const char* class_name;  // zero8.optim's and bitsandbytes' class stem (AdamW -> AdamW8bit, AdamW32bit)
  const char* deepspeed;   // "optimizer": {"type"} (case-insensitive); nullptr: none
  const char* torch;       // torch.optim class; nullptr: none
  const char* bnb[2];      // bitsandbytes class stems that run this algorithm (no Paged prefix, 8bit/32bit suffix)
  Algo decoupled;          // what a true decouple entry selects (adam -> adamw); algo itself when none
  Algo loads_from;         // zero8.optim also loads this algorithm's state dicts (lamb: adam's); algo: none
  int num_states;
  quant::MapKind state_map[2];  // the map of each 8-bit state
  const char* torch_state[2];   // torch.optim's (lion-pytorch's) name of each state
  bool trust_ratio;        // two phases: per-tensor norms, then the step scaled by optim_trust_ratio
  bool torch_flags;        // a config accepts torch.optim's implementation flags (foreach, fused, ...)
  const HyperSpec* hyper;
  int num_hyper;
};

namespace table {

using R = HyperRole;
using F = HyperField;
constexpr HyperType kReal = HyperType::real, kFlag = HyperType::flag;
constexpr PyArg kPos = PyArg::positional, kKw = PyArg::keyword, kKwLast = PyArg::keyword_last, kNoArg = PyArg::none;
constexpr HyperRange kAny{};
constexpr HyperRange kNonNeg{0.0, kInf, false, false};
constexpr HyperRange kClip{0.0, kInf, false, false, true};  // 0: no clip
constexpr HyperRange kUnit{0.0, 1.0, false, true};          // [0, 1)
constexpr HyperRange kUnitClosed{0.0, 1.0, false, false};   // [0, 1]

constexpr const char* kNoAmsgrad = "zero8 keeps no running maximum of the second moment";
constexpr const char* kNoMaxUnorm =
    "zero8 computes the per-tensor trust ratio of the paper (clipped at max_trust_ratio) instead of bitsandbytes' "
    "update-norm clipping";
constexpr const char* kOwnKernels = "zero8 runs its own fused kernels, not torch.optim.Adam(W)";
constexpr const char* kOneRmsState = "zero8's RMSprop keeps one state (the square average)";

// Columns: key, DeepSpeed key, torch.optim key, bitsandbytes key (nullptr: that library has none), role,
// Hyper field, type, defaults (DeepSpeed, torch.optim, zero8.optim), range, zero8.optim argument, why.
// The entries of a row are in zero8.optim's argument order (bitsandbytes').

// DeepSpeed builds FusedAdam for "Adam", with adam_w_mode true by default; torch.optim.Adam decays by L2
// unless decoupled_weight_decay; bitsandbytes' Adam always decouples (see kAlgos), and so does zero8.optim's
// unless told otherwise.
inline constexpr HyperSpec kAdam[] = {
    {"lr", "lr", "lr", "lr", R::value, F::lr, kReal, 1e-3, 1e-3, 1e-3, kNonNeg, kPos, nullptr},
    {"betas[0]", "betas[0]", "betas[0]", "betas[0]", R::value, F::beta1, kReal, 0.9, 0.9, 0.9, kUnit, kPos, nullptr},
    {"betas[1]", "betas[1]", "betas[1]", "betas[1]", R::value, F::beta2, kReal, 0.999, 0.999, 0.999, kUnit, kPos,
     nullptr},
    {"eps", "eps", "eps", "eps", R::value, F::eps, kReal, 1e-8, 1e-8, 1e-8, kNonNeg, kPos, nullptr},
    {"weight_decay", "weight_decay", "weight_decay", "weight_decay", R::value, F::weight_decay, kReal, 0, 0, 0,
     kNonNeg, kPos, nullptr},
    {"amsgrad", "amsgrad", "amsgrad", "amsgrad", R::fixed, F::none, kFlag, 0, 0, 0, kAny, kPos, kNoAmsgrad},
    {"bias_correction", "bias_correction", nullptr, nullptr, R::value, F::bias_correction, kFlag, 1, 1, 1, kAny,
     kNoArg, nullptr},
    {"decoupled_weight_decay", "adam_w_mode", "decoupled_weight_decay", nullptr, R::decouple, F::none, kFlag, 1, 0,
     1, kAny, kKwLast, nullptr},
    {"torch_adam", "torch_adam", nullptr, nullptr, R::ignored, F::none, kFlag, 0, 0, 0, kAny, kNoArg, kOwnKernels},
};

// torch.optim.AdamW and bitsandbytes decay by 1e-2 by default, DeepSpeed's FusedAdam by 0. The decouple flag
// is true whatever it is given (DeepSpeed ignores adam_w_mode for "AdamW"; zero8.optim.AdamW has no such
// argument, and refuses a group that sets it false).
inline constexpr HyperSpec kAdamW[] = {
    {"lr", "lr", "lr", "lr", R::value, F::lr, kReal, 1e-3, 1e-3, 1e-3, kNonNeg, kPos, nullptr},
    {"betas[0]", "betas[0]", "betas[0]", "betas[0]", R::value, F::beta1, kReal, 0.9, 0.9, 0.9, kUnit, kPos, nullptr},
    {"betas[1]", "betas[1]", "betas[1]", "betas[1]", R::value, F::beta2, kReal, 0.999, 0.999, 0.999, kUnit, kPos,
     nullptr},
    {"eps", "eps", "eps", "eps", R::value, F::eps, kReal, 1e-8, 1e-8, 1e-8, kNonNeg, kPos, nullptr},
    {"weight_decay", "weight_decay", "weight_decay", "weight_decay", R::value, F::weight_decay, kReal, 0, 1e-2, 1e-2,
     kNonNeg, kPos, nullptr},
    {"amsgrad", "amsgrad", "amsgrad", "amsgrad", R::fixed, F::none, kFlag, 0, 0, 0, kAny, kPos, kNoAmsgrad},
    {"bias_correction", "bias_correction", nullptr, nullptr, R::value, F::bias_correction, kFlag, 1, 1, 1, kAny,
     kNoArg, nullptr},
    {"decoupled_weight_decay", "adam_w_mode", "decoupled_weight_decay", nullptr, R::decouple, F::none, kFlag, 1, 1,
     1, kAny, kNoArg, nullptr},
    {"torch_adam", "torch_adam", nullptr, nullptr, R::ignored, F::none, kFlag, 0, 0, 0, kAny, kNoArg, kOwnKernels},
};

// bitsandbytes keeps SGD's momentum and dampening as betas = (momentum, dampening), with eps = 0.
inline constexpr HyperSpec kSGD[] = {
    {"lr", "lr", "lr", "lr", R::value, F::lr, kReal, 1e-3, 1e-3, 1e-3, kNonNeg, kPos, nullptr},
    {"momentum", "momentum", "momentum", "betas[0]", R::value, F::beta1, kReal, 0, 0, 0, kUnit, kPos, nullptr},
    {"dampening", "dampening", "dampening", "betas[1]", R::value, F::dampening, kReal, 0, 0, 0, kUnitClosed, kPos,
     nullptr},
    {"weight_decay", "weight_decay", "weight_decay", "weight_decay", R::value, F::weight_decay, kReal, 0, 0, 0,
     kNonNeg, kPos, nullptr},
    {"nesterov", "nesterov", "nesterov", "nesterov", R::value, F::nesterov, kFlag, 0, 0, 0, kAny, kPos, nullptr},
    {"eps", nullptr, nullptr, "eps", R::bnb_const, F::none, kReal, 0, 0, 0, kAny, kNoArg, nullptr},
};

// DeepSpeed's FusedLion: lr 1e-3, betas (0.9, 0.999); the paper and bitsandbytes: 1e-4, (0.9, 0.99).
// torch.optim has no Lion.
inline constexpr HyperSpec kLion[] = {
    {"lr", "lr", nullptr, "lr", R::value, F::lr, kReal, 1e-3, 1e-4, 1e-4, kNonNeg, kPos, nullptr},
    {"betas[0]", "betas[0]", nullptr, "betas[0]", R::value, F::beta1, kReal, 0.9, 0.9, 0.9, kUnit, kPos, nullptr},
    {"betas[1]", "betas[1]", nullptr, "betas[1]", R::value, F::beta2, kReal, 0.999, 0.99, 0.99, kUnit, kPos, nullptr},
    {"weight_decay", "weight_decay", nullptr, "weight_decay", R::value, F::weight_decay, kReal, 0, 0, 0, kNonNeg,
     kPos, nullptr},
    {"eps", nullptr, nullptr, "eps", R::bnb_const, F::none, kReal, 0, 0, 0, kAny, kNoArg, nullptr},
};

// bitsandbytes keeps alpha as betas[0] and momentum (0 here) as betas[1].
inline constexpr HyperSpec kRMSprop[] = {
    {"lr", "lr", "lr", "lr", R::value, F::lr, kReal, 1e-2, 1e-2, 1e-2, kNonNeg, kPos, nullptr},
    {"alpha", "alpha", "alpha", "betas[0]", R::value, F::beta2, kReal, 0.99, 0.99, 0.99, kUnit, kPos, nullptr},
    {"eps", "eps", "eps", "eps", R::value, F::eps, kReal, 1e-8, 1e-8, 1e-8, kNonNeg, kPos, nullptr},
    {"weight_decay", "weight_decay", "weight_decay", "weight_decay", R::value, F::weight_decay, kReal, 0, 0, 0,
     kNonNeg, kPos, nullptr},
    {"momentum", "momentum", "momentum", "betas[1]", R::fixed, F::none, kReal, 0, 0, 0, kAny, kPos, kOneRmsState},
    {"centered", "centered", "centered", "centered", R::fixed, F::none, kFlag, 0, 0, 0, kAny, kPos, kOneRmsState},
};

// bitsandbytes' Adagrad groups hold betas = (0, 0).
inline constexpr HyperSpec kAdagrad[] = {
    {"lr", "lr", "lr", "lr", R::value, F::lr, kReal, 1e-2, 1e-2, 1e-2, kNonNeg, kPos, nullptr},
    {"lr_decay", "lr_decay", "lr_decay", "lr_decay", R::value, F::lr_decay, kReal, 0, 0, 0, kNonNeg, kPos, nullptr},
    {"weight_decay", "weight_decay", "weight_decay", "weight_decay", R::value, F::weight_decay, kReal, 0, 0, 0,
     kNonNeg, kPos, nullptr},
    {"initial_accumulator_value", "initial_accumulator_value", "initial_accumulator_value",
     "initial_accumulator_value", R::init, F::initial_accumulator, kReal, 0, 0, 0, kNonNeg, kPos, nullptr},
    {"eps", "eps", "eps", "eps", R::value, F::eps, kReal, 1e-10, 1e-10, 1e-10, kNonNeg, kPos, nullptr},
    {"betas[0]", nullptr, nullptr, "betas[0]", R::bnb_const, F::none, kReal, 0, 0, 0, kAny, kNoArg, nullptr},
    {"betas[1]", nullptr, nullptr, "betas[1]", R::bnb_const, F::none, kReal, 0, 0, 0, kAny, kNoArg, nullptr},
};

// DeepSpeed's FusedLamb names the trust-ratio clips max_coeff / min_coeff (min 0.01 there, 0 in zero8.optim
// and bitsandbytes' terms). torch.optim has no LAMB.
inline constexpr HyperSpec kLAMB[] = {
    {"lr", "lr", nullptr, "lr", R::value, F::lr, kReal, 1e-3, 1e-3, 1e-3, kNonNeg, kPos, nullptr},
    {"bias_correction", "bias_correction", nullptr, "bias_correction", R::value, F::bias_correction, kFlag, 1, 1, 1,
     kAny, kPos, nullptr},
    {"betas[0]", "betas[0]", nullptr, "betas[0]", R::value, F::beta1, kReal, 0.9, 0.9, 0.9, kUnit, kPos, nullptr},
    {"betas[1]", "betas[1]", nullptr, "betas[1]", R::value, F::beta2, kReal, 0.999, 0.999, 0.999, kUnit, kPos,
     nullptr},
    {"eps", "eps", nullptr, "eps", R::value, F::eps, kReal, 1e-8, 1e-8, 1e-8, kNonNeg, kPos, nullptr},
    {"weight_decay", "weight_decay", nullptr, "weight_decay", R::value, F::weight_decay, kReal, 0, 0, 0, kNonNeg,
     kPos, nullptr},
    {"amsgrad", "amsgrad", nullptr, "amsgrad", R::fixed, F::none, kFlag, 0, 0, 0, kAny, kPos, kNoAmsgrad},
    {"adam_w_mode", nullptr, nullptr, "adam_w_mode", R::fixed, F::none, kFlag, 1, 1, 1, kAny, kPos,
     "zero8's LAMB decouples weight decay as the paper does"},
    {"max_unorm", nullptr, nullptr, "max_unorm", R::ignored, F::none, kReal, 1, 1, 1, kAny, kKw, kNoMaxUnorm},
    {"max_trust_ratio", "max_coeff", nullptr, nullptr, R::value, F::max_trust_ratio, kReal, 10, 10, 10, kClip, kKw,
     nullptr},
    {"min_trust_ratio", "min_coeff", nullptr, nullptr, R::value, F::min_trust_ratio, kReal, 0.01, 0, 0, kNonNeg, kKw,
     nullptr},
    {"eps_inside_sqrt", "eps_inside_sqrt", nullptr, nullptr, R::fixed, F::none, kFlag, 0, 0, 0, kAny, kNoArg,
     "zero8 adds eps outside the square root"},
};

// SGD's arguments, then the trust ratio. LARS is not a DeepSpeed optimizer: its config keys are zero8's.
inline constexpr HyperSpec kLARS[] = {
    {"lr", "lr", nullptr, "lr", R::value, F::lr, kReal, 1e-3, 1e-3, 1e-3, kNonNeg, kPos, nullptr},
    {"momentum", "momentum", nullptr, "betas[0]", R::value, F::beta1, kReal, 0, 0, 0, kUnit, kPos, nullptr},
    {"dampening", "dampening", nullptr, "betas[1]", R::value, F::dampening, kReal, 0, 0, 0, kUnitClosed, kPos,
     nullptr},
    {"weight_decay", "weight_decay", nullptr, "weight_decay", R::value, F::weight_decay, kReal, 0, 0, 0, kNonNeg,
     kPos, nullptr},
    {"nesterov", "nesterov", nullptr, "nesterov", R::value, F::nesterov, kFlag, 0, 0, 0, kAny, kPos, nullptr},
    {"eps", nullptr, nullptr, "eps", R::bnb_const, F::none, kReal, 0, 0, 0, kAny, kNoArg, nullptr},
    {"max_unorm", nullptr, nullptr, "max_unorm", R::ignored, F::none, kReal, 0.02, 0.02, 0.02, kAny, kKw,
     kNoMaxUnorm},
    {"trust_coefficient", "trust_coefficient", nullptr, nullptr, R::value, F::trust_coefficient, kReal, 1e-3, 1e-3,
     1e-3, kNonNeg, kKw, nullptr},
    {"max_trust_ratio", nullptr, nullptr, nullptr, R::value, F::max_trust_ratio, kReal, 10, 10, 10, kClip, kKw,
     nullptr},
    {"min_trust_ratio", nullptr, nullptr, nullptr, R::value, F::min_trust_ratio, kReal, 0, 0, 0, kNonNeg, kKw,
     nullptr},
};

using quant::MapKind;
constexpr MapKind kS = MapKind::dynamic_signed, kU = MapKind::dynamic_unsigned;

}  // namespace table

// Columns: algo, name, class name, DeepSpeed type, torch.optim class, bitsandbytes classes, decoupled form,
// loads from, states (count, maps, torch names), trust ratio, torch flags in a config, hyperparameters.
inline constexpr AlgoSpec kAlgos[] = {
    {Algo::adam, "adam", "Adam", "Adam", "Adam", {nullptr, nullptr}, Algo::adamw, Algo::adam,
     2, {table::kS, table::kU}, {"exp_avg", "exp_avg_sq"}, false, true, table::kAdam, int(std::size(table::kAdam))},
    // bitsandbytes' Adam decays as its AdamW does (its update is torch.optim.AdamW's), so it runs as adamw.
    {Algo::adamw, "adamw", "AdamW", "AdamW", "AdamW", {"AdamW", "Adam"}, Algo::adamw, Algo::adamw,
     2, {table::kS, table::kU}, {"exp_avg", "exp_avg_sq"}, false, true, table::kAdamW, int(std::size(table::kAdamW))},
    {Algo::sgd, "sgd", "SGD", "SGD", "SGD", {"SGD", nullptr}, Algo::sgd, Algo::sgd,
     1, {table::kS, table::kS}, {"momentum_buffer", nullptr}, false, true, table::kSGD, int(std::size(table::kSGD))},
    // torch.optim has no Lion; its state name is lion-pytorch's.
    {Algo::lion, "lion", "Lion", "Lion", nullptr, {"Lion", nullptr}, Algo::lion, Algo::lion,
     1, {table::kS, table::kS}, {"exp_avg", nullptr}, false, false, table::kLion, int(std::size(table::kLion))},
    {Algo::rmsprop, "rmsprop", "RMSprop", "RMSprop", "RMSprop", {"RMSprop", nullptr}, Algo::rmsprop, Algo::rmsprop,
     1, {table::kS, table::kS}, {"square_avg", nullptr}, false, true, table::kRMSprop,
     int(std::size(table::kRMSprop))},
    {Algo::adagrad, "adagrad", "Adagrad", "Adagrad", "Adagrad", {"Adagrad", nullptr}, Algo::adagrad, Algo::adagrad,
     1, {table::kS, table::kS}, {"sum", nullptr}, false, true, table::kAdagrad, int(std::size(table::kAdagrad))},
    {Algo::lamb, "lamb", "LAMB", "Lamb", nullptr, {"LAMB", nullptr}, Algo::lamb, Algo::adam,
     2, {table::kS, table::kU}, {"exp_avg", "exp_avg_sq"}, true, false, table::kLAMB, int(std::size(table::kLAMB))},
    // LARS is not a DeepSpeed optimizer: "LARS" in a config is zero8's.
    {Algo::lars, "lars", "LARS", "LARS", nullptr, {"LARS", nullptr}, Algo::lars, Algo::sgd,
     1, {table::kS, table::kS}, {"momentum_buffer", nullptr}, true, true, table::kLARS, int(std::size(table::kLARS))},
};

inline constexpr int kNumAlgos = int(std::size(kAlgos));

constexpr bool algo_table_in_enum_order() {
  for (int i = 0; i < kNumAlgos; ++i)
    if (int(kAlgos[i].algo) != i || int(kAlgos[i].decoupled) >= kNumAlgos || int(kAlgos[i].loads_from) >= kNumAlgos)
      return false;
  return true;
}
static_assert(algo_table_in_enum_order(), "kAlgos[i] must describe Algo(i), and refer to rows that exist");

// The most entries a row has (OptimizerConfig keeps one value per entry).
constexpr int algo_max_hyper() {
  int m = 0;
  for (const AlgoSpec& s : kAlgos) m = s.num_hyper > m ? s.num_hyper : m;
  return m;
}
inline constexpr int kMaxHyper = algo_max_hyper();

constexpr bool algo_valid(Algo a) { return int(a) < kNumAlgos; }
// The row of a valid algorithm (callers check algo_valid first where the value comes from outside).
constexpr const AlgoSpec& algo_spec(Algo a) { return kAlgos[int(a)]; }
constexpr const char* algo_name(Algo a) { return algo_valid(a) ? algo_spec(a).name : "?"; }
constexpr int algo_num_states(Algo a) { return algo_spec(a).num_states; }
constexpr bool algo_has_trust_ratio(Algo a) { return algo_spec(a).trust_ratio; }

constexpr const char* hyper_field_name(HyperField f) {
  switch (f) {
    case HyperField::none: return "";
    case HyperField::lr: return "lr";
    case HyperField::beta1: return "beta1";
    case HyperField::beta2: return "beta2";
    case HyperField::eps: return "eps";
    case HyperField::weight_decay: return "weight_decay";
    case HyperField::dampening: return "dampening";
    case HyperField::nesterov: return "nesterov";
    case HyperField::bias_correction: return "bias_correction";
    case HyperField::lr_decay: return "lr_decay";
    case HyperField::initial_accumulator: return "initial_accumulator";
    case HyperField::trust_coefficient: return "trust_coefficient";
    case HyperField::max_trust_ratio: return "max_trust_ratio";
    case HyperField::min_trust_ratio: return "min_trust_ratio";
  }
  return "";
}

}  // namespace zero8::optim
