// ptp-graph: what the decoding loop does to MLX graphs that are never evaluated, as a small MLX C++ extension built
// wherever MLX runs (Linux's CPU, a Mac's Metal, CUDA): no kernels, no machine-specific flags.
//
// The cut: a call built ahead for an outcome that did not happen (ptp_mlx/decode/release.py) is never evaluated,
// but its graph holds the K/V buffers that the call queued instead writes in place: MLX donates a buffer only when
// nothing else holds it, else the call copies it (tens of megabytes a call). Letting the whole graph go frees every
// node's inputs on the host, on the critical path (0.17-0.35 ms a read on the 2-core CPU where it was measured, on
// memory the compute pushed out of the caches). Cutting only the edges to those buffers is less: the unevaluated
// nodes near a build's K/V outputs stop holding the buffers it was built on. Every build is cut as it is made,
// while the call before computes (`cut_ahead`), and after the read the build that runs gets its edges back
// (`restore`); the rest of the unused builds' graphs is let go after the next call is queued.
// A cut edge points at a scalar that lives as long as the process: a node left cut is never evaluated, so what it
// would have read does not matter, and its shape is not looked at again.

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

// What a cut edge points at: a scalar that lives as long as the process (see the top of this file).
const mx::array& placeholder() {
  static const mx::array* none = new mx::array(0.0f);
  return *none;
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
                       const std::unordered_set<std::uintptr_t>& kept, const Ids& stop = {}, int* cut_before = nullptr) {
  const auto none = placeholder().id();
  std::vector<Edge> edges;
  std::unordered_set<std::uintptr_t> seen;
  std::vector<mx::array> level(outs), next;
  auto visit = [&](const mx::array& a, bool deeper) {
    if (!a.has_primitive() || kept.count(a.id()) || !seen.insert(a.id()).second) return;
    const auto& in = a.inputs();
    for (int i = 0; i < static_cast<int>(in.size()); ++i) {
      if (named(targets, in[i].id()))
        edges.emplace_back(a, i);
      else if (cut_before != nullptr && in[i].id() == none)
        ++*cut_before;  // (a node another cut reached: see `cut_ahead`)
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

inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p);
#else
  (void)p;
#endif
}

// Cut the edges found (where they still read a buffer named). (No copy of an edge's node handle: each is a
// reference count on memory the compute pushed out of the caches.)
int cut(std::vector<Edge>& edges, const Ids& targets) {
  const auto& none = placeholder();
  int n = 0;
  for (auto& [node, i] : edges) {
    auto& in = node.inputs();
    if (node.has_primitive() && i < static_cast<int>(in.size()) && named(targets, in[i].id())) {
      in[i] = none;
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

// One build's cut, made while the call before it computes (decode/release.py, prepare; where a device computes, off
// the critical path): the edges of its graph near its K/V outputs to the buffers it was built on are found from the
// outputs and cut at once, each with the index of the buffer it read, so that from then on the build holds none of
// them. After the read only the build that runs gets its edges back (`restore`, from the same buffers): the read
// touches one build's nodes however many are let go (cutting each unused build after the read took 0.1-0.25 ms a
// read with free rows here, two to four builds of 120-180 edges, on memory the compute pushed out of the caches).
// The buffers are kept as ids only: holding them would stop MLX from donating them to the call that runs.
struct CutPlan {
  std::vector<Edge> edges;
  std::vector<int> which;  // for each edge, the index in `bufs` of the buffer it read
  Ids targets;
  int shared = 0;  // edges within reach that another build's cut had cut already (`restore` would not mend them)
};

CutPlan cut_ahead(const std::vector<mx::array>& outs, const std::vector<mx::array>& bufs,
                  const std::vector<mx::array>& stop, int depth) {
  CutPlan plan{{}, {}, ids(bufs)};
  std::vector<std::pair<std::uintptr_t, int>> index;  // (buffer id, its place in bufs), sorted by id
  index.reserve(bufs.size());
  for (int k = 0; k < static_cast<int>(bufs.size()); ++k) index.emplace_back(bufs[k].id(), k);
  std::sort(index.begin(), index.end());
  for (auto& e : find(outs, plan.targets, depth, {}, ids(stop), &plan.shared)) {
    auto& in = e.first.inputs();
    auto at = std::lower_bound(index.begin(), index.end(), std::make_pair(in[e.second].id(), -1));
    if (at == index.end() || at->first != in[e.second].id()) continue;  // (`find` named it: never, but kept out)
    in[e.second] = placeholder();
    plan.which.push_back(at->second);
    plan.edges.push_back(std::move(e));
  }
  return plan;
}

// Give the build that runs its edges back: each cut edge (still pointing at the placeholder) reads its buffer of
// `bufs` again (the state it was built on, in the order `cut_ahead` was given it). Returns how many were put back.
int restore(const CutPlan& plan, const std::vector<mx::array>& bufs) {
  const auto none = placeholder().id();
  // (the nodes, then their inputs, asked of memory all at once before any is read: the compute pushed them out of
  // the caches, and one miss after another was most of the time here)
  for (const auto& e : plan.edges) prefetch(reinterpret_cast<const void*>(e.first.id()));
  for (const auto& b : bufs) prefetch(reinterpret_cast<const void*>(b.id()));
  for (const auto& e : plan.edges) prefetch(e.first.inputs().data() + e.second);
  int n = 0;
  for (std::size_t k = 0; k < plan.edges.size(); ++k) {
    const auto& [node, i] = plan.edges[k];
    auto& in = const_cast<mx::array&>(node).inputs();
    int w = plan.which[k];
    if (i < static_cast<int>(in.size()) && in[i].id() == none && w < static_cast<int>(bufs.size()) &&
        named(plan.targets, bufs[w].id())) {
      in[i] = bufs[w];
      ++n;
    }
  }
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
  nb::class_<CutPlan>(m, "CutPlan")
      .def_prop_ro("edges", [](const CutPlan& p) { return p.edges.size(); })
      .def_prop_ro("shared", [](const CutPlan& p) { return p.shared; });
  m.def("cut_ahead", &cut_ahead, nb::arg("outs"), nb::arg("bufs"), nb::arg("stop"), nb::arg("depth"),
        "One build's cut, made ahead: the edges to any of `bufs` within `depth` edges of its K/V outputs `outs`, "
        "never walking into the graphs of `stop` (a call still computing), cut at once; the buffers are kept as "
        "ids only. `restore` puts them back.");
  m.def("restore", &restore, nb::arg("plan"), nb::arg("bufs"),
        "Put back the edges `cut_ahead` cut, each to its buffer of `bufs` (the same list, in the same order); "
        "returns how many.");
}
