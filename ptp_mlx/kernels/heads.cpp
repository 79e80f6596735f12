// ptp-aux-head: what a PTP call reads from each auxiliary row's logits, as one MLX primitive on the CPU (issue 41).
//
// An auxiliary row's logits (the whole vocabulary: 49152 for the default model) give its draft (the argmax), the
// draft's confidence, up to three runner-ups with theirs (a token tree's candidates) and, when sampling, the top
// probability at the sampler's temperature. As graph nodes that was about 25 nodes and a dozen passes over the row
// (argmax, max, the log-sum-exp's five exp kernels, the runner-ups' block maxima, partitions and gathers): 0.53 ms
// a row here. Here it is three passes over the row (block maxima, the exponentials' sum, the sum at temperature).
// None of it decides an emitted token (drafts are verified, confidences price rows), so it need not match the
// graph form bit for bit; it is deterministic, and ties go to the lower token id.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "cpu_ops.h"
#include "simd16.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

using namespace ptp16;

constexpr int BLOCK = 128;  // the runner-ups' search: block maxima, then inside the best blocks
constexpr float NINF = -std::numeric_limits<float>::infinity();

// sum over the row of exp(x * scale - shift), in 16 lanes (the tail padded with -inf).
float exp_sum(const float* x, int64_t V, float scale, float shift) {
  v16 acc{};
  int64_t j = 0;
  for (; j + LANES <= V; j += LANES) acc += exp16(load(x + j) * scale - shift);
  if (j < V) {
    float t[LANES];
    std::fill(t, t + LANES, NINF);
    std::copy(x + j, x + V, t);
    acc += exp16(load(t) * scale - shift);
  }
  return lane_sum(acc);
}

struct Head {
  int32_t top;
  float conf, top_prob;
};

// One row: the argmax (lowest id among ties), its probability, the `alts` likeliest other tokens and theirs.
Head row_head(const float* x, int64_t V, int alts, float inv_t, std::vector<float>& bm, int32_t* alt, float* alt_conf) {
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  bm.resize(nb);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * BLOCK, hi = std::min<int64_t>(V, lo + BLOCK);
    v16 m = splat(NINF);
    int64_t j = lo;
    for (; j + LANES <= hi; j += LANES) {
      const v16 v = load(x + j);
      m = v > m ? v : m;
    }
    float mb = NINF;
    for (int k = 0; k < LANES; ++k) mb = m[k] > mb ? m[k] : mb;
    for (; j < hi; ++j) mb = x[j] > mb ? x[j] : mb;
    bm[b] = mb;
  }
  // The best blocks, best first (ties: lower block): they hold the row's alts + 1 largest logits.
  const int want = std::min<int64_t>(alts + 1, nb);
  int32_t blocks[8];
  for (int r = 0; r < want; ++r) {
    int32_t pick = -1;
    for (int64_t b = 0; b < nb; ++b) {
      bool taken = false;
      for (int q = 0; q < r; ++q) taken |= blocks[q] == b;
      if (!taken && (pick < 0 || bm[b] > bm[pick])) pick = static_cast<int32_t>(b);
    }
    blocks[r] = pick;
  }
  const float best = bm[blocks[0]];
  int32_t top = static_cast<int32_t>(blocks[0]) * BLOCK;
  while (top < V - 1 && x[top] != best) ++top;
  const float sum = exp_sum(x, V, 1.0f, best);
  Head h{top, 1.0f / sum, 0.0f};
  if (inv_t != 0.0f) h.top_prob = 1.0f / exp_sum(x, V, inv_t, best * inv_t);
  // Runner-ups: repeatedly the largest candidate not yet taken (ties: lower id), the argmax excluded.
  int32_t got[8];
  for (int r = 0; r < alts; ++r) {
    int32_t pick = -1;
    for (int q = 0; q < want; ++q) {
      const int64_t lo = static_cast<int64_t>(blocks[q]) * BLOCK, hi = std::min<int64_t>(V, lo + BLOCK);
      for (int64_t j = lo; j < hi; ++j) {
        if (j == top) continue;
        bool taken = false;
        for (int p = 0; p < r; ++p) taken |= got[p] == j;
        if (taken) continue;
        if (pick < 0 || x[j] > x[pick] || (x[j] == x[pick] && j < pick)) pick = static_cast<int32_t>(j);
      }
    }
    got[r] = pick;
    alt[r] = pick < 0 ? top : pick;  // (a vocabulary smaller than alts + 1: the argmax again, confidence 0)
    alt_conf[r] = pick < 0 ? 0.0f : std::exp(x[pick] - best) / sum;
  }
  return h;
}

