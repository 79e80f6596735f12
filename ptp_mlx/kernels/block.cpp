// ptp-block: one decoder layer of a fixed-shape pass (a llama-style block: RMS norm, q|k|v (per-head q and k norms
// for qwen3), RoPE from the call's table, the K/V rows written at the pass's offset, attention over the bucket, o,
// residual, RMS norm, gate|up, SwiGLU, down, residual) as one MLX primitive on the CPU.
//
// Why: on MLX's CPU backend every node of a call's graph costs a few microseconds on the thread that replays the
// compiled graph and again on the stream thread (dispatch, allocation, a wake-up), whatever its size. A layer of
// the default model was 15 computing nodes and 9 views (4 projection groups, 2 norms, 2 RoPEs, 2 K/V writes, 2
// adds, attention, SwiGLU): 449 computing nodes a plain step, whose overhead was about a third of the step. Here a
// layer is one node and one task on the stream thread.
//
// Bits: the layer runs the very kernels the per-op primitives run (cpu_ops.h: rms_norm_rows, group_run,
// rope_rows, attention_run, swiglu_rows) on the same values in the same order, and the adds are float adds, so
// every output is the per-op graph's bit for bit (tests/test_block.py compares them on every pass kind).
// The K/V buffers are updated in place when MLX can donate them (as its own slice update does), else copied.
// Weights already evaluated are held by the primitive, not taken as graph inputs (block()): the host touches every
// input of every node when it replays a compiled call, queues it and lets it go.

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
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

constexpr int GROUPS = 4;  // q|k|v, o, gate|up, down
enum { X, KBUF, VBUF, START, COS, SIN, MASK, NORM1, NORM2, GATE, QNORM, KNORM, FIRST_GROUP };

struct Group {
  int N = 0, R = 0;  // output columns, LoRA rank (0: none)
  bool bias = false, b16 = false;
  int at = 0;  // index of its W among the inputs (bias, B, spans after it)
};

struct Config {
  int Hq, Hkv, D, dims, S, mk;  // heads, head size, rotated dims, keys read (bucket), mask kind (1 bool, 2 add)
  bool traditional, gated, qk_norm;  // qk_norm: q and k normed per head before RoPE (qwen3)
  float eps1, eps2, scale, eps_qk;
  Group g[GROUPS];
  bool operator==(const Config& o) const {
    if (Hq != o.Hq || Hkv != o.Hkv || D != o.D || dims != o.dims || S != o.S || mk != o.mk ||
        traditional != o.traditional || gated != o.gated || eps1 != o.eps1 || eps2 != o.eps2 || scale != o.scale ||
        qk_norm != o.qk_norm || eps_qk != o.eps_qk)
      return false;
    for (int i = 0; i < GROUPS; ++i)
      if (g[i].N != o.g[i].N || g[i].R != o.g[i].R || g[i].bias != o.g[i].bias || g[i].b16 != o.g[i].b16)
        return false;
    return true;
  }
};

// Where each of block()'s arrays lives: slot >= 0 is the primitive's graph input of that index, slot < 0 its held
// array -1 - slot (an evaluated weight: see block()).
struct Layout {
  std::vector<int> slots;  // one per array of block()'s layout
  std::vector<mx::array> held;
};
using Held = std::shared_ptr<const Layout>;
constexpr int MAX_ARRAYS = FIRST_GROUP + 4 * GROUPS;
bool g_hold = true;  // false: every array a graph input (block_hold: the reference the tests and A/B runs compare)

class Block : public ptpcpu::CpuPrimitive {
 public:
  Block(mx::Stream stream, Config c, Held layout) : CpuPrimitive(stream), c_(c), l_(std::move(layout)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PTPBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Block&>(other);
    if (!(c_ == o.c_) || l_->slots != o.l_->slots) return false;
    for (size_t i = 0; i < l_->held.size(); ++i)
      if (l_->held[i].id() != o.l_->held[i].id()) return false;
    return true;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[X].shape(), in[KBUF].shape(), in[VBUF].shape()};  // (X, KBUF and VBUF are always graph inputs)
  }

 private:
  Config c_;
  Held l_;
};

