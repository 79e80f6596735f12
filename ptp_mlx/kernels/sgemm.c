/* ptp-sgemm: a cblas_sgemm for the few-row products of PTP decoding (project issue 41).
 *
 * MLX's CPU backend sends every float32 matmul to cblas_sgemm. A BLAS packs the weight panels on every call,
 * which makes a pass of 4..16 token rows cost far more than one row, although a kernel that reads each weight
 * once stays memory-bound up to about 8-10 rows. This library exports cblas_sgemm, computes the calls it is
 * built for (A not transposed, alpha 1, beta 0 or 1, at most PTP_MAX_M rows) with register tiles over the
 * operands as MLX lays them out (no packing), and forwards every other call to the real BLAS, whose sgemm
 * Python hands over with ptp_sgemm_set_fallback (ptp_mlx/blas.py).
 *
 * Batch invariance is the point, not a side effect: PTP is lossless only if every row of a k-row pass equals
 * that row computed alone. So each output element goes through one fixed sequence of float operations
 * whatever M is, wherever its row sits in a tile and whichever tail path it takes:
 *   C = A B^T: one vector accumulator per element, K consumed in order in chunks of the vector width (the K
 *              tail as one masked chunk with zeros), then one fixed horizontal-sum tree (hsum_*), then + C
 *              when beta is 1. Tile shapes only change the schedule, never an element's arithmetic.
 *   C = A B:   one lane per element, fused multiply-adds over k in order from zero, then + C when beta is 1.
 * The AVX-512, AVX2 and portable paths differ from each other (one process uses one), not within themselves.
 * An optional second thread splits N, never K, so it keeps this property (ptp_sgemm_set_threads). */

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && !defined(PTP_PORTABLE_ONLY) /* -D: as on other CPUs */
#include <immintrin.h>
#define PTP_X86 1
#endif

#ifndef PTP_MAX_M
#define PTP_MAX_M 256 /* every decode width and a prefill chunk (decode/ar.py: 128 rows); a prefill ran faster
                         * so than through the BLAS on both threads up to about 256 rows (docs/method.md section 10) */
#endif
static int max_m = PTP_MAX_M; /* the most rows a call may have for the kernel to take it (ptp_sgemm_set_max_m) */

enum { RowMajor = 101, ColMajor = 102, NoTrans = 111, Trans = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
/* One kernel computes columns [n0, n1) of C (all M rows): the unit the optional second thread splits. */
typedef void (*kern_fn)(int M, int n0, int n1, int K, const float *A, long lda, const float *B, long ldb,
                        int beta1, float *C, long ldc);

static sgemm_fn fallback;
static int enabled = 1;
static unsigned long long n_taken, n_forwarded, ns_taken, ns_forwarded;

#include <time.h>
static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

/* ---- portable C: a fixed 8-lane split of K, whatever the compiler makes of the lanes (built with
 * -ffp-contract=off, so a*b+c stays two roundings in every specialisation). ---- */

static float dot_portable(int K, const float *a, const float *b) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int k = 0;
    for (; k + 8 <= K; k += 8)
        for (int l = 0; l < 8; l++) s[l] += a[k + l] * b[k + l];
    for (int l = 0; k + l < K; l++) s[l] += a[k + l] * b[k + l];
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

static void nt_portable(int M, int n0, int n1, int K, const float *A, long lda, const float *B, long ldb,
                        int beta1, float *C, long ldc) {
    for (int n = n0; n < n1; n++)
        for (int m = 0; m < M; m++) {
            float r = dot_portable(K, A + m * lda, B + n * ldb);
            C[m * ldc + n] = beta1 ? C[m * ldc + n] + r : r;
        }
}

static void nn_portable(int M, int n0, int n1, int K, const float *A, long lda, const float *B, long ldb,
                        int beta1, float *C, long ldc) {
    for (int m = 0; m < M; m++)
        for (int n = n0; n < n1; n++) {
            float s = 0;
            for (int k = 0; k < K; k++) s += A[m * lda + k] * B[k * ldb + n];
            C[m * ldc + n] = beta1 ? C[m * ldc + n] + s : s;
        }
}

#ifdef PTP_X86
#define INLINE static inline __attribute__((always_inline))
#define T512 __attribute__((target("avx512f")))
#define T256 __attribute__((target("avx2,fma")))

/* While the tiles of a block of weight rows compute, they prefetch the block PF_BLOCKS ahead, one cache line per
 * row and chunk, the rows shared among the tiles (without prefetch, 8 rows cost 1.8x one row instead of 1.15x;
 * every tile prefetching every row, 16 rows cost 1.8x instead of 1.5x), into L2 (PF_HINT; -D to retry): on
 * 2026-12-05, builds interleaved in one process, a 1-row pass of the model's products took 16.1 ms with L2
 * prefetches and 18.0 with L1 ones, 8 rows 17.7 against 23.2 (AVX2 path: 1 row 16.5 / 18.6, 4 rows 17.6 / 23.5):
 * the block then no longer evicts from L1 the rows the tiles are still reading (earlier sessions, on a VM of the
 * same CPU family, had measured the two within noise). 2 blocks ahead: within noise. */
/* past this many rows the AVX-512 A B^T tiles hold each token row in a register (``nt_512``) */
#define RA_ROWS 8
#ifndef PF_BLOCKS
#define PF_BLOCKS 1
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
/* the block to prefetch from the tiles of NR weight rows at n, if it lies inside this call's columns */
#define PF(NR) (PF_BLOCKS && n + (PF_BLOCKS + 1) * (NR) <= n1 ? B + (n + PF_BLOCKS * (NR)) * ldb : 0)

/* ---- AVX-512F ---- */

/* Four 16-lane accumulators to their four sums, by one fixed tree per vector:
 * lanes i + (i+8), then + (i+4), then + (i+2), then + (i+1). Tails pass zero vectors for the unused ones. */
INLINE T512 __m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    z = _mm512_add_ps(z, _mm512_permute_ps(z, 0x4E));
    z = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                          0, 0, 0, 0), z));
}

