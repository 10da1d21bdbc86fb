// Checkpoints of a device optimizer (ShardConfig::memory = device) under mpirun -np K: fed the same
// gradients as a host optimizer, it writes the same files byte for byte (the save's nonce and time
// aside); a device checkpoint loads into a host optimizer and a host one into a device optimizer, and
// either resumes bit-exactly as the uninterrupted host run. The device communicator is the MPI world
// (device buffers staged: ranks may share one GPU) and, where every rank has a GPU of its own, NCCL,
// whose save and load pass their control data (flags, strings, the nonce) through device memory.
// Skips, naming why, without CUDA or a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt_util.h"
#include "dist_env.h"
#include "zero8/checkpoint.h"
#include "zero8/checkpoint_format.h"
#include "zero8/kernels/device.h"
#include "zero8/kernels/vec.h"

#if ZERO8_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace zero8::test {
namespace {

namespace fs = std::filesystem;
using Part = ShardedOptimizer::Part;

#define SKIP_WITHOUT_CUDA()                                   \
  do {                                                        \
    const std::string why_ = device::cuda_unavailable();      \
    if (!why_.empty()) GTEST_SKIP() << why_;                  \
  } while (0)

constexpr Part kParts[] = {Part::working, Part::master, Part::codes1, Part::absmax1, Part::codes2,
                           Part::absmax2, Part::state1, Part::state2, Part::residual};

// A device optimizer on the caller's stream `stream`, holding the same weights as ckpt_make(c, ..., seed)
// (written into a host twin and copied over).
std::unique_ptr<ShardedOptimizer> device_make(const ShardConfig& c, comm::Communicator& comm, void* stream,
                                              uint64_t seed = 77) {
  std::unique_ptr<ShardedOptimizer> host = ckpt_make(c, world(), seed);
  ShardConfig d = c;
  d.memory = MemSpace::device;
  d.stream = stream;
  auto opt = std::make_unique<ShardedOptimizer>(ckpt_params(), d, comm);
  for (int g = 0; g < shard::kNumGroups; ++g)
    opt->copy_from_host(Group(g), Part::working, host->working(Group(g)));
  opt->init(0);
  return opt;
}

// ckpt_train for a device optimizer: each micro-batch's gradient (the same values, times the loss scale)
// is uploaded on the optimizer's stream and added to its gradient input, as ckpt_train adds it on the host.
void device_train(ShardedOptimizer& opt, void* stream, int64_t first, int steps, int gas = 1, int64_t inf_step = -1) {
  const int r = opt.rank();
  const shard::Layout& lay = opt.layout();
  device::Buffer upload;
  for (int64_t s = first; s < first + steps; ++s) {
    const float scale = float(opt.loss_scale());
    for (int m = 0; m < gas; ++m) {
      for (int g = 0; g < shard::kNumGroups; ++g) {
        const shard::GroupLayout& gl = lay.groups[g];
        if (gl.padded() == 0) continue;
        std::vector<float> grad(size_t(gl.padded()), 0.0f);
        for (int p : gl.params) {
          const shard::ParamSlot& slot = lay.slots[size_t(p)];
          for (int64_t i = 0; i < slot.numel; ++i) grad[size_t(slot.offset + i)] = ckpt_grad_value(r, s, m, p, i) * scale;
        }
        if (s == inf_step && m == 0 && r == 0 && lay.slots[2].group == Group(g) && lay.slots[2].numel > 0)
          grad[size_t(lay.slots[2].offset + 5)] = INFINITY;
        upload.reserve(int64_t(grad.size() * 4), "gradient upload");
        device::copy(upload.data(), grad.data(), int64_t(grad.size() * 4), stream, "gradient upload");
        vec::add(opt.grad_input(Group(g)), DType::f32, upload.data(), DType::f32, int64_t(grad.size()),
                 {MemSpace::device, stream});
        device::synchronize(stream, "gradient upload");  // the host vector goes at the end of this scope
      }
      for (int p = int(lay.params.size()) - 1; p >= 0; --p) opt.grad_ready(p);
      opt.backward_end(m == gas - 1);
    }
    opt.step();
  }
}

// Everything of one rank that a resumed run depends on, read through copy_to_host (either memory).
struct Parts {
  std::vector<std::vector<uint8_t>> bytes;
  int64_t steps = 0;
  LossScalerState scaler;
};

Parts parts_of(ShardedOptimizer& opt) {
  Parts out;
  for (int g = 0; g < shard::kNumGroups; ++g)
    for (Part p : kParts) {
      std::vector<uint8_t> b(size_t(opt.part_bytes(Group(g), p)));
      opt.copy_to_host(Group(g), p, b.data());
      out.bytes.push_back(std::move(b));
    }
  out.steps = opt.steps();
  out.scaler = opt.scaler().state();
  return out;
}

// "" when equal, else what differs.
std::string parts_diff(const Parts& a, const Parts& b) {
  std::string d;
  for (size_t k = 0; k < a.bytes.size(); ++k)
    if (a.bytes[k] != b.bytes[k])
      d += "group " + std::to_string(k / 9) + " " + ShardedOptimizer::part_name(kParts[k % 9]) + "; ";
  if (a.steps != b.steps) d += "steps " + std::to_string(a.steps) + " vs " + std::to_string(b.steps) + "; ";
  if (std::memcmp(&a.scaler.scale, &b.scaler.scale, sizeof(double)) != 0 || a.scaler.cur_iter != b.scaler.cur_iter ||
      a.scaler.last_overflow_iter != b.scaler.last_overflow_iter || a.scaler.cur_hysteresis != b.scaler.cur_hysteresis)
    d += "loss scaler; ";
  return d;
}

struct Case {
  const char* name;
  ShardConfig cfg;
  int gas = 1;
  int64_t inf_step = -1;
};

// The configurations whose device steps equal the host's bit for bit (LAMB's norms are summed in another
// order on the device, so it is left out): everything a checkpoint holds (bf16 working copy off the
// rounded master, error-feedback residuals, fp16 loss scaling after an overflow, 32-bit states).
std::vector<Case> cases() {
  std::vector<Case> v;
  v.push_back({"adamw 8-bit, bf16, int8 grads + params, error feedback", ckpt_config()});
  ShardConfig lion = ckpt_config();
  lion.algo = optim::Algo::lion;
  lion.hyper.lr = 1e-3f;
  lion.hyper.beta2 = 0.99f;
  lion.working_dtype = DType::f16;
  lion.fp16 = true;
  lion.loss_scaler.initial_scale_power = 8;
  lion.loss_scaler.hysteresis = 1;
  lion.stage = 1;
  v.push_back({"lion 8-bit, fp16 loss scaling after an overflow, stage 1, accumulation 2", lion, 2, 1});
  ShardConfig fp32 = ckpt_config();
  fp32.bits = 32;
  fp32.working_dtype = DType::f32;
  fp32.int8_grads = false;
  fp32.int8_params = false;
  fp32.error_feedback = false;
  v.push_back({"adamw 32-bit, f32, fp32 communication", fp32});
  return v;
}

std::vector<uint8_t> shard_without_nonce(const std::string& path) {
  std::vector<uint8_t> b = file_read_bytes(path);
  if (b.size() >= sizeof(ckpt::ShardHeader)) std::memset(b.data() + offsetof(ckpt::ShardHeader, nonce), 0, 8);
  return b;
}

// The manifest without what differs between any two saves (the nonce, the time, and the checksums that
// cover the nonce: the shards' and the manifest's own).
nlohmann::json manifest_without_nonce(const std::string& path) {
  nlohmann::json j = nlohmann::json::parse(file_read_bytes(path));
  j.erase("nonce");
  j.erase("saved_unix_s");
  j.erase(ckpt::kManifestHashKey);
  for (nlohmann::json& f : j.at("files"))
    if (f.at("role") == "shard") f.erase("xxh3_64");
  return j;
}

// Rank 0: the two tags hold the same files with the same bytes, but for the nonce; "" when they do.
std::string tag_diff(const std::string& a, const std::string& b) {
  std::string d;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(a)) names.push_back(e.path().filename().string());
  std::vector<std::string> other;
  for (const auto& e : fs::directory_iterator(b)) other.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  std::sort(other.begin(), other.end());
  if (names != other) return "different file names";
  for (const std::string& n : names) {
    const std::string pa = a + "/" + n, pb = b + "/" + n;
    if (n == ckpt::kManifestName) {
      if (manifest_without_nonce(pa) != manifest_without_nonce(pb)) d += n + "; ";
    } else if (n.rfind(ckpt::kShardPrefix, 0) == 0) {
      if (shard_without_nonce(pa) != shard_without_nonce(pb)) d += n + "; ";
    } else if (file_read_bytes(pa) != file_read_bytes(pb)) {
      d += n + "; ";
    }
  }
  return d;
}

