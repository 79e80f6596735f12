// ptp-attention: one decode pass's attention of one layer as one MLX primitive on the CPU (issue 41).
//
// Why: on MLX's CPU backend every node of a call's graph costs about 5 us on the stream thread, and about as much
// again on the thread that replays the compiled graph, whatever its size (docs/results/kernel/nodes-2026-12-04.md).
// Attention over our K/V state was ~25 of them a layer: the scaled queries, two batched matmuls, the mask's add,
// and the softmax's max, exp (five fused kernels around two bit casts), sum and divide, with the reshapes and
// broadcasts between. Here it is one node, and its work skips the keys a row does not see (the rest of the
// fixed-capacity bucket), which the graph form computes and masks.
//
// For every batch b, query head h and row l (key/value head h / (Hq / Hkv)):
//   visible = the keys s whose mask entry is true (bool) or not -inf (additive), in increasing s
//   score_s = dot(q * scale, k_s) (+ mask_s when additive)        over visible s
//   p_s     = exp(score_s - max score) / sum of those exps
//   out     = sum_s p_s v_s                                       in increasing s
// Each row's result depends only on its own query, its visible keys' K/V and their order: never on how many rows
// the pass has, where the row sits, or at which slots of the buffer its keys are (a tree strand's ancestors sit
// elsewhere than a plain step's, with the same values in the same order). So a k-row pass is k one-row passes,
// bit for bit. Reductions run in 16 fixed lanes (simd16.h), the exponential is MLX's CPU algorithm (2^round(x log2 e)
// through the exponent bits, the fraction by a degree-6 polynomial).

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <cstdlib>
#include <type_traits>
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

namespace {

using namespace ptp16;
constexpr int RB = 4;  // query rows computed together (8 accumulator vectors)

using ptpcpu::View4;  // a 4-d array's data and element strides, broadcast dimensions at stride 0
using ptpcpu::view4;


// q, k or v with a contiguous last axis as it is; the rare other view copied into ``buf`` (row-major).
View4 dense_last(const mx::array& a, std::vector<float>& buf) {
  if (a.strides()[3] == 1 || a.shape(3) == 1) return view4(a, a.shape());
  buf.resize(a.size());
  ptpcpu::dense(a, buf.data());
  const int64_t S3 = a.shape(3), S2 = a.shape(2) * S3, S1 = a.shape(1) * S2;
  return View4{reinterpret_cast<const char*>(buf.data()), {S1, S2, S3, 1}};
}

class Attention : public ptpcpu::CpuPrimitive {
 public:
  Attention(mx::Stream stream, float scale, int mask_kind)
      : CpuPrimitive(stream), scale_(scale), mask_kind_(mask_kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && mask_kind_ == o.mask_kind_;
  }

