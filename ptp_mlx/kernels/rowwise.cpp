// ptp-mlx's row-wise CPU primitives (issue 41): SwiGLU's `silu(gate) * x`, RMS norm, and RoPE from a cos/sin table.
//
// Why: on MLX's CPU backend a node of a call's graph costs about 5 us on the stream thread and about as much on the
// thread that replays the compiled graph, whatever its size. SwiGLU with ptp-mlx's fast exp (ptp_mlx/fused_exp.py)
// was seven nodes a layer (five fused kernels around two bit casts), an RMS norm three, a table RoPE five (two
// slices, two products, a concatenation). Each is one node here. A row's result never depends on the rows around
// it or how many there are: SwiGLU's elements all go through the same 16-lane code (a row's tail through a padded
// vector), a norm's sum of squares runs in 16 fixed lanes, and RoPE is computed exactly as the graph form computes
// it (products rounded apart, never fused), so it changes no bit of any path.

#include <algorithm>
#include <optional>
#include <cmath>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "cpu_ops.h"
#include "simd16.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace ptpcpu {

using namespace ptp16;

inline v16 silu_mul(v16 g, v16 x) { return g / (1.0f + exp16(-g)) * x; }

// out = silu(g) * x over `rows` rows of N (rows `gstride`, `xstride` apart; out row-major): every element through
// the same 16-lane code, a row's tail through a padded vector.
void swiglu_rows(const float* g, int64_t gstride, const float* x, int64_t xstride, int64_t rows, int64_t N,
                 float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gi = g + r * gstride;
    const float* xi = x + r * xstride;
    float* o = out + r * N;
    int64_t j = 0;
    for (; j + LANES <= N; j += LANES) store(o + j, silu_mul(load(gi + j), load(xi + j)));
    if (j < N) {  // the row's tail through a padded vector: the same code as every other element
      float tg[LANES] = {}, tx[LANES] = {}, to[LANES];
      std::copy(gi + j, gi + N, tg);
      std::copy(xi + j, xi + N, tx);
      store(to, silu_mul(load(tg), load(tx)));
      std::copy(to, to + (N - j), o + j);
    }
  }
}

// out = x * (1 / sqrt(mean(x^2) + eps)) (* w) over `rows` rows of N (`stride` apart; out row-major); the sum of
// squares in 16 fixed lanes.
void rms_norm_rows(const float* x, int64_t rows, int64_t stride, int64_t N, const float* w, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xi = x + r * stride;
    float* o = out + r * N;
    v16 acc{};
    int64_t j = 0;
    for (; j + LANES <= N; j += LANES) {
      const v16 v = load(xi + j);
      acc += v * v;
    }
    if (j < N) {
      float t[LANES] = {};
      std::copy(xi + j, xi + N, t);
      const v16 v = load(t);
      acc += v * v;
    }
    const float scale = 1.0f / std::sqrt(lane_sum(acc) / static_cast<float>(N) + eps);
    if (w != nullptr)
      for (int64_t k = 0; k < N; ++k) o[k] = xi[k] * scale * w[k];
    else
      for (int64_t k = 0; k < N; ++k) o[k] = xi[k] * scale;
  }
}

// RoPE of x [B, H, R, D] from per-row tables cos, sin [R, dims / 2]: the graph form's products and sums exactly
// (a = x1 cos - x2 sin, b = x1 sin + x2 cos, each product rounded before the sum), columns past dims copied.
#if defined(__clang__)
#define PTP_NO_CONTRACT
#else
#define PTP_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif

PTP_NO_CONTRACT void rope_rows(const float* x, const int64_t* xst, const float* c, const float* s, int64_t cst,
                               int64_t sst, float* o, const int* shape, int dims, bool traditional) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const int B = shape[0], H = shape[1], R = shape[2], D = shape[3], half = dims / 2;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) {
        const float* xr = x + b * xst[0] + h * xst[1] + r * xst[2];
        const float* cr = c + r * cst;
        const float* sr = s + r * sst;
        float* orow = o + ((static_cast<int64_t>(b) * H + h) * R + r) * D;
        for (int i = 0; i < half; ++i) {
          const int i1 = traditional ? 2 * i : i, i2 = traditional ? 2 * i + 1 : half + i;
          const float x1 = xr[i1 * xst[3]], x2 = xr[i2 * xst[3]];
          const float p1 = x1 * cr[i], p2 = x2 * sr[i], p3 = x1 * sr[i], p4 = x2 * cr[i];
          orow[i1] = p1 - p2;
          orow[i2] = p3 + p4;
        }
        for (int j = dims; j < D; ++j) orow[j] = xr[j * xst[3]];
      }
}

}  // namespace ptpcpu

