/* Stress of ptp-sgemm's pool (tests/test_kernels.py): back-to-back jobs of different chunk counts (products of N = 576
 * and 3072 columns, ptp_sgemm_parallel jobs of 40 units), every unit counted, products checked against the first.
 * Exits 0, or 1 on a wrong product or unit count; a late claim of a finished job can hang it (the test times it out). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
typedef int (*par_fn)(void (*)(void *, int), void *, int);
typedef int (*thr_fn)(int, int, int);
static int counts[64];
static void unit(void *ctx, int i) { (void)ctx; __atomic_fetch_add(&counts[i], 1, __ATOMIC_RELAXED); }
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    sgemm_fn sg = (sgemm_fn)dlsym(h, "cblas_sgemm");
    par_fn par = (par_fn)dlsym(h, "ptp_sgemm_parallel");
    thr_fn thr = (thr_fn)dlsym(h, "ptp_sgemm_set_threads");
    thr(2, 0, 0);
    int iters = argc > 2 ? atoi(argv[2]) : 20000, K = 576;
    int Ns[2] = {576, 3072};
    float *A = malloc(sizeof(float) * 4 * K), *B = malloc(sizeof(float) * 3072 * K);
    float *C = malloc(sizeof(float) * 4 * 3072), *R[2];
    for (int i = 0; i < 4 * K; i++) A[i] = (float)((i * 7) % 13) - 6.0f;
    for (int i = 0; i < 3072 * K; i++) B[i] = (float)((i * 5) % 11) - 5.0f;
    for (int j = 0; j < 2; j++) {
        R[j] = malloc(sizeof(float) * 4 * Ns[j]);
        sg(101, 111, 112, 4, Ns[j], K, 1.0f, A, K, B, K, 0.0f, R[j], Ns[j]);
    }
    for (int it = 0; it < iters; it++) {
        int j = it % 2;
        sg(101, 111, 112, 4, Ns[j], K, 1.0f, A, K, B, K, 0.0f, C, Ns[j]);
        if (j == 0) {
            memset(counts, 0, sizeof counts);
            par(unit, 0, 40);
            for (int u = 0; u < 40; u++)
                if (counts[u] != 1) { fprintf(stderr, "unit %d ran %d times at %d\n", u, counts[u], it); return 1; }
        }
        if (it % 64 == 63 && memcmp(C, R[j], sizeof(float) * 4 * Ns[j])) { fprintf(stderr, "wrong product at %d\n", it); return 1; }
    }
    return 0;
}
