// ptp-graph: what the decoding loop does to MLX graphs that are never evaluated, as a small MLX C++ extension built
// wherever MLX runs (Linux's CPU, a Mac's Metal, CUDA): no kernels, no machine-specific flags.
//
// The cut: a call built ahead for an outcome that did not happen (ptp_mlx/decode/release.py, park) is never
// evaluated, but its graph holds the K/V buffers that the call queued instead writes in place: MLX donates a buffer
// only when nothing else holds it, else the call copies it (tens of megabytes a call). Letting the whole graph go
// frees every node's inputs on the host, on the critical path (0.17-0.35 ms a read on the 2-core CPU where it was
// measured, on memory the compute pushed out of the caches). Cutting only the edges to those buffers is less: the
// unevaluated nodes near the dropped build's K/V outputs stop holding the buffers it was built on (found while the
// call before computes: `prepare`; cut after the read: `cut_prepared`, 0.05-0.2 ms a read on that CPU's cold
// memory); the rest of the graph is let go after the next call is queued.
// A cut edge points at a scalar that lives as long as the process: the node is never evaluated, so what it would
// have read does not matter, and its shape is not looked at again. Returns how many edges were cut.

#include <algorithm>
#include <cstdint>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

using Ids = std::vector<std::uintptr_t>;  // sorted: searched for every input of every node walked
using Edge = std::pair<mx::array, int>;   // an unevaluated node and the index of an input that is a buffer named

Ids ids(const std::vector<mx::array>& bufs) {
  Ids out;
  out.reserve(bufs.size());
  for (const auto& b : bufs) out.push_back(b.id());
  std::sort(out.begin(), out.end());
  return out;
}

bool named(const Ids& targets, std::uintptr_t id) { return std::binary_search(targets.begin(), targets.end(), id); }

// Every unevaluated node `keep` reaches, however deep.
std::unordered_set<std::uintptr_t> reached(const std::vector<mx::array>& keep) {
  std::unordered_set<std::uintptr_t> kept;
  std::vector<mx::array> stack;
  for (const auto& k : keep)
    if (k.has_primitive()) stack.push_back(k);
  while (!stack.empty()) {
    mx::array a = stack.back();
    stack.pop_back();
    if (!kept.insert(a.id()).second) continue;
    for (const auto& s : a.siblings())
      if (!kept.count(s.id())) stack.push_back(s);
    for (const auto& x : a.inputs())
      if (x.has_primitive() && !kept.count(x.id())) stack.push_back(x);
  }
  return kept;
}

// The edges to any of `targets` in the unevaluated nodes within `depth` edges of `outs` (and their siblings), but
// in nodes of `kept`. A build that moves a strand's K/V rows in its own graph (decode/fixed.py, move_rows) reads the
// buffers through the move's gather and slice update, a few nodes before its outputs: depth 1 would miss them, and
// the call queued instead would copy every buffer. Level by level from the outputs (breadth first), so that a node
// is walked once, from the output nearest it: a layer's K and V outputs are siblings of its node, which the next
// layer's node reads too.
//
// `stop`: arrays whose graphs are not walked (read by id only, from the walked node's inputs): the outputs of a call
// still computing, whose nodes MLX's stream thread evaluates and lets go of meanwhile.
std::vector<Edge> find(const std::vector<mx::array>& outs, const Ids& targets, int depth,
                       const std::unordered_set<std::uintptr_t>& kept, const Ids& stop = {}) {
  std::vector<Edge> edges;
  std::unordered_set<std::uintptr_t> seen;
  std::vector<mx::array> level(outs), next;
  auto visit = [&](const mx::array& a, bool deeper) {
    if (!a.has_primitive() || kept.count(a.id()) || !seen.insert(a.id()).second) return;
    const auto& in = a.inputs();
    for (int i = 0; i < static_cast<int>(in.size()); ++i) {
      if (named(targets, in[i].id()))
        edges.emplace_back(a, i);
      else if (deeper && !named(stop, in[i].id()) && in[i].has_primitive())
        next.push_back(in[i]);
    }
  };
  for (int d = depth; d > 0 && !level.empty(); --d) {
    for (const auto& a : level) {
      if (!a.has_primitive() || seen.count(a.id())) continue;
      visit(a, d > 1);
      for (const auto& s : a.siblings()) visit(s, d > 1);
    }
    level.swap(next);
    next.clear();
  }
  return edges;
}

