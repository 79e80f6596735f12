// ptp-graph: what the decoding loop does to MLX graphs that are never evaluated, as a small MLX C++ extension built
// wherever MLX runs (Linux's CPU, a Mac's Metal, CUDA): no kernels, no machine-specific flags.
//
// cut_buffers: a call built ahead for an outcome that did not happen (ptp_mlx/decode/ahead.py, park) is never
// evaluated, but its graph holds the K/V buffers that the call queued instead writes in place: MLX donates a buffer
// only when nothing else holds it, else the call copies it (tens of megabytes a call). Letting the whole graph go
// frees every node's inputs on the host, on the critical path (0.17-0.35 ms a read on the 2-core CPU where it was
// measured, on memory the compute pushed out of the caches). Cutting only the edges to those buffers is a few
// microseconds: the nodes that wrote `outs` (the dropped build's K/V outputs) and their siblings stop holding any
// of `bufs` (the buffers the build was made on); the rest of the graph is let go after the next call is queued.
// A cut edge points at a scalar that lives as long as the process: the node is never evaluated, so what it would
// have read does not matter, and its shape is not looked at again. Returns how many edges were cut.

#include <algorithm>
#include <cstdint>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

int cut_buffers(std::vector<mx::array>& outs, const std::vector<mx::array>& bufs) {
  static const mx::array* none = new mx::array(0.0f);
  std::vector<std::uintptr_t> targets;
  targets.reserve(bufs.size());
  for (const auto& b : bufs) targets.push_back(b.id());
  std::sort(targets.begin(), targets.end());
  std::vector<std::uintptr_t> done;  // nodes walked (on the CPU a layer's K and V are siblings of one node)
  int cut = 0;
  auto walk = [&](mx::array& a) {
    for (auto& x : a.inputs())
      if (std::binary_search(targets.begin(), targets.end(), x.id())) {
        x = *none;
        ++cut;
      }
  };
  for (auto& o : outs) {
    if (!o.has_primitive() || std::find(done.begin(), done.end(), o.id()) != done.end()) continue;
    done.push_back(o.id());
    walk(o);
    for (auto& s : o.siblings()) {
      done.push_back(s.id());
      walk(s);
    }
  }
  return cut;
}

}  // namespace

NB_MODULE(_ptp_graph, m) {
  m.doc() = "ptp-mlx's graph tools: cut an unevaluated graph's edges to buffers another call writes in place";
  m.def("cut_buffers", &cut_buffers, nb::arg("outs"), nb::arg("bufs"),
        "Make the nodes of an unevaluated graph's outputs `outs` (and their siblings) stop holding any of `bufs`, "
        "so that another call writes them in place; returns the edges cut. See graph_tools.cpp.");
}