/* An MR x NR tile's accumulators to C: each element's sum by hsum4_512, then + C where beta is 1 (the tiles over
 * floats and over codes both end here, so an element's last steps are the same whichever computed it). */
INLINE T512 void store_nt_512(const int MR, const int NR, __m512 acc[8][8], int beta1, float *C, long ldc) {
    __m512 z = _mm512_setzero_ps();
    for (int i = 0; i < MR; i++) {
        float *c = C + i * ldc;
        for (int j = 0; j < NR; j += 4) {
            __m128 r = hsum4_512(acc[i][j], j + 1 < NR ? acc[i][j + 1] : z, j + 2 < NR ? acc[i][j + 2] : z,
                                 j + 3 < NR ? acc[i][j + 3] : z);
            if (j + 4 <= NR) {
                if (beta1) r = _mm_add_ps(_mm_loadu_ps(c + j), r);
                _mm_storeu_ps(c + j, r);
            } else {
                float t[4];
                _mm_storeu_ps(t, r);
                for (int u = 0; j + u < NR; u++) c[j + u] = beta1 ? c[j + u] + t[u] : t[u];
            }
        }
    }
}

/* As many tiles as MR allows, of balanced heights (10 rows: 5 + 5, not 6 + 4), each of constant height:
 * TILE(mr) runs rows m .. m + mr (none taller than MR built). */
#define BALANCED_TILES(MR, M, TILE)                                                                                \
    for (int t = 0, tiles = ((M) + (MR) - 1) / (MR), m = 0, h; t < tiles; t++, m += h) {                          \
        h = (M) / tiles + (t < (M) % tiles);                                                                       \
        switch (h) {                                                                                               \
        case 8: if ((MR) >= 8) TILE(8); break; case 7: if ((MR) >= 7) TILE(7); break;                             \
        case 6: if ((MR) >= 6) TILE(6); break; case 5: if ((MR) >= 5) TILE(5); break;                             \
        case 4: if ((MR) >= 4) TILE(4); break; case 3: if ((MR) >= 3) TILE(3); break;                             \
        case 2: if ((MR) >= 2) TILE(2); break; default: TILE(1); break;                                            \
        }                                                                                                          \
    }

/* An MR x NR tile of C = A B^T (NR a multiple of 4 or 1; MR, NR compile-time constants after inlining, so
 * acc lives in registers). While it streams its weight rows it prefetches rows pf_first, pf_first + pf_step,
 * ... of the block pf (the tiles of one block share that work, so memory stays busy throughout). */
