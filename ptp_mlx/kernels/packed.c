/* Packed weights: float32 matrices whose every value is a 4- or 8-bit code times a scale plus an offset, read
 * from their codes (included by sgemm.c, which it extends; project issue 41).
 *
 * Why: a model converted from a quantized GGUF to float32 (the default model: Q4_1 projections, a Q8_0 head) holds
 * in 32 bits what its file held in 4 to 8. A decode pass reads every weight once, and on this kind of CPU that
 * read is what a few-row product waits for. Python (ptp_mlx/kernels/packed.py) finds such matrices, proves each
 * value is w = fma(q, d, m) exactly (q an integer code, d and m per group of 32 values along K: q * d is exact,
 * so fma and the product-then-sum give the same float), and registers the codes beside the float32 matrix, which
 * stays where it is. A product C = A B^T whose B lies inside a registered matrix is computed from the codes: each
 * B vector is rebuilt bit for bit in registers and meets the very fused multiply-adds, in the same order, and the
 * same horizontal-sum tree as the AVX-512 float path (tile_nt_512), so every element is bit for bit what that path
 * gives, at every width: the packed form changes how many bytes a product reads, never a result.
 *
 * Layout of one packed row (K / 32 groups, `gbytes` each): the group's codes, then d and m (float32). 4-bit codes:
 * byte j holds the codes of k = j (low nibble) and k = j + 16 (high); 8-bit: one byte per k. "16 bits": values
 * that are bfloat16 numbers (the adapter's A rows, held at that precision), stored as their high halves and
 * widened exactly (a shift), 32 per group, no d or m. Only the AVX-512 path
 * reads them (another path leaves the registry unused: ptp_sgemm_packs() says which). */

#define PK_MAX 8192 /* registered matrices (the default model: 211 of codes and 120 adapter A runs; a test process
                     * loads many models) */
/* Tiles by rows: 2 x PK_NR2 up to two rows, 4 x PK_NR4 up to four, PK_MR x PK_NR beyond; products of more than
 * PK_MAX_M rows read the floats, whose register-row tiles (nt_512) then win. Measured 2026-12-05 on the default
 * model's 211 products, two threads, ms a pass, floats / codes: 1 row 17.7 / 7.0, 4 rows 17.8 / 9.9, 8 rows
 * 19.4 / 15.4, 10 rows 21.1 / 19.3, 11 rows 21.6 / 20.9, 12 rows 22.0 / 22.5, 16 rows 27.1 / 27.8. Tiles of
 * 8 x 3 (the floats' shape) ran out of registers here (8 rows 18.6, 16 rows 34.4); 8 x 2 beat 6 x 3, 5 x 4 and
 * 4 x 4; 4 x 4 beat 4 x 5 and 4 x 6 at three and four rows. Either way each element has the same bits. With the
 * lookup (ptile) the floats win from 11 rows (three runs, ms: 10 rows 19.7 / 19.3, 11 rows 20.1 / 20.7). */
#ifndef PK_MR
#define PK_MR 8
#define PK_NR 2
#endif
#ifndef PK_NR2
#define PK_NR2 8
#endif
#ifndef PK_NR4
#define PK_NR4 4
#endif
#ifndef PK_MAX_M
#define PK_MAX_M 10
#endif

struct packed {
    const float *base; /* the float32 matrix [rows, K], row-contiguous, that the codes stand for */
    int rows, K, bits, gbytes;
    const unsigned char *data; /* rows x (K / 32) groups */
};

static struct packed pk_table[PK_MAX];
static int pk_count; /* entries [0, pk_count) are valid; written under pk_mu, read without it (see pk_find) */
/* Products between finding an entry and their last read of its codes: a matrix forgotten (or re-registered) waits
 * for none before its caller frees the old codes, which a product in flight on another thread may still read (a
 * model released while a step of it computes: at exit, a segmentation fault in pk_chunk). Seq-cst on both sides:
 * a product counts itself before it loads `data`, the forgetting thread clears `data` before it reads the count. */
static int pk_readers;

/* Wait until no product reads codes found before now. */
static void pk_quiesce(void) {
    while (__atomic_load_n(&pk_readers, __ATOMIC_SEQ_CST)) sched_yield();
}
static pthread_mutex_t pk_mu = PTHREAD_MUTEX_INITIALIZER;
static int pk_on = 1;
static unsigned long long pk_hits;

/* Bytes a group of 32 values takes: codes then d and m (float32) for 4 and 8 bits; 32 bfloat16 halves for 16. */
static int pk_gbytes(int bits) { return bits == 16 ? 64 : bits * 4 + 8; }

