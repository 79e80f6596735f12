// ptp-gated-linear: a fused projection group and its gated LoRA as one MLX primitive on the CPU (issue 41).
//
// A drafting call on a small model costs what its primitives cost: the adapter's LoRA adds a split, a gate
// multiply and an addmm to each of the default model's 120 fused projection groups, and those 240+ small nodes
// made a 1-token + 3-auxiliary-row call cost 1.3 plain steps where the same call without the LoRA costs 1.05
// (docs/results/kernel/rows-2026-12-04.md). This primitive computes one group in one node:
//
//   y[:, :]  = x @ W[:N]^T (+ bias)             the very cblas_sgemm call MLX makes for a plain pass's
//                                               `x @ W[:N].T` (same operands, strides and beta), so every row
//                                               is bit for bit the plain product, whatever BLAS serves it
//   a        = x @ W[N:]^T                      the adapter's stacked A rows (rank R): columns N.. of the
//                                               same call where ptp-sgemm computes it (its columns keep
//                                               their bits whatever the call's width), else a second sgemm
//   y[i, :] += sum_k (a[i, k] * gate[i]) B[k, :]   only on rows whose gate is not zero, only over the
//                                               columns where B's row k is not zero (B is block-diagonal
//                                               over the group's projections: spans[k] = [lo, hi)), B in
//                                               float32 or bfloat16 (the fused model passes bfloat16: half
//                                               the bytes a drafting call reads, widened exactly)
//
// Token rows (gate 0) are never touched after the base product, so they stay exactly a plain pass's rows.
// Only float32 on the CPU stream; Python uses the graph form everywhere else (ptp_mlx/model/fused.py).
// cblas_sgemm is resolved in the process's global scope, where ptp_mlx/blas.py placed ptp-sgemm (or MKL)
// before MLX loaded: the same function MLX's own matmuls call.

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
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
#include "simd16.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

using ptpcpu::NoTrans;
using ptpcpu::RowMajor;
using ptpcpu::Trans;