 private:
  float scale_;
  int mask_kind_;  // 0: none (causal is built by the caller), 1: bool, 2: additive float32
};

// One call's attention, shared by the units that compute it (``unit``): the rows' visible keys, found first.
struct Job {
  int B, Hq, L, D, Hkv, S, rep, R, Sp, blocks, mk;
  View4 qv, kv, vv, mv;
  float scale;
  float* op;
  std::vector<const int*> vrow;  // per (b, g, r) [(b * Hkv + g) * R + r]: the row's visible keys, in order
  std::vector<int> nvis;         // and how many
  std::vector<int> send;         // per (b, g): the end of the keys any of its rows sees
  int (*nt)(int, int, int, const float*, long, const float*, long, float*, long);  // ptp_sgemm_nt, or null
};

// Rows [r0, r0 + RB) of key/value head g in batch b (u = (b * Hkv + g) * blocks + r0 / RB): every number a row
// gets depends on its own query and visible keys only, so the units may run on any thread in any order.
void unit(const Job& J, int u) {
  const int B = J.B, Hq = J.Hq, L = J.L, D = J.D, Hkv = J.Hkv, rep = J.rep, R = J.R, Sp = J.Sp, mk = J.mk;
  (void)B;
  const int bg = u / J.blocks, r0 = (u % J.blocks) * RB, b = bg / Hkv, g = bg % Hkv;
  const View4 &qv = J.qv, &kv = J.kv, &vv = J.vv, &mv = J.mv;
  const float scale = J.scale;
  float* op = J.op;
  const float* Q = reinterpret_cast<const float*>(qv.data);
  const float* K = reinterpret_cast<const float*>(kv.data);
  const float* V = reinterpret_cast<const float*>(vv.data);
  const int* const* vrow = J.vrow.data() + static_cast<size_t>(bg) * R;
  const int* nvis = J.nvis.data() + static_cast<size_t>(bg) * R;
  const int send = J.send[bg];
  const int KB = 2 * LANES;  // output columns a row block holds per pass
  const float ninf = -std::numeric_limits<float>::infinity();
  thread_local std::vector<float> qs, sc, c, pf;  // (each thread its own)
  qs.assign(static_cast<size_t>(RB) * D, 0.0f);
  sc.resize(static_cast<size_t>(RB) * Sp);
  c.resize(J.S + LANES);
  pf.resize(static_cast<size_t>(RB) * Sp);
  const float* kb = K + b * kv.st[0] + g * kv.st[1];
  const float* vb = V + b * vv.st[0] + g * vv.st[1];
  {
    const int nr = R - r0 < RB ? R - r0 : RB;
    for (int i = 0; i < RB; ++i) {
      float* qd = qs.data() + static_cast<size_t>(i) * D;
      if (i >= nr) {
        std::fill(qd, qd + D, 0.0f);
        continue;
      }
      const int h = g * rep + (r0 + i) / L, l = (r0 + i) % L;
      const float* qr = Q + b * qv.st[0] + h * qv.st[1] + l * qv.st[2];
      for (int d = 0; d < D; ++d) qd[d] = qr[d] * scale;
    }
    // Scores of keys [0, send): 16 keys at a time, each key's products in 16 lanes over d (chunks in order),
    // the lanes summed by one fixed tree (sum16) that also gathers the 16 keys' scores into one vector. A
    // key's score depends on nothing else: not its slot, its block or the rows beside it. K is read once
    // per block of rows, in place (no copy).
    if (J.nt != nullptr && kv.st[3] == 1 && J.nt(nr, send, D, qs.data(), D, kb, kv.st[2], sc.data(), Sp)) {
      // the scores by ptp-sgemm's A B^T kernel (tiles of rows x keys; each score one accumulator over d in
      // order and one fixed sum tree, whatever the rows: the same bits at every width)
    } else for (int s0 = 0; s0 < send; s0 += LANES) {
      const float* kr[LANES];
      for (int t = 0; t < LANES; ++t) kr[t] = kb + std::min(s0 + t, send - 1) * kv.st[2];  // (the tail: repeats)
      for (int i = 0; i < nr; ++i) {
        const float* qd = qs.data() + static_cast<size_t>(i) * D;
        v16 x[LANES] = {};
        int d = 0;
        for (; d + LANES <= D; d += LANES) {
          const v16 qv16 = load(qd + d);
          for (int t = 0; t < LANES; ++t) x[t] += qv16 * load(kr[t] + d);
        }
        if (d < D) {  // a head size that is not a multiple of 16: the last chunk through padded copies
          float tq[LANES] = {}, tk[LANES] = {};
          std::copy(qd + d, qd + D, tq);
          const v16 qv16 = load(tq);
          for (int t = 0; t < LANES; ++t) {
            std::copy(kr[t] + d, kr[t] + D, tk);
            x[t] += qv16 * load(tk);
          }
        }
        store(sc.data() + static_cast<size_t>(i) * Sp + s0, sum16(x));
      }
    }
    // Per row: the visible scores packed in order (padded with -inf to whole vectors), their softmax in
    // lanes, then the probabilities spread back over the keys (zero where the row does not see).
    for (int i = 0; i < RB; ++i) {
      float* p = pf.data() + static_cast<size_t>(i) * Sp;
      std::fill(p, p + send, 0.0f);
      if (i >= nr) continue;
      const int r = r0 + i, n = nvis[r];
      const int* vr = vrow[r];
      if (n == 0) continue;
      const float* si = sc.data() + static_cast<size_t>(i) * Sp;
      // visible keys in one run (a causal prefix): gathered and scattered as vectors, the same values
      const bool run = vr[n - 1] - vr[0] == n - 1;
      const int v0 = vr[0];
      if (mk == 2) {
        const int h = g * rep + r / L, l = r % L;
        const float* mr = reinterpret_cast<const float*>(mv.data) + b * mv.st[0] + h * mv.st[1] + l * mv.st[2];
        if (run && mv.st[3] == 1)
          for (int j = 0; j < n; ++j) c[j] = si[v0 + j] + mr[v0 + j];
        else
          for (int j = 0; j < n; ++j) c[j] = si[vr[j]] + mr[vr[j] * mv.st[3]];
      } else if (run) {
        std::copy(si + v0, si + v0 + n, c.data());
      } else {
        for (int j = 0; j < n; ++j) c[j] = si[vr[j]];
      }
      const int np = (n + LANES - 1) / LANES * LANES;
      for (int j = n; j < np; ++j) c[j] = ninf;
      v16 mx16 = splat(ninf);
      for (int j = 0; j < np; j += LANES) {
        const v16 x = load(c.data() + j);
        mx16 = x > mx16 ? x : mx16;
      }
      float m = ninf;
      for (int j = 0; j < LANES; ++j) m = mx16[j] > m ? mx16[j] : m;
      v16 sum{};
      for (int j = 0; j < np; j += LANES) {
        const v16 e = exp16(load(c.data() + j) - m);  // the padding: exp(-inf) = 0
        store(c.data() + j, e);
        sum += e;
      }
      const float inv = 1.0f / lane_sum(sum);
      if (run)
        for (int j = 0; j < n; ++j) p[v0 + j] = c[j] * inv;
      else
        for (int j = 0; j < n; ++j) p[vr[j]] = c[j] * inv;
    }
    // Output: for each column block, the sum over keys in order; a key no row of the block sees is skipped
    // (for the others its probability is zero: adding 0 * v changes no bit).
    int lo = send, hi = 0;
    for (int i = 0; i < nr; ++i) {
      const int r = r0 + i, n = nvis[r];
      if (n == 0) continue;
      const int* vr = vrow[r];
      lo = vr[0] < lo ? vr[0] : lo;
      hi = vr[n - 1] + 1 > hi ? vr[n - 1] + 1 : hi;
    }
    float* ob[RB];
    for (int i = 0; i < RB; ++i) {
      const int r = r0 + (i < nr ? i : 0), h = g * rep + r / L, l = r % L;
      ob[i] = op + ((static_cast<int64_t>(b) * Hq + h) * L + l) * D;
    }
    int d0 = 0;
    // Column blocks of NV vectors: a head of 64 in one pass over the keys (16 accumulators), else 32 at a time.
    // Each element is the same FMA chain over the keys in order whatever the block, so the block changes no bit.
    auto columns = [&](auto nv) {
      constexpr int NV = decltype(nv)::value;
      v16 a[RB][NV] = {};
      for (int s = lo; s < hi; ++s) {
        bool any = false;
        for (int i = 0; i < RB; ++i) any |= pf[static_cast<size_t>(i) * Sp + s] != 0.0f;
        if (!any) continue;
        const float* vs = vb + s * vv.st[2] + d0;
        v16 vj[NV];
        for (int j = 0; j < NV; ++j) vj[j] = load(vs + j * LANES);
        for (int i = 0; i < RB; ++i) {
          const v16 pi = splat(pf[static_cast<size_t>(i) * Sp + s]);
          for (int j = 0; j < NV; ++j) a[i][j] += pi * vj[j];
        }
      }
      for (int i = 0; i < nr; ++i)
        for (int j = 0; j < NV; ++j) store(ob[i] + d0 + j * LANES, a[i][j]);
      d0 += NV * LANES;
    };
    while (d0 + 2 * KB <= D) columns(std::integral_constant<int, 4>{});
    while (d0 + KB <= D) columns(std::integral_constant<int, 2>{});
    for (; d0 < D; ++d0) {  // columns past the last whole block
      for (int i = 0; i < nr; ++i) {
        float a0 = 0.0f;
        for (int s = lo; s < hi; ++s)  // fused explicitly: however this loop is compiled, one rounding a term
          a0 = std::fma(pf[static_cast<size_t>(i) * Sp + s], vb[s * vv.st[2] + d0], a0);
        ob[i][d0] = a0;
      }
    }
    for (int i = 0; i < nr; ++i)
      if (nvis[r0 + i] == 0)  // a row that sees nothing: the graph form's softmax gives NaN
        std::fill(ob[i], ob[i] + D, std::numeric_limits<float>::quiet_NaN());
  }
}

// fn(ctx, i) for i in [0, n) on ptp-sgemm's second thread too (ptp_sgemm_parallel), where that library is loaded
// and PTP_MLX_ATTENTION_THREADS is not 1 (read per call: tests compare both).
typedef int (*parallel_fn)(void (*)(void*, int), void*, int);
parallel_fn parallel() {
  static parallel_fn fn = reinterpret_cast<parallel_fn>(dlsym(RTLD_DEFAULT, "ptp_sgemm_parallel"));
  const char* one = std::getenv("PTP_MLX_ATTENTION_THREADS");
  return one != nullptr && std::string(one) == "1" ? nullptr : fn;
}

// ptp-sgemm's A B^T kernel for the scores, where that library is loaded and PTP_MLX_ATTENTION_SCORES is not 0.
typedef int (*nt_fn)(int, int, int, const float*, long, const float*, long, float*, long);
nt_fn score_kernel() {
  static nt_fn fn = reinterpret_cast<nt_fn>(dlsym(RTLD_DEFAULT, "ptp_sgemm_nt"));
  const char* off = std::getenv("PTP_MLX_ATTENTION_SCORES");
  return off != nullptr && std::string(off) == "0" ? nullptr : fn;
}

}  // namespace

