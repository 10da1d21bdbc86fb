// Checkpoints of the sharded optimizer (zero8/checkpoint.h) for the engine: collective save and load
// with the client state and config carried as JSON text, plus the communicator-free readers (latest,
// tags, verify, fp32 export). Every call releases the GIL; results come back as dicts.
#include <map>
#include <string>
#include <tuple>
#include <utility>
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
  d["bytes_hashed"] = r.bytes_hashed;
  return d;
}
}  // namespace

void init_checkpoint(py::module_& m) {
  m.def(
      "checkpoint_save",
      [](shard::ShardedOptimizer& opt, const std::string& dir, const std::string& tag,
         const std::string& client_state_json, const std::string& config_json, int keep_last,
         const std::map<std::string, py::bytes>& extra_files, bool update_latest,
         const std::vector<std::pair<std::string, std::string>>& state_dict,
         const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>, Ptr, int64_t>>& module_tensors) {
        ckpt::SaveOptions o;
        o.tag = tag;
        o.client_state = client_state_json;
        o.config_json = config_json;
        o.keep_last = keep_last;
        o.update_latest = update_latest;
        // Views, not copies: the bytes objects live in extra_files and the caller keeps the tensors alive
        // for the call.
        for (const auto& [name, bytes] : extra_files)
          o.extra_files.emplace_back(name, ckpt::ByteSpan{PyBytes_AS_STRING(bytes.ptr()), int64_t(PyBytes_GET_SIZE(bytes.ptr()))});
        o.state_dict = state_dict;
        for (const auto& [name, dtype, shape, data, bytes] : module_tensors)
          o.module_tensors.push_back(ckpt::SaveOptions::ModuleTensor{name, dtype, shape, {as_ptr<const void>(data), bytes}});
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
      py::arg("update_latest") = true, py::arg("state_dict") = std::vector<std::pair<std::string, std::string>>{},
      py::arg("module_tensors") = std::vector<std::tuple<std::string, std::string, std::vector<int64_t>, Ptr, int64_t>>{},
      "Collective atomic save of <dir>/<tag> (tag '' -> global_step<steps>) and <dir>/latest (unless "
      "update_latest is False): dict(tag, path, bytes, removed). client_state_json/config_json are JSON text "
      "stored as is ('' -> null); extra_files {name: bytes} (rank 0's are used) are written into the tag before "
      "it is installed, with checksums. state_dict [(key, source)] and module_tensors [(name, safetensors dtype, "
      "shape, data_ptr, nbytes)]: the module's whole state_dict for checkpoint_export_fp32 (zero8::ckpt::SaveOptions); "
      "each tensor is written from its memory at data_ptr (contiguous, on the CPU), which the caller keeps alive "
      "and unchanged during the call.");
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
      "saved_world, client_state_json, config_json, warnings, bytes_hashed). before_commit(dict) runs on every "
      "rank after everything is validated and read, before anything changes; an exception there (on any rank) "
      "fails the load everywhere. On error opt is untouched.");
  m.def(
      "checkpoint_client_state",
      [](const std::string& tag_dir, bool model_rest) {
        return ckpt::manifest_read_extras_checked(tag_dir, model_rest).client_state;
      },
      py::arg("tag_dir"), py::arg("model_rest") = true, py::call_guard<py::gil_scoped_release>(),
      "The client state JSON text of <tag_dir>/manifest.json, after checking the manifest and the checksum "
      "of every extra file it lists (Zero8IOError naming the file otherwise); model_rest=False leaves out "
      "model_rest.safetensors, which a load does not read (one rank checking it is enough).");
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
  m.def(
      "checkpoint_export_fp32",
      [](const std::string& tag_dir, const std::string& out_path, bool verify) {
        ckpt::ExportResult r;
        {
          py::gil_scoped_release release;
          r = ckpt::export_fp32(tag_dir, out_path, verify);
        }
        py::dict d;
        d["tensors"] = r.tensors;
        d["trained"] = r.trained;
        d["rest"] = r.rest;
        d["complete"] = r.complete;
        return d;
      },
      py::arg("tag_dir"), py::arg("out_path"), py::arg("verify") = true,
      "Consolidated weights of a tag as a safetensors file: the module's whole state_dict (trained parameters "
      "fp32 from the masters, frozen parameters and buffers from model_rest.safetensors, 16-bit floats widened "
      "to fp32) when the manifest lists it, else the trained parameters: dict(tensors, trained, rest, complete).");
}

}  // namespace zero8::bindings