/* Write entry `e` for `base`, its codes published last (a reader that sees them sees the fields). */
static void pk_fill(struct packed *e, const float *base, int rows, int K, int bits, const unsigned char *data) {
    e->base = base, e->rows = rows, e->K = K, e->bits = bits, e->gbytes = pk_gbytes(bits);
    __atomic_store_n(&e->data, data, __ATOMIC_RELEASE);
}

/* Register the codes of `base` ([rows, K]); 0 where nothing is kept (a full table, a shape the kernel does not
 * read, a path without the kernel). The caller keeps `data` and `base` alive until ptp_sgemm_unpack(base). */
int ptp_sgemm_pack(const float *base, int rows, int K, int bits, const unsigned char *data) {
    if (!base || !data || rows < 1 || K < 32 || K % 32 || (bits != 4 && bits != 8 && bits != 16)) return 0;
    pthread_mutex_lock(&pk_mu);
    int ok = 0;
    for (int i = 0; i < pk_count; i++)
        if (pk_table[i].base == base) { /* re-registered: the new codes replace the old in place */
            __atomic_store_n(&pk_table[i].data, (const unsigned char *)0, __ATOMIC_SEQ_CST);
            pk_quiesce(); /* (the caller frees the old codes next) */
            pk_fill(&pk_table[i], base, rows, K, bits, data);
            ok = 1;
        }
    for (int i = 0; !ok && i < pk_count; i++)
        if (!pk_table[i].data) { /* a forgotten matrix's entry: no product reads it (its codes are null) */
            pk_fill(&pk_table[i], base, rows, K, bits, data);
            ok = 1;
        }
    if (!ok && pk_count < PK_MAX) {
        pk_fill(&pk_table[pk_count], base, rows, K, bits, data);
        __atomic_store_n(&pk_count, pk_count + 1, __ATOMIC_RELEASE);
        ok = 1;
    }
    pthread_mutex_unlock(&pk_mu);
    return ok;
}

/* Forget the codes of `base` (before its memory is freed): products over it read the floats again. An entry is
 * cleared, never moved, so a product in flight on another thread sees either the codes or none; returns once no
 * product still reads the codes it found before. */
int ptp_sgemm_unpack(const float *base) {
    int n = 0;
    pthread_mutex_lock(&pk_mu);
    for (int i = 0; i < pk_count; i++)
        if (pk_table[i].base == base && pk_table[i].data) {
            __atomic_store_n(&pk_table[i].data, (const unsigned char *)0, __ATOMIC_SEQ_CST);
            n++;
        }
    pthread_mutex_unlock(&pk_mu);
    if (n) pk_quiesce();
    return n;
}

/* The number of matrices whose codes are in use. */
int ptp_sgemm_packed_count(void) {
    int n = 0, c = __atomic_load_n(&pk_count, __ATOMIC_ACQUIRE);
    for (int i = 0; i < c; i++) n += __atomic_load_n(&pk_table[i].data, __ATOMIC_ACQUIRE) != 0;
    return n;
}

/* on = 0: products read the floats even where codes are registered (for comparisons); returns the setting. */
int ptp_sgemm_packed_enable(int on) {
    if (on >= 0) pk_on = on != 0;
    return pk_on;
}

/* The entry whose matrix holds rows B .. of a product with `ldb` (its own row length) and K, and the first row;
 * 0 if none. Calls come in layer order, so the entry after the last hit is tried first. */
static const struct packed *pk_find(const float *B, long ldb, int K, int *row0, const unsigned char **data) {
    static __thread int hint;
    int c = __atomic_load_n(&pk_count, __ATOMIC_ACQUIRE);
    for (int t = 0; t < c; t++) {
        int i = (hint + t) % c;
        const struct packed *e = &pk_table[i];
        const unsigned char *d = __atomic_load_n(&e->data, __ATOMIC_SEQ_CST); /* (after pk_readers counts us) */
        if (!d || e->K != K || ldb != K || B < e->base || B >= e->base + (long)e->rows * K) continue;
        long off = B - e->base;
        if (off % K) continue;
        hint = i + 1;
        *row0 = (int)(off / K), *data = d;
        return e;
    }
    return 0;
}

#ifdef PTP_X86
/* Columns [n0, n1) of C = A B^T from B's codes, in MR x NR tiles as tile_nt_512 runs them: per 16 values of K,
 * the NR weight vectors (rebuilt from codes), then each row's FMAs into its accumulators; then hsum4_512.
 * A 4-bit group's 16 possible values are one vector, fma(0..15, d, m), so each of its weights is a lookup
 * (vpermps by the code's low four bits) of exactly the value fma(code, d, m) gives: one FMA a group instead of
 * a conversion and an FMA every 16 weights (the model's products, two threads: 1 row 7.0 -> 6.4-6.7 ms, 2 rows
 * 8.5 -> 7.6-7.9, 8 rows 15.3 -> 14.9; two builds timed in turn, 2026-12-05). */
