// Tag directories of a checkpoint directory (<dir>/<tag>/) and the pointer file <dir>/latest: tag names,
// the tags present, installing a complete temporary directory as a tag (replacing a same-named one
// atomically), rewriting latest, keep_last pruning, and removing what interrupted saves left behind.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/io.h"

namespace zero8::ckpt::detail {

// Whether t can name a tag (a directory of dir): not empty, no '/' or control character, no leading '.'
// (temporary directories have one), not latest's names; false with the reason in *why.
bool tag_check(const std::string& t, std::string* why);

struct TagEntry {
  std::string name;
  double saved = 0.0;
  int64_t step = 0;
};
// Subdirectories holding a zero8 manifest (read lightly: format, save time, step), oldest save first.
std::vector<TagEntry> tags_scan(const std::string& dir);

// Leftovers of interrupted saves: temporary directories and latest.tmp are removed. A moved-aside
// tag (two-rename replace) is removed when its replacement is in place, and otherwise renamed back:
// it is then the only copy of its tag, and latest may name it.
void leftovers_remove(const std::string& dir);

// Replace <dir>/<tag> by the complete temporary directory tmp. Returns the path now holding the old
// tag, to remove once latest has moved on ("" when there was none).
std::string tag_install(const std::string& dir, const std::string& tag, const std::string& tmp, uint64_t nonce,
                        const Env& env);
// <dir>/latest names tag, replaced atomically (written to latest.tmp, synced, renamed).
void latest_write(const std::string& dir, const std::string& tag, const Env& env);
// Removes all but the `keep` most recently saved tags; `saved` (just saved) and `latest` ("" when
// there is none) always stay, and count toward `keep`. Returns the removed tags, oldest first.
std::vector<std::string> keep_last_prune(const std::string& dir, int keep, const std::string& saved,
                                         const std::string& latest);

}  // namespace zero8::ckpt::detail
