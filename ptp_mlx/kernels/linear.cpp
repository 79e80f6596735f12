// ptp-linear: a fused projection group of a plain pass (q|k|v, gate|up, o, down, the tied head) as one MLX
// primitive on the CPU, with one output per projection.
//
// Why: MLX computes `x @ W.T` for x [B, L, K] as three nodes (Flatten, Matmul, Unflatten) and the group's parts
// as a fourth (Split), and on MLX's CPU backend every node costs a few microseconds on the stream thread and on the
// thread that replays the compiled graph, whatever its size (docs/results/kernel/nodes-2026-12-04.md): in a plain
// step they were 302 of its 1011 nodes. Here the group is one node.
//
// Every row is bit for bit MLX's own product: the very cblas_sgemm call MLX makes for `x @ W[:N].T` (RowMajor,
// NoTrans, Trans, lda = ldb = K, beta 0), or for `addmm(bias, x, W[:N].T)` (the bias broadcast into the output,
// beta 1), into one [M, N] buffer; the projections' columns are then copied out.

#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "cpu_ops.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

using ptpcpu::NoTrans;
using ptpcpu::RowMajor;
using ptpcpu::Trans;

class Linear : public ptpcpu::CpuPrimitive {
 public:
  Linear(mx::Stream stream, std::vector<int> outs, bool has_bias)
      : CpuPrimitive(stream), outs_(std::move(outs)), bias_(has_bias) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Linear&>(other);
    return outs_ == o.outs_ && bias_ == o.bias_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return ptpcpu::group_shapes(inputs[0].shape(), outs_);
  }

 private:
  std::vector<int> outs_;
  bool bias_;
};

void Linear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];  // [..., K]
  const mx::array& W = inputs[1];  // [>= N, K], row-contiguous
  if (!W.flags().row_contiguous || (bias_ && !inputs[2].flags().row_contiguous))
    throw std::invalid_argument("linear: W and bias must be row-contiguous");
  int N = 0;
  for (int n : outs_) N += n;
  const int K = x.shape(-1);
  const int M = static_cast<int>(x.size() / K);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  std::vector<float*> outp;
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
    outp.push_back(o.data<float>());
  }
  encoder.dispatch([x = mx::array::unsafe_weak_copy(x), Wp = W.data<float>(),
                    bias = bias_ ? inputs[2].data<float>() : nullptr, outp, outs = outs_, M, N, K]() {
    thread_local std::vector<float> xbuf, ybuf;
    const float* xs = x.data<float>();
    if (!x.flags().row_contiguous) {
      xbuf.resize(static_cast<size_t>(M) * K);
      ptpcpu::dense(x, xbuf.data());
      xs = xbuf.data();
    }
    // One projection: straight into its output; several: into one buffer, then each one's columns.
    float* y = outs.size() == 1 ? outp[0] : (ybuf.resize(static_cast<size_t>(M) * N), ybuf.data());
    if (bias != nullptr)
      for (int i = 0; i < M; ++i) std::memcpy(y + static_cast<size_t>(i) * N, bias, sizeof(float) * N);
    const ptpcpu::sgemm_fn sgemm = ptpcpu::blas_sgemm("ptp-linear");
    sgemm(RowMajor, NoTrans, Trans, M, N, K, 1.0f, xs, K, Wp, K, bias != nullptr ? 1.0f : 0.0f, y, N);
    if (outs.size() > 1) ptpcpu::scatter_columns(y, M, outs, outp);
  });
}

std::vector<mx::array> linear(const mx::array& x, const mx::array& W, const std::vector<int>& outs,
                              std::optional<mx::array> bias) {
  auto check = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("linear: ") + what);
  };
  int N = 0;
  for (int n : outs) {
    check(n > 0, "every output width is positive");
    N += n;
  }
  check(!outs.empty(), "at least one output");
  check(x.dtype() == mx::float32 && W.dtype() == mx::float32, "float32 operands");
  check(x.ndim() >= 1 && W.ndim() == 2 && W.shape(1) == x.shape(-1) && W.shape(0) >= N, "W is [>= sum(outs), in]");
  if (bias) check(bias->dtype() == mx::float32 && bias->size() == static_cast<size_t>(N), "bias is [sum(outs)]");
  std::vector<mx::array> inputs = {x, W};
  if (bias) inputs.push_back(*bias);
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays(ptpcpu::group_shapes(x.shape(), outs), std::vector<mx::Dtype>(outs.size(), mx::float32),
                                std::make_shared<Linear>(stream, outs, bias.has_value()), std::move(inputs));
}

}  // namespace

void register_linear(nb::module_& m) {
  m.def("linear", &linear, nb::arg("x"), nb::arg("W"), nb::arg("outs"), nb::arg("bias") = nb::none(),
        "[x @ W[a:b].T (+ bias[a:b]) for each projection's rows a:b of W, widths `outs`], every row bit for bit "
        "MLX's product of the group (`x @ W[:sum(outs)].T`, or addmm with the bias).");
}
