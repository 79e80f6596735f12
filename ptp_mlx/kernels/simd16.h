// 16-float vectors for ptp-mlx's CPU primitives (attention.cpp, rowwise.cpp): GCC and Clang vector extensions, one
// AVX-512 register, two AVX2 or four NEON ones, so that the lanes, and with them every rounding, are the same on
// every machine and in every loop. Multiply-adds written `a += b * c` are fused where the target has FMA (GNU
// mode contracts them), the same way in every loop of one build.
#pragma once

#include <cstdint>
#include <limits>

namespace ptp16 {

constexpr int LANES = 16;
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // an unaligned load or store
typedef int32_t i16 __attribute__((vector_size(64)));

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// exp as MLX's CPU backend computes it (2^round(x log2 e) through the exponent bits, the fraction by a degree-6
// polynomial), on 16 lanes; the edges (+-88, NaN) selected after.
inline v16 exp16(v16 x) {
  const v16 y = x * 1.442695f;
  const v16 t = y + 0.5f;
  const v16 tt = __builtin_convertvector(__builtin_convertvector(t, i16), v16);
  const v16 ip = tt - __builtin_convertvector(-(tt > t), v16);  // floor(t): (tt > t) is -1 where true
  const v16 f = y - ip;
  v16 r = splat(1.535336188319500e-4f);
  r = r * f + 1.339887440266574e-3f;
  r = r * f + 9.618437357674640e-3f;
  r = r * f + 5.550332471162809e-2f;
  r = r * f + 2.402264791363012e-1f;
  r = r * f + 6.931472028550421e-1f;
  r = r * f + 1.0f;
  const i16 bits = (__builtin_convertvector(ip, i16) + 127) << 23;
  v16 out = reinterpret_cast<const v16&>(bits) * r;
  out = x > 88.0f ? splat(std::numeric_limits<float>::infinity()) : out;
  out = x < -88.0f ? splat(0.0f) : out;
  return x != x ? x : out;
}

inline float lane_sum(v16 x) {  // a fixed pairwise order
  float t[LANES];
  store(t, x);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) t[j] += t[j + w];
  return t[0];
}

// Lanes of two vectors picked by constant indices (0-15: a's, 16-31: b's).
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
#define PTP_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PTP_SHUF(a, b, ...) __builtin_shuffle(a, b, i16{__VA_ARGS__})
#endif

// The 16 lane sums of x[0..15], as one vector (lane t: the sum of x[t]'s lanes), by one fixed tree for every t:
// lanes j and j + 8 first, then j and j + 4, j and j + 2, j and j + 1.
inline v16 sum16(const v16* x) {
  v16 y[8], z[4], w[2];
  for (int t = 0; t < 8; ++t)
    y[t] = PTP_SHUF(x[2 * t], x[2 * t + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           PTP_SHUF(x[2 * t], x[2 * t + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int t = 0; t < 4; ++t)
    z[t] = PTP_SHUF(y[2 * t], y[2 * t + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           PTP_SHUF(y[2 * t], y[2 * t + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int t = 0; t < 2; ++t)
    w[t] = PTP_SHUF(z[2 * t], z[2 * t + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           PTP_SHUF(z[2 * t], z[2 * t + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return PTP_SHUF(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         PTP_SHUF(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

}  // namespace ptp16
