// ptp-graph: what the decoding loop does to MLX graphs that are never evaluated, as a small MLX C++ extension built
// wherever MLX runs (Linux's CPU, a Mac's Metal, CUDA): no kernels, no machine-specific flags.
//
// cut_buffers: a call built ahead for an outcome that did not happen (ptp_mlx/decode/ahead.py, park) is never
// evaluated, but its graph holds the K/V buffers that the call queued instead writes in place: MLX donates a buffer
// only when nothing else holds it, else the call copies it (tens of megabytes a call). Letting the whole graph go
// frees every node's inputs on the host, on the critical path (0.17-0.35 ms a read on the 2-core CPU where it was
// measured, on memory the compute pushed out of the caches). Cutting only the edges to those buffers is a few
// microseconds: the unevaluated nodes near `outs` (the dropped build's K/V outputs) stop holding any of `bufs` (the
// buffers the build was made on); the rest of the graph is let go after the next call is queued.
// A cut edge points at a scalar that lives as long as the process: the node is never evaluated, so what it would
// have read does not matter, and its shape is not looked at again. Returns how many edges were cut.

#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// The nodes within `depth` edges of `outs` (through nodes not yet evaluated) stop holding any of the buffers whose
// ids are `targets`, except the nodes any of `keep` reaches (a build that will run: its graph may share nodes with
// the dropped ones). A build that moves a strand's K/V rows in its own graph (decode/fixed.py, move_rows) reads the
// buffers through the move's gather and slice update, a few nodes before its outputs: depth 1 would miss them, and
// the call queued instead would copy every buffer.
int cut_core(const std::vector<const std::vector<mx::array>*>& outs, const std::unordered_set<std::uintptr_t>& targets,
             const std::vector<const std::vector<mx::array>*>& keep, int depth) {
  static const mx::array* none = new mx::array(0.0f);
  std::unordered_set<std::uintptr_t> kept;  // every unevaluated node `keep` reaches, however deep
  std::vector<mx::array> stack;
  for (const auto* ks : keep)
    for (const auto& k : *ks)
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
  // the nodes walked, with the depth left when they were (a node reached first through a longer path, the layers
  // before it, is walked again from closer: a layer's K and V outputs are siblings of its node)
  std::unordered_map<std::uintptr_t, int> seen;
  std::vector<std::pair<mx::array, int>> todo;
  for (const auto* os : outs)
    for (const auto& o : *os) todo.emplace_back(o, depth);
  int cut = 0;
  auto visit = [&](mx::array& a, int d) {
    if (!a.has_primitive() || kept.count(a.id())) return;
    auto [it, fresh] = seen.try_emplace(a.id(), d);
    if (!fresh && it->second >= d) return;
    it->second = d;
    for (auto& x : a.inputs()) {
      if (targets.count(x.id())) {
        x = *none;
        ++cut;
      } else if (d > 1 && x.has_primitive()) {
        todo.emplace_back(x, d - 1);
      }
    }
  };
  while (!todo.empty()) {
    auto [a, d] = todo.back();
    todo.pop_back();
    auto at = seen.find(a.id());
    if (!a.has_primitive() || (at != seen.end() && at->second >= d)) continue;
    visit(a, d);
    for (auto& s : a.siblings()) visit(s, d);
  }
  return cut;
}

std::unordered_set<std::uintptr_t> ids(const std::vector<mx::array>& bufs) {
  std::unordered_set<std::uintptr_t> out;
  for (const auto& b : bufs) out.insert(b.id());
  return out;
}

int cut_buffers(std::vector<mx::array>& outs, const std::vector<mx::array>& bufs, const std::vector<mx::array>& keep,
                int depth) {
  return cut_core({&outs}, ids(bufs), {&keep}, depth);
}

// One build's cut, prepared while the call before it computes (decode/ahead.py, where a device computes: off the
// critical path), so that the read's verdict only walks: its K/V outputs (`outs`), its other outputs (`also`: what a
// build kept reaches) and the ids of the buffers it was built on (ids only: holding the buffers would stop MLX from
// donating them to the call that runs).
struct CutPlan {
  std::vector<mx::array> outs, also;
  std::unordered_set<std::uintptr_t> targets;
};

CutPlan prepare(std::vector<mx::array> outs, std::vector<mx::array> also, const std::vector<mx::array>& bufs) {
  return CutPlan{std::move(outs), std::move(also), ids(bufs)};
}

int cut_prepared(const std::vector<CutPlan*>& unused, const CutPlan* keep, int depth) {
  std::vector<const std::vector<mx::array>*> outs, kept;
  std::unordered_set<std::uintptr_t> targets;
  for (const auto* p : unused) {
    outs.push_back(&p->outs);
    targets.insert(p->targets.begin(), p->targets.end());
  }
  if (keep != nullptr) kept = {&keep->outs, &keep->also};
  return cut_core(outs, targets, kept, depth);
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
  m.def("prepare", &prepare, nb::arg("outs"), nb::arg("also"), nb::arg("bufs"),
        "One build's cut, prepared ahead: its K/V outputs `outs`, its other outputs `also` (what it reaches where it "
        "is kept) and the buffers `bufs` it was built on (their ids only).");
  m.def("cut_prepared", &cut_prepared, nb::arg("unused"), nb::arg("keep").none(), nb::arg("depth"),
        "`cut_buffers` over prepared builds: the unused ones' edges to their buffers, never in nodes the kept one (or "
        "None) reaches; returns the edges cut.");
}
