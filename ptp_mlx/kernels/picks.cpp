// ptp-picks: the sampler's passes over a whole row of logits (sampler.py), as MLX primitives on the CPU.
//
// Why: a token row's pick read its 49152 logits in a dozen graph nodes on MLX's CPU backend (the argmax, the
// finiteness test's max, isnan and all; at a temperature the float64 conversion, the division, the maximum, the
// float32 exponential's fused kernel, the conversion back and the sum): 0.2 ms a row greedy, 0.9 ms sampled, on
// the path of every PTP call once per token row. Here they are two passes each.
//
// Bits: both give exactly what the graph gives. The greedy pick compares only. The tempered statistics repeat the
// graph's arithmetic in its order: x = float64(logit) / T, m = max x, d = x - m, the exponential of float32(d) by
// fused_exp.py's float32 operations (each product rounded before its add, as MLX's fused kernel does: no
// multiply-add), and Z the sum of their float64 values one after the other, as MLX sums a float64 row on the CPU
// (tests/test_cpu_ops.py compares every bit with the graph form).

#include <cmath>
#include <cstdint>
#include <cstring>
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

constexpr float NINF = -std::numeric_limits<float>::infinity();

// The greedy pick of each row (sampler.py: pick at temperature 0): the argmax, the lowest id among equal maxima,
// or -1 where the row holds a NaN or its maximum is not finite; what MLX's argmax, max, isfinite, isnan and all
// give as five nodes and four passes over the row (0.18 ms a row of the default model's vocabulary here), in two
// passes. Exact: comparisons only, no arithmetic.
int32_t greedy_row(const float* x, int64_t V) {
  v16 m = splat(NINF);
  i16 nan{};
  int64_t j = 0;
  for (; j + LANES <= V; j += LANES) {
    const v16 v = load(x + j);
    m = v > m ? v : m;
    nan |= v != v;
  }
  float best = NINF;
  bool any_nan = false;
  for (int k = 0; k < LANES; ++k) {
    best = m[k] > best ? m[k] : best;
    any_nan |= nan[k] != 0;
  }
  for (; j < V; ++j) {
    best = x[j] > best ? x[j] : best;
    any_nan |= x[j] != x[j];
  }
  if (any_nan || !std::isfinite(best)) return -1;
  for (int64_t k = 0; k < V; ++k)
    if (x[k] == best) return static_cast<int32_t>(k);
  return -1;  // (unreachable: best is one of the row's values)
}

class GreedyPick : public ptpcpu::CpuPrimitive {
 public:
  explicit GreedyPick(mx::Stream stream) : CpuPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPGreedyPick"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.pop_back();
    return {shape};
  }
};

void GreedyPick::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), op = out.data<int32_t>()]() {
    thread_local std::vector<float> buf;
    const int64_t V = x.shape(-1);
    const auto rows = ptpcpu::rows_of(x, buf);  // (a view: copied)
    for (int64_t r = 0; r < rows.rows; ++r) op[r] = greedy_row(rows.p + r * rows.stride, V);
  });
}

mx::array greedy_pick(const mx::array& logits) {
  if (logits.dtype() != mx::float32 || logits.ndim() < 1 || logits.shape(-1) < 1)
    throw std::invalid_argument("greedy_pick: logits are float32 [..., vocab]");
  auto shape = logits.shape();
  shape.pop_back();
  return mx::array(shape, mx::int32, std::make_shared<GreedyPick>(mx::default_stream(mx::Device::cpu)), {logits});
}

// fused_exp.py's e^x on float32 lanes, every operation rounded to float32 on its own (the barrier keeps the
// compiler from fusing a product into the add after it: MLX's fused kernel makes no multiply-add). Lanes: one
// vector register of this target (16 with AVX-512, 8 with AVX, 4 with SSE or NEON), else one at a time.
#if defined(__AVX512F__)
constexpr int VW = 16;
#elif defined(__AVX__)
constexpr int VW = 8;
#elif defined(__SSE2__) || defined(__aarch64__)
constexpr int VW = 4;
#else
constexpr int VW = 1;
#endif
#if defined(__AVX512F__)
#define BARRIER(v) __asm__("" : "+v"(v))
#elif defined(__SSE2__)
#define BARRIER(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define BARRIER(v) __asm__("" : "+w"(v))
#else
#define BARRIER(v) (v) = *static_cast<volatile vf*>(&(v))
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));

inline vf vsplat(float x) {
  vf v;
  for (int k = 0; k < VW; ++k) v[k] = x;
  return v;
}

