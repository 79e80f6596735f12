// Timing of ptp-sgemm products over 4-bit codes from C (no Python between calls): gcc -O2 -o cbench cbench.c -ldl;
// ./cbench <ptp-sgemm .so> N K matrices threads (matrices 1: data in cache; 60: from memory). A measurement, not
// part of ptp-mlx.
// C driver: many registered 4-bit matrices (cold) or one (hot); time products at M rows, 1 or 2 threads.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) { printf("%s\n", dlerror()); return 1; }
    sgemm_t sg = (sgemm_t)dlsym(h, "cblas_sgemm");
    int (*pack)(const void *, int, int, int, const void *) = dlsym(h, "ptp_sgemm_pack");
    int (*thr)(int, int, int) = dlsym(h, "ptp_sgemm_set_threads");
    int N = atoi(argv[2]), K = atoi(argv[3]), nm = atoi(argv[4]), T = atoi(argv[5]);
    thr(T, 0, 0);
    int gb = 24, G = K / 32;
    float **W = malloc(sizeof(float *) * nm);
    for (int m = 0; m < nm; m++) {
        unsigned char *codes = malloc((size_t)N * G * gb);
        for (size_t i = 0; i < (size_t)N * G; i++) {
            unsigned char *g = codes + i * gb;
            for (int b = 0; b < 16; b++) g[b] = rand() & 255;
            float d = 0.01f, mm = -0.08f; memcpy(g + 16, &d, 4); memcpy(g + 20, &mm, 4);
        }
        W[m] = malloc(sizeof(float) * (size_t)N * K);  /* floats: never read when codes are registered */
        memset(W[m], 0, sizeof(float) * (size_t)N * K);
        if (!pack(W[m], N, K, 4, codes)) { printf("pack failed\n"); return 1; }
    }
    float *A = malloc(sizeof(float) * 64 * K), *C = malloc(sizeof(float) * 64 * N);
    for (int i = 0; i < 64 * K; i++) A[i] = (rand() % 1000) * 1e-3f;
    int Ms[] = {1, 2, 4, 8};
    for (int mi = 0; mi < 4; mi++) {
        int M = Ms[mi];
        double best = 1e9;
        for (int r = 0; r < 7; r++) {
            double t = now();
            for (int m = 0; m < nm; m++) sg(101, 111, 112, M, N, K, 1.0f, A, K, W[m], K, 0.0f, C, N);
            t = now() - t;
            if (t < best) best = t;
        }
        double macs = (double)M * N * K * nm;
        printf("N %d K %d mats %d T %d M %d: %.3f ms  %.1f GMAC/s  %.1f GB/s codes\n", N, K, nm, T, M, best * 1e3,
               macs / best / 1e9, (double)N * G * gb * nm / best / 1e9);
    }
    return 0;
}
