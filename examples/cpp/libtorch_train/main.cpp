// Trains a small MLP classifier with libtorch autograd and zero8's C++ sharded optimizer under mpirun
// (`mpirun -np 2 ./libtorch_train`): ZeRO stage 2, 8-bit AdamW states, int8 gradient reduce-scatter.
// The parameters are torch::from_blob views into the optimizer's working buffer, so the forward pass
// reads what the optimizer writes; a gradient hook per parameter hands its gradient to zero8 (grad_add:
// into the bucket that carries it, no full-size gradient buffer) and reports it ready, so full buckets
// are reduced while backward is still running.
// Exit status 0 when the held-out loss fell below half its initial value, 1 otherwise.
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>
#include <torch/version.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "zero8/comm/communicator.h"
#include "zero8/error.h"
#include "zero8/sharded.h"
#include "zero8/version.h"

namespace {

constexpr int64_t kIn = 32, kHidden = 256, kClasses = 10;
constexpr int64_t kEvalRows = 4096;

struct Options {
  int steps = 300;
  int batch = 64;  // per rank
  int log_every = 50;
  float lr = 2e-3f;
  int threads = 1;
  bool int8_params = true;  // zero8's default
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--steps") o.steps = std::atoi(next("--steps"));
    else if (a == "--batch") o.batch = std::atoi(next("--batch"));
    else if (a == "--log-every") o.log_every = std::atoi(next("--log-every"));
    else if (a == "--lr") o.lr = float(std::atof(next("--lr")));
    else if (a == "--threads") o.threads = std::atoi(next("--threads"));
    else if (a == "--fp32-params") o.int8_params = false;
    else {
      std::printf("usage: %s [--steps N] [--batch B per rank] [--log-every K] [--lr LR] [--threads T] "
                  "[--fp32-params]\n", argv[0]);
      std::exit(a == "--help" || a == "-h" ? 0 : 2);
    }
  }
  if (o.steps < 1 || o.batch < 1 || o.log_every < 1 || o.threads < 1) {
    std::fprintf(stderr, "--steps, --batch, --log-every and --threads must be >= 1\n");
    std::exit(2);
  }
  return o;
}

// The task: labels are the argmax of a fixed random "teacher" network's outputs on Gaussian inputs,
// so the student must learn a nonlinear map. Batches depend only on (step, rank): reproducible.
struct Teacher {
  torch::Tensor w1, w2;
  Teacher() {
    auto g = at::make_generator<at::CPUGeneratorImpl>(7);
    w1 = at::randn({kIn, 64}, g) / std::sqrt(double(kIn));
    w2 = at::randn({64, kClasses}, g) / 8.0;
  }
  std::pair<torch::Tensor, torch::Tensor> batch(uint64_t seed, int64_t rows) const {
    auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
    torch::Tensor x = at::randn({rows, kIn}, g);
    torch::Tensor y = torch::tanh(x.matmul(w1)).matmul(w2).argmax(1);
    return {x, y};
  }
};

struct MLP : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, out{nullptr};
  MLP() {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kHidden));
    out = register_module("out", torch::nn::Linear(kHidden, kClasses));
  }
  torch::Tensor forward(torch::Tensor x) {
    return out->forward(torch::gelu(fc2->forward(torch::gelu(fc1->forward(x)))));
  }
};