// B's values as floats, 16 at a time: float32 as they are, bfloat16 (the high half of a float32) widened exactly.
inline ptp16::v16 wide16(const float* p) { return ptp16::load(p); }
inline ptp16::v16 wide16(const uint16_t* p) {
  typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));
  const ptp16::i16 w = __builtin_convertvector(*reinterpret_cast<const h16*>(p), ptp16::i16) << 16;
  return reinterpret_cast<const ptp16::v16&>(w);
}
inline float wide1(float v) { return v; }
inline float wide1(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// y[i, lo:hi] += sum_k (a[i, k] * gate[i]) B[k, lo:hi] on rows whose gate is not zero (token rows untouched),
// k in order, for each block of ranks that share one span (a projection's block of B). Per 16 columns, up to 16
// of the block's B vectors stay in registers while every auxiliary row takes its multiply-adds: B is read once
// a call, and the adds run at the FMA rate.
template <typename T>
struct Delta {
  int R, N, la, ld, n;
  const float *gp, *ap;
  const T* Bp;
  const int32_t* sp;
  float* yp;
  const int* rows;  // the n rows whose gate is not zero
};

// Columns [0, cut) of every span (part 0) or [cut, N) (part 1): each column belongs to one part whatever span
// covers it (a rank row's span is where it is not zero, so spans of one projection may differ at their edges),
// so the two parts never write one element, and each element's sum runs over the blocks in the same order.
template <typename T>
void delta_part(const Delta<T>& J, int part, int cut) {
  using ptp16::v16;
  float s[16 * 64];  // (a * gate) for up to 16 ranks of up to 64 rows (more rows: in slices)
  for (int k0 = 0, k1; k0 < J.R; k0 = k1) {
    const int lo = J.sp[2 * k0], hi = J.sp[2 * k0 + 1];
    for (k1 = k0 + 1; k1 < J.R && k1 - k0 < 16 && J.sp[2 * k1] == lo && J.sp[2 * k1 + 1] == hi; ++k1) {
    }
    const int nk = k1 - k0;
    const int a = part == 0 ? lo : std::max(lo, cut), b = part == 0 ? std::min(hi, cut) : hi;
    if (a >= b) continue;
    for (int r0 = 0; r0 < J.n; r0 += 64) {
      const int nr = std::min(64, J.n - r0);
      for (int r = 0; r < nr; ++r) {
        const int row = J.rows[r0 + r];
        for (int k = 0; k < nk; ++k) s[r * nk + k] = J.ap[static_cast<size_t>(row) * J.la + k0 + k] * J.gp[row];
      }
      int j = a;
      for (; j + 16 <= b; j += 16) {
        v16 w[16];
        for (int k = 0; k < nk; ++k) w[k] = wide16(J.Bp + static_cast<size_t>(k0 + k) * J.N + j);
        for (int r = 0; r < nr; ++r) {
          float* yr = J.yp + static_cast<size_t>(J.rows[r0 + r]) * J.ld + j;
          const float* sr = s + r * nk;
          v16 acc = ptp16::load(yr);
          for (int k = 0; k < nk; ++k) acc += ptp16::splat(sr[k]) * w[k];
          ptp16::store(yr, acc);
        }
      }
      for (; j < b; ++j)
        for (int r = 0; r < nr; ++r) {
          float* yr = J.yp + static_cast<size_t>(J.rows[r0 + r]) * J.ld + j;
          for (int k = 0; k < nk; ++k) *yr += s[r * nk + k] * wide1(J.Bp[static_cast<size_t>(k0 + k) * J.N + j]);
        }
    }
  }
}

// fn(ctx, i) for i in [0, n) on ptp-sgemm's second thread too, where that library is loaded and
// PTP_MLX_DELTA_THREADS is not 1 (read per call: tests compare both).
typedef int (*parallel_fn)(void (*)(void*, int), void*, int);
parallel_fn delta_parallel() {
  static parallel_fn fn = reinterpret_cast<parallel_fn>(dlsym(RTLD_DEFAULT, "ptp_sgemm_parallel"));
  const char* one = std::getenv("PTP_MLX_DELTA_THREADS");
  return one != nullptr && one[0] == '1' && one[1] == '\0' ? nullptr : fn;
}

// Both halves of the columns (split at a multiple of 16 near N / 2) at once on ptp-sgemm's two threads (the other
// one otherwise waits for this pass: B streams from memory, about 5 MB a call on the default model), or both in
// turn on this one: the same sums either way.
template <typename T>
void add_delta(int M, int R, int N, const float* gp, const float* ap, int la, const T* Bp, const int32_t* sp,
               float* yp, int ld) {
  thread_local std::vector<int> rows;
  rows.clear();
  for (int i = 0; i < M; ++i)
    if (gp[i] != 0.0f) rows.push_back(i);
  Delta<T> J{R, N, la, ld, static_cast<int>(rows.size()), gp, ap, Bp, sp, yp, rows.data()};
  parallel_fn par = delta_parallel();
  auto run = [](void* ctx, int u) {
    const Delta<T>& D = *static_cast<const Delta<T>*>(ctx);
    delta_part(D, u, D.N / 32 * 16);
  };
  if (par != nullptr)
    par(run, &J, 2);
  else
    for (int u = 0; u < 2; ++u) run(&J, u);
}

}  // namespace