INLINE T512 void tile_nt_512(const int MR, const int NR, const int RA, int K, const float *A, long lda,
                             const float *B, long ldb, int beta1, float *C, long ldc, const float *pf, int pf_first,
                             int pf_step) {
    __m512 acc[8][8];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        if (pf)
            for (int j = pf_first; j < NR; j += pf_step) _mm_prefetch((const char *)(pf + j * ldb + k), PF_HINT);
        __m512 b[8];
        for (int j = 0; j < NR; j++) b[j] = _mm512_loadu_ps(B + j * ldb + k);
        for (int i = 0; i < MR; i++) {
            __m512 a = _mm512_loadu_ps(A + i * lda + k);
            if (RA) /* a register: one load of the row for its NR FMAs (the compiler folds one into each) */
                __asm__("" : "+v"(a));
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    if (k < K) { /* the K tail: one chunk with zeros beyond K, in both operands */
        __mmask16 mk = (__mmask16)((1u << (K - k)) - 1);
        __m512 b[8];
        for (int j = 0; j < NR; j++) b[j] = _mm512_maskz_loadu_ps(mk, B + j * ldb + k);
        for (int i = 0; i < MR; i++) {
            __m512 a = _mm512_maskz_loadu_ps(mk, A + i * lda + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    store_nt_512(MR, NR, acc, beta1, C, ldc);
}

/* All M rows of A, in tiles of MR, against one block of NR weight rows: the block comes from memory once
 * (the first tile) and from L1 for the others, and the tiles share the prefetch of block pf. */
INLINE T512 void rows_nt_512(const int MR, const int NR, const int RA, int M, int K, const float *A, long lda,
                             const float *B, long ldb, int beta1, float *C, long ldc, const float *pf) {
#define TILE(mr) tile_nt_512(mr, NR, RA, K, A + m * lda, lda, B, ldb, beta1, C + m * ldc, ldc, pf, t, tiles)
    BALANCED_TILES(MR, M, TILE)
#undef TILE
}

/* The tile shape by the number of rows, the fewest tiles of the most weight rows that fit the registers
 * (accumulators + weights + one row: 2 x 8, 4 x 6, 6 x 4, 8 x 3). Measured on the default model's products,
 * two threads, builds interleaved in one process (/tmp-style ctypes timing, Zen 4), ms per pass:
 *   1 row 18.0 -> 16.1 (tiles of 8 weight rows: more rows streamed side by side; with the L2 prefetch below),
 *   4 rows 19.6 -> 16.2, 8 rows 23.2 -> 17.0 (one 8 x 3 tile instead of 6 + 2), 10 rows 22.1 -> 20.7 (5 + 5
 *   instead of 6 + 4), 16 rows 32.9 -> 29.5 (8 + 8 instead of 6 + 6 + 4).
 * Past 8 rows the products are compute-bound, and there the token row goes through a register (RA): GCC folds
 * the load into each of the NR FMAs that use it, 27 loads for 24 FMAs in an 8 x 3 tile, and Zen 4 issues one
 * 512-bit load a cycle (an 8 x 3 tile over L1-resident data: 87 -> 95 GFLOP/s, 6 x 4: 87 -> 100; the FMA peak
 * is 117). With it, 6 x 4 tiles of 5 or 6 rows beat 8 x 3 and tiles of 4 rows lose to it (2026-12-05,
 * docs/results/kernel/register-rows/): 10 rows 24.5 -> 20.3, 12 rows 21.9 -> 20.5, 16 rows 31.9 -> 26.2,
 * 24 rows 42.7 -> 35.4, 32 rows 55.8 -> 46.9 ms. At 8 rows or fewer the products wait on memory: no change.
 * An element's arithmetic does not depend on the tile (one accumulator over K in order, one fixed sum tree), so
 * the choice keeps every row bit for bit the same at every width. */
static T512 void nt_512(int M, int n0, int n1, int K, const float *A, long lda, const float *B, long ldb,
                        int beta1, float *C, long ldc) {
    int n = n0;
#define COLS(MR, NR, RA)                                                                                           \
    for (; n + (NR) <= n1; n += (NR))                                                                              \
        rows_nt_512(MR, NR, RA, M, K, A, lda, B + n * ldb, ldb, beta1, C + n, ldc, PF(NR))
    if (M <= 2)
        COLS(2, 8, 0);
    else if (M <= 4)
        COLS(4, 6, 0);
    else if (M <= 6)
        COLS(6, 4, 0);
    else if (M <= RA_ROWS)
        COLS(8, 3, 0);
    else if (M >= 5 * ((M + 5) / 6)) /* tiles of 6 rows, none under 5 */
        COLS(6, 4, 1);
    else /* 9, 13, 14, 19 rows: tiles of 6 would leave one of 4 */
        COLS(8, 3, 1);
    COLS(6, 4, 0); /* a tail of whole blocks of four weight rows (a LoRA's rank 16 after tiles of 6) */
#undef COLS
    for (; n < n1; n++) rows_nt_512(8, 1, 0, M, K, A, lda, B + n * ldb, ldb, beta1, C + n, ldc, 0);
}

/* An MR x NV tile of C = A B (NV vectors of 16 columns; the last one `last` columns wide, masked when `last` <
 * 16; MR, NV and FULL compile-time constants after inlining, so acc lives in registers). Every element is one FMA
 * chain over k in order from zero: the tile shape only decides how many chains run side by side (enough to cover
 * the FMA latency: a lone row takes 8 vectors of columns at once), as in the AVX2 path below. */
INLINE T512 void tile_nn_512(const int MR, const int NV, const int FULL, int K, const float *A, long lda,
                             const float *B, long ldb, int beta1, float *C, long ldc, int last) {
    __m512 acc[4][8];
    __mmask16 mk = (__mmask16)((1u << last) - 1);
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m512 b[8];
        const float *bk = B + k * ldb;
        for (int v = 0; v < NV; v++)
            b[v] = FULL || v < NV - 1 ? _mm512_loadu_ps(bk + 16 * v) : _mm512_maskz_loadu_ps(mk, bk + 16 * v);
        for (int i = 0; i < MR; i++) {
            __m512 a = _mm512_set1_ps(A[i * lda + k]);
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < NV; v++) {
            float *c = C + i * ldc + 16 * v;
            __m512 r = acc[i][v];
            if (FULL || v < NV - 1) {
                if (beta1) r = _mm512_add_ps(_mm512_loadu_ps(c), r);
                _mm512_storeu_ps(c, r);
            } else {
                if (beta1) r = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, c), r);
                _mm512_mask_storeu_ps(c, mk, r);
            }
        }
}

/* Columns [n0, n1) of MR rows: tiles of NV vectors, then the rest (a partial last vector masked). */
INLINE T512 void cols_nn_512(const int MR, const int NV, int n0, int n1, int K, const float *A, long lda,
                             const float *B, long ldb, int beta1, float *C, long ldc) {
    int n = n0;
    for (; n + 16 * NV <= n1; n += 16 * NV) tile_nn_512(MR, NV, 1, K, A, lda, B + n, ldb, beta1, C + n, ldc, 16);
    int rest = n1 - n, nv = (rest + 15) / 16, last = rest - 16 * (nv - 1);
#define REST(k)                                                                                                    \
    case k:                                                                                                        \
        if (last == 16)                                                                                            \
            tile_nn_512(MR, k < NV ? k : NV, 1, K, A, lda, B + n, ldb, beta1, C + n, ldc, 16);                     \
        else                                                                                                       \
            tile_nn_512(MR, k < NV ? k : NV, 0, K, A, lda, B + n, ldb, beta1, C + n, ldc, last);                   \
        break;
    switch (nv) {
        REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8)
    default:
        break;
    }
#undef REST
}

/* C = A B for columns [n0, n1): blocks of 96 columns, each taken by every row tile in turn (tiles of 4 rows x 6
 * vectors, 24 accumulators; the last 1-3 rows together), so a block of B comes from memory once, while the next
 * block is prefetched (a LoRA's B: 16 rows of up to 3072 columns, read once a call; ``NN_PF``); then the last
 * columns as before (3 x 8, 2 x 8, 1 x 8 past the tiles of 4). */
#ifndef NN_PF
#define NN_PF 1
#endif
static T512 void nn_512(int M, int n0, int n1, int K, const float *A, long lda, const float *B, long ldb,
                        int beta1, float *C, long ldc) {
    int n = n0;
    for (; n + 96 <= n1; n += 96) {
        if (NN_PF && n + 192 <= n1)
            for (int k = 0; k < K; k++)
                for (int v = 0; v < 6; v++) _mm_prefetch((const char *)(B + k * ldb + n + 96 + 16 * v), PF_HINT);
        int m = 0;
        for (; m + 4 <= M; m += 4) tile_nn_512(4, 6, 1, K, A + m * lda, lda, B + n, ldb, beta1, C + m * ldc + n, ldc, 16);
        if (M - m == 3) tile_nn_512(3, 6, 1, K, A + m * lda, lda, B + n, ldb, beta1, C + m * ldc + n, ldc, 16);
        if (M - m == 2) tile_nn_512(2, 6, 1, K, A + m * lda, lda, B + n, ldb, beta1, C + m * ldc + n, ldc, 16);
        if (M - m == 1) tile_nn_512(1, 6, 1, K, A + m * lda, lda, B + n, ldb, beta1, C + m * ldc + n, ldc, 16);
    }
    if (n == n1)
        return;
    int m = 0;
    for (; m + 4 <= M; m += 4) cols_nn_512(4, 6, n, n1, K, A + m * lda, lda, B, ldb, beta1, C + m * ldc, ldc);
    if (M - m == 3) cols_nn_512(3, 8, n, n1, K, A + m * lda, lda, B, ldb, beta1, C + m * ldc, ldc);
    if (M - m == 2) cols_nn_512(2, 8, n, n1, K, A + m * lda, lda, B, ldb, beta1, C + m * ldc, ldc);
    if (M - m == 1) cols_nn_512(1, 8, n, n1, K, A + m * lda, lda, B, ldb, beta1, C + m * ldc, ldc);
}

/* ---- AVX2 + FMA: the same design with 8 lanes ---- */

/* Four 8-lane accumulators to their sums, one fixed tree per vector: i + (i+4), then pairs, then the two. */
INLINE T256 __m128 hsum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    __m256 h = _mm256_hadd_ps(ab, cd); /* a01 a23 c01 c23 | b01 b23 d01 d23 */
    h = _mm256_hadd_ps(h, h);          /* a c a c | b d b d */
    return _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

INLINE T256 __m256i mask_256(int n) { /* lanes below n set */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

INLINE T256 void tile_nt_256(const int MR, const int NR, int K, const float *A, long lda, const float *B,
                             long ldb, int beta1, float *C, long ldc, const float *pf, int pf_first, int pf_step) {
    __m256 acc[4][8];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        if (pf && (k & 15) == 0) /* one cache line per row every other chunk */
            for (int j = pf_first; j < NR; j += pf_step) _mm_prefetch((const char *)(pf + j * ldb + k), PF_HINT);
        __m256 b[8];
        for (int j = 0; j < NR; j++) b[j] = _mm256_loadu_ps(B + j * ldb + k);
        for (int i = 0; i < MR; i++) {
            __m256 a = _mm256_loadu_ps(A + i * lda + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    if (k < K) {
        __m256i mk = mask_256(K - k);
        __m256 b[8];
        for (int j = 0; j < NR; j++) b[j] = _mm256_maskload_ps(B + j * ldb + k, mk);
        for (int i = 0; i < MR; i++) {
            __m256 a = _mm256_maskload_ps(A + i * lda + k, mk);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    __m256 z = _mm256_setzero_ps();
    for (int i = 0; i < MR; i++) {
        float *c = C + i * ldc;
        if (NR == 1) {
            float r = _mm_cvtss_f32(hsum4_256(acc[i][0], z, z, z));
            c[0] = beta1 ? c[0] + r : r;
            continue;
        }
        for (int j = 0; j < NR; j += 4) {
            __m128 r = hsum4_256(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]);
            if (beta1) r = _mm_add_ps(_mm_loadu_ps(c + j), r);
            _mm_storeu_ps(c + j, r);
        }
    }
}

INLINE T256 void rows_nt_256(const int MR, const int NR, int M, int K, const float *A, long lda, const float *B,
                             long ldb, int beta1, float *C, long ldc, const float *pf) {
    int tiles = (M + MR - 1) / MR, t = 0, m = 0;
#define TILE(mr) tile_nt_256(mr, NR, K, A + m * lda, lda, B, ldb, beta1, C + m * ldc, ldc, pf, t, tiles)
    for (; m + MR <= M; m += MR, t++) TILE(MR); /* 3 x 4: 12 accumulators + 4 weights of the 16 ymm registers */
    if (MR > 2 && M - m == 2) TILE(2);
    if (M - m == 1) TILE(1);
#undef TILE
}

/* 1 and 2 rows in tiles of 8 weight rows (2 x 8 spills a few accumulators, and is still faster): a 1-row pass of
 * the default model's products 35.7 -> 31.7 ms, 2 rows 35.5 -> 32.8 ms on one thread (Zen 4 running this path;
 * /tmp-style interleaved timing); the same bits at every width, as for AVX-512 above. */
#ifndef NR256_ONE
#define NR256_ONE 8
#endif
#ifndef NR256_TWO
#define NR256_TWO 8
#endif
static T256 void nt_256(int M, int n0, int n1, int K, const float *A, long lda, const float *B, long ldb,
                        int beta1, float *C, long ldc) {
    int n = n0;
#define COLS(MR, NR)                                                                                               \
    for (; n + (NR) <= n1; n += (NR))                                                                              \
        rows_nt_256(MR, NR, M, K, A, lda, B + n * ldb, ldb, beta1, C + n, ldc, PF(NR))
    if (M <= 1)
        COLS(1, NR256_ONE);
    else if (M <= 2)
        COLS(2, NR256_TWO);
    else
        COLS(3, 4);
#undef COLS
    for (; n < n1; n++) rows_nt_256(3, 1, M, K, A, lda, B + n * ldb, ldb, beta1, C + n, ldc, 0);
}

/* An MR x NV tile of C = A B (NV vectors of 8 columns; the last one `last` columns wide, masked when `last` < 8;
 * MR, NV and whether `last` is 8 are compile-time constants after inlining, so acc lives in registers). Every
 * element is one FMA chain over k in order from zero: the tile shape only decides how many chains run side by
 * side (enough to cover the FMA latency: a lone row takes 8 vectors of columns at once). */
INLINE T256 void tile_nn_256(const int MR, const int NV, const int FULL, int K, const float *A, long lda,
                             const float *B, long ldb, int beta1, float *C, long ldc, int last) {
    __m256 acc[3][8];
    __m256i mk = mask_256(last);
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m256 b[8];
        const float *bk = B + k * ldb;
        for (int v = 0; v < NV; v++)
            b[v] = FULL || v < NV - 1 ? _mm256_loadu_ps(bk + 8 * v) : _mm256_maskload_ps(bk + 8 * v, mk);
        for (int i = 0; i < MR; i++) {
            __m256 a = _mm256_broadcast_ss(A + i * lda + k);
            for (int v = 0; v < NV; v++) acc[i][v] = _mm256_fmadd_ps(a, b[v], acc[i][v]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < NV; v++) {
            float *c = C + i * ldc + 8 * v;
            __m256 r = acc[i][v];
            if (FULL || v < NV - 1) {
                if (beta1) r = _mm256_add_ps(_mm256_loadu_ps(c), r);
                _mm256_storeu_ps(c, r);
            } else {
                if (beta1) r = _mm256_add_ps(_mm256_maskload_ps(c, mk), r);
                _mm256_maskstore_ps(c, mk, r);
            }
        }
}

/* Columns [n0, n1) of MR rows: tiles of NV vectors, then the rest (a partial last vector masked). */
INLINE T256 void cols_nn_256(const int MR, const int NV, int n0, int n1, int K, const float *A, long lda,
                             const float *B, long ldb, int beta1, float *C, long ldc) {
    int n = n0;
    for (; n + 8 * NV <= n1; n += 8 * NV) tile_nn_256(MR, NV, 1, K, A, lda, B + n, ldb, beta1, C + n, ldc, 8);
    int rest = n1 - n, nv = (rest + 7) / 8, last = rest - 8 * (nv - 1);
#define REST(k)                                                                                                    \
    case k:                                                                                                        \
        if (last == 8)                                                                                             \
            tile_nn_256(MR, k < NV ? k : NV, 1, K, A, lda, B + n, ldb, beta1, C + n, ldc, 8);                      \
        else                                                                                                       \
            tile_nn_256(MR, k < NV ? k : NV, 0, K, A, lda, B + n, ldb, beta1, C + n, ldc, last);                   \
        break;
    switch (nv) {
        REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8)
    default:
        break;
    }
#undef REST
}

static T256 void nn_256(int M, int n0, int n1, int K, const float *A, long lda, const float *B, long ldb,
                        int beta1, float *C, long ldc) {
    int m = 0;
    for (; m + 3 <= M; m += 3) cols_nn_256(3, 4, n0, n1, K, A + m * lda, lda, B, ldb, beta1, C + m * ldc, ldc);
    if (M - m == 2) cols_nn_256(2, 4, n0, n1, K, A + m * lda, lda, B, ldb, beta1, C + m * ldc, ldc);
    if (M - m == 1) cols_nn_256(1, 8, n0, n1, K, A + m * lda, lda, B, ldb, beta1, C + m * ldc, ldc);
}
#endif /* PTP_X86 */

static kern_fn kern_nt = nt_portable, kern_nn = nn_portable;
static const char *path_name = "portable";

/* Select a path by name ("avx512", "avx2", "portable"; NULL = the best this CPU runs). Returns 1 if it is now
 * in use. (Static: an exported name called from inside would bind to another copy of the library loaded in
 * the same process.) */
static int use_path(const char *name) {
    int best = name == 0;
#ifdef PTP_X86
    __builtin_cpu_init();
    if ((best || !strcmp(name, "avx512")) && __builtin_cpu_supports("avx512f")) {
        kern_nt = nt_512, kern_nn = nn_512, path_name = "avx512";
        return 1;
    }
    if ((best || !strcmp(name, "avx2")) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        kern_nt = nt_256, kern_nn = nn_256, path_name = "avx2";
        return 1;
    }
#endif
    if (best || !strcmp(name, "portable")) {
        kern_nt = nt_portable, kern_nn = nn_portable, path_name = "portable";
        return 1;
    }
    return 0;
}

__attribute__((constructor)) static void choose_path(void) { use_path(0); }

/* ---- an optional second thread ----
 * The caller and the worker claim chunks of N from one counter, so a worker the OS has not scheduled yet (two
 * cores, MLX's own thread, a busy machine) costs nothing: the caller then takes every chunk itself, and waits
 * only for a chunk the worker has started. A chunk is all M rows of some columns, so no element's arithmetic
 * depends on who computes it. The claim word is (job << 32 | next chunk): a worker late for a job cannot claim
 * in the next one. */

/* After a job the worker lingers this long, yielding its core to any thread that wants it, before it sleeps on
 * the condition variable. Waking a sleeping worker costs the caller a futex call and, under a hypervisor, an
 * interrupt to the other virtual CPU, once per product after a gap longer than the spin (attention and the norms
 * between two products often take longer). How much that costs depends on the host: in one phase of this VM a
 * plain step took 47.5-48.5 ms without lingering and 42.2-43.2 ms with it (0.5, 1, 2, 5 or 20 ms alike); in a later
 * phase 42.2-42.8 ms either way (`docs/results/kernel/linger-2026-12-04.md`). 1 ms covers the gaps inside a pass,
 * and the worker still sleeps through the host's longer work between calls. */
#ifndef LINGER_NS
#define LINGER_NS 1000000
#endif

static struct {
    pthread_t tid;
    int started, wanted, min_work, spin, busy, sleeping;
    long long linger_ns;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the job: written by the caller before it publishes `claim`, read after a successful claim; `gen` (with
     * `gctx`) instead of `fn`: a generic job of `chunks` units (ptp_sgemm_parallel) */
    kern_fn fn;
    void (*gen)(void *, int);
    void *gctx;
    int M, N, K, beta1, chunk, chunks;
    const float *A, *B;
    float *C;
    long lda, ldb, ldc;
    uint64_t claim;
    unsigned job;
    int finished;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .min_work = 1 << 18, .spin = 1 << 16,
        .linger_ns = LINGER_NS};

/* Claim and compute chunks of job `job` until none is left. */
static void work(unsigned job) {
    uint64_t c = __atomic_load_n(&pool.claim, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((unsigned)(c >> 32) != job || (uint32_t)c >= (uint32_t)pool.chunks) return;
        if (!__atomic_compare_exchange_n(&pool.claim, &c, c + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
        int n0 = (int)(uint32_t)c * pool.chunk, n1 = n0 + pool.chunk < pool.N ? n0 + pool.chunk : pool.N;
        if (pool.gen)
            pool.gen(pool.gctx, n0);
        else
            pool.fn(pool.M, n0, n1, pool.K, pool.A, pool.lda, pool.B, pool.ldb, pool.beta1, pool.C, pool.ldc);
        __atomic_fetch_add(&pool.finished, 1, __ATOMIC_RELEASE);
        c = __atomic_load_n(&pool.claim, __ATOMIC_ACQUIRE);
    }
}

static void *worker(void *arg) {
    (void)arg;
    unsigned seen = 0;
    for (;;) {
        /* spin a while (a pass's calls come tens of microseconds apart), then linger, yielding the core to any
         * thread that wants it, until `linger_ns` have passed since the last job, then sleep until the next job.
         * No pause instruction: under a hypervisor, pause loops get the virtual CPU descheduled. */
        for (int i = 0; i < pool.spin && __atomic_load_n(&pool.job, __ATOMIC_SEQ_CST) == seen; i++)
            __asm__ __volatile__("" ::: "memory");
        long long linger = __atomic_load_n(&pool.linger_ns, __ATOMIC_RELAXED); /* (set from another thread) */
        if (linger > 0 && __atomic_load_n(&pool.job, __ATOMIC_SEQ_CST) == seen) {
            unsigned long long until = now_ns() + (unsigned long long)linger;
            while (__atomic_load_n(&pool.job, __ATOMIC_SEQ_CST) == seen && now_ns() < until) {
                for (int i = 0; i < 256 && __atomic_load_n(&pool.job, __ATOMIC_SEQ_CST) == seen; i++)
                    __asm__ __volatile__("" ::: "memory");
                sched_yield();
            }
        }
        if (__atomic_load_n(&pool.job, __ATOMIC_SEQ_CST) == seen) {
            pthread_mutex_lock(&pool.mu);
            __atomic_store_n(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
            while (__atomic_load_n(&pool.job, __ATOMIC_SEQ_CST) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            __atomic_store_n(&pool.sleeping, 0, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = __atomic_load_n(&pool.job, __ATOMIC_SEQ_CST);
        work(seen);
    }
    return 0;
}

static void share(void);

static void run(kern_fn fn, int M, int N, int K, const float *A, long lda, const float *B, long ldb, int beta1,
                float *C, long ldc) {
    if (!pool.started || !pool.wanted || (long)N * K < pool.min_work || N < 64 ||
        __atomic_exchange_n(&pool.busy, 1, __ATOMIC_ACQUIRE)) { /* busy: another caller thread has it */
        fn(M, 0, N, K, A, lda, B, ldb, beta1, C, ldc);
        return;
    }
    /* about 16 chunks of whole tiles: few enough that each keeps its prefetch stream, enough to balance */
    int chunk = ((N + 15) / 16 + 47) / 48 * 48; /* (48: whole tiles of 3, 4, 6 or 8 weight rows) */
    pool.fn = fn, pool.gen = 0, pool.M = M, pool.N = N, pool.K = K, pool.beta1 = beta1, pool.chunk = chunk;
    pool.chunks = (N + chunk - 1) / chunk;
    pool.A = A, pool.lda = lda, pool.B = B, pool.ldb = ldb, pool.C = C, pool.ldc = ldc;
    share();
}

/* Publish the job written into `pool`, wake the worker if it sleeps, compute chunks beside it, wait for all. */
static void share(void) {
    pool.finished = 0;
    unsigned job = pool.job + 1;
    __atomic_store_n(&pool.claim, (uint64_t)job << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.job, job, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleeping, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_signal(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    work(job);
    for (int i = 0; __atomic_load_n(&pool.finished, __ATOMIC_ACQUIRE) != pool.chunks; i++)
        if (i > 1 << 14) sched_yield(); /* the worker was descheduled inside its chunk */
    /* No late claim of this job: a worker still inside work() after its last chunk (descheduled between its count
     * and its next look at the claim) could otherwise read the next job's `chunks`, claim an index past this job's
     * end before the next claim is published, run it with the next job's fields and count it into the next job's
     * `finished` after share() reset it (2026-12-05: finished 13 of 12, the stream thread waiting for good). The
     * fence keeps the next job's fields from being seen before this store. */
    __atomic_store_n(&pool.claim, ((uint64_t)job << 32) | 0xFFFFFFFFu, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(&pool.busy, 0, __ATOMIC_RELEASE);
}

/* fn(ctx, i) for i in [0, n), shared with the worker where there is one and it is free (else all here, in order);
 * returns when every unit is done. For ptp-mlx's CPU primitives (attention: its heads), which find it with dlsym:
 * the worker waits beside MLX's stream thread between products anyway. Returns the threads used (1 or 2). */
int ptp_sgemm_parallel(void (*fn)(void *, int), void *ctx, int n) {
    if (n <= 0) return 1;
    if (n == 1 || !pool.started || !pool.wanted || __atomic_exchange_n(&pool.busy, 1, __ATOMIC_ACQUIRE)) {
        for (int i = 0; i < n; i++) fn(ctx, i);
        return 1;
    }
    pool.fn = 0, pool.gen = fn, pool.gctx = ctx, pool.N = n, pool.chunk = 1, pool.chunks = n;
    share();
    return 2;
}

#include "packed.c" /* products over registered codes (pk_try) */

/* ---- the exported entry points ---- */

/* Plain C, for a process with no fallback at all: every case the interface allows, row-major. */
static void sgemm_naive(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                        int ldb, float beta, float *C, int ldc) {
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float s = 0;
            for (int k = 0; k < K; k++)
                s += (ta == Trans ? A[(long)k * lda + m] : A[(long)m * lda + k]) *
                     (tb == Trans ? B[(long)n * ldb + k] : B[(long)k * ldb + n]);
            float *c = C + (long)m * ldc + n;
            *c = beta == 0.0f ? alpha * s : alpha * s + beta * *c;
        }
}

/* Whether the A B^T tiles of M rows load A's rows inside their FMAs (every path but AVX-512 past 8 rows, whose
 * tiles hold each row in a register: there the copy costs more than the straddling loads, 16 rows 25.4 -> 24.0 ms
 * a pass of the products without it, 8 rows 17.8 -> 21.8 ms without it; docs/results/kernel/register-rows/). */
static int folds_rows(int M) {
#ifdef PTP_X86
    if (kern_nt == nt_512) return M <= RA_ROWS;
#endif
    return 1;
}
/* A's rows copied to 64-byte aligned rows, when they are not: MLX's allocator puts arrays 8 bytes past a
 * 16-byte boundary, and a 64-byte load that straddles two cache lines costs two. M x K floats per call, next to
 * the M x N x K multiply-adds, and the values are the same, so the arithmetic is too. */
static const float *aligned_rows(int M, int K, const float *A, long *lda) {
    static __thread float *buf;
    static __thread size_t cap;
    long ld = (K + 15) & ~15L;
    if (((uintptr_t)A & 63) == 0 && (*lda & 15) == 0) return A;
    size_t need = (size_t)M * ld;
    if (need > cap) {
        void *p = 0;
        if (posix_memalign(&p, 64, need * sizeof(float))) return A;
        free(buf);
        buf = p, cap = need;
    }
    for (int m = 0; m < M; m++) memcpy(buf + m * ld, A + m * *lda, K * sizeof(float));
    *lda = ld;
    return buf;
}

/* A forwarded row-major product C = op(A) op(B), split in two halves across the pool (``fwd_half``). */
#define FWD_SPLIT_WORK (1 << 23) /* multiply-adds: below it (about 0.1 ms), the handover costs more than it gains */
struct fwd {
    int ta, tb, M, N, K;
    float alpha, beta;
    const float *A;
    int lda;
    const float *B;
    int ldb;
    float *C;
    int ldc, by_cols;
};

/* Half `i` of a split forward: the same fallback call on half of C's columns (by_cols) or rows. A column of C
 * is op(B)'s column: row n of B when B is transposed, else column n; a row of C is op(A)'s row likewise. */
static void fwd_half(void *ctx, int i) {
    const struct fwd *f = ctx;
    int whole = f->by_cols ? f->N : f->M, lo = i == 0 ? 0 : whole / 2, n = i == 0 ? whole / 2 : whole - whole / 2;
    const float *A = f->A, *B = f->B;
    float *C = f->C;
    int M = f->M, N = f->N;
    if (f->by_cols)
        B += f->tb == Trans ? (long)lo * f->ldb : lo, C += lo, N = n;
    else
        A += f->ta == Trans ? lo : (long)lo * f->lda, C += (long)lo * f->ldc, M = n;
    fallback(RowMajor, f->ta, f->tb, M, N, f->K, f->alpha, A, f->lda, B, f->ldb, f->beta, C, f->ldc);
}

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    /* Column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T: the same call with the operands swapped. */
    int o = order, rta = ta, rtb = tb, rM = M, rN = N, rlda = lda, rldb = ldb;
    const float *rA = A, *rB = B;
    if (order == ColMajor) o = RowMajor, rta = tb, rtb = ta, rM = N, rN = M, rA = B, rB = A, rlda = ldb, rldb = lda;
    int ok = enabled && o == RowMajor && rta == NoTrans && (rtb == NoTrans || rtb == Trans) && alpha == 1.0f &&
             (beta == 0.0f || beta == 1.0f) && rM >= 1 && rM <= max_m && rN >= 1 && K >= 1 && rlda >= K &&
             rldb >= (rtb == Trans ? K : rN) && ldc >= rN;
    if (ok) {
        unsigned long long t0 = now_ns();
        __atomic_fetch_add(&n_taken, 1, __ATOMIC_RELAXED);
        long la = rlda;
        if (rtb == Trans && folds_rows(rM)) rA = aligned_rows(rM, K, rA, &la);
        if (rtb != Trans || !pk_try(rM, rN, K, rA, la, rB, rldb, beta == 1.0f, C, ldc))
            run(rtb == Trans ? kern_nt : kern_nn, rM, rN, K, rA, la, rB, rldb, beta == 1.0f, C, ldc);
        __atomic_fetch_add(&ns_taken, now_ns() - t0, __ATOMIC_RELAXED);
        return;
    }
    unsigned long long t0 = now_ns();
    __atomic_fetch_add(&n_forwarded, 1, __ATOMIC_RELAXED);
    if (fallback && pool.started && pool.wanted && (double)rM * rN * K >= FWD_SPLIT_WORK && (rN >= 128 || rM >= 128)) {
        /* A large product (a prefill's): the fallback (a one-thread BLAS) on both cores, each half of C's columns
         * (or, with few columns, of its rows) by one call on its own thread. */
        struct fwd f = {rta, rtb, rM, rN, K, alpha, beta, rA, rlda, rB, rldb, C, ldc, rN >= 128};
        ptp_sgemm_parallel(fwd_half, &f, 2);
    } else if (fallback)
        fallback(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    else if ((o == RowMajor) && (rta == NoTrans || rta == Trans) && (rtb == NoTrans || rtb == Trans))
        sgemm_naive(rta, rtb, rM, rN, K, alpha, rA, rlda, rB, rldb, beta, C, ldc);
    __atomic_fetch_add(&ns_forwarded, now_ns() - t0, __ATOMIC_RELAXED);
}

/* Tests use it to cover every path this machine can run; a process should not switch mid-way. */
int ptp_sgemm_use(const char *name) { return use_path(name); }
void ptp_sgemm_set_fallback(void *fn) { memcpy(&fallback, &fn, sizeof fallback); } /* ISO C: no cast */
void ptp_sgemm_enable(int on) { enabled = on != 0; }
const char *ptp_sgemm_info(void) { return path_name; }
int ptp_sgemm_max_m(void) { return max_m; }
/* m >= 1: the kernel takes calls of at most m rows from now on (benchmarks compare it with the BLAS; a process
 * should not switch mid-way); returns the value in use. */
int ptp_sgemm_set_max_m(int m) {
    if (m >= 1) max_m = m;
    return max_m;
}
/* Whether cblas_sgemm computes C = A B^T of M rows itself: then each column of C is the same whatever other
 * columns the call has (one accumulator per element), so a caller may fold more weight rows into one call
 * (ptp-gated-linear: the LoRA's A rows after the projection's). */
int ptp_sgemm_takes_nt(int M) { return enabled && M >= 1 && M <= max_m; }
unsigned long long ptp_sgemm_taken(void) { return __atomic_load_n(&n_taken, __ATOMIC_RELAXED); }
unsigned long long ptp_sgemm_forwarded(void) { return __atomic_load_n(&n_forwarded, __ATOMIC_RELAXED); }
/* Nanoseconds spent in the calls taken and forwarded, for profiles (ptp-bench --profile). */
unsigned long long ptp_sgemm_taken_ns(void) { return __atomic_load_n(&ns_taken, __ATOMIC_RELAXED); }
unsigned long long ptp_sgemm_forwarded_ns(void) { return __atomic_load_n(&ns_forwarded, __ATOMIC_RELAXED); }

/* How long the worker lingers after a job (yielding its core to any thread that wants it) before it sleeps;
 * ns < 0 changes nothing. Returns the value now in use. */
long long ptp_sgemm_set_linger(long long ns) {
    if (ns >= 0) __atomic_store_n(&pool.linger_ns, ns, __ATOMIC_RELAXED);
    return __atomic_load_n(&pool.linger_ns, __ATOMIC_RELAXED);
}

/* n = 2: a second thread shares the products of at least min_work weights (N x K; 0 keeps the default), and
 * spins `spin` rounds (0: the default) before it sleeps; n = 1: none; n = 0 changes nothing. Returns the number now in use. ptp_mlx/blas.py asks
 * for it where there are two cores (PTP_MLX_SGEMM_THREADS=1: not): each step measured about 25% faster there. */
int ptp_sgemm_set_threads(int n, int min_work, int spin) {
    if (min_work > 0) pool.min_work = min_work;
    if (spin > 0) pool.spin = spin;
    if (n >= 2 && !pool.started) pool.started = pthread_create(&pool.tid, 0, worker, 0) == 0;
    if (n > 0) pool.wanted = n >= 2; /* n = 0: only ask */
    return pool.started && pool.wanted ? 2 : 1;
}

/* C = A B^T (beta 0) on this thread with the decode kernel, whatever ptp_sgemm_enable says: for ptp-mlx's CPU
 * primitives (attention's scores), whose rows must come out alike at every width. 0 (nothing done) where M is
 * out of the kernel's range. */
int ptp_sgemm_nt(int M, int N, int K, const float *A, long lda, const float *B, long ldb, float *C, long ldc) {
    if (M < 1 || M > max_m || N < 1 || K < 1 || lda < K || ldb < K || ldc < N) return 0;
    A = aligned_rows(M, K, A, &lda);
    kern_nt(M, 0, N, K, A, lda, B, ldb, 0, C, ldc);
    return 1;
}