namespace {

using namespace ptp16;
using ptpcpu::CpuPrimitive;
using ptpcpu::rows_of;

class SwiGLU : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

void SwiGLU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_input_array(inputs[1]);
  encoder.set_output_array(out);
  encoder.dispatch([g = mx::array::unsafe_weak_copy(inputs[0]), x = mx::array::unsafe_weak_copy(inputs[1]),
                    op = out.data<float>()]() {
    thread_local std::vector<float> gbuf, xbuf;
    const int64_t N = g.shape(-1);
    const auto gr = rows_of(g, gbuf), xr = rows_of(x, xbuf);
    ptpcpu::swiglu_rows(gr.p, gr.stride, xr.p, xr.stride, gr.rows, N, op);
  });
}

mx::array swiglu(const mx::array& gate, const mx::array& x) {
  if (gate.dtype() != mx::float32 || x.dtype() != mx::float32 || gate.shape() != x.shape() || gate.ndim() == 0)
    throw std::invalid_argument("swiglu: gate and x are float32 arrays of one shape");
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(stream), {gate, x});
}


// out = x * (1 / sqrt(mean(x^2) + eps)) (* w), over the last axis; the sum of squares in 16 fixed lanes.
class RMSNorm : public CpuPrimitive {
 public:
  RMSNorm(mx::Stream stream, float eps, bool weighted) : CpuPrimitive(stream), eps_(eps), weighted_(weighted) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RMSNorm&>(other);
    return eps_ == o.eps_ && weighted_ == o.weighted_;
  }

 private:
  float eps_;
  bool weighted_;
};

void RMSNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  std::optional<mx::array> w;
  if (weighted_) w = mx::array::unsafe_weak_copy(inputs[1]);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), w, op = out.data<float>(), eps = eps_]() {
    thread_local std::vector<float> xbuf, wbuf;
    const int64_t N = x.shape(-1);
    const auto xr = rows_of(x, xbuf);
    const float* wp = w ? rows_of(*w, wbuf).p : nullptr;
    ptpcpu::rms_norm_rows(xr.p, xr.rows, xr.stride, N, wp, eps, op);
  });
}

mx::array rms_norm(const mx::array& x, std::optional<mx::array> weight, float eps) {
  if (x.dtype() != mx::float32 || x.ndim() == 0)
    throw std::invalid_argument("rms_norm: x is a float32 array");
  std::vector<mx::array> inputs = {x};
  if (weight) {
    if (weight->dtype() != mx::float32 || weight->ndim() != 1 || weight->shape(0) != x.shape(-1))
      throw std::invalid_argument("rms_norm: weight is float32 [x.shape[-1]]");
    inputs.push_back(*weight);
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(stream, eps, weight.has_value()),
                   std::move(inputs));
}

class RopeTable : public CpuPrimitive {
 public:
  RopeTable(mx::Stream stream, int dims, bool traditional)
      : CpuPrimitive(stream), dims_(dims), traditional_(traditional) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopeTable&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_;
  }

 private:
  int dims_;
  bool traditional_;
};

void RopeTable::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), c = mx::array::unsafe_weak_copy(inputs[1]),
                    s = mx::array::unsafe_weak_copy(inputs[2]), op = out.data<float>(), dims = dims_,
                    trad = traditional_]() {
    // The tables: [..., R, half] views (of one table for every layer), read as rows in place where they can be.
    thread_local std::vector<float> cbuf, sbuf;
    const auto cr = rows_of(c, cbuf), sr = rows_of(s, sbuf);
    const int shape[4] = {x.shape(0), x.shape(1), x.shape(2), x.shape(3)};
    const int64_t xst[4] = {x.strides()[0], x.strides()[1], x.strides()[2], x.strides()[3]};
    ptpcpu::rope_rows(x.data<float>(), xst, cr.p, sr.p, cr.stride, sr.stride, op, shape, dims, trad);
  });
}

mx::array rope_table(const mx::array& x, const mx::array& cos, const mx::array& sin, int dims, bool traditional) {
  auto bad = [](const char* what) { throw std::invalid_argument(std::string("rope_table: ") + what); };
  if (x.dtype() != mx::float32 || cos.dtype() != mx::float32 || sin.dtype() != mx::float32) bad("float32 operands");
  if (x.ndim() != 4) bad("x is [B, H, rows, D]");
  if (dims % 2 != 0 || dims > x.shape(3) || dims <= 0) bad("dims is even and at most D");
  if (cos.shape() != sin.shape() || cos.shape(-1) != dims / 2 || cos.size() != static_cast<size_t>(x.shape(2)) * (dims / 2))
    bad("cos and sin are [rows, dims / 2]");
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RopeTable>(stream, dims, traditional), {x, cos, sin});
}

}  // namespace

void register_rowwise(nb::module_& m) {
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("x"), "gate / (1 + exp(-gate)) * x, elementwise (float32).");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"),
        "x / sqrt(mean(x^2, -1) + eps) (* weight), float32.");
  m.def("rope_table", &rope_table, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("dims"),
        nb::arg("traditional"), "RoPE of x [B, H, rows, D] from per-row cos and sin [rows, dims / 2] (float32).");
}
