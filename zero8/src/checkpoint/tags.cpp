// Tag directories of a checkpoint directory and its `latest` (tags.h): names, listing, installing a
// complete tag atomically, pruning old ones, and cleaning up what interrupted saves left.
#include "checkpoint/tags.h"

#include <fcntl.h>
#include <stdio.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "checkpoint/io.h"
#include "zero8/checkpoint_format.h"

namespace zero8::ckpt::detail {

namespace fs = std::filesystem;
using json = nlohmann::json;

bool tag_check(const std::string& t, std::string* why) {
  if (t.empty()) *why = "is empty";
  else if (t.size() > 200) *why = "is longer than 200 characters";
  else if (std::any_of(t.begin(), t.end(), [](char ch) { return ch == '/' || (unsigned char)ch < 0x20 || ch == 0x7f; }))
    *why = "contains '/' or a control character";
  else if (t[0] == '.') *why = "starts with '.' (names of temporary directories do)";
  else if (t == kLatestName || t == kLatestTmpName) *why = "is reserved";
  else return true;
  return false;
}

std::vector<TagEntry> tags_scan(const std::string& dir) {
  std::vector<TagEntry> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::string why;
    if (!tag_check(name, &why) || !e.is_directory(ec)) continue;
    try {
      const json j = json::parse(file_read_text(join(e.path().string(), kManifestName), int64_t(1) << 28));
      if (!j.is_object() || j.value("format", "") != kFormatName) continue;
      out.push_back(TagEntry{name, j.value("saved_unix_s", 0.0), j.value("step", int64_t(0))});
    } catch (const std::exception&) {
      // not a complete tag (no manifest, or an unreadable one): never listed, never removed
    }
  }
  if (ec) CKPT_FAIL(dir, "cannot list: " + ec.message());
  std::sort(out.begin(), out.end(), [](const TagEntry& a, const TagEntry& b) {
    return a.saved != b.saved ? a.saved < b.saved : a.name < b.name;
  });
  return out;
}

namespace {

// The tag a .replaced-* directory holds ("" when it has no readable manifest).
std::string replaced_tag(const std::string& path) {
  try {
    const json j = json::parse(file_read_text(join(path, kManifestName), int64_t(1) << 28));
    return j.value("tag", "");
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace

void leftovers_remove(const std::string& dir) {
  std::vector<fs::path> entries;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) entries.push_back(e.path());
  if (ec) CKPT_FAIL(dir, "cannot list: " + ec.message());
  bool renamed = false;
  for (const fs::path& p : entries) {
    const std::string name = p.filename().string();
    if (name.rfind(kTmpPrefix, 0) == 0 || name == kLatestTmpName) {
      remove_tree(p.string());
    } else if (name.rfind(kReplacedPrefix, 0) == 0) {
      const std::string t = replaced_tag(p.string());
      std::string why;
      if (t.empty() || !tag_check(t, &why) || exists(join(join(dir, t), kManifestName))) {
        remove_tree(p.string());
      } else {
        if (exists(join(dir, t))) remove_tree(join(dir, t));  // an incomplete directory of that name
        rename_or_fail(p.string(), join(dir, t));
        renamed = true;
      }
    }
  }
  if (renamed) fsync_dir(dir);
}

std::string tag_install(const std::string& dir, const std::string& tag, const std::string& tmp, uint64_t nonce,
                        const Env& env) {
  const std::string final_path = join(dir, tag);
  if (!exists(final_path)) {
    rename_or_fail(tmp, final_path);
    return "";
  }
  if (env.rename_exchange) {
    // One atomic step: <tag> is the new checkpoint, tmp holds the old one.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) return tmp;
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
      CKPT_FAIL(tmp, "cannot exchange with " + final_path + ": " + errno_text(errno));
  }
  // Two renames; in between, tag_path() finds the old tag under its .replaced- name.
  const std::string aside = join(dir, kReplacedPrefix + tag + "-" + hex64(nonce));
  rename_or_fail(final_path, aside);
  fsync_dir(dir);
  crash_at(env, "after_move_aside", 0);
  rename_or_fail(tmp, final_path);
  return aside;
}

void latest_write(const std::string& dir, const std::string& tag, const Env& env) {
  const std::string tmp = join(dir, kLatestTmpName);
  FileWriter w(tmp, false);
  w.write(tag.data(), int64_t(tag.size()));
  w.finish();
  crash_at(env, "before_latest_rename", 0);
  rename_or_fail(tmp, join(dir, kLatestName));
  fsync_dir(dir);
}

std::vector<std::string> keep_last_prune(const std::string& dir, int keep, const std::string& saved,
                                         const std::string& latest) {
  std::vector<std::string> removed;
  if (keep <= 0) return removed;
  std::vector<TagEntry> tags = tags_scan(dir);  // oldest first
  int kept = 0;
  for (const TagEntry& t : tags) kept += t.name == saved || (t.name == latest && latest != saved);
  for (auto it = tags.rbegin(); it != tags.rend(); ++it) {
    if (it->name == saved || it->name == latest) continue;
    if (kept < keep) {
      ++kept;
      continue;
    }
    remove_tree(join(dir, it->name));
    removed.push_back(it->name);
  }
  if (!removed.empty()) fsync_dir(dir);
  std::reverse(removed.begin(), removed.end());
  return removed;
}

}  // namespace zero8::ckpt::detail

namespace zero8::ckpt {

using namespace detail;

std::string latest_read(const std::string& dir) {
  const std::string path = join(dir, kLatestName);
  if (!exists(path)) {
    if (!exists(dir)) CKPT_FAIL(dir, "missing: no such checkpoint directory");
    CKPT_FAIL(path, "missing: no checkpoint was completed in " + dir + " (or it is not a zero8 checkpoint directory)");
  }
  std::string t = file_read_text(path, 4096);
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  std::string why;
  if (!tag_check(t, &why)) CKPT_FAIL(path, "does not name a valid tag: '" + t + "' " + why);
  return t;
}

std::string tag_path(const std::string& dir, const std::string& tag) {
  // A tag is a name in dir: "../other/global_step3" would read another directory's checkpoint.
  std::string why;
  ZERO8_CHECK_ARG(tag_check(tag, &why), "tag", "'" << tag << "' " << why << " (a tag is the name of a directory in " << dir << ")");
  const std::string p = join(dir, tag);
  if (exists(join(p, kManifestName))) return p;
  // An interrupted two-rename replace: the old tag waits under its .replaced- name.
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kReplacedPrefix + tag + "-", 0) == 0 && replaced_tag(e.path().string()) == tag) return e.path().string();
  }
  if (!exists(p)) CKPT_FAIL(p, "missing: tag '" + tag + "' is not in " + dir);
  CKPT_FAIL(join(p, kManifestName), "missing: tag '" + tag + "' is not a complete checkpoint");
}

std::vector<std::string> tags_list(const std::string& dir) {
  std::vector<std::string> out;
  for (const TagEntry& t : tags_scan(dir)) out.push_back(t.name);
  return out;
}

}  // namespace zero8::ckpt