int run(const Options& opt) {
  torch::set_num_threads(opt.threads);
  std::unique_ptr<zero8::comm::Communicator> comm = zero8::comm::comm_create("auto");
  const int rank = comm->rank(), world = comm->size();

  torch::manual_seed(1234);  // the same initial weights everywhere (init() also broadcasts rank 0's)
  auto model = std::make_shared<MLP>();
  std::vector<torch::Tensor> params;
  std::vector<zero8::shard::ParamSpec> specs;
  for (const auto& item : model->named_parameters()) {
    params.push_back(item.value());
    specs.push_back({item.key(), item.value().sizes().vec(), false});
  }

  zero8::shard::ShardConfig cfg;
  cfg.algo = zero8::optim::Algo::adamw;
  cfg.hyper.lr = opt.lr;
  cfg.hyper.beta2 = 0.99f;
  cfg.hyper.weight_decay = 0.01f;
  cfg.bits = 8;            // 8-bit states for parameters of >= layout.min_8bit_size elements
  cfg.stage = 2;           // gradients reduced per bucket during backward
  cfg.int8_grads = true;   // int8 reduce-scatter
  cfg.int8_params = opt.int8_params;
  cfg.reduce_bucket_size = 32768;  // a few buckets for this model, so reduction overlaps backward
  cfg.gradient_clipping = 1.0;
  cfg.threads = opt.threads;
  zero8::shard::ShardedOptimizer sharded(specs, cfg, *comm);

  // Parameters become views into the working buffer (fp32 here); values copied in first.
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      torch::Tensor& p = params[i];
      torch::Tensor w = torch::from_blob(sharded.param_working(int(i)), p.sizes(), torch::kFloat32);
      w.copy_(p);
      p.set_data(w);
    }
  }
  sharded.init(0);

  // The gradient hook: hand this backward's gradient to zero8 (added in fp32 to the bucket that carries
  // it, accumulating micro-batches) and report it complete; the returned undefined tensor leaves
  // autograd's gradient unchanged.
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].register_hook([&sharded, i](torch::Tensor g) {
      const torch::Tensor c = g.contiguous();
      sharded.grad_add(int(i), c.data_ptr(), zero8::DType::f32);
      sharded.grad_ready(int(i));
      return torch::Tensor();
    });
  }

  Teacher teacher;
  auto [x_eval, y_eval] = teacher.batch(999999, kEvalRows);
  auto evaluate = [&]() {
    torch::NoGradGuard no_grad;
    torch::Tensor logits = model->forward(x_eval);
    double loss = torch::nn::functional::cross_entropy(logits, y_eval).item<double>();
    double acc = logits.argmax(1).eq(y_eval).to(torch::kFloat64).mean().item<double>();
    return std::make_pair(loss, acc);
  };

  auto [loss0, acc0] = evaluate();
  if (rank == 0) {
    int64_t n = 0;
    for (auto& p : params) n += p.numel();
    // What the collectives carry (one rank sends nothing, so it quantizes nothing).
    const zero8::shard::WirePlan& wire = sharded.wire();
    std::printf("zero8 %s, libtorch %s: %d rank(s) on %s, MLP %lld parameters, 8-bit AdamW, ZeRO stage 2, "
                "%s gradients, %s parameter sync\n", zero8::version(), TORCH_VERSION, world, comm->backend(),
                (long long)n, zero8::comm::wire_format_name(wire.grads), wire.int8_params ? "int8" : "exact");
    std::printf("step %4d  held-out loss %.4f  accuracy %.3f\n", 0, loss0, acc0);
  }

  auto t0 = std::chrono::steady_clock::now();
  double train_loss = 0.0;
  for (int step = 1; step <= opt.steps; ++step) {
    auto [x, y] = teacher.batch(uint64_t(step) * 1000 + uint64_t(rank), opt.batch);
    torch::Tensor loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    sharded.backward_end(/*boundary=*/true);  // the remaining buckets; gradients now averaged shards
    zero8::shard::StepInfo info = sharded.step();
    for (auto& p : params) p.mutable_grad() = torch::Tensor();  // zero8 holds the gradients
    // Cosine decay to 10% over the run (the scheduler's job in the Python engine).
    sharded.hyper().lr = opt.lr * float(0.1 + 0.45 * (1.0 + std::cos(M_PI * step / opt.steps)));
    train_loss += comm->all_reduce_value(loss.item<double>(), zero8::comm::ReduceOp::sum) / world;
    if (step % opt.log_every == 0 || step == opt.steps) {
      auto [l, a] = evaluate();
      if (rank == 0) {
        std::printf("step %4d  train loss %.4f  held-out loss %.4f  accuracy %.3f  grad norm %.3f\n", step,
                    train_loss / (step % opt.log_every ? step % opt.log_every : opt.log_every), l, a,
                    info.grad_norm);
      }
      train_loss = 0.0;
    }
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Every replica must hold identical weights: compare a checksum across ranks.
  double sum = 0.0;
  for (auto& p : params) sum += p.to(torch::kFloat64).sum().item<double>();
  double lo = comm->all_reduce_value(sum, zero8::comm::ReduceOp::min);
  double hi = comm->all_reduce_value(sum, zero8::comm::ReduceOp::max);
  auto [loss1, acc1] = evaluate();
  zero8::shard::MemoryStats mem = sharded.memory();
  uint64_t sent = comm->stats().bytes();
  bool ok = loss1 < 0.5 * loss0 && lo == hi;
  if (rank == 0) {
    std::printf("done: %d steps in %.1f s; held-out loss %.4f -> %.4f, accuracy %.3f -> %.3f; optimizer state "
                "%lld bytes on rank 0; rank 0 sent %llu bytes; replicas %s\n", opt.steps, secs, loss0, loss1,
                acc0, acc1, (long long)mem.state, (unsigned long long)sent, lo == hi ? "identical" : "DIFFER");
    std::printf(ok ? "PASS: the held-out loss fell below half its initial value\n"
                   : "FAIL: the held-out loss did not halve, or the replicas differ\n");
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse(argc, argv);
  try {
    return run(opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch_train: %s\n", e.what());
    return 1;
  }
}