INLINE T512 void ptile(const int MR, const int NR, const int BITS, int K, const float *A, long lda,
                       const unsigned char *P, long prow, int gbytes, int beta1, float *C, long ldc,
                       const unsigned char *pf) {
    __m512 acc[8][8];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int g = 0, k = 0; k < K; g++, k += 32) {
        const unsigned char *grp = P + (long)g * gbytes;
        if (pf)
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(pf + j * prow + (long)g * gbytes), PF_HINT);
        if (BITS == 4) {
            __m512 lut[8];
            for (int j = 0; j < NR; j++) {
                const float *dm = (const float *)(grp + j * prow + 16);
                lut[j] = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[0]), _mm512_set1_ps(dm[1]));
            }
            for (int h = 0; h < 2; h++) {
                __m512 a[8];
                for (int i = 0; i < MR; i++) {
                    a[i] = _mm512_loadu_ps(A + i * lda + k + 16 * h);
                    __asm__("" : "+v"(a[i]));
                }
                for (int j = 0; j < NR; j++) {
                    __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(grp + j * prow)));
                    if (h) x = _mm512_srli_epi32(x, 4);
                    __m512 b = _mm512_permutexvar_ps(x, lut[j]); /* uses the index's low four bits only */
                    for (int i = 0; i < MR; i++) acc[i][j] = _mm512_fmadd_ps(a[i], b, acc[i][j]);
                }
            }
            continue;
        }
        for (int h = 0; h < 2; h++) { /* 8 bits: a code a byte; 16: bfloat16 halves, a shift gives each float */
            __m512 b[8];
            for (int j = 0; j < NR; j++) {
                const unsigned char *q = grp + j * prow;
                if (BITS == 16) {
                    __m256i x = _mm256_loadu_si256((const __m256i *)(q + 32 * h));
                    b[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
                } else {
                    __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * h)));
                    const float *dm = (const float *)(q + 32);
                    b[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x), _mm512_set1_ps(dm[0]), _mm512_set1_ps(dm[1]));
                }
            }
            for (int i = 0; i < MR; i++) {
                __m512 a = _mm512_loadu_ps(A + i * lda + k + 16 * h);
                __asm__("" : "+v"(a)); /* one load of the row for its NR FMAs (9 rows: 20.7 -> 17.3 ms) */
                for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
            }
        }
    }
    store_nt_512(MR, NR, acc, beta1, C, ldc);
}

/* All M rows against NR packed weight rows at P (rows `prow` bytes apart), in balanced tiles of at most MR. */
INLINE T512 void prows(const int MR, const int NR, const int BITS, int M, int K, const float *A, long lda,
                       const unsigned char *P, long prow, int gbytes, int beta1, float *C, long ldc,
                       const unsigned char *pf) {
    /* the first tile streams the block and prefetches the next */
#define PT(mr) ptile(mr, NR, BITS, K, A + m * lda, lda, P, prow, gbytes, beta1, C + m * ldc, ldc, t == 0 ? pf : 0)
    BALANCED_TILES(MR, M, PT)
#undef PT
}

struct pjob {
    int M, N, K, bits, gbytes, beta1, chunk;
    const float *A;
    long lda, ldc;
    const unsigned char *P; /* the product's first packed row */
    float *C;
};

/* Tile shapes by rows: see PK_MR above (each keeps every element's arithmetic; they only schedule it). */
#define PK_COLS(MR, NR, BITS)                                                                                      \
    for (; n + (NR) <= n1; n += (NR))                                                                              \
        prows(MR, NR, BITS, j->M, j->K, j->A, j->lda, j->P + (long)n * prow, prow, j->gbytes, j->beta1, j->C + n,  \
              j->ldc, n + 2 * (NR) <= n1 ? j->P + (long)(n + (NR)) * prow : 0)
#define PK_ALL(BITS)                                                                                               \
    do {                                                                                                           \
        if (j->M <= 2)                                                                                             \
            PK_COLS(2, PK_NR2, BITS);                                                                              \
        else if (j->M <= 4)                                                                                        \
            PK_COLS(4, PK_NR4, BITS);                                                                              \
        else                                                                                                       \
            PK_COLS(PK_MR, PK_NR, BITS);                                                                           \
        PK_COLS(8, 1, BITS);                                                                                       \
    } while (0)

static T512 void pk_chunk(void *ctx, int i) {
    const struct pjob *j = ctx;
    long prow = (long)(j->K / 32) * j->gbytes;
    int n = i * j->chunk, n1 = n + j->chunk < j->N ? n + j->chunk : j->N;
    if (j->bits == 4)
        PK_ALL(4);
    else if (j->bits == 8)
        PK_ALL(8);
    else
        PK_ALL(16);
}
#undef PK_ALL
#undef PK_COLS