inline vf graph_exp(vf x) {
  static const float poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
  const float ROUND = 12582912.0f;
  vf t = x * 1.442695f;
  t = t < -127.0f ? vsplat(-127.0f) : t;  // (clip; a NaN lane, a row that picks -1, gives what it gives)
  t = t > 127.0f ? vsplat(127.0f) : t;
  const vf shifted = t + ROUND;
  const vf frac = t - (shifted - ROUND);
  vf p = frac * poly[0];
  BARRIER(p);
  p = p + poly[1];
  for (int i = 2; i < 7; ++i) {
    vf q = p * frac;
    BARRIER(q);
    p = q + poly[i];
  }
  const vi bits = (reinterpret_cast<const vi&>(shifted) - (0x4B400000 - 127)) << 23;
  const vf y = reinterpret_cast<const vf&>(bits) * p;
  return t < -126.9f ? vsplat(0.0f) : y;
}

class TemperedStats : public ptpcpu::CpuPrimitive {
 public:
  TemperedStats(mx::Stream stream, double t, double cutoff) : CpuPrimitive(stream), t_(t), cutoff_(cutoff) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPTemperedStats"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const TemperedStats&>(other);
    return t_ == o.t_ && cutoff_ == o.cutoff_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = 1;
    return {shape, shape, shape};
  }

 private:
  double t_, cutoff_;
};

void TemperedStats::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
  }
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), mp = outputs[0].data<double>(),
                    zp = outputs[1].data<double>(), np_ = outputs[2].data<int32_t>(), t = t_, cutoff = cutoff_]() {
    thread_local std::vector<float> buf;
    thread_local std::vector<double> xs;
    const int64_t V = x.shape(-1);
    const auto rows = ptpcpu::rows_of(x, buf);  // (a view: copied)
    const bool divide = t != 0.0 && t != 1.0;
    xs.resize(V + VW);
    alignas(64) float e[VW];
    for (int64_t r = 0; r < rows.rows; ++r) {
      const float* xr = rows.p + r * rows.stride;
      // The maximum of x / T is the largest logit's (division by T > 0 keeps the order, and rounds monotonically).
      float best = NINF;
      bool nan = false;
      for (int64_t j = 0; j < V; ++j) {
        best = xr[j] > best ? xr[j] : best;
        nan |= xr[j] != xr[j];
      }
      const double m = nan ? std::numeric_limits<double>::quiet_NaN()  // (MLX's max of a row with a NaN)
                           : divide ? static_cast<double>(best) / t : static_cast<double>(best);
      if (divide)
        for (int64_t j = 0; j < V; ++j) xs[j] = static_cast<double>(xr[j]) / t - m;
      else
        for (int64_t j = 0; j < V; ++j) xs[j] = static_cast<double>(xr[j]) - m;
      for (int64_t j = V; j < V + VW; ++j) xs[j] = 0.0;  // (the last vector's padding, never summed)
      double z = 0.0;
      int32_t positive = 0;
      for (int64_t j = 0; j < V; ++j) positive += xs[j] > cutoff;
      for (int64_t j = 0; j < V; j += VW) {
        vf dv;
        for (int k = 0; k < VW; ++k) dv[k] = static_cast<float>(xs[j + k]);
        const vf ev = graph_exp(dv);
        std::memcpy(e, &ev, sizeof ev);
        const int n = V - j < VW ? static_cast<int>(V - j) : VW;
        for (int k = 0; k < n; ++k) z += static_cast<double>(e[k]);  // one after the other, as MLX sums
      }
      mp[r] = m, zp[r] = z, np_[r] = positive;
    }
  });
}

std::vector<mx::array> tempered_stats(const mx::array& logits, double temperature, double cutoff) {
  if (logits.dtype() != mx::float32 || logits.ndim() < 1 || logits.shape(-1) < 1)
    throw std::invalid_argument("tempered_stats: logits are float32 [..., vocab]");
  if (!(temperature >= 0.0)) throw std::invalid_argument("tempered_stats: a temperature >= 0");
  auto shape = logits.shape();
  shape.back() = 1;
  return mx::array::make_arrays({shape, shape, shape}, {mx::float64, mx::float64, mx::int32},
                                std::make_shared<TemperedStats>(mx::default_stream(mx::Device::cpu), temperature,
                                                                cutoff),
                                {logits});
}

}  // namespace

void register_picks(nb::module_& m) {
  m.def("greedy_pick", &greedy_pick, nb::arg("logits"),
        "Each row's argmax of logits (float32 [..., vocab]), int32: the lowest id among equal maxima, -1 where the "
        "row holds a NaN or its maximum is not finite.");
  m.def("tempered_stats", &tempered_stats, nb::arg("logits"), nb::arg("temperature"), nb::arg("cutoff"),
        "Per row of logits (float32 [..., vocab]) at a temperature (divided where it is not 0 or 1), in float64: "
        "the maximum m, Z = the sum of fused_exp(float32(x - m)) in order, and how many x - m exceed cutoff; each "
        "[..., 1] (float64, float64, int32).");
}