void ptpcpu::attention_run(const View4& q, const View4& k, const View4& v, const View4& m, int B_, int Hq, int L_,
                           int D, int Hkv_, int S_, int mk, float scale, float* op) {
  thread_local std::vector<int> vis, nscan;
  thread_local Job J;
  J.B = B_, J.Hq = Hq, J.L = L_, J.D = D;
  J.Hkv = Hkv_, J.S = S_, J.rep = J.Hq / J.Hkv, J.mk = mk, J.scale = scale, J.op = op;
  J.nt = score_kernel();
  const int B = J.B, L = J.L, Hkv = J.Hkv, S = J.S, rep = J.rep;
  J.qv = q, J.kv = k, J.vv = v, J.mv = m;
  const View4& mv = J.mv;
  const int R = J.R = rep * L;  // the query rows that share one key/value head
  J.Sp = (S + LANES - 1) / LANES * LANES;
  J.blocks = (R + RB - 1) / RB;
  // Each row's visible keys, in increasing order, and the end of the keys any row sees. A mask shared by the
  // batch and the heads (every call's) is scanned once per row of the pass, not once per head.
  const bool shared = mk == 0 || (mv.st[0] == 0 && mv.st[1] == 0);
  const float ninf = -std::numeric_limits<float>::infinity();
  const int slots = shared ? L : B * Hkv * R;
  vis.resize(static_cast<size_t>(slots) * S);
  nscan.assign(slots, -1);
  J.vrow.resize(static_cast<size_t>(B) * Hkv * R);
  J.nvis.resize(static_cast<size_t>(B) * Hkv * R);
  J.send.assign(static_cast<size_t>(B) * Hkv, 0);
  for (int b = 0; b < B; ++b)
    for (int g = 0; g < Hkv; ++g) {
      const int bg = b * Hkv + g;
      int& send = J.send[bg];
      for (int r = 0; r < R; ++r) {
        const int h = g * rep + r / L, l = r % L;
        const int slot = shared ? l : bg * R + r;
        if (nscan[slot] < 0) {
          int* vr = vis.data() + static_cast<size_t>(slot) * S;
          int n = 0;
          if (mk == 0) {
            for (int s = 0; s < S; ++s) vr[n++] = s;
          } else if (mk == 1) {
            const bool* mr = reinterpret_cast<const bool*>(mv.data) + b * mv.st[0] + h * mv.st[1] + l * mv.st[2];
            for (int s = 0; s < S; ++s)
              if (mr[s * mv.st[3]]) vr[n++] = s;
          } else {
            const float* mr = reinterpret_cast<const float*>(mv.data) + b * mv.st[0] + h * mv.st[1] + l * mv.st[2];
            for (int s = 0; s < S; ++s)
              if (mr[s * mv.st[3]] != ninf) vr[n++] = s;
          }
          nscan[slot] = n;
        }
        const size_t at = static_cast<size_t>(bg) * R + r;
        J.vrow[at] = vis.data() + static_cast<size_t>(slot) * S;
        J.nvis[at] = nscan[slot];
        if (J.nvis[at] > 0 && J.vrow[at][J.nvis[at] - 1] + 1 > send) send = J.vrow[at][J.nvis[at] - 1] + 1;
      }
    }
  // The units on both threads where ptp-sgemm has its second one (each key/value head's rows a unit or more).
  const int units = B * Hkv * J.blocks;
  parallel_fn par = parallel();
  auto run = [](void* ctx, int u) { unit(*static_cast<const Job*>(ctx), u); };
  if (par != nullptr)
    par(run, &J, units);
  else
    for (int u = 0; u < units; ++u) unit(J, u);
}