class AuxHead : public ptpcpu::CpuPrimitive {
 public:
  AuxHead(mx::Stream stream, int alts, float inv_t) : CpuPrimitive(stream), alts_(alts), inv_t_(inv_t) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPAuxHead"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AuxHead&>(other);
    return alts_ == o.alts_ && inv_t_ == o.inv_t_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int n = inputs[0].shape(0);
    return {{n}, {n}, {n, alts_}, {n, alts_}, {n}};
  }

 private:
  int alts_;
  float inv_t_;
};

void AuxHead::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
  }
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), top = outputs[0].data<int32_t>(),
                    conf = outputs[1].data<float>(), alt = outputs[2].data<int32_t>(),
                    alt_conf = outputs[3].data<float>(), top_prob = outputs[4].data<float>(), alts = alts_,
                    inv_t = inv_t_]() {
    thread_local std::vector<float> bm, buf;
    const int n = x.shape(0);
    const int64_t V = x.shape(1);
    const auto rows = ptpcpu::rows_of(x, buf);  // (a view: copied)
    for (int i = 0; i < n; ++i) {
      const float* xr = rows.p + i * rows.stride;
      const Head h = row_head(xr, V, alts, inv_t, bm, alt + static_cast<int64_t>(i) * alts,
                              alt_conf + static_cast<int64_t>(i) * alts);
      top[i] = h.top;
      conf[i] = h.conf;
      top_prob[i] = h.top_prob;
    }
  });
}

std::vector<mx::array> aux_head(const mx::array& logits, int alts, float inv_t) {
  if (logits.dtype() != mx::float32 || logits.ndim() != 2 || logits.shape(1) < 1)
    throw std::invalid_argument("aux_head: logits are float32 [rows, vocab]");
  if (alts < 0 || alts > 7) throw std::invalid_argument("aux_head: 0 to 7 runner-ups");
  const int n = logits.shape(0);
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({{n}, {n}, {n, alts}, {n, alts}, {n}},
                                {mx::int32, mx::float32, mx::int32, mx::float32, mx::float32},
                                std::make_shared<AuxHead>(stream, alts, inv_t), {logits});
}

// The ids of each row's c largest logits, in increasing id order (ties at the edge: the lower ids), for the fast
// sampled pick (sampler.py: _head): a radix select over the floats' order-preserving bit patterns (a histogram of
// the top 12 bits, then the one bucket that holds the edge), where MLX's argpartition and sort of the candidates
// took about 0.5 ms a row of the default model's vocabulary (since 2026-12-06 a guess of the edge from a sample
// comes first: top_ids_sampled). Which of several equal logits at the edge are taken does not change a pick: it
// trusts only the candidates strictly likelier than the least likely one.
inline uint32_t order_key(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);  // larger float, larger key (a NaN: the largest)
}

// First a guess of the edge from every 16th logit: the ids at or above a key that about 1.5 c of the sample exceed
// are gathered in one pass, and the c largest found among those alone (every id at or above the guess is there, so
// where at least c are, the edge and its ties are the whole row's: the same ids as the histogram below, which runs
// where the guess took fewer than c). 0.05 ms a row of the default model's vocabulary instead of 0.2.
bool top_ids_sampled(const float* x, int64_t V, int c, int32_t* out, std::vector<uint32_t>& keys,
                     std::vector<uint32_t>& edge) {
  constexpr int STEP = 16;
  const int64_t n_sample = V / STEP;
  const int64_t want = (static_cast<int64_t>(c) * 3 / 2 + STEP - 1) / STEP + 4;  // sampled keys above the guess
  if (n_sample < 4 * want) return false;  // (a short row: the histogram alone)
  edge.resize(n_sample);
  for (int64_t i = 0; i < n_sample; ++i) edge[i] = order_key(x[i * STEP]);
  std::nth_element(edge.begin(), edge.begin() + (want - 1), edge.end(), std::greater<uint32_t>());
  const uint32_t guess = edge[want - 1];
  thread_local std::vector<int32_t> cand;
  cand.resize(V);
  keys.resize(V);
  int64_t n = 0;
  for (int64_t j = 0; j < V; ++j) {
    const uint32_t k = order_key(x[j]);
    cand[n] = static_cast<int32_t>(j);
    keys[n] = k;
    n += k >= guess;
  }
  if (n < c) return false;
  edge.assign(keys.begin(), keys.begin() + n);
  std::nth_element(edge.begin(), edge.begin() + (c - 1), edge.end(), std::greater<uint32_t>());
  const uint32_t thr = edge[c - 1];
  int64_t greater = 0;
  for (int64_t i = 0; i < n; ++i) greater += keys[i] > thr;
  int64_t ties = c - greater, m = 0;
  for (int64_t i = 0; i < n && m < c; ++i)
    if (keys[i] > thr || (keys[i] == thr && ties-- > 0)) out[m++] = cand[i];
  return true;
}

