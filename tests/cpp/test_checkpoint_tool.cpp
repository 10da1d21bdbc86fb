// The checkpoint readers behind zero8-checkpoint, on a one-process checkpoint: the fp32 export and
// the model file read back with the checkpoint tests' own safetensors reader (header length, JSON header,
// raw little-endian data; tests/dist/ckpt_util.h) equal the masters and the working copy byte for byte; verify finds each
// kind of fault and names the file; the bytes per part add up from the layout; tags and latest; a tag that
// cannot be read is reported with the OS's reason, by the library and by zero8-checkpoint inspect, which
// also fails on a missing or truncated file. (Multi-rank checkpoints and the rest of the tool's command
// line: tests/dist/run_checkpoint.cmake.)
#include <grp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>

#include "../dist/ckpt_util.h"
#include "zero8/checkpoint.h"
#include "zero8/checkpoint_format.h"
#include "zero8/comm/communicator.h"
#include "zero8/error.h"
#include "zero8/sharded.h"

#ifndef ZERO8_CHECKPOINT_TOOL
#define ZERO8_CHECKPOINT_TOOL ""  // built without the tools (ZERO8_BUILD_TOOLS=OFF): its tests skip
#endif

namespace zero8 {
namespace {

namespace fs = std::filesystem;
using shard::Group;

std::vector<uint8_t> read_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

// The model and export files read with the checkpoint tests' own safetensors reader (ckpt_util.h).
std::map<std::string, test::StTensor> safetensors_load(const std::string& path, nlohmann::json* meta = nullptr) {
  test::StFile f = test::safetensors_read(path);
  if (meta) *meta = f.metadata;
  return std::move(f.tensors);
}

std::vector<shard::ParamSpec> params() { return {{"a", {70, 50}}, {"b", {33}}, {"c", {1200}}, {"s", {}}}; }

shard::ShardConfig config() {
  shard::ShardConfig c;
  c.layout.state_block = 64;
  c.layout.wire_block = 128;
  c.layout.min_8bit_size = 1000;
  c.algo = optim::Algo::adamw;
  c.hyper.lr = 1e-2f;
  c.working_dtype = DType::bf16;
  c.int8_params = true;  // no effect at one rank (sharded.h, WirePlan): see CheckpointTool's SetUp
  return c;
}

class CheckpointTool : public ::testing::Test {
 protected:
  void SetUp() override {
    comm_ = comm::comm_create("single");
    opt_ = std::make_unique<shard::ShardedOptimizer>(params(), config(), *comm_);
    for (size_t p = 0; p < params().size(); ++p)
      for (int64_t i = 0; i < opt_->layout().slots[p].numel; ++i)
        dtype_store(opt_->param_working(int(p)), DType::bf16, i, std::sin(float(i) * 0.37f + float(p)) * 0.1f);
    opt_->init(0);
    for (int s = 0; s < 2; ++s) {
      for (size_t p = 0; p < params().size(); ++p)
        for (int64_t i = 0; i < opt_->layout().slots[p].numel; ++i)
          opt_->param_grad(int(p))[i] = std::cos(float(i) * 0.11f + float(s * 7 + p)) * 0.01f;
      opt_->backward_end(true);
      opt_->step();
    }
    // A working copy that is not the rounded master, as int8 parameter sync leaves it over several
    // ranks (one rank syncs exactly), so that the model file shows which of the two it holds: the
    // first element of a and c one bf16 ulp off.
    for (size_t p = 0; p < params().size(); p += 2) *static_cast<uint16_t*>(opt_->param_working(int(p))) ^= 1;
    dir_ = (fs::temp_directory_path() / ("zero8_ckpt_tool_" + std::to_string(::getpid()))).string();
    fs::remove_all(dir_);
    ckpt::SaveOptions so;
    so.tag = "first";
    ckpt::save(*opt_, dir_, so);
    tag_dir_ = ckpt::save(*opt_, dir_).path;  // global_step2, the latest
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::unique_ptr<comm::Communicator> comm_;
  std::unique_ptr<shard::ShardedOptimizer> opt_;
  std::string dir_, tag_dir_;
};

TEST_F(CheckpointTool, Fp32ExportHoldsTheMastersBitForBit) {
  const std::string out = dir_ + "/weights.safetensors";
  ckpt::export_fp32(tag_dir_, out);
  nlohmann::json meta;
  const auto t = safetensors_load(out, &meta);
  // The metadata CHECKPOINT.md lists: no state_dict in this save, so the trained parameters only.
  EXPECT_EQ(meta, (nlohmann::json{{"format", "pt"}, {"zero8_tag", "global_step2"}, {"zero8_step", "2"},
                                  {"zero8_source", "fp32 masters"}}));
  ASSERT_EQ(t.size(), params().size());
  for (size_t p = 0; p < params().size(); ++p) {
    const auto& x = t.at(params()[p].name);
    const shard::ParamSlot& s = opt_->layout().slots[p];
    EXPECT_EQ(x.dtype, "F32");
    EXPECT_EQ(x.shape, params()[p].shape);
    ASSERT_EQ(int64_t(x.data.size()), s.numel * 4);
    // One rank: its partition is the whole group, so master(g) + offset is this parameter.
    EXPECT_EQ(std::memcmp(x.data.data(), opt_->master(s.group) + s.offset, x.data.size()), 0) << params()[p].name;
  }
}

TEST_F(CheckpointTool, ModelFileHoldsTheWorkingCopyBitForBit) {
  const auto t = safetensors_load(tag_dir_ + "/model.safetensors");
  ASSERT_EQ(t.size(), params().size());
  bool differs_from_master = false;
  for (size_t p = 0; p < params().size(); ++p) {
    const auto& x = t.at(params()[p].name);
    const shard::ParamSlot& s = opt_->layout().slots[p];
    EXPECT_EQ(x.dtype, "BF16");
    EXPECT_EQ(x.shape, params()[p].shape);
    ASSERT_EQ(int64_t(x.data.size()), s.numel * 2);
    EXPECT_EQ(std::memcmp(x.data.data(), opt_->param_working(int(p)), x.data.size()), 0) << params()[p].name;
    for (int64_t i = 0; i < s.numel; ++i)
      differs_from_master = differs_from_master ||
                            dtype_load(x.data.data(), DType::bf16, i) != bf16_to_f32(f32_to_bf16(opt_->master(s.group)[s.offset + i]));
  }
  EXPECT_TRUE(differs_from_master) << "the working copy is the rounded master: the model file would not need saving";
}

TEST_F(CheckpointTool, SummaryAddsUpFromTheLayout) {
  const ckpt::Manifest m = ckpt::manifest_read(tag_dir_);
  const ckpt::Summary s = ckpt::summarize(m, int64_t(fs::file_size(tag_dir_ + "/manifest.json")));
  const int64_t q8 = 3500 + 1200, f32 = 33 + 1, blocks = (q8 + 63) / 64;
  EXPECT_EQ(s.numel, q8 + f32);
  EXPECT_EQ(s.master, (q8 + f32) * 4);
  EXPECT_EQ(s.codes, 2 * q8);
  EXPECT_EQ(s.absmax, 2 * blocks * 4);
  EXPECT_EQ(s.fp32, 2 * f32 * 4);
  EXPECT_EQ(s.residual, 0);
  EXPECT_EQ(s.model, int64_t(fs::file_size(tag_dir_ + "/model.safetensors")));
  int64_t on_disk = 0;
  for (const auto& e : fs::directory_iterator(tag_dir_)) on_disk += int64_t(e.file_size());
  EXPECT_EQ(s.total, on_disk);
  EXPECT_GT(s.other, 0);  // shard headers, alignment padding and the manifest
  EXPECT_EQ(m.step, 2);
  EXPECT_EQ(m.world, 1);
  EXPECT_EQ(m.tag, "global_step2");
}

TEST_F(CheckpointTool, TagsAndLatest) {
  EXPECT_EQ(ckpt::tags_list(dir_), (std::vector<std::string>{"first", "global_step2"}));
  EXPECT_EQ(ckpt::latest_read(dir_), "global_step2");
  EXPECT_EQ(ckpt::tag_path(dir_, "first"), dir_ + "/first");
  try {
    ckpt::tag_path(dir_, "nope");
    ADD_FAILURE() << "a missing tag was found";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nope: missing"), std::string::npos) << e.what();
  }
  // A tag is a name in the directory, never a path out of it (the tool's --tag, zero_to_fp32's -t).
  fs::create_directories(dir_ + "/sub");
  for (const std::string bad : {"../first", "../sub/../first", "sub/", ".", ".."}) {
    try {
      ckpt::tag_path(dir_ + "/sub", bad);
      ADD_FAILURE() << "tag '" << bad << "' was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find("'tag': '" + bad + "' "), std::string::npos) << e.what();
    }
  }
  write_bytes(dir_ + "/latest", {'.', '.', '/', 'x'});
  try {
    ckpt::latest_read(dir_);
    ADD_FAILURE() << "a bad latest was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("latest: does not name a valid tag"), std::string::npos) << e.what();
  }
}

// What a child process reports: its exit code and output. unprivileged: the child first becomes the user
// nobody (uid and gid 65534) when this process is root, whom no permission bits stop.
struct ChildResult {
  int code = -1;
  std::string out;
};
ChildResult in_child(bool unprivileged, const std::function<int()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    const bool drop = unprivileged && ::geteuid() == 0;
    if (drop && (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0)) ::_exit(125);
    const int code = body();
    std::fflush(nullptr);
    ::_exit(code);
  }
  ::close(fds[1]);
  ChildResult r;
  char buf[4096];
  for (ssize_t k; (k = ::read(fds[0], buf, sizeof(buf))) > 0;) r.out.append(buf, size_t(k));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// zero8-checkpoint with these arguments (in a child; see in_child).
ChildResult run_tool(const std::vector<std::string>& args, bool unprivileged = false) {
  return in_child(unprivileged, [&] {
    std::vector<char*> argv{const_cast<char*>(ZERO8_CHECKPOINT_TOOL)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(ZERO8_CHECKPOINT_TOOL, argv.data());
    return 126;
  });
}

// A tag directory without permissions used to be "manifest.json: missing" (not a complete checkpoint), and
// zero8-checkpoint inspect left it out of the tag list: both now name the path and the OS's reason.
TEST_F(CheckpointTool, AnUnreadableTagIsReportedWithTheOsError) {
  if (!*ZERO8_CHECKPOINT_TOOL) GTEST_SKIP() << "zero8-checkpoint was not built";
  fs::permissions(dir_, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                            fs::perms::others_read | fs::perms::others_exec);  // nobody may look inside
  fs::permissions(tag_dir_, fs::perms::none);
  const std::string manifest = tag_dir_ + "/manifest.json";
  const ChildResult probe = in_child(true, [&] { return ::access(manifest.c_str(), R_OK) == 0 ? 0 : 1; });
  if (probe.code != 1) {
    fs::permissions(tag_dir_, fs::perms::owner_all);
    GTEST_SKIP() << "this process reads a directory without permissions (exit " << probe.code << ")";
  }
  // The library: tag_path (load, verify, to-fp32 of a named tag) and the tag `latest` names.
  const ChildResult lib = in_child(true, [&] {
    try {
      ckpt::tag_path(dir_, "global_step2");
      std::printf("no error");
    } catch (const Error& e) {
      std::printf("%s", e.what());
      return e.code() == ErrorCode::io ? 0 : 1;
    }
    return 2;
  });
  EXPECT_EQ(lib.code, 0) << lib.out;
  EXPECT_EQ(lib.out, manifest + ": cannot access: Permission denied");
  // The tool: the tag is listed as unreadable, with the reason, and inspecting it (latest names it) fails.
  ChildResult r = run_tool({"inspect", dir_}, true);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("tags (2, oldest first; 1 unreadable)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  global_step2             unreadable: " + manifest + ": cannot open: Permission denied"),
            std::string::npos) << r.out;
  EXPECT_NE(r.out.find("error: " + manifest + ": cannot access: Permission denied"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("missing"), std::string::npos) << r.out;
  r = run_tool({"inspect", dir_, "--tag", "first"}, true);  // another tag is fine
  EXPECT_EQ(r.code, 0) << r.out;
  fs::permissions(tag_dir_, fs::perms::owner_all);
}

// inspect reads each file's size and header: a missing or truncated file fails it (exit 1, naming the
// file), as verify would; a changed byte inside a file is only verify's to find (the checksums).
TEST_F(CheckpointTool, InspectFailsOnAMissingOrTruncatedFile) {
  if (!*ZERO8_CHECKPOINT_TOOL) GTEST_SKIP() << "zero8-checkpoint was not built";
  ChildResult r = run_tool({"inspect", dir_});
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("files: all 2 present, sizes and headers as the manifest lists them (checksums: "
                       "zero8-checkpoint verify)"), std::string::npos) << r.out;
  const std::string shard = tag_dir_ + "/zero8_shard_rank0.bin", model = tag_dir_ + "/model.safetensors";
  std::vector<uint8_t> bytes = read_bytes(shard);
  bytes[bytes.size() / 2] ^= 1;
  write_bytes(shard, bytes);
  r = run_tool({"inspect", dir_});
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(run_tool({"verify", dir_}).code, 1);
  bytes.resize(bytes.size() - 100);
  write_bytes(shard, bytes);
  fs::remove(model);
  r = run_tool({"inspect", dir_});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("error: " + shard + ": truncated: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("error: " + model + ": missing"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("FAILED " + tag_dir_ + ": 2 problem(s)"), std::string::npos) << r.out;
  EXPECT_EQ(run_tool({"inspect", dir_, "--tag", "first"}).code, 0);
}

TEST_F(CheckpointTool, RenamedTagDirectoryLoadsWithAWarning) {
  fs::rename(dir_ + "/first", dir_ + "/renamed");
  std::vector<float> master(opt_->master(Group::q8), opt_->master(Group::q8) + 4700);
  std::fill(opt_->master(Group::q8), opt_->master(Group::q8) + 4700, 0.0f);
  ckpt::LoadOptions lo;
  lo.tag = "renamed";
  const ckpt::LoadResult r = ckpt::load(*opt_, dir_, lo);
  EXPECT_EQ(r.path, dir_ + "/renamed");
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("saved as tag 'first'"), std::string::npos) << r.warnings[0];
  EXPECT_EQ(std::vector<float>(opt_->master(Group::q8), opt_->master(Group::q8) + 4700), master);
}

TEST_F(CheckpointTool, VerifyFindsEachFaultAndNamesTheFile) {
  EXPECT_TRUE(ckpt::verify(tag_dir_).ok());
  const std::string shard = tag_dir_ + "/zero8_shard_rank0.bin", model = tag_dir_ + "/model.safetensors",
                    manifest = tag_dir_ + "/manifest.json";
  const std::vector<uint8_t> shard0 = read_bytes(shard), model0 = read_bytes(model), manifest0 = read_bytes(manifest);
  auto problems = [&] { return ckpt::verify(tag_dir_).problems; };
  auto expect_one = [&](const std::string& a, const std::string& b) {
    const std::vector<std::string> p = problems();
    ASSERT_EQ(p.size(), 1u) << (p.empty() ? "no problem found" : p[0]);
    EXPECT_NE(p[0].find(a), std::string::npos) << p[0];
    EXPECT_NE(p[0].find(b), std::string::npos) << p[0];
  };
  auto manifest_edit = [&](const std::function<void(nlohmann::ordered_json&)>& f) {
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(manifest0.begin(), manifest0.end());
    f(j);
    j.erase(ckpt::kManifestHashKey);  // a deliberate edit: what is checked here is the edited field
    const std::string t = j.dump(1);
    write_bytes(manifest, std::vector<uint8_t>(t.begin(), t.end()));
  };
  auto restore = [&] {
    write_bytes(shard, shard0);
    write_bytes(model, model0);
    write_bytes(manifest, manifest0);
  };

  std::vector<uint8_t> b = shard0;
  b[b.size() / 2] ^= 1;
  write_bytes(shard, b);
  expect_one("zero8_shard_rank0.bin", "checksum mismatch");
  restore();

  b = shard0;
  b[0] = 'X';
  write_bytes(shard, b);
  expect_one("zero8_shard_rank0.bin", "bad magic");
  restore();

  b = shard0;
  b.resize(b.size() - 1);
  write_bytes(shard, b);
  expect_one("zero8_shard_rank0.bin", "truncated");
  restore();

  b = shard0;
  b.push_back(0);
  write_bytes(shard, b);
  expect_one("zero8_shard_rank0.bin", "the manifest says");
  restore();

  // Two corrupt files: both reported.
  b = shard0;
  b[b.size() - 1] ^= 1;
  write_bytes(shard, b);
  fs::remove(model);
  EXPECT_EQ(problems().size(), 2u);
  restore();

  // A section listed twice: the range is covered twice.
  manifest_edit([](nlohmann::ordered_json& j) {
    auto& secs = j["files"][0]["sections"];
    secs.push_back(secs[0]);
  });
  expect_one("manifest.json", "");
  EXPECT_TRUE(problems()[0].find("overlap") != std::string::npos || problems()[0].find("covered twice") != std::string::npos)
      << problems()[0];
  restore();

  // A section past the end of its file.
  manifest_edit([](nlohmann::ordered_json& j) { j["files"][0]["sections"][1]["offset"] = j["files"][0]["bytes"]; });
  expect_one("manifest.json", "outside the file");
  restore();

  // The layout recomputed from the parameters disagrees with a group's recorded offsets.
  manifest_edit([](nlohmann::ordered_json& j) { j["params"][2]["offset"] = 64; });
  expect_one("manifest.json", "disagree with the layout");
  restore();

  // The manifest and the model file disagree on a shape (same element count, so the layout holds).
  manifest_edit([](nlohmann::ordered_json& j) { j["params"][1]["shape"] = {3, 11}; });
  expect_one("model.safetensors", "parameter 'b' has shape [33], the manifest says [3, 11]");
  restore();
  EXPECT_TRUE(ckpt::verify(tag_dir_).ok());
}

TEST_F(CheckpointTool, ExportOfACorruptCheckpointFailsAndWritesNothing) {
  std::vector<uint8_t> b = read_bytes(tag_dir_ + "/zero8_shard_rank0.bin");
  b[100] ^= 4;
  write_bytes(tag_dir_ + "/zero8_shard_rank0.bin", b);
  const std::string out = dir_ + "/w.safetensors";
  try {
    ckpt::export_fp32(tag_dir_, out);
    ADD_FAILURE() << "exported a corrupt checkpoint";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("zero8_shard_rank0.bin: checksum mismatch"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(out));
  for (const auto& e : fs::directory_iterator(dir_)) EXPECT_EQ(e.path().string().find("w.safetensors"), std::string::npos);
}

// With verification, the export checks every file verify checks, also those it does not read: a corrupt
// model.safetensors (the working copy; the export takes the masters) fails it as it fails verify.
TEST_F(CheckpointTool, ExportChecksEveryFileVerifyChecks) {
  const std::string model = tag_dir_ + "/model.safetensors", out = dir_ + "/w.safetensors";
  const std::vector<uint8_t> model0 = read_bytes(model);
  std::vector<uint8_t> b = model0;
  b[b.size() - 3] ^= 0x10;  // a byte of the last tensor's data: the file still parses
  write_bytes(model, b);
  ASSERT_EQ(ckpt::verify(tag_dir_).problems.size(), 1u);
  try {
    ckpt::export_fp32(tag_dir_, out);
    ADD_FAILURE() << "exported a checkpoint whose model file is corrupt";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors: checksum mismatch"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(out));
  // Without verification the export reads the masters only, and they are intact.
  const ckpt::ExportResult r = ckpt::export_fp32(tag_dir_, out, /*verify_files=*/false);
  EXPECT_EQ(r.tensors, int64_t(params().size()));
  write_bytes(model, model0);
}

// The output path is checked before anything is read or written: the export never replaces a file of the
// checkpoint it reads (directly, by a hard link or a symbolic link), a directory, fifo or device, and its
// errors name the path given, not the temporary file. A replaced file keeps its permission bits; a symbolic
// link is written through.
TEST_F(CheckpointTool, ExportOutputPathIsCheckedFirst) {
  const std::vector<uint8_t> model0 = read_bytes(tag_dir_ + "/model.safetensors");
  auto refused = [&](const std::string& out, const std::string& what) {
    try {
      ckpt::export_fp32(tag_dir_, out);
      ADD_FAILURE() << "exported to " << out;
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind(out + ": ", 0) == 0 || m.rfind(out + " (a symbolic link", 0) == 0, true) << m;
      EXPECT_NE(m.find(what), std::string::npos) << m;
      EXPECT_EQ(m.find(".tmp-"), std::string::npos) << m;
    }
  };
  // Files of the checkpoint being read.
  refused(tag_dir_ + "/model.safetensors", "a tag directory of the checkpoint being exported");
  refused(tag_dir_ + "/../global_step2/manifest.json", "a tag directory of the checkpoint being exported");
  refused(dir_ + "/latest", "a file of the checkpoint being exported");
  fs::create_hard_link(tag_dir_ + "/zero8_shard_rank0.bin", dir_ + "/hard.st");
  refused(dir_ + "/hard.st", "a file of the checkpoint being exported");
  fs::create_symlink(tag_dir_ + "/model.safetensors", dir_ + "/link.st");
  refused(dir_ + "/link.st", "a tag directory of the checkpoint being exported");
  // Another tag's files and directory, and a new name in any tag directory (a file no manifest lists).
  const std::string other = dir_ + "/" + ckpt::tags_list(dir_).front();
  ASSERT_NE(fs::canonical(other), fs::canonical(tag_dir_));
  const std::vector<uint8_t> other_model = read_bytes(other + "/model.safetensors");
  refused(other + "/model.safetensors", "a tag directory of the checkpoint being exported");
  refused(other + "/new.safetensors", "a tag directory of the checkpoint being exported");
  refused(tag_dir_ + "/new.safetensors", "a tag directory of the checkpoint being exported");
  fs::create_hard_link(other + "/model.safetensors", dir_ + "/hard_other.st");
  refused(dir_ + "/hard_other.st", "a file of the checkpoint being exported");
  EXPECT_TRUE(ckpt::verify(other).ok());
  EXPECT_EQ(read_bytes(other + "/model.safetensors"), other_model);
  EXPECT_FALSE(fs::exists(other + "/new.safetensors"));
  EXPECT_TRUE(ckpt::verify(tag_dir_).ok());
  EXPECT_EQ(read_bytes(tag_dir_ + "/model.safetensors"), model0);
  EXPECT_EQ(ckpt::latest_read(dir_), "global_step2");
  // Not a file to replace, or nowhere to write.
  fs::create_directory(dir_ + "/adir");
  refused(dir_ + "/adir", "is a directory");
  ASSERT_EQ(::mkfifo((dir_ + "/fifo").c_str(), 0644), 0);
  refused(dir_ + "/fifo", "not a regular file");
  EXPECT_TRUE(fs::is_fifo(dir_ + "/fifo"));
  refused(dir_ + "/nodir/w.st", "the directory " + dir_ + "/nodir does not exist");
  try {
    ckpt::export_fp32(tag_dir_, "");
    ADD_FAILURE() << "exported to ''";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
  }
  for (const auto& e : fs::directory_iterator(dir_)) EXPECT_EQ(e.path().string().find(".tmp-"), std::string::npos) << e.path();

  // A 0600 file is replaced and stays 0600; its other name (a hard link) keeps the old bytes.
  const std::string priv = dir_ + "/priv.st";
  write_bytes(priv, {'o', 'l', 'd'});
  fs::permissions(priv, fs::perms::owner_read | fs::perms::owner_write);
  fs::create_hard_link(priv, dir_ + "/priv2.st");
  ckpt::export_fp32(tag_dir_, priv);
  EXPECT_EQ(fs::status(priv).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(safetensors_load(priv).size(), params().size());
  EXPECT_EQ(read_bytes(dir_ + "/priv2.st"), (std::vector<uint8_t>{'o', 'l', 'd'}));
  // A symbolic link is written through: the link stays, the file it leads to (existing or not) is the export.
  write_bytes(dir_ + "/target", {'x'});
  fs::create_symlink("target", dir_ + "/to_target.st");
  fs::create_symlink("new_target", dir_ + "/to_new.st");
  ckpt::export_fp32(tag_dir_, dir_ + "/to_target.st");
  ckpt::export_fp32(tag_dir_, dir_ + "/to_new.st");
  for (const char* name : {"/to_target.st", "/to_new.st"}) EXPECT_TRUE(fs::is_symlink(dir_ + name)) << name;
  EXPECT_EQ(read_bytes(dir_ + "/target"), read_bytes(priv));
  EXPECT_EQ(read_bytes(dir_ + "/new_target"), read_bytes(priv));
}

// The module's whole state_dict (SaveOptions::state_dict, module_tensors): the export gives every key in
// state_dict order, trained ones from the masters, the others from model_rest.safetensors (16-bit floats
// widened to F32 exactly, integers as saved), a tied alias under each name; verify checks that file.
TEST_F(CheckpointTool, Fp32ExportOfAStateDictHoldsEveryKey) {
  auto bytes_of = [](const void* p, size_t n) { return ckpt::ByteSpan{p, int64_t(n)}; };
  std::vector<uint16_t> frozen(6);
  for (size_t i = 0; i < frozen.size(); ++i) frozen[i] = f32_to_f16(0.25f * float(i) - 0.5f);
  const std::vector<int64_t> pos = {0, 1, 2, (int64_t(1) << 40) + 3};  // not exact in float32
  const uint16_t mean = f32_to_bf16(1.5f);
  ckpt::SaveOptions so;
  so.tag = "module";
  so.module_tensors = {{"emb.weight", "F16", {2, 3}, bytes_of(frozen.data(), 12)},
                       {"pos_ids", "I64", {4}, bytes_of(pos.data(), 32)},
                       {"bn.mean", "BF16", {}, bytes_of(&mean, 2)}};
  so.state_dict = {{"emb.weight", "emb.weight"}, {"a", "a"}, {"pos_ids", "pos_ids"}, {"b", "b"}, {"c", "c"},
                   {"head.weight", "a"}, {"s", "s"}, {"bn.mean", "bn.mean"}, {"emb2.weight", "emb.weight"}};
  const std::string tag_dir = ckpt::save(*opt_, dir_, so).path;
  EXPECT_TRUE(ckpt::verify(tag_dir).ok());
  EXPECT_EQ(ckpt::manifest_read(tag_dir).state_dict.size(), so.state_dict.size());

  const std::string out = dir_ + "/full.safetensors";
  const ckpt::ExportResult r = ckpt::export_fp32(tag_dir, out);
  EXPECT_TRUE(r.complete);
  EXPECT_EQ(r.tensors, 9);
  EXPECT_EQ(r.trained, 5);
  EXPECT_EQ(r.rest, 4);
  const auto t = safetensors_load(out);
  ASSERT_EQ(t.size(), so.state_dict.size());
  {  // the header lists the keys in state_dict order
    std::vector<std::string> want;
    for (const auto& e : so.state_dict) want.push_back(e.first);
    EXPECT_EQ(test::safetensors_read(out).order, want);
  }
  for (size_t p = 0; p < params().size(); ++p) {
    const shard::ParamSlot& s = opt_->layout().slots[p];
    const auto& x = t.at(params()[p].name);
    EXPECT_EQ(x.dtype, "F32");
    ASSERT_EQ(int64_t(x.data.size()), s.numel * 4);
    EXPECT_EQ(std::memcmp(x.data.data(), opt_->master(s.group) + s.offset, x.data.size()), 0) << params()[p].name;
  }
  EXPECT_EQ(t.at("head.weight").data, t.at("a").data);
  EXPECT_EQ(t.at("head.weight").shape, t.at("a").shape);
  for (const char* k : {"emb.weight", "emb2.weight"}) {
    const auto& x = t.at(k);
    EXPECT_EQ(x.dtype, "F32");
    EXPECT_EQ(x.shape, (std::vector<int64_t>{2, 3}));
    ASSERT_EQ(x.data.size(), 24u);
    for (size_t i = 0; i < frozen.size(); ++i) {
      float v;
      std::memcpy(&v, x.data.data() + 4 * i, 4);
      EXPECT_EQ(v, 0.25f * float(i) - 0.5f) << k << "[" << i << "]";
    }
  }
  EXPECT_EQ(t.at("pos_ids").dtype, "I64");
  EXPECT_EQ(t.at("pos_ids").data, std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(pos.data()),
                                                        reinterpret_cast<const uint8_t*>(pos.data()) + 32));
  EXPECT_EQ(t.at("bn.mean").dtype, "F32");
  EXPECT_EQ(t.at("bn.mean").shape, std::vector<int64_t>{});
  float m;
  std::memcpy(&m, t.at("bn.mean").data.data(), 4);
  EXPECT_EQ(m, 1.5f);

  // The checkpoint still loads into the optimizer (the model_rest file is one of its checked files).
  ckpt::LoadOptions lo;
  lo.tag = "module";
  EXPECT_EQ(ckpt::load(*opt_, dir_, lo).tag, "module");

  // verify: a corrupt model_rest file, and one that disagrees with the manifest's state_dict.
  const std::string rest = tag_dir + "/" + ckpt::kModelRestName;
  const std::vector<uint8_t> rest0 = read_bytes(rest);
  std::vector<uint8_t> b = rest0;
  b[b.size() - 1] ^= 1;
  write_bytes(rest, b);
  ASSERT_EQ(ckpt::verify(tag_dir).problems.size(), 1u);
  EXPECT_NE(ckpt::verify(tag_dir).problems[0].find("model_rest.safetensors: checksum mismatch"), std::string::npos);
  EXPECT_THROW(ckpt::export_fp32(tag_dir, dir_ + "/bad.safetensors"), Error);
  EXPECT_FALSE(fs::exists(dir_ + "/bad.safetensors"));
  write_bytes(rest, rest0);
  const std::string manifest = tag_dir + "/manifest.json";
  const std::vector<uint8_t> manifest0 = read_bytes(manifest);
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(manifest0.begin(), manifest0.end());
  for (auto& e : j["state_dict"])
    if (e["name"] == "pos_ids") e["dtype"] = "I32", e["shape"] = {8};
  j.erase(ckpt::kManifestHashKey);
  const std::string text = j.dump(1);
  write_bytes(manifest, std::vector<uint8_t>(text.begin(), text.end()));
  const std::vector<std::string> p = ckpt::verify(tag_dir).problems;
  ASSERT_EQ(p.size(), 1u);
  EXPECT_NE(p[0].find("tensor 'pos_ids' is I64 [4], the manifest says I32 [8]"), std::string::npos) << p[0];
  write_bytes(manifest, manifest0);

  // Without a state_dict (older checkpoints, callers without a module): the trained parameters only.
  const ckpt::ExportResult old = ckpt::export_fp32(tag_dir_, dir_ + "/old.safetensors");
  EXPECT_FALSE(old.complete);
  EXPECT_EQ(old.tensors, int64_t(params().size()));
  EXPECT_TRUE(ckpt::manifest_read(tag_dir_).state_dict.empty());
}

TEST_F(CheckpointTool, SaveChecksTheStateDictBeforeWriting) {
  auto save_fails = [&](const ckpt::SaveOptions& so, const std::string& what) {
    try {
      ckpt::save(*opt_, dir_, so);
      ADD_FAILURE() << "saved: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(dir_ + "/bad"));
  };
  ckpt::SaveOptions so;
  so.tag = "bad";
  so.state_dict = {{"a", "a"}, {"x", "nothing"}};
  save_fails(so, "'nothing' is neither a trained parameter nor one of module_tensors");
  so.state_dict = {{"a", "a"}, {"pos", "pos"}};
  const std::string zeros(32, '\0');
  so.module_tensors = {{"pos", "I64", {4}, {zeros.data(), 24}}};
  save_fails(so, "24 bytes for 4 elements of I64");
  so.module_tensors = {{"pos", "I64", {1}, {nullptr, 8}}};
  save_fails(so, "'pos': no data (null pointer)");
  so.module_tensors = {{"pos", "C64", {1}, {zeros.data(), 8}}};
  save_fails(so, "unsupported dtype 'C64'");
  so.module_tensors = {{"pos", "I64", {1}, {zeros.data(), 8}}, {"unused", "U8", {1}, {zeros.data(), 1}}};
  save_fails(so, "'unused' is not the source of any state_dict key");
  so.module_tensors = {{"pos", "I64", {1}, {zeros.data(), 8}}};
  so.state_dict = {{"a", "a"}, {"pos", "pos"}, {"a", "pos"}};
  save_fails(so, "key 'a' is given twice");
  so.state_dict = {{"a", "a"}, {"pos", "pos"}};
  so.extra_files = {{ckpt::kModelRestName, {zeros.data(), 1}}};
  save_fails(so, "reserved");
  so.extra_files = {{"notes.txt", {nullptr, 4}}};
  save_fails(so, "'notes.txt': 4 bytes at");
}

}  // namespace
}  // namespace zero8