TEST(CheckpointCuda, DeviceFilesEqualTheHostFilesByteForByte) {
  SKIP_WITHOUT_CUDA();
  device::Stream stream("the caller's stream");  // declared first: it outlives the optimizers, which name it
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    TempDir host_dir, dev_dir;
    auto host = ckpt_make(c.cfg, world());
    auto dev = device_make(c.cfg, world(), stream.get());
    ckpt_train(*host, 0, 3, c.gas, c.inf_step);
    device_train(*dev, stream.get(), 0, 3, c.gas, c.inf_step);
    ASSERT_EQ(parts_diff(parts_of(*host), parts_of(*dev)), "") << "the twins differ before the save";
    ckpt::SaveOptions so;
    so.client_state = R"({"epoch": 2})";
    const ckpt::SaveResult hs = ckpt::save(*host, host_dir.path, so);
    const ckpt::SaveResult ds = ckpt::save(*dev, dev_dir.path, so);
    EXPECT_EQ(hs.tag, ds.tag);
    // The tags' sizes, but for the manifest's, whose time and nonce are numbers of varying length.
    const auto manifest_bytes = [](const std::string& tag) {
      return int64_t(fs::file_size(fs::path(tag) / ckpt::kManifestName));
    };
    EXPECT_EQ(hs.bytes - manifest_bytes(hs.path), ds.bytes - manifest_bytes(ds.path));
    std::string diff;
    if (world().rank() == 0) diff = tag_diff(hs.path, ds.path);
    EXPECT_EQ(diff, "") << "rank 0: files that differ";
    EXPECT_TRUE(ckpt::verify(ds.path).ok());
  }
}