// How many handles share an array's description. MLX keeps it private; is_donatable() asks for exactly one, but
// every output of a multi-output primitive holds its own copy of the inputs, so a buffer only this primitive holds
// has as many handles as the primitive has outputs. (Read through the explicit-instantiation access rule.)
template <class Tag, auto M>
struct Rob {
  friend auto member(Tag) { return M; }
};
struct DescTag {
  friend auto member(DescTag);
};
template struct Rob<DescTag, &mx::array::array_desc_>;

long holders(const mx::array& a) { return (a.*member(DescTag{})).use_count(); }

// A K/V buffer's output: the input's memory where nothing but this primitive's outputs holds the input (what MLX's
// own slice update asks before it writes in place: a snapshot of the state keeps its buffers), else a fresh buffer
// the task fills with a copy first. Returns whether a copy is needed.
bool take_buffer(const mx::array& in, mx::array& out, size_t outputs) {
  const auto& data = in.data_shared_ptr();
  if (in.flags().row_contiguous && holders(in) <= static_cast<long>(outputs) && data.use_count() == 1 &&
      data->is_owned()) {
    out.copy_shared_buffer(in);
    return false;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return true;
}

void Block::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const Layout& l = *l_;
  auto arg = [&](int i) -> const mx::array& { return l.slots[i] >= 0 ? inputs[l.slots[i]] : l.held[-1 - l.slots[i]]; };
  for (int i : {int(KBUF), int(VBUF), int(NORM1), int(NORM2)})
    if (!arg(i).flags().row_contiguous) throw std::invalid_argument("block: K/V buffers and norms must be row-contiguous");
  for (const auto& g : c_.g)
    for (int i = g.at; i < g.at + 1 + g.bias + 2 * (g.R > 0); ++i)
      if (!arg(i).flags().row_contiguous) throw std::invalid_argument("block: weights must be row-contiguous");
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const bool copy_k = take_buffer(inputs[KBUF], outputs[1], outputs.size());
  const bool copy_v = take_buffer(inputs[VBUF], outputs[2], outputs.size());
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& o : outputs) encoder.set_output_array(o);
  std::vector<mx::array> gin;  // weak copies: the encoder holds the graph inputs until the task has run
  for (const auto& a : inputs) gin.push_back(mx::array::unsafe_weak_copy(a));
  encoder.dispatch([gin = std::move(gin), lay = l_, c = c_, op = out.data<float>(),
                    kp = outputs[1].data<float>(), vp = outputs[2].data<float>(), copy_k, copy_v,
                    kin = inputs[KBUF].data<float>(), vin = inputs[VBUF].data<float>(),
                    kbytes = inputs[KBUF].nbytes()]() {
    // (`lay` keeps the weights for the task, should the graph that holds this primitive go first)
    const mx::array* in[MAX_ARRAYS];
    for (size_t i = 0; i < lay->slots.size(); ++i)
      in[i] = lay->slots[i] >= 0 ? &gin[lay->slots[i]] : &lay->held[-1 - lay->slots[i]];
    thread_local std::vector<float> xbuf, cbuf, sbuf, gbuf, xn, y1, qn, kn, qr, kr, ao, at, y2, h, y3, act, y4;
    const mx::array& x = *in[X];
    const int H = x.shape(-1), M = static_cast<int>(x.size() / H);
    const int Hq = c.Hq, Hkv = c.Hkv, D = c.D, cap = in[KBUF]->shape(2);
    const auto xr = ptpcpu::rows_of(x, xbuf);
    const auto cr = ptpcpu::rows_of(*in[COS], cbuf), sr = ptpcpu::rows_of(*in[SIN], sbuf);
    const float* gp = nullptr;
    if (c.gated) {
      gbuf.resize(M);
      ptpcpu::dense(*in[GATE], gbuf.data());
      gp = gbuf.data();
    }
    auto group = [&](int i, const float* src, int K, std::vector<float>& y) {
      const Group& g = c.g[i];
      const float* bias = g.bias ? in[g.at + 1]->data<float>() : nullptr;
      const void* B = g.R > 0 ? in[g.at + 1 + g.bias]->data<void>() : nullptr;
      const int32_t* sp = g.R > 0 ? in[g.at + 2 + g.bias]->data<int32_t>() : nullptr;
      return ptpcpu::group_run(src, M, K, in[g.at]->data<float>(), g.N, g.R, B, g.b16, sp, g.R > 0 ? gp : nullptr,
                               bias, y);
    };
    // Attention's half: norm, q|k|v, RoPE of q and k, the K/V rows written, attention over the bucket.
    xn.resize(static_cast<size_t>(M) * H);
    ptpcpu::rms_norm_rows(xr.p, M, xr.stride, H, in[NORM1]->data<float>(), c.eps1, xn.data());
    const int ld1 = group(0, xn.data(), H, y1);
    qr.resize(static_cast<size_t>(Hq) * M * D);
    kr.resize(static_cast<size_t>(Hkv) * M * D);
    const int qshape[4] = {1, Hq, M, D}, kshape[4] = {1, Hkv, M, D};
    const float *qsrc = y1.data(), *ksrc = y1.data() + Hq * D;  // q and k as [1, heads, M, D] views
    int64_t qst[4] = {0, D, ld1, 1}, kst_in[4] = {0, D, ld1, 1};
    if (c.qk_norm) {  // each head's q and k through its RMS norm first, rows of D as the per-op norm takes them
      qn.resize(static_cast<size_t>(M) * Hq * D);
      kn.resize(static_cast<size_t>(M) * Hkv * D);
      for (int r = 0; r < M; ++r) {
        ptpcpu::rms_norm_rows(qsrc + static_cast<size_t>(r) * ld1, Hq, D, D, in[QNORM]->data<float>(), c.eps_qk,
                              qn.data() + static_cast<size_t>(r) * Hq * D);
        ptpcpu::rms_norm_rows(ksrc + static_cast<size_t>(r) * ld1, Hkv, D, D, in[KNORM]->data<float>(), c.eps_qk,
                              kn.data() + static_cast<size_t>(r) * Hkv * D);
      }
      qsrc = qn.data(), ksrc = kn.data(), qst[2] = int64_t(Hq) * D, kst_in[2] = int64_t(Hkv) * D;
    }
    ptpcpu::rope_rows(qsrc, qst, cr.p, sr.p, cr.stride, sr.stride, qr.data(), qshape, c.dims, c.traditional);
    ptpcpu::rope_rows(ksrc, kst_in, cr.p, sr.p, cr.stride, sr.stride, kr.data(), kshape, c.dims, c.traditional);
    if (copy_k) std::memcpy(kp, kin, kbytes);
    if (copy_v) std::memcpy(vp, vin, kbytes);
    // the write position, clamped as MLX's slice update clamps it
    const int off = std::min(std::max(in[START]->data<int32_t>()[0], 0), cap - M);
    const float* vsrc = y1.data() + static_cast<size_t>(Hq + Hkv) * D;
    for (int g = 0; g < Hkv; ++g)
      for (int r = 0; r < M; ++r) {
        const size_t dst = (static_cast<size_t>(g) * cap + off + r) * D;
        std::memcpy(kp + dst, kr.data() + (static_cast<size_t>(g) * M + r) * D, sizeof(float) * D);
        std::memcpy(vp + dst, vsrc + static_cast<size_t>(r) * ld1 + g * D, sizeof(float) * D);
      }
    const ptpcpu::View4 qv{reinterpret_cast<const char*>(qr.data()), {int64_t(Hq) * M * D, int64_t(M) * D, D, 1}};
    const ptpcpu::View4 kv{reinterpret_cast<const char*>(kp), {int64_t(Hkv) * cap * D, int64_t(cap) * D, D, 1}};
    const ptpcpu::View4 vv{reinterpret_cast<const char*>(vp), {kv.st[0], kv.st[1], kv.st[2], kv.st[3]}};
    const ptpcpu::View4 mv = ptpcpu::view4(*in[MASK], {1, Hq, M, c.S});
    ao.resize(static_cast<size_t>(Hq) * M * D);
    ptpcpu::attention_run(qv, kv, vv, mv, 1, Hq, M, D, Hkv, c.S, c.mk, c.scale, ao.data());
    // [Hq, M, D] -> [M, Hq * D], o, the residual.
    at.resize(static_cast<size_t>(M) * Hq * D);
    for (int hh = 0; hh < Hq; ++hh)
      for (int r = 0; r < M; ++r)
        std::memcpy(at.data() + (static_cast<size_t>(r) * Hq + hh) * D, ao.data() + (static_cast<size_t>(hh) * M + r) * D,
                    sizeof(float) * D);
    const int ld2 = group(1, at.data(), Hq * D, y2);
    h.resize(static_cast<size_t>(M) * H);
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < H; ++j) h[static_cast<size_t>(r) * H + j] = xr.p[r * xr.stride + j] + y2[static_cast<size_t>(r) * ld2 + j];
    // The MLP's half: norm, gate|up, SwiGLU, down, the residual.
    ptpcpu::rms_norm_rows(h.data(), M, H, H, in[NORM2]->data<float>(), c.eps2, xn.data());
    const int I = c.g[2].N / 2;
    const int ld3 = group(2, xn.data(), H, y3);
    act.resize(static_cast<size_t>(M) * I);
    ptpcpu::swiglu_rows(y3.data(), ld3, y3.data() + I, ld3, M, I, act.data());
    const int ld4 = group(3, act.data(), I, y4);
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < H; ++j) op[static_cast<size_t>(r) * H + j] = h[static_cast<size_t>(r) * H + j] + y4[static_cast<size_t>(r) * ld4 + j];
  });
}