namespace {

void Attention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& q = inputs[0];  // [B, Hq, L, D]
  const mx::array& k = inputs[1];  // [B, Hkv, S, D]
  const mx::array& v = inputs[2];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const int mk = mask_kind_;
  std::optional<mx::array> mask;
  if (mk != 0) mask = mx::array::unsafe_weak_copy(inputs[3]);
  encoder.dispatch([q = mx::array::unsafe_weak_copy(q), k = mx::array::unsafe_weak_copy(k),
                    v = mx::array::unsafe_weak_copy(v), mask, mk, op = out.data<float>(), scale = scale_]() {
    thread_local std::vector<float> qbuf, kbuf, vbuf;
    const mx::Shape full = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    const View4 mv = mask ? view4(*mask, full) : View4{nullptr, {0, 0, 0, 0}};
    ptpcpu::attention_run(dense_last(q, qbuf), dense_last(k, kbuf), dense_last(v, vbuf), mv, q.shape(0),
                          q.shape(1), q.shape(2), q.shape(3), k.shape(1), k.shape(2), mk, scale, op);
  });
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    std::optional<mx::array> mask) {
  auto check = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("attention: ") + what);
  };
  check(q.dtype() == mx::float32 && k.dtype() == mx::float32 && v.dtype() == mx::float32, "float32 q, k, v");
  check(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4, "q, k, v are [B, H, rows, D]");
  check(k.shape() == v.shape() && k.shape(0) == q.shape(0) && k.shape(3) == q.shape(3), "k and v match q");
  check(k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0, "query heads are a multiple of key heads");
  int kind = 0;
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) {
    check(mask->dtype() == mx::bool_ || mask->dtype() == mx::float32, "a bool or float32 mask");
    check(mask->ndim() >= 1 && mask->ndim() <= 4, "a mask of at most 4 axes");
    const mx::Shape full = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    const int off = 4 - static_cast<int>(mask->ndim());
    for (int d = 0; d < static_cast<int>(mask->ndim()); ++d)
      check(mask->shape(d) == 1 || mask->shape(d) == full[d + off], "a mask that broadcasts to [B, Hq, rows, keys]");
    kind = mask->dtype() == mx::bool_ ? 1 : 2;
    inputs.push_back(*mask);
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(q.shape(), mx::float32, std::make_shared<Attention>(stream, scale, kind), std::move(inputs));
}

}  // namespace

void register_attention(nb::module_& m) {
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
        nb::arg("mask") = nb::none(),
        "softmax(q k^T * scale + mask) v over each row's visible keys; q [B, Hq, L, D], k and v [B, Hkv, S, D] "
        "(float32).");
}
