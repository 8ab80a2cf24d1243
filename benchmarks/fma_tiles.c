/* What an fp32 matmul's register tiles reach on one core of this CPU, against the register-only
   FMA rate bench's floor is made of: the FMA kernel's loop (kernels/fma.py) written in C, a tile of
   R rows x V vectors of accumulators, each k step V loads of a weight panel packed [K, V x lanes]
   and R broadcasts of X's rows, over m rows and K, hot (the same operands every call). gcc builds
   it as well as TVM builds the kernel (the same loop reads within a few percent), so what it cannot
   reach, no tile shape or blocking of ours will.

       gcc -O3 -march=native -o /tmp/fma_tiles benchmarks/fma_tiles.c && /tmp/fma_tiles

   AVX-512 only (16 lanes; 32 vector registers for 24-28 accumulators). */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double register_only(void) {
    __m512 acc[24], b = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(1e-9f);
    for (int i = 0; i < 24; i++) acc[i] = _mm512_set1_ps((float)i);
    const long steps = 20000000L;
    double started = now();
    for (long s = 0; s < steps; s++) {
#pragma GCC unroll 24
        for (int i = 0; i < 24; i++) acc[i] = _mm512_fmadd_ps(acc[i], b, c);
    }
    double seconds = now() - started;
    float sink = 0;
    for (int i = 0; i < 24; i++) sink += _mm512_reduce_add_ps(acc[i]);
    if (sink == 1234.5f) printf("!");
    return 2.0 * 16 * 24 * steps / seconds / 1e9;
}

#define TILE_KERNEL(R, V)                                                                              \
    static void tile_##R##x##V(const float *x, const float *w, float *y, int m, int k) {               \
        for (int t = 0; t + R <= m; t += R) {                                                          \
            __m512 acc[R][V];                                                                          \
            for (int i = 0; i < R; i++)                                                                \
                for (int v = 0; v < V; v++) acc[i][v] = _mm512_setzero_ps();                           \
            const float *rows = x + (long)t * k;                                                       \
            for (int kk = 0; kk < k; kk++) {                                                           \
                __m512 panel[V];                                                                       \
                for (int v = 0; v < V; v++) panel[v] = _mm512_load_ps(w + (kk * V + v) * 16);          \
                for (int i = 0; i < R; i++) {                                                          \
                    __m512 b = _mm512_set1_ps(rows[(long)i * k + kk]);                                 \
                    for (int v = 0; v < V; v++) acc[i][v] = _mm512_fmadd_ps(b, panel[v], acc[i][v]);   \
                }                                                                                      \
            }                                                                                          \
            for (int i = 0; i < R; i++)                                                                \
                for (int v = 0; v < V; v++) _mm512_storeu_ps(y + ((long)(t + i) * V + v) * 16, acc[i][v]); \
        }                                                                                              \
    }

TILE_KERNEL(6, 4)
TILE_KERNEL(8, 3)
TILE_KERNEL(4, 6)
TILE_KERNEL(12, 2)

typedef void (*tile_fn)(const float *, const float *, float *, int, int);

static double rate(tile_fn f, int rows, int vectors, int m, int k) {
    float *x = aligned_alloc(64, sizeof(float) * m * k), *w = aligned_alloc(64, sizeof(float) * k * vectors * 16);
    float *y = aligned_alloc(64, sizeof(float) * m * vectors * 16);
    for (long i = 0; i < (long)m * k; i++) x[i] = 1e-3f * (float)(i % 7);
    for (long i = 0; i < (long)k * vectors * 16; i++) w[i] = 1e-3f * (float)(i % 5);
    double flops = 2.0 * (m / rows * rows) * vectors * 16 * k;
    int calls = (int)(4e9 / flops) + 1;
    f(x, w, y, m, k);
    double started = now();
    for (int c = 0; c < calls; c++) f(x, w, y, m, k);
    double seconds = now() - started;
    free(x), free(w), free(y);
    return flops * calls / seconds / 1e9;
}

int main(void) {
    double peak = register_only();
    printf("register-only FMA: %.1f GFLOP/s a core\n\n", peak);
    struct { tile_fn f; int rows, vectors; } tiles[] = {{tile_6x4, 6, 4}, {tile_8x3, 8, 3}, {tile_4x6, 4, 6}, {tile_12x2, 12, 2}};
    struct { int m, k; const char *what; } shapes[] = {
        {12, 128, "X and the panel in L1"}, {120, 768, "K 768: the panel in L2"}, {1020, 3072, "K 3072: X past L2"}};
    printf("| tile | m x K | where | GFLOP/s | of register-only |\n| --- | --- | --- | --- | --- |\n");
    for (int s = 0; s < 3; s++)
        for (int t = 0; t < 4; t++) {
            double r = rate(tiles[t].f, tiles[t].rows, tiles[t].vectors, shapes[s].m, shapes[s].k);
            printf("| %d x %d | %d x %d | %s | %.1f | %.0f%% |\n", tiles[t].rows, tiles[t].vectors, shapes[s].m, shapes[s].k,
                   shapes[s].what, r, 100 * r / peak);
        }
    return 0;
}
