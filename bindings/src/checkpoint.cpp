// Checkpoints of the sharded optimizer (zero8/checkpoint.h) for the engine: collective save and load
// with the client state and config carried as JSON text, plus the communicator-free readers (latest,
// tags, verify, fp32 export). Every call releases the GIL; results come back as dicts.
#include <map>
#include <string>
#include <vector>

#include "bind.h"
#include "zero8/checkpoint.h"

namespace zero8::bindings {

namespace {
py::dict load_result_dict(const ckpt::LoadResult& r) {
  py::dict d;
  d["tag"] = r.tag;
  d["path"] = r.path;
  d["step"] = r.step;
  d["saved_world"] = r.saved_world;
  d["client_state_json"] = r.client_state;
  d["config_json"] = r.config_json;
  d["warnings"] = r.warnings;
  return d;
}
}  // namespace

void init_checkpoint(py::module_& m) {
  m.def(
      "checkpoint_save",
      [](shard::ShardedOptimizer& opt, const std::string& dir, const std::string& tag,
         const std::string& client_state_json, const std::string& config_json, int keep_last,
         const std::map<std::string, py::bytes>& extra_files, bool update_latest) {
        ckpt::SaveOptions o;
        o.tag = tag;
        o.client_state = client_state_json;
        o.config_json = config_json;
        o.keep_last = keep_last;
        o.update_latest = update_latest;
        for (const auto& [name, bytes] : extra_files) o.extra_files.emplace_back(name, std::string(bytes));
        ckpt::SaveResult r;
        {
          py::gil_scoped_release release;
          r = ckpt::save(opt, dir, o);
        }
        py::dict d;
        d["tag"] = r.tag;
        d["path"] = r.path;
        d["bytes"] = r.bytes;
        d["removed"] = r.removed;
        return d;
      },
      py::arg("opt"), py::arg("dir"), py::arg("tag") = "", py::arg("client_state_json") = "null",
      py::arg("config_json") = "", py::arg("keep_last") = 0, py::arg("extra_files") = std::map<std::string, py::bytes>{},
      py::arg("update_latest") = true,
      "Collective atomic save of <dir>/<tag> (tag '' -> global_step<steps>) and <dir>/latest (unless "
      "update_latest is False): dict(tag, path, bytes, removed). client_state_json/config_json are JSON text "
      "stored as is ('' -> null); extra_files {name: bytes} (rank 0's are used) are written into the tag before "
      "it is installed, with checksums.");
  m.def(
      "checkpoint_load",
      [](shard::ShardedOptimizer& opt, const std::string& dir, const std::string& tag, bool verify,
         py::object before_commit) {
        ckpt::LoadOptions o;
        o.tag = tag;
        o.verify = verify;
        if (!before_commit.is_none())
          o.before_commit = [&before_commit](const ckpt::LoadResult& staged) {
            py::gil_scoped_acquire gil;
            try {
              before_commit(load_result_dict(staged));
            } catch (const py::error_already_set& e) {
              throw error_from_python(e);
            }
          };
        ckpt::LoadResult r;
        {
          py::gil_scoped_release release;
          r = ckpt::load(opt, dir, o);
        }
        return load_result_dict(r);
      },
      py::arg("opt"), py::arg("dir"), py::arg("tag") = "", py::arg("verify") = true,
      py::arg("before_commit") = py::none(),
      "Collective load (tag '' -> the one <dir>/latest names; any world size): dict(tag, path, step, "
      "saved_world, client_state_json, config_json, warnings). before_commit(dict) runs on every rank after "
      "everything is validated and read, before anything changes; an exception there (on any rank) fails the "
      "load everywhere. On error opt is untouched.");
  m.def(
      "checkpoint_client_state",
      [](const std::string& tag_dir) { return ckpt::manifest_read_extras_checked(tag_dir).client_state; },
      py::arg("tag_dir"), py::call_guard<py::gil_scoped_release>(),
      "The client state JSON text of <tag_dir>/manifest.json, after checking the manifest and the checksum "
      "of every extra file it lists (Zero8IOError naming the file otherwise).");
  m.def("latest_read", &ckpt::latest_read, py::arg("dir"), py::call_guard<py::gil_scoped_release>(),
        "The tag <dir>/latest names; Zero8IOError when missing or bad.");
  m.def("checkpoint_tags", &ckpt::tags_list, py::arg("dir"), py::call_guard<py::gil_scoped_release>(),
        "Complete tags of dir, oldest save first.");
  m.def("checkpoint_tag_path", &ckpt::tag_path, py::arg("dir"), py::arg("tag"),
        py::call_guard<py::gil_scoped_release>(), "The directory holding tag `tag` of dir.");
  m.def(
      "checkpoint_verify",
      [](const std::string& tag_dir) {
        ckpt::VerifyResult r;
        {
          py::gil_scoped_release release;
          r = ckpt::verify(tag_dir);
        }
        py::dict d;
        d["ok"] = r.ok();
        d["problems"] = r.problems;
        d["files"] = r.files;
        d["bytes"] = r.bytes;
        return d;
      },
      py::arg("tag_dir"), "Every check of a saved tag: dict(ok, problems, files, bytes).");
  m.def("checkpoint_export_fp32", &ckpt::export_fp32, py::arg("tag_dir"), py::arg("out_path"),
        py::arg("verify") = true, py::call_guard<py::gil_scoped_release>(),
        "Consolidated fp32 weights (one tensor per parameter) of a tag as a safetensors file.");
}

}  // namespace zero8::bindings
