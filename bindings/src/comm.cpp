// The Communicator (comm/communicator.h) for the engine: creation, collectives over Python bytes and
// lists (small control data, on any backend: through device scratch on NCCL) or raw pointers (tensors),
// byte counters, splits and the pp x dp topology. Every collective releases the GIL; Python objects are
// converted before and after.
#include <memory>
#include <string>
#include <vector>

#include "bind.h"
#include "zero8/comm/communicator.h"
#include "zero8/error.h"

namespace zero8::bindings {
namespace {

using comm::Communicator;
using comm::ReduceOp;
using comm::ScalarType;
using CommPtr = std::shared_ptr<Communicator>;

ReduceOp parse_op(const std::string& op) {
  for (ReduceOp o : {ReduceOp::sum, ReduceOp::max, ReduceOp::min})
    if (op == comm::reduce_op_name(o)) return o;
  ZERO8_CHECK_ARG(false, "op", "unknown reduction '" << op << "' (sum, max or min)");
  return ReduceOp::sum;
}

// "f32" or "float32" (and u8/i32/i64/f64 likewise).
ScalarType parse_scalar_type(const std::string& t) {
  static const char* const short_names[] = {"u8", "i32", "i64", "f32", "f64"};
  for (int i = 0; i < 5; ++i)
    if (t == short_names[i] || t == comm::scalar_type_name(ScalarType(i))) return ScalarType(i);
  ZERO8_CHECK_ARG(false, "scalar_type", "unknown scalar type '" << t << "' (u8, i32, i64, f32 or f64)");
  return ScalarType::f32;
}

py::object wrap(std::unique_ptr<Communicator> c) {
  if (!c) return py::none();
  return py::cast(CommPtr(std::move(c)));
}

py::dict stats_dict(const comm::CommStats& s) {
  py::dict d;
  for (int k = 0; k < comm::kOpKinds; ++k) {
    const comm::OpStats& o = s.ops[size_t(k)];
    py::dict e;
    e["calls"] = o.calls;
    e["bytes"] = o.bytes;
    e["seconds"] = o.seconds;
    e["bytes_to_peer"] = o.bytes_to_peer;
    d[comm::op_kind_name(comm::OpKind(k))] = e;
  }
  return d;
}

}  // namespace

void init_comm(py::module_& m) {
  py::class_<Communicator, CommPtr>(
      m, "Communicator",
      "A group of ranks running the same collectives in the same order (see comm/communicator.h for the "
      "blocking, failure and byte-counting contract). Made by comm_create, split or topology_split.")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("name", &Communicator::name)
      .def_property_readonly("backend", [](const Communicator& c) { return std::string(c.backend()); })
      .def_property_readonly("memory",
                             [](const Communicator& c) {
                               return std::string(c.memory() == comm::MemSpace::host ? "host" : "device");
                             })
      .def_property_readonly("device", &Communicator::device,
                             "The CUDA device a device-memory backend (NCCL) works on; -1 for host backends.")
      .def_property_readonly("world_ranks", &Communicator::world_ranks)
      .def("description", &Communicator::description)
      .def_property("timeout", &Communicator::timeout, &Communicator::set_timeout,
                    "Seconds a call may take before every rank raises Zero8CommError.")
      .def_property(
          "stream", [](const Communicator& c) { return reinterpret_cast<Ptr>(c.stream()); },
          [](Communicator& c, Ptr s) { c.set_stream(as_ptr<void>(s)); },
          "The CUDA stream (an int: torch.cuda.current_stream().cuda_stream; 0: none) that device-buffer calls "
          "are ordered on and wait for (comm/communicator.h, \"Streams\").")
      .def("barrier", &Communicator::barrier, py::call_guard<py::gil_scoped_release>())
      .def(
          "broadcast_bytes",
          [](Communicator& c, const py::bytes& data, int root) {
            std::string buf = data;
            {
              py::gil_scoped_release release;
              // The length first, so only the root needs to know it (others may pass b"").
              int64_t len = int64_t(buf.size());
              comm::broadcast_host(c, &len, int64_t(sizeof(len)), root);
              buf.resize(size_t(len));
              comm::broadcast_host(c, buf.data(), len, root);
            }
            return py::bytes(buf);
          },
          py::arg("data"), py::arg("root") = 0, "Root's bytes on every rank (other ranks' data is ignored).")
      .def(
          "broadcast_ptr",
          [](Communicator& c, Ptr buf, int64_t nbytes, int root) { c.broadcast(as_ptr<void>(buf), nbytes, root); },
          py::arg("ptr"), py::arg("nbytes"), py::arg("root") = 0, py::call_guard<py::gil_scoped_release>(),
          "In place: nbytes at ptr become the root's on every rank.")
      .def(
          "all_reduce_f64",
          [](Communicator& c, std::vector<double> values, const std::string& op) {
            const ReduceOp o = parse_op(op);
            {
              py::gil_scoped_release release;
              comm::all_reduce_host(c, values.data(), int64_t(values.size()), ScalarType::f64, o);
            }
            return values;
          },
          py::arg("values"), py::arg("op") = "sum",
          "Element-wise reduction of a list of floats over the ranks (sum as a left fold in rank order).")
      .def(
          "all_reduce_ptr",
          [](Communicator& c, Ptr data, int64_t count, const std::string& scalar_type, const std::string& op) {
            const ScalarType t = parse_scalar_type(scalar_type);
            const ReduceOp o = parse_op(op);
            py::gil_scoped_release release;
            c.all_reduce(as_ptr<void>(data), as_ptr<void>(data), count, t, o);
          },
          py::arg("ptr"), py::arg("count"), py::arg("scalar_type") = "f32", py::arg("op") = "sum",
          "In place reduction of count elements at ptr (scalar_type u8/i32/i64/f32/f64, op sum/max/min).")
      .def(
          "all_gather_bytes",
          [](Communicator& c, const py::bytes& data) {
            const std::string mine = data;
            const int n = c.size();
            std::vector<int64_t> lens(static_cast<size_t>(n)), displs(static_cast<size_t>(n), 0);
            std::string all;
            {
              py::gil_scoped_release release;
              const int64_t my_len = int64_t(mine.size());
              comm::all_gather_host(c, &my_len, lens.data(), int64_t(sizeof(int64_t)));
              int64_t total = 0;
              for (int p = 0; p < n; ++p) {
                displs[size_t(p)] = total;
                total += lens[size_t(p)];
              }
              all.resize(size_t(total));
              comm::all_gather_v_host(c, mine.data(), my_len, all.data(), lens, displs);
            }
            py::list out;
            for (int p = 0; p < n; ++p) out.append(py::bytes(all.data() + displs[size_t(p)], size_t(lens[size_t(p)])));
            return out;
          },
          py::arg("data"), "Every rank's bytes (any lengths), in rank order.")
      .def(
          "all_gather_ptr",
          [](Communicator& c, Ptr send, Ptr recv, int64_t nbytes) {
            c.all_gather(as_ptr<const void>(send), as_ptr<void>(recv), nbytes);
          },
          py::arg("send_ptr"), py::arg("recv_ptr"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
          "recv (size * nbytes) = every rank's nbytes at send, in rank order.")
      .def(
          "send_bytes",
          [](Communicator& c, const py::bytes& data, int peer, int tag) {
            const std::string buf = data;
            py::gil_scoped_release release;
            comm::send_host(c, buf.data(), int64_t(buf.size()), peer, tag);
          },
          py::arg("data"), py::arg("peer"), py::arg("tag") = 0, "Blocking send to `peer` (recv must name the size).")
      .def(
          "recv_bytes",
          [](Communicator& c, int64_t nbytes, int peer, int tag) {
            ZERO8_CHECK_ARG(nbytes >= 0, "nbytes", "must be >= 0, got " << nbytes);
            std::string buf(size_t(nbytes), '\0');
            {
              py::gil_scoped_release release;
              comm::recv_host(c, buf.data(), nbytes, peer, tag);
            }
            return py::bytes(buf);
          },
          py::arg("nbytes"), py::arg("peer"), py::arg("tag") = 0, "Blocking receive of exactly nbytes from `peer`.")
      .def(
          "send_ptr",
          [](Communicator& c, Ptr buf, int64_t nbytes, int peer, int tag) {
            c.send(as_ptr<const void>(buf), nbytes, peer, tag);
          },
          py::arg("ptr"), py::arg("nbytes"), py::arg("peer"), py::arg("tag") = 0,
          py::call_guard<py::gil_scoped_release>(), "Blocking send of nbytes at ptr to `peer` (a tensor's memory).")
      .def(
          "recv_ptr",
          [](Communicator& c, Ptr buf, int64_t nbytes, int peer, int tag) {
            c.recv(as_ptr<void>(buf), nbytes, peer, tag);
          },
          py::arg("ptr"), py::arg("nbytes"), py::arg("peer"), py::arg("tag") = 0,
          py::call_guard<py::gil_scoped_release>(),
          "Blocking receive of exactly nbytes from `peer` into the memory at ptr.")
      .def_property_readonly("queues_p2p", &Communicator::queues_p2p,
                             "Whether send_ptr_queued/recv_ptr_queued are ordered on `stream` (or the legacy default "
                             "stream) without blocking (NCCL) instead of blocking (comm/communicator.h).")
      .def(
          "send_ptr_queued",
          [](Communicator& c, Ptr buf, int64_t nbytes, int peer, int tag) {
            c.send_queued(as_ptr<const void>(buf), nbytes, peer, tag);
          },
          py::arg("ptr"), py::arg("nbytes"), py::arg("peer"), py::arg("tag") = 0,
          py::call_guard<py::gil_scoped_release>(),
          "send_ptr ordered on `stream` where queues_p2p (returns once issued; the memory must stay valid in "
          "stream order), else send_ptr.")
      .def(
          "recv_ptr_queued",
          [](Communicator& c, Ptr buf, int64_t nbytes, int peer, int tag) {
            c.recv_queued(as_ptr<void>(buf), nbytes, peer, tag);
          },
          py::arg("ptr"), py::arg("nbytes"), py::arg("peer"), py::arg("tag") = 0,
          py::call_guard<py::gil_scoped_release>(),
          "recv_ptr ordered on `stream` where queues_p2p (work queued on the stream later sees the data), else "
          "recv_ptr.")
      .def("sync", &Communicator::sync, py::call_guard<py::gil_scoped_release>(),
           "Waits for the transfers queued so far (send_ptr_queued/recv_ptr_queued), naming a dead or stalled "
           "peer.")
      .def("stats", [](const Communicator& c) { return stats_dict(c.stats()); },
           "{op_name: {calls, bytes, seconds, bytes_to_peer}}: bytes this rank sent since creation or stats_reset().")
      .def("stats_reset", &Communicator::stats_reset)
      .def(
          "split",
          [](Communicator& c, int color, int key, const std::string& name) {
            std::unique_ptr<Communicator> child;
            {
              py::gil_scoped_release release;
              child = c.split(color, key, name);
            }
            return wrap(std::move(child));
          },
          py::arg("color"), py::arg("key") = 0, py::arg("name") = "",
          "Collective: ranks with the same color form a child ordered by (key, rank); color < 0 -> None.")
      .def("abort", &Communicator::abort, py::arg("code") = 1,
           "End the whole job now (MPI_Abort; the single backend exits the process).")
      .def("__repr__", [](const Communicator& c) { return "<zero8._C.Communicator " + c.description() + ">"; });

  m.def(
      "comm_create",
      [](const std::string& backend, bool host_if_gpus_shared) {
        ZERO8_CHECK_ARG(!host_if_gpus_shared || backend == "nccl", "host_if_gpus_shared",
                        "is for backend 'nccl', not '" << backend << "'");
        std::unique_ptr<Communicator> c;
        {
          py::gil_scoped_release release;
          c = host_if_gpus_shared ? comm::nccl_or_host_create() : comm::comm_create(backend);
        }
        return CommPtr(std::move(c));
      },
      py::arg("backend") = "auto", py::arg("host_if_gpus_shared") = false,
      "A world communicator: 'single', 'mpi', 'nccl' or 'auto' (mpi under mpirun when built with MPI, else "
      "single). A backend this build lacks raises Zero8NotSupportedError. 'nccl' with host_if_gpus_shared: "
      "the 'mpi' world it would bootstrap over where ranks share a GPU (every rank alike), instead of the "
      "error naming them.");
  m.def(
      "comm_create_tcp",
      [](int rank, int size, py::function exchange, bool nccl, bool host_if_gpus_shared) {
        // The exchange is Python (torch.distributed's store), called on this thread while the connections
        // are made without the GIL.
        comm::AddressExchange call = [&exchange, size](const std::string& mine) {
          py::gil_scoped_acquire hold;
          try {
            return exchange(mine).cast<std::vector<std::string>>();
          } catch (const py::error_already_set& e) {
            throw error_from_python(e);
          } catch (const py::cast_error&) {
            ZERO8_THROW(invalid_argument, "comm_create_tcp: the exchange must return a list of " << size
                                              << " strings (every rank's contact string, in rank order)");
          }
        };
        std::unique_ptr<Communicator> c;
        {
          py::gil_scoped_release release;
          c = comm::tcp_create(rank, size, call);
          if (nccl) c = comm::nccl_create_over(std::move(c), host_if_gpus_shared);
        }
        return CommPtr(std::move(c));
      },
      py::arg("rank"), py::arg("size"), py::arg("exchange"), py::arg("nccl") = false,
      py::arg("host_if_gpus_shared") = false,
      "A 'tcp' world communicator (every pair of ranks connected over TCP) for processes that no MPI launcher "
      "started: `exchange(mine)` is called once with this rank's contact string and returns every rank's, in "
      "rank order (zero8.engine.world_comm does it through torch.distributed's store). nccl=True: an 'nccl' "
      "world bootstrapped over it (C++ nccl_create_over), on the rank's GPU among its node's; with "
      "host_if_gpus_shared, the tcp world itself where ranks share a GPU.");
  m.def("comm_backend_available", &comm::comm_backend_available, py::arg("backend"),
        "Whether the backend is compiled in (not: usable right now).");
  m.def(
      "comm_auto_backend",
      [](const std::string& memory) {
        ZERO8_CHECK_ARG(memory == "host" || memory == "device", "memory",
                        "must be \"host\" or \"device\", got \"" << memory << "\"");
        return comm::comm_auto_backend(memory == "device" ? comm::MemSpace::device : comm::MemSpace::host);
      },
      py::arg("memory") = "host",
      "The backend comm_create('auto') makes for buffers in `memory`: 'single' or 'mpi' (started by an MPI "
      "launcher), for \"device\" 'nccl' instead of 'mpi' when that launcher started several processes and zero8 "
      "has NCCL.");
  m.def(
      "topology_split",
      [](Communicator& world, int pp) {
        comm::Topology t;
        {
          py::gil_scoped_release release;
          t = comm::topology_split(world, pp);
        }
        py::dict d;
        d["pp"] = t.pp;
        d["dp"] = t.dp;
        d["pp_stage"] = t.pp_stage;
        d["dp_rank"] = t.dp_rank;
        d["dp_group"] = wrap(std::move(t.dp_group));
        d["pp_group"] = wrap(std::move(t.pp_group));
        return d;
      },
      py::arg("world"), py::arg("pp") = 1,
      "Collective: pp x dp groups, rank = pp_stage * dp + dp_rank. dict(pp, dp, pp_stage, dp_rank, dp_group, "
      "pp_group).");
  m.def(
      "node_groups",
      [](Communicator& world) {
        comm::NodeGroups g;
        {
          py::gil_scoped_release release;
          g = comm::node_groups(world);
        }
        py::dict d;
        d["node"] = g.node;
        d["nodes"] = g.nodes;
        d["local_rank"] = g.local_rank;
        d["local_size"] = g.local_size;
        d["intra"] = wrap(std::move(g.intra));
        d["inter"] = wrap(std::move(g.inter));
        return d;
      },
      py::arg("world"), "Collective: node grouping (ZERO8_COMM_NODE, default hostname): dict(node, nodes, "
                        "local_rank, local_size, intra, inter).");
}

}  // namespace zero8::bindings