void top_ids_row(const float* x, int64_t V, int c, int32_t* out, std::vector<uint32_t>& keys,
                 std::vector<uint32_t>& edge) {
  if (top_ids_sampled(x, V, c, out, keys, edge)) return;
  constexpr int BITS = 12, SHIFT = 32 - BITS;
  thread_local std::vector<int32_t> h4;  // four histograms, filled in turn: logits crowd into a few buckets, and
  h4.assign(4 << BITS, 0);               // one counter's increments would wait on each other
  keys.resize(V);
  int64_t i = 0;
  for (; i + 4 <= V; i += 4)
    for (int j = 0; j < 4; ++j) {
      keys[i + j] = order_key(x[i + j]);
      ++h4[(j << BITS) + (keys[i + j] >> SHIFT)];
    }
  for (; i < V; ++i) {
    keys[i] = order_key(x[i]);
    ++h4[keys[i] >> SHIFT];
  }
  int64_t hist[1 << BITS];
  for (int b = 0; b < (1 << BITS); ++b)
    hist[b] = static_cast<int64_t>(h4[b]) + h4[(1 << BITS) + b] + h4[(2 << BITS) + b] + h4[(3 << BITS) + b];
  int bucket = (1 << BITS) - 1;
  int64_t above = 0;  // keys in buckets above `bucket`
  while (above + hist[bucket] < c) above += hist[bucket--];
  edge.clear();
  for (int64_t k = 0; k < V; ++k)
    if (static_cast<int>(keys[k] >> SHIFT) == bucket) edge.push_back(keys[k]);
  const int64_t need = c - above;  // taken from the edge bucket, its largest first
  std::nth_element(edge.begin(), edge.begin() + (need - 1), edge.end(), std::greater<uint32_t>());
  const uint32_t thr = edge[need - 1];
  int64_t greater = above;
  for (uint32_t k : edge) greater += k > thr;
  int64_t ties = c - greater, n = 0;
  for (int64_t k = 0; k < V && n < c; ++k)
    if (keys[k] > thr || (keys[k] == thr && ties-- > 0)) out[n++] = static_cast<int32_t>(k);
}

class TopIds : public ptpcpu::CpuPrimitive {
 public:
  TopIds(mx::Stream stream, int c) : CpuPrimitive(stream), c_(c) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPTopIds"; }
  bool is_equivalent(const mx::Primitive& other) const override { return c_ == static_cast<const TopIds&>(other).c_; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = c_;
    return {shape};
  }

 private:
  int c_;
};

void TopIds::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), op = out.data<int32_t>(), c = c_]() {
    thread_local std::vector<float> buf;
    thread_local std::vector<uint32_t> keys, edge;
    const int64_t V = x.shape(-1);
    const auto rows = ptpcpu::rows_of(x, buf);  // (a view: copied)
    for (int64_t r = 0; r < rows.rows; ++r) top_ids_row(rows.p + r * rows.stride, V, c, op + r * c, keys, edge);
  });
}

mx::array top_ids(const mx::array& logits, int c) {
  if (logits.dtype() != mx::float32 || logits.ndim() < 1)
    throw std::invalid_argument("top_ids: logits are float32 [..., vocab]");
  if (c < 1 || c > logits.shape(-1)) throw std::invalid_argument("top_ids: c is between 1 and the vocabulary");
  auto shape = logits.shape();
  shape.back() = c;
  return mx::array(shape, mx::int32, std::make_shared<TopIds>(mx::default_stream(mx::Device::cpu), c), {logits});
}

}  // namespace

void register_heads(nb::module_& m) {
  m.def("aux_head", &aux_head, nb::arg("logits"), nb::arg("alts"), nb::arg("inv_t"),
        "Per row of logits [rows, vocab]: (argmax int32, its probability, `alts` runner-ups int32 [rows, alts] and "
        "their probabilities, the argmax's probability at temperature 1 / inv_t, or 0 where inv_t is 0).");
  m.def("top_ids", &top_ids, nb::arg("logits"), nb::arg("c"),
        "The ids of each row's c largest logits (float32 [..., vocab]), int32 in increasing order; at equal logits "
        "on the edge, the lower ids.");
}