TEST(CheckpointCuda, CheckpointsLoadAcrossMemoriesAndResumeBitExactly) {
  SKIP_WITHOUT_CUDA();
  device::Stream stream("the caller's stream");  // declared first: it outlives the optimizers, which name it
  const int k = 3, m = 3;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    TempDir host_dir, dev_dir;
    // The uninterrupted host run, saved at step k.
    auto host = ckpt_make(c.cfg, world());
    ckpt_train(*host, 0, k, c.gas, c.inf_step);
    const Parts at_save = parts_of(*host);
    ckpt::save(*host, host_dir.path);
    ckpt_train(*host, k, m, c.gas, c.inf_step);
    const Parts run_a = parts_of(*host);
    // Its device twin, saved at step k.
    auto dev = device_make(c.cfg, world(), stream.get());
    device_train(*dev, stream.get(), 0, k, c.gas, c.inf_step);
    ckpt::save(*dev, dev_dir.path);

    // The device checkpoint into a host optimizer that trained elsewhere, and on.
    auto h2 = ckpt_make(c.cfg, world(), 1234);
    ckpt_train(*h2, 100, 1, c.gas);
    const ckpt::LoadResult lr = ckpt::load(*h2, dev_dir.path);
    EXPECT_TRUE(lr.warnings.empty()) << lr.warnings.front();
    EXPECT_EQ(parts_diff(parts_of(*h2), at_save), "") << "host after loading the device checkpoint, rank " << world().rank();
    ckpt_train(*h2, k, m, c.gas, c.inf_step);
    EXPECT_EQ(parts_diff(parts_of(*h2), run_a), "") << "host resumed from the device checkpoint, rank " << world().rank();

    // Either checkpoint into a device optimizer that trained elsewhere, and on.
    for (const std::string* dir : {&dev_dir.path, &host_dir.path}) {
      SCOPED_TRACE(*dir == dev_dir.path ? "device checkpoint into a device optimizer" : "host checkpoint into a device optimizer");
      auto d2 = device_make(c.cfg, world(), stream.get(), 1234);
      device_train(*d2, stream.get(), 100, 1, c.gas);
      ckpt::load(*d2, *dir);
      EXPECT_EQ(parts_diff(parts_of(*d2), at_save), "") << "right after load, rank " << world().rank();
      device_train(*d2, stream.get(), k, m, c.gas, c.inf_step);
      EXPECT_EQ(parts_diff(parts_of(*d2), run_a), "") << "after " << m << " more steps, rank " << world().rank();
    }
  }
}

#if ZERO8_WITH_NCCL
// Over NCCL the checkpoint's agreement, strings and nonce go through device scratch (communicator.h's
// *_host calls), and the restored working copy is broadcast by NCCL; the files equal the host run's.
TEST(CheckpointCuda, OverNcclSavesAndLoadsAsOverMpi) {
  SKIP_WITHOUT_CUDA();
  int devices = 0;
  cudaGetDeviceCount(&devices);
  if (devices < world().size())
    GTEST_SKIP() << "NCCL needs one GPU per rank: " << world().size() << " ranks, " << devices << " device(s)";
  std::unique_ptr<comm::Communicator> nccl = comm::comm_create("nccl");
  // After the communicator, which makes the rank's GPU current (local rank r: device r): a stream made
  // before would belong to device 0, which the device optimizers of ranks r > 0 refuse. Declared before
  // them: it outlives the optimizers, which name it.
  device::Stream stream("the caller's stream");
  const Case c = cases().front();
  TempDir host_dir, dev_dir;
  auto host = ckpt_make(c.cfg, world());
  ckpt_train(*host, 0, 2);
  const Parts at_save = parts_of(*host);
  const ckpt::SaveResult hs = ckpt::save(*host, host_dir.path);
  auto dev = device_make(c.cfg, *nccl, stream.get());
  device_train(*dev, stream.get(), 0, 2);
  const ckpt::SaveResult ds = ckpt::save(*dev, dev_dir.path);
  std::string diff;
  if (world().rank() == 0) diff = tag_diff(hs.path, ds.path);
  EXPECT_EQ(diff, "") << "rank 0: files that differ";
  auto d2 = device_make(c.cfg, *nccl, stream.get(), 1234);
  const ckpt::LoadResult lr = ckpt::load(*d2, host_dir.path);
  EXPECT_EQ(lr.step, 2);
  EXPECT_EQ(parts_diff(parts_of(*d2), at_save), "") << "rank " << world().rank();
}
#endif

}  // namespace
}  // namespace zero8::test
