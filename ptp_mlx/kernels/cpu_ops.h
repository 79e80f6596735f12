// What ptp-mlx's CPU primitives share (gated_linear.cpp, linear.cpp, attention.cpp, rowwise.cpp, heads.cpp): a base class for a
// primitive that runs on MLX's CPU stream only, and reading an input that may be a view.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace ptpcpu {

namespace mx = mlx::core;

// A primitive of the CPU stream: its GPU evaluation refuses, and by default its one output has its first input's
// shape.
class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU stream only");
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

// A row-major copy of any float32 view into `dst` (a.size() floats).
inline void dense(const mx::array& a, float* dst) {
  const float* src = a.data<float>();
  const auto& shape = a.shape();
  const auto& st = a.strides();
  const int nd = static_cast<int>(shape.size());
  std::vector<int64_t> idx(nd, 0);
  for (size_t n = 0; n < a.size(); ++n) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[d] * st[d];
    dst[n] = src[off];
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

// A projection group's output shapes: `in` with its last axis each width of `outs` (one output per projection).
inline std::vector<mx::Shape> group_shapes(const mx::Shape& in, const std::vector<int>& outs) {
  std::vector<mx::Shape> shapes;
  for (int n : outs) {
    auto s = in;
    s.back() = n;
    shapes.push_back(s);
  }
  return shapes;
}

// A group's product y [M, sum(outs)] (rows `ld` apart where ld > 0) split into its projections' outputs, each
// its columns, row by row.
inline void scatter_columns(const float* y, int M, const std::vector<int>& outs, const std::vector<float*>& outp,
                            int ld = 0) {
  int N = ld;
  if (N <= 0)
    for (int n : outs) N += n;
  for (size_t p = 0, col = 0; p < outs.size(); col += outs[p], ++p)
    for (int i = 0; i < M; ++i)
      std::memcpy(outp[p] + static_cast<size_t>(i) * outs[p], y + static_cast<size_t>(i) * N + col,
                  sizeof(float) * outs[p]);
}

// A float32 array as rows of its last axis: row r starts at p + r * stride, its elements contiguous.
struct Rows {
  const float* p;
  int64_t rows, stride;
};

// In place where the last axis is contiguous and the other axes collapse into one stride (a slice of rows, a split
// of a fused product); otherwise a row-major copy in `buf`.
inline Rows rows_of(const mx::array& a, std::vector<float>& buf) {
  const int nd = static_cast<int>(a.ndim());
  const int64_t n = nd == 0 ? 1 : a.shape(-1);
  bool in_place = nd > 0 && (n == 1 || a.strides()[nd - 1] == 1);
  int64_t rows = 1, stride = -1, inner = 0;  // inner: the stride one step out of the previous axis kept
  for (int d = nd - 2; d >= 0 && in_place; --d) {
    if (a.shape(d) == 1) continue;
    if (stride < 0)
      stride = a.strides()[d];
    else if (a.strides()[d] != inner)
      in_place = false;
    inner = a.strides()[d] * a.shape(d);
    rows *= a.shape(d);
  }
  if (in_place) return {a.data<float>(), rows, stride < 0 ? n : stride};
  buf.resize(a.size());
  dense(a, buf.data());
  return {buf.data(), static_cast<int64_t>(a.size()) / (n > 0 ? n : 1), n};
}

// cblas_sgemm as resolved in the process's global scope, where ptp_mlx/blas.py placed ptp-sgemm (or MKL) before
// MLX loaded: the same function MLX's own matmuls call. `who` names the caller in the error where there is none.
enum { RowMajor = 101, NoTrans = 111, Trans = 112 };
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                         float*, int);

inline sgemm_fn blas_sgemm(const char* who) {
  static sgemm_fn fn = reinterpret_cast<sgemm_fn>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  if (fn == nullptr) throw std::runtime_error(std::string(who) + ": no cblas_sgemm in the process");
  return fn;
}

// A 4-d array's data and element strides, broadcast dimensions at stride 0 (attention's operands).
struct View4 {
  const char* data;
  int64_t st[4];
};

// `a` as a view of shape `full` (a's axes right-aligned to full's four), its broadcast axes at stride 0.
inline View4 view4(const mx::array& a, const mx::Shape& full) {
  View4 v{a.data<char>(), {0, 0, 0, 0}};
  const int off = 4 - static_cast<int>(a.ndim());
  for (int d = 0; d < static_cast<int>(a.ndim()); ++d)
    v.st[d + off] = a.shape(d) == 1 && full[d + off] != 1 ? 0 : a.strides()[d];
  return v;
}

// The kernels behind the primitives, as functions over memory: each primitive runs one of them, and ptp-block
// (block.cpp) runs them in a layer's order, so a layer computed either way has the same bits.
// rowwise.cpp
void rms_norm_rows(const float* x, int64_t rows, int64_t stride, int64_t N, const float* w, float eps, float* out);
void swiglu_rows(const float* g, int64_t gstride, const float* x, int64_t xstride, int64_t rows, int64_t N,
                 float* out);
void rope_rows(const float* x, const int64_t* xst, const float* c, const float* s, int64_t cst, int64_t sst,
               float* o, const int* shape, int dims, bool traditional);
// attention.cpp: q [B, Hq, L, D], k and v [B, Hkv, S, D] with a contiguous last axis, mask kind mk (0 none, 1
// bool, 2 additive float32); out [B, Hq, L, D] row-major.
void attention_run(const View4& q, const View4& k, const View4& v, const View4& m, int B, int Hq, int L, int D,
                   int Hkv, int S, int mk, float scale, float* out);
// gated_linear.cpp: a group's product (and its LoRA delta on rows whose gate is not zero, when R > 0 and gate is
// given) into y, [M, ld] with the projections in columns [0, N); returns ld.
int group_run(const float* xs, int M, int K, const float* W, int N, int R, const void* B, bool b16,
              const int32_t* spans, const float* gate, const float* bias, std::vector<float>& y);

}  // namespace ptpcpu