// The group's product, and with a gate and R > 0 its LoRA delta on rows whose gate is not zero, into y [M, ld]:
// the projections in columns [0, N), the A rows' columns after them when they joined the call. Returns ld.
int ptpcpu::group_run(const float* xs, int M, int K, const float* Wp, int N, int R, const void* Bp, bool b16,
                      const int32_t* sp, const float* gp, const float* bias, std::vector<float>& y) {
  thread_local std::vector<float> abuf;
  bool any = false;
  for (int i = 0; gp != nullptr && i < M && !any; ++i) any = gp[i] != 0.0f;
  ptpcpu::sgemm_fn sgemm = ptpcpu::blas_sgemm("ptp-gated-linear");
  // With auxiliary rows and ptp-sgemm computing the product itself, the adapter's A rows (stored right after
  // W[:N]) join the projection's call: each column of that kernel's product is the same whatever other columns
  // the call has, so y's columns keep their bits, and A streams with W on both threads instead of in a cold
  // one-thread call of its own (30 layers x 4 groups of them: about 1 ms of an 8-row call, 2026-12-05).
  typedef int (*takes_fn)(int);
  static takes_fn takes = reinterpret_cast<takes_fn>(dlsym(RTLD_DEFAULT, "ptp_sgemm_takes_nt"));
  const bool fold = any && R > 0 && takes != nullptr && takes(M) != 0;
  const int ld = fold ? N + R : N;  // y's row stride (y and a side by side when folded)
  y.resize(static_cast<size_t>(M) * ld);
  float* yp = y.data();
  if (bias != nullptr)
    for (int i = 0; i < M; ++i) {
      std::memcpy(yp + static_cast<size_t>(i) * ld, bias, sizeof(float) * N);
      if (fold) std::fill(yp + static_cast<size_t>(i) * ld + N, yp + static_cast<size_t>(i) * ld + ld, 0.0f);
    }
  // Exactly MLX's call for a plain pass's `x @ W[:N].T` (or addmm with the bias copied into the output), with
  // the A rows' columns after it when folded.
  sgemm(RowMajor, NoTrans, Trans, M, fold ? N + R : N, K, 1.0f, xs, K, Wp, K, bias != nullptr ? 1.0f : 0.0f, yp, ld);
  if (!any || R == 0) return ld;
  const float* ap = yp + N;  // a = x @ W[N:]^T, rows `la` apart
  int la = ld;
  if (!fold) {
    abuf.resize(static_cast<size_t>(M) * R);
    sgemm(RowMajor, NoTrans, Trans, M, R, K, 1.0f, xs, K, Wp + static_cast<size_t>(N) * K, K, 0.0f, abuf.data(), R);
    ap = abuf.data(), la = R;
  }
  // The delta, rank block by rank block (ranks that share a span: one projection's block of B, read once
  // for every auxiliary row while it stays in cache), each auxiliary row's columns summed over k in order.
  if (b16)
    add_delta(M, R, N, gp, ap, la, reinterpret_cast<const uint16_t*>(Bp), sp, yp, ld);
  else
    add_delta(M, R, N, gp, ap, la, reinterpret_cast<const float*>(Bp), sp, yp, ld);
  return ld;
}

namespace {

class GatedLinear : public ptpcpu::CpuPrimitive {
 public:
  GatedLinear(mx::Stream stream, std::vector<int> outs, bool has_bias)
      : CpuPrimitive(stream), outs_(std::move(outs)), bias_(has_bias) {
    for (int n : outs_) out_ += n;
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPGatedLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GatedLinear&>(other);
    return outs_ == o.outs_ && bias_ == o.bias_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return ptpcpu::group_shapes(inputs[0].shape(), outs_);
  }

 private:
  std::vector<int> outs_;
  int out_ = 0;
  bool bias_;
};

void GatedLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];      // [..., K]
  const mx::array& W = inputs[1];      // [N + R, K], row-contiguous
  const mx::array& B = inputs[2];      // [R, N] float32 or bfloat16, row-contiguous, scale folded in
  const mx::array& gate = inputs[3];   // M floats
  const mx::array& spans = inputs[4];  // [R, 2] int32: B row k is zero outside [lo, hi)

  const int K = x.shape(-1), N = out_, R = B.shape(0);
  const int M = static_cast<int>(x.size() / K);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  std::vector<float*> outp;
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
    outp.push_back(o.data<float>());
  }

  // The constants (W, B, spans, bias) are the group's own evaluated matrices; x and gate come from the graph
  // and are gathered when they are views.
  for (size_t n = 1; n < inputs.size(); ++n)
    if (n != 3 && !inputs[n].flags().row_contiguous)
      throw std::invalid_argument("gated_linear: W, B, spans and bias must be row-contiguous");
  const float* bias = bias_ ? inputs[5].data<float>() : nullptr;
  encoder.dispatch([x = mx::array::unsafe_weak_copy(x), gate = mx::array::unsafe_weak_copy(gate),
                    Wp = W.data<float>(), Bp = B.data<void>(), b16 = B.dtype() == mx::bfloat16,
                    sp = spans.data<int32_t>(), bias, outp, outs = outs_, M, N, K, R]() {
    thread_local std::vector<float> xbuf, gbuf, ybuf;
    const float* xs = x.data<float>();
    if (!x.flags().row_contiguous) {
      xbuf.resize(static_cast<size_t>(M) * K);
      ptpcpu::dense(x, xbuf.data());
      xs = xbuf.data();
    }
    const float* gp = gate.data<float>();
    if (!gate.flags().row_contiguous) {
      gbuf.resize(M);
      ptpcpu::dense(gate, gbuf.data());
      gp = gbuf.data();
    }
    const int ld = ptpcpu::group_run(xs, M, K, Wp, N, R, Bp, b16, sp, gp, bias, ybuf);
    ptpcpu::scatter_columns(ybuf.data(), M, outs, outp, ld);
  });
}