/* A product's runs of registered rows (a fused group's base codes, then its adapter's A rows as bfloat16 halves):
 * one job of column chunks over all of them, so a run too short to split (A: 16-48 rows) shares the pool with
 * the others instead of running alone on one thread after them. */
#define PK_RUNS 8
struct pruns {
    int n, first[PK_RUNS + 1]; /* run r owns chunks first[r] .. first[r + 1] */
    struct pjob j[PK_RUNS];
};

static T512 void pk_run_chunk(void *ctx, int i) {
    const struct pruns *rs = ctx;
    int r = 0;
    while (i >= rs->first[r + 1]) r++;
    pk_chunk(&rs->j[r], i - rs->first[r]);
}

static void pk_runs(struct pruns *rs) {
    long work = 0;
    for (int r = 0; r < rs->n; r++) work += (long)rs->j[r].N * rs->j[r].K;
    int chunks = rs->first[rs->n];
    if (chunks > 1 && work >= pool.min_work / 4)
        ptp_sgemm_parallel(pk_run_chunk, rs, chunks);
    else
        for (int i = 0; i < chunks; i++) pk_run_chunk(rs, i);
    rs->n = 0;
}

/* Add C[:, n..] = A B^T for B = rows row0 .. row0 + N of entry e (from its codes) to the runs, computed with
 * them once they are full or the product's last run is in. */
static void pk_add_run(struct pruns *rs, const struct packed *e, const unsigned char *data, int row0, int M, int N,
                       int K, const float *A, long lda, int beta1, float *C, long ldc) {
    long prow = (long)(K / 32) * e->gbytes;
    struct pjob j = {M, N, K, e->bits, e->gbytes, beta1, 48, A, lda, ldc, data + (long)row0 * prow, C};
    rs->j[rs->n] = j;
    rs->first[rs->n + 1] = rs->first[rs->n] + (N + j.chunk - 1) / j.chunk;
    if (++rs->n == PK_RUNS) pk_runs(rs);
}
#endif

/* Whether this product (row-major A B^T, A already aligned) was computed from codes: its weight rows in runs,
 * each run from the registered matrix that holds it (projections registered one by one still form one product
 * when they lie side by side, as a fused group's do), and rows no entry holds (a LoRA's A rows stored after a
 * group's) from the floats, which give each column the same bits whatever other columns a call has. */
#ifdef PTP_X86
static int pk_read(int M, int N, int K, const float *A, long lda, const float *B, long ldb, int beta1, float *C,
                   long ldc);
#endif
static int pk_try(int M, int N, int K, const float *A, long lda, const float *B, long ldb, int beta1, float *C,
                  long ldc) {
#ifdef PTP_X86
    if (!pk_on || M > PK_MAX_M || kern_nt != nt_512) return 0;
    __atomic_fetch_add(&pk_readers, 1, __ATOMIC_SEQ_CST);
    int done = pk_read(M, N, K, A, lda, B, ldb, beta1, C, ldc);
    __atomic_fetch_sub(&pk_readers, 1, __ATOMIC_SEQ_CST);
    return done;
#else
    (void)M, (void)N, (void)K, (void)A, (void)lda, (void)B, (void)ldb, (void)beta1, (void)C, (void)ldc;
    return 0;
#endif
}

#ifdef PTP_X86
/* pk_try's product, counted in pk_readers: 0 where no entry holds B's first row. */
static int pk_read(int M, int N, int K, const float *A, long lda, const float *B, long ldb, int beta1, float *C,
                   long ldc) {
    int row0, n = 0;
    const unsigned char *data;
    const struct packed *e = pk_find(B, ldb, K, &row0, &data);
    if (!e) return 0;
    __atomic_fetch_add(&pk_hits, 1, __ATOMIC_RELAXED);
    struct pruns rs;
    rs.n = 0, rs.first[0] = 0;
    while (e) {
        int Np = e->rows - row0 < N - n ? e->rows - row0 : N - n;
        pk_add_run(&rs, e, data, row0, M, Np, K, A, lda, beta1, C + n, ldc);
        n += Np;
        e = n < N ? pk_find(B + (long)n * ldb, ldb, K, &row0, &data) : 0;
    }
    if (rs.n) pk_runs(&rs);
    if (n < N) run(kern_nt, M, N - n, K, A, lda, B + (long)n * ldb, ldb, beta1, C + n, ldc);
    return 1;
}
#endif

/* Products computed from codes so far (for profiles and tests). */
unsigned long long ptp_sgemm_packed_hits(void) { return __atomic_load_n(&pk_hits, __ATOMIC_RELAXED); }

/* 1 where products can be computed from codes (the AVX-512 path is in use), else 0. */
int ptp_sgemm_packs(void) {
#ifdef PTP_X86
    return kern_nt == nt_512;
#else
    return 0;
#endif
}
