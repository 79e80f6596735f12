// ptp-swiglu: SwiGLU's `silu(gate) * x` as one MLX primitive on the CPU (issue 41).
//
// Why: the graph form of `gate / (1 + exp(-gate)) * x`, with ptp-mlx's fast exp (ptp_mlx/fused_exp.py), is seven
// nodes a layer (five fused kernels around two bit casts); on MLX's CPU backend a node costs about 5 us on the
// stream thread and about as much on the thread that replays the compiled graph, whatever its size. Here it is
// one node. Every element is computed by the same 16-lane code (a row's tail through a padded vector), so an
// element's bits never depend on its position, the rows around it or how many there are.

#include <algorithm>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "simd16.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

using namespace ptp16;

inline v16 silu_mul(v16 g, v16 x) { return g / (1.0f + exp16(-g)) * x; }

// An array as rows of its last axis: (rows, row stride) when its other axes collapse into one stride and its last
// axis is contiguous; rows = -1 otherwise.
std::pair<int64_t, int64_t> as_rows(const mx::array& a) {
  const int nd = static_cast<int>(a.ndim());
  const int64_t n = a.shape(-1);
  if (n > 1 && a.strides()[nd - 1] != 1) return {-1, 0};
  int64_t rows = 1, stride = -1, inner = 0;  // inner: the stride one step out of the previous axis kept
  for (int d = nd - 2; d >= 0; --d) {
    if (a.shape(d) == 1) continue;
    if (stride < 0)
      stride = a.strides()[d];
    else if (a.strides()[d] != inner)
      return {-1, 0};
    inner = a.strides()[d] * a.shape(d);
    rows *= a.shape(d);
  }
  return {rows, stride < 0 ? n : stride};
}

void dense(const mx::array& a, std::vector<float>& buf) {  // a row-major copy of any view
  const float* src = a.data<float>();
  const auto& shape = a.shape();
  const auto& st = a.strides();
  const int nd = static_cast<int>(shape.size());
  buf.resize(a.size());
  std::vector<int64_t> idx(nd, 0);
  for (size_t n = 0; n < a.size(); ++n) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[d] * st[d];
    buf[n] = src[off];
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

class SwiGLU : public mx::Primitive {
 public:
  explicit SwiGLU(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("ptp-swiglu runs on the CPU stream only");
  }
  const char* name() const override { return "PTPSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
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
    auto [gr, gs] = as_rows(g);
    auto [xr, xs] = as_rows(x);
    const float* gp = g.data<float>();
    const float* xp = x.data<float>();
    if (gr < 0) {
      dense(g, gbuf);
      gp = gbuf.data(), gs = N, gr = static_cast<int64_t>(g.size()) / std::max<int64_t>(N, 1);
    }
    if (xr < 0) {
      dense(x, xbuf);
      xp = xbuf.data(), xs = N, xr = static_cast<int64_t>(x.size()) / std::max<int64_t>(N, 1);
    }
    for (int64_t r = 0; r < gr; ++r) {
      const float* gi = gp + r * gs;
      const float* xi = xp + r * xs;
      float* o = op + r * N;
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
  });
}

mx::array swiglu(const mx::array& gate, const mx::array& x) {
  if (gate.dtype() != mx::float32 || x.dtype() != mx::float32 || gate.shape() != x.shape() || gate.ndim() == 0)
    throw std::invalid_argument("swiglu: gate and x are float32 arrays of one shape");
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(stream), {gate, x});
}

}  // namespace

void register_swiglu(nb::module_& m) {
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("x"), "gate / (1 + exp(-gate)) * x, elementwise (float32).");
}