std::vector<mx::array> gated_linear_parts(const mx::array& x, const mx::array& W, const mx::array& B,
                                          const mx::array& gate, const mx::array& spans, const std::vector<int>& outs,
                                          std::optional<mx::array> bias) {
  auto check = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("gated_linear: ") + what);
  };
  const int K = x.shape(-1);
  int out = 0;
  for (int n : outs) {
    check(n > 0, "every output width is positive");
    out += n;
  }
  check(!outs.empty(), "at least one output");
  check(x.dtype() == mx::float32 && W.dtype() == mx::float32 &&
            (B.dtype() == mx::float32 || B.dtype() == mx::bfloat16) && gate.dtype() == mx::float32 &&
            spans.dtype() == mx::int32,
        "float32 operands (B float32 or bfloat16) and int32 spans");
  check(W.ndim() == 2 && W.shape(1) == K && W.shape(0) >= out, "W is [out + rank, in]");
  check(B.ndim() == 2 && B.shape(1) == out && W.shape(0) == out + B.shape(0), "B is [rank, out]");
  check(static_cast<int64_t>(gate.size()) * K == static_cast<int64_t>(x.size()), "one gate per row of x");
  check(spans.size() == 2 * static_cast<size_t>(B.shape(0)), "spans is [rank, 2]");
  if (bias) check(bias->dtype() == mx::float32 && bias->size() == static_cast<size_t>(out), "bias is [out]");
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {x, W, B, gate, spans};
  if (bias) inputs.push_back(*bias);
  return mx::array::make_arrays(ptpcpu::group_shapes(x.shape(), outs), std::vector<mx::Dtype>(outs.size(), mx::float32),
                                std::make_shared<GatedLinear>(stream, outs, bias.has_value()), std::move(inputs));
}

mx::array gated_linear(const mx::array& x, const mx::array& W, const mx::array& B, const mx::array& gate,
                       const mx::array& spans, int out, std::optional<mx::array> bias) {
  return gated_linear_parts(x, W, B, gate, spans, {out}, std::move(bias))[0];
}

}  // namespace

void register_attention(nb::module_& m);  // attention.cpp
void register_rowwise(nb::module_& m);    // rowwise.cpp
void register_heads(nb::module_& m);      // heads.cpp
void register_linear(nb::module_& m);     // linear.cpp
void register_block(nb::module_& m);      // block.cpp
void register_picks(nb::module_& m);      // picks.cpp

NB_MODULE(_ptp_cpu_ops, m) {
  m.doc() = "ptp-mlx's CPU primitives: a fused projection group (plain, or with its gated LoRA), a layer's attention, SwiGLU, RMS norm, table RoPE and the auxiliary rows' head, a whole decoder layer, the sampler's passes over a row";
  register_attention(m);
  register_rowwise(m);
  register_heads(m);
  register_linear(m);
  register_block(m);
  register_picks(m);
  m.def("gated_linear", &gated_linear, nb::arg("x"), nb::arg("W"), nb::arg("B"), nb::arg("gate"),
        nb::arg("spans"), nb::arg("out"), nb::arg("bias") = nb::none(),
        "y = x @ W[:out].T (+ bias), plus (x @ W[out:].T * gate) @ B on rows whose gate is not zero.");
  m.def("gated_linear_parts", &gated_linear_parts, nb::arg("x"), nb::arg("W"), nb::arg("B"), nb::arg("gate"),
        nb::arg("spans"), nb::arg("outs"), nb::arg("bias") = nb::none(),
        "gated_linear's output as one array per projection (widths `outs`), each its columns of the group's.");
}