// arrays: x [1, M, H], K and V buffers [1, Hkv, cap, D], start int32 [1], cos and sin [.., M, dims / 2], mask
// (broadcasting to [1, Hq, M, S]; bool, or additive float32), the two norms' weights [H], the row gate (M floats;
// any array when no group has a LoRA), the q and k norms' weights [D] (qwen3; any arrays without), then per group (q|k|v, o, gate|up, down) W [N + R, K], its bias [N] if
// any, and with a LoRA its B [R, N] (float32 or bfloat16) and spans [R, 2] int32.
// Of these, the weights (norms, W, bias, B, spans) that are evaluated already are held by the primitive; the others
// (x, the buffers, start, cos, sin, mask, a LoRA's gate, and any weight not evaluated yet) are its graph inputs.
// ints: Hq, Hkv, D, dims, traditional, S, qk_norm, then per group N, R, has_bias. floats: eps1, eps2, scale,
// the q and k norms' eps.
std::vector<mx::array> block(const std::vector<mx::array>& arrays, const std::vector<int>& ints,
                             const std::vector<float>& floats) {
  auto check = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("block: ") + what);
  };
  check(ints.size() == 7 + 3 * GROUPS && floats.size() == 4, "7 + 12 ints and 4 floats");
  Config c{};
  c.Hq = ints[0], c.Hkv = ints[1], c.D = ints[2], c.dims = ints[3], c.traditional = ints[4] != 0, c.S = ints[5];
  c.qk_norm = ints[6] != 0;
  c.eps1 = floats[0], c.eps2 = floats[1], c.scale = floats[2], c.eps_qk = floats[3];
  int at = FIRST_GROUP;
  for (int i = 0; i < GROUPS; ++i) {
    Group& g = c.g[i];
    g.N = ints[7 + 3 * i], g.R = ints[8 + 3 * i], g.bias = ints[9 + 3 * i] != 0, g.at = at;
    at += 1 + g.bias + 2 * (g.R > 0);
    c.gated |= g.R > 0;
  }
  check(static_cast<int>(arrays.size()) == at && at <= MAX_ARRAYS, "the arrays the ints describe");
  const mx::array& x = arrays[X];
  const int H = x.ndim() == 3 ? x.shape(2) : 0, M = x.ndim() == 3 ? x.shape(1) : 0;
  check(x.dtype() == mx::float32 && x.ndim() == 3 && x.shape(0) == 1, "x is float32 [1, rows, hidden]");
  const auto& K = arrays[KBUF];
  check(K.dtype() == mx::float32 && K.ndim() == 4 && K.shape(0) == 1 && K.shape(1) == c.Hkv && K.shape(3) == c.D &&
            arrays[VBUF].shape() == K.shape() && arrays[VBUF].dtype() == mx::float32,
        "K and V are float32 [1, Hkv, capacity, D]");
  check(c.Hkv > 0 && c.Hq % c.Hkv == 0 && c.S >= M && c.S <= K.shape(2), "heads and the bucket fit the buffers");
  check(arrays[START].dtype() == mx::int32 && arrays[START].size() == 1, "start is int32 [1]");
  check(c.dims > 0 && c.dims % 2 == 0 && c.dims <= c.D, "dims is even and at most D");
  for (int i : {int(COS), int(SIN)})
    check(arrays[i].dtype() == mx::float32 && arrays[i].size() == static_cast<size_t>(M) * (c.dims / 2),
          "cos and sin are float32 [rows, dims / 2]");
  const auto& m = arrays[MASK];
  check((m.dtype() == mx::bool_ || m.dtype() == mx::float32) && m.ndim() >= 1 && m.ndim() <= 4, "a bool or float mask");
  const int full[4] = {1, c.Hq, M, c.S};
  for (int d = 0, off = 4 - static_cast<int>(m.ndim()); d < static_cast<int>(m.ndim()); ++d)
    check(m.shape(d) == 1 || m.shape(d) == full[d + off], "a mask that broadcasts to [1, Hq, rows, bucket]");
  c.mk = m.dtype() == mx::bool_ ? 1 : 2;
  for (int i : {int(NORM1), int(NORM2)})
    check(arrays[i].dtype() == mx::float32 && arrays[i].size() == static_cast<size_t>(H), "norm weights are [hidden]");
  if (c.gated) check(arrays[GATE].dtype() == mx::float32 && arrays[GATE].size() == static_cast<size_t>(M), "one gate a row");
  if (c.qk_norm)
    for (int i : {int(QNORM), int(KNORM)})
      check(arrays[i].dtype() == mx::float32 && arrays[i].size() == static_cast<size_t>(c.D) &&
                arrays[i].flags().row_contiguous,
            "q and k norm weights are float32 [D]");
  const int Kin[GROUPS] = {H, c.Hq * c.D, H, c.g[2].N / 2};
  check(c.g[0].N == (c.Hq + 2 * c.Hkv) * c.D && c.g[1].N == H && c.g[2].N % 2 == 0 && c.g[3].N == H,
        "groups q|k|v, o, gate|up and down");
  for (int i = 0; i < GROUPS; ++i) {
    Group& g = c.g[i];
    const auto& W = arrays[g.at];
    check(W.dtype() == mx::float32 && W.ndim() == 2 && W.shape(1) == Kin[i] && W.shape(0) >= g.N + g.R,
          "W is float32 [>= N + rank, in]");
    if (g.bias) check(arrays[g.at + 1].dtype() == mx::float32 && arrays[g.at + 1].size() == static_cast<size_t>(g.N), "bias is [N]");
    if (g.R > 0) {
      const auto& B = arrays[g.at + 1 + g.bias];
      check((B.dtype() == mx::float32 || B.dtype() == mx::bfloat16) && B.ndim() == 2 && B.shape(0) == g.R &&
                B.shape(1) == g.N, "B is [rank, N]");
      check(arrays[g.at + 2 + g.bias].dtype() == mx::int32 && arrays[g.at + 2 + g.bias].size() == 2 * static_cast<size_t>(g.R),
            "spans is int32 [rank, 2]");
      g.b16 = B.dtype() == mx::bfloat16;
    }
  }
  // Evaluated weights are held by the primitive rather than taken as graph inputs: a compiled call replays, a
  // queued call traverses and a released call frees every input of every node on the host, and the weights were
  // about two thirds of a call's inputs (14 a layer). What the call computes is the same.
  auto layout = std::make_shared<Layout>();
  std::vector<mx::array> inputs;
  for (int i = 0; i < static_cast<int>(arrays.size()); ++i) {
    const mx::array& a = arrays[i];
    const bool graph = !g_hold || i <= MASK || (i == GATE && c.gated) || a.is_tracer() || !a.is_available();
    if (graph) {
      layout->slots.push_back(static_cast<int>(inputs.size()));
      inputs.push_back(a);
    } else {
      layout->slots.push_back(-1 - static_cast<int>(layout->held.size()));
      layout->held.push_back(a);
    }
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({x.shape(), K.shape(), K.shape()}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<Block>(stream, c, std::move(layout)), inputs);
}

}  // namespace

void register_block(nb::module_& m) {
  m.def("block", &block, nb::arg("arrays"), nb::arg("ints"), nb::arg("floats"),
        "One llama-style decoder layer of a fixed pass: (output, K buffer, V buffer); see block.cpp.");
  m.def("block_hold", [](bool on) { g_hold = on; }, nb::arg("on"),
        "Whether block() holds evaluated weights in the primitive (default) or takes every array as a graph input.");
}
