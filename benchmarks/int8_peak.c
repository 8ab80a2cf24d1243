/* One core's register-only rates (no loads): what an int8 or fp32 matmul kernel can reach at most.
   8 independent chains each, so that latency never binds. Built and run by
   benchmarks/int8_kernel.py --peak (gcc -O2 -march=native int8_peak.c). */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ITERATIONS 100000000L
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define RATE(name, body, macs) do { \
        double started = now(); \
        for (long r = 0; r < ITERATIONS; r++) __asm__ volatile(body ::: CLOBBERS); \
        double seconds = now() - started; \
        printf("%-48s %6.1f GMAC/s a core\n", name, (double)(macs) * ITERATIONS / seconds / 1e9); \
    } while (0)

int main(void) {
    RATE("vfmadd231ps (fp32 FMA)",
         "vfmadd231ps %%ymm14,%%ymm15,%%ymm0\n vfmadd231ps %%ymm14,%%ymm15,%%ymm1\n vfmadd231ps %%ymm14,%%ymm15,%%ymm2\n"
         "vfmadd231ps %%ymm14,%%ymm15,%%ymm3\n vfmadd231ps %%ymm14,%%ymm15,%%ymm4\n vfmadd231ps %%ymm14,%%ymm15,%%ymm5\n"
         "vfmadd231ps %%ymm14,%%ymm15,%%ymm6\n vfmadd231ps %%ymm14,%%ymm15,%%ymm7\n", 8 * 8);
    RATE("vpmaddwd + vpaddd (int16 rows and weights)",
         "vpmaddwd %%ymm14,%%ymm15,%%ymm8\n vpmaddwd %%ymm14,%%ymm15,%%ymm9\n vpmaddwd %%ymm14,%%ymm15,%%ymm10\n vpmaddwd %%ymm14,%%ymm15,%%ymm11\n"
         "vpaddd %%ymm8,%%ymm0,%%ymm0\n vpaddd %%ymm9,%%ymm1,%%ymm1\n vpaddd %%ymm10,%%ymm2,%%ymm2\n vpaddd %%ymm11,%%ymm3,%%ymm3\n"
         "vpmaddwd %%ymm14,%%ymm15,%%ymm12\n vpmaddwd %%ymm14,%%ymm15,%%ymm13\n vpmaddwd %%ymm14,%%ymm15,%%ymm8\n vpmaddwd %%ymm14,%%ymm15,%%ymm9\n"
         "vpaddd %%ymm12,%%ymm4,%%ymm4\n vpaddd %%ymm13,%%ymm5,%%ymm5\n vpaddd %%ymm8,%%ymm6,%%ymm6\n vpaddd %%ymm9,%%ymm7,%%ymm7\n", 8 * 16);
    RATE("vpmaddubsw + vpmaddwd(1) + vpaddd (u8 x s8: ours without VNNI)",
         "vpmaddubsw %%ymm14,%%ymm15,%%ymm8\n vpmaddubsw %%ymm14,%%ymm15,%%ymm9\n vpmaddubsw %%ymm14,%%ymm15,%%ymm10\n vpmaddubsw %%ymm14,%%ymm15,%%ymm11\n"
         "vpmaddwd %%ymm8,%%ymm13,%%ymm8\n vpmaddwd %%ymm9,%%ymm13,%%ymm9\n vpmaddwd %%ymm10,%%ymm13,%%ymm10\n vpmaddwd %%ymm11,%%ymm13,%%ymm11\n"
         "vpaddd %%ymm8,%%ymm0,%%ymm0\n vpaddd %%ymm9,%%ymm1,%%ymm1\n vpaddd %%ymm10,%%ymm2,%%ymm2\n vpaddd %%ymm11,%%ymm3,%%ymm3\n", 4 * 32);
    RATE("vpmaddubsw + vpaddw (int16 sums: saturate)",
         "vpmaddubsw %%ymm14,%%ymm15,%%ymm8\n vpmaddubsw %%ymm14,%%ymm15,%%ymm9\n vpmaddubsw %%ymm14,%%ymm15,%%ymm10\n vpmaddubsw %%ymm14,%%ymm15,%%ymm11\n"
         "vpaddw %%ymm8,%%ymm0,%%ymm0\n vpaddw %%ymm9,%%ymm1,%%ymm1\n vpaddw %%ymm10,%%ymm2,%%ymm2\n vpaddw %%ymm11,%%ymm3,%%ymm3\n"
         "vpmaddubsw %%ymm14,%%ymm15,%%ymm12\n vpmaddubsw %%ymm14,%%ymm15,%%ymm13\n vpmaddubsw %%ymm14,%%ymm15,%%ymm8\n vpmaddubsw %%ymm14,%%ymm15,%%ymm9\n"
         "vpaddw %%ymm12,%%ymm4,%%ymm4\n vpaddw %%ymm13,%%ymm5,%%ymm5\n vpaddw %%ymm8,%%ymm6,%%ymm6\n vpaddw %%ymm9,%%ymm7,%%ymm7\n", 8 * 32);
    RATE("vpsignb + vpmaddubsw + vpmaddwd(1) + vpaddd (|s8| x s8)",
         "vpsignb %%ymm15,%%ymm14,%%ymm8\n vpsignb %%ymm15,%%ymm14,%%ymm9\n vpsignb %%ymm15,%%ymm14,%%ymm10\n vpsignb %%ymm15,%%ymm14,%%ymm11\n"
         "vpmaddubsw %%ymm8,%%ymm12,%%ymm8\n vpmaddubsw %%ymm9,%%ymm12,%%ymm9\n vpmaddubsw %%ymm10,%%ymm12,%%ymm10\n vpmaddubsw %%ymm11,%%ymm12,%%ymm11\n"
         "vpmaddwd %%ymm8,%%ymm13,%%ymm8\n vpmaddwd %%ymm9,%%ymm13,%%ymm9\n vpmaddwd %%ymm10,%%ymm13,%%ymm10\n vpmaddwd %%ymm11,%%ymm13,%%ymm11\n"
         "vpaddd %%ymm8,%%ymm0,%%ymm0\n vpaddd %%ymm9,%%ymm1,%%ymm1\n vpaddd %%ymm10,%%ymm2,%%ymm2\n vpaddd %%ymm11,%%ymm3,%%ymm3\n", 4 * 32);
    return 0;
}