// A cut edge points at a scalar that lives as long as the process (see the top of this file). `skip`: nodes left
// as they are. (No copy of an edge's node handle: each is a reference count on memory the compute pushed out of the
// caches.)
int cut(std::vector<Edge>& edges, const Ids& targets, const std::unordered_set<std::uintptr_t>& skip = {}) {
  static const mx::array* none = new mx::array(0.0f);
  int n = 0;
  for (auto& [node, i] : edges) {
    if (!skip.empty() && skip.count(node.id())) continue;
    auto& in = node.inputs();
    if (node.has_primitive() && i < static_cast<int>(in.size()) && named(targets, in[i].id())) {
      in[i] = *none;
      ++n;
    }
  }
  return n;
}

int cut_buffers(const std::vector<mx::array>& outs, const std::vector<mx::array>& bufs,
                const std::vector<mx::array>& keep, int depth) {
  auto targets = ids(bufs);
  auto edges = find(outs, targets, depth, reached(keep));
  return cut(edges, targets);
}

// One build's cut, found while the call before it computes (decode/release.py, prepare; where a device computes,
// off the critical path): the edges of its graph near its K/V outputs to the buffers it was built on, found from
// the outputs then, and the ids of those buffers (ids only: holding them would stop MLX from donating them to the
// call that runs). After the read only the edges found are cut (a walk of the graph then, on memory the compute
// pushed out of the caches, took 0.5-0.7 ms a read with free rows here).
struct CutPlan {
  std::vector<Edge> edges;
  Ids targets;
};

CutPlan prepare(const std::vector<mx::array>& outs, const std::vector<mx::array>& bufs,
               const std::vector<mx::array>& stop, int depth) {
  auto targets = ids(bufs);
  auto edges = find(outs, targets, depth, {}, ids(stop));
  return CutPlan{std::move(edges), std::move(targets)};
}

// The prepared cuts of `unused`, but in a node the prepared cut of `keep` (the build that runs, or None) found too:
// the builds share no node that reads the buffers (each moves its rows, or grows the buffers, in nodes of its own),
// and this makes sure of it where a node within reach of both would.
int cut_prepared(const std::vector<CutPlan*>& unused, const CutPlan* keep) {
  std::unordered_set<std::uintptr_t> shared;
  if (keep != nullptr)
    for (const auto& e : keep->edges) shared.insert(e.first.id());
  int n = 0;
  for (auto* p : unused) n += cut(p->edges, p->targets, shared);
  return n;
}

}  // namespace

NB_MODULE(_ptp_graph, m) {
  m.doc() = "ptp-mlx's graph tools: cut an unevaluated graph's edges to buffers another call writes in place";
  m.def("cut_buffers", &cut_buffers, nb::arg("outs"), nb::arg("bufs"), nb::arg("keep") = std::vector<mx::array>(),
        nb::arg("depth") = 1,
        "Make the unevaluated nodes within `depth` edges of `outs` (and their siblings) stop holding any of `bufs`, "
        "except those any of `keep` reaches, so that another call writes them in place; returns the edges cut. See "
        "graph_tools.cpp.");
  nb::class_<CutPlan>(m, "CutPlan");
  m.def("prepare", &prepare, nb::arg("outs"), nb::arg("bufs"), nb::arg("stop"), nb::arg("depth"),
        "One build's cut, found ahead: the edges to any of `bufs` within `depth` edges of its K/V outputs `outs`, "
        "never walking into the graphs of `stop` (a call still computing); nothing is cut yet, and the buffers are "
        "kept as ids only.");
  m.def("cut_prepared", &cut_prepared, nb::arg("unused"), nb::arg("keep").none(),
        "Cut the prepared edges of the builds `unused`, but in nodes whose edges the prepared cut `keep` (the build "
        "that runs, or None) found too; returns the edges cut.");
}
