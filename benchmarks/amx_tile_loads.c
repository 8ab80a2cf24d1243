/* Where the AMX bf16 kernel's k steps (kernels/amx.py, bf16_kernel) wait, on one core: 2 x 2
   tiles, each k step two row tiles of X (rows of K bf16, read at X's row stride, as the kernel
   reads them) and two weight tiles, four tdpbf16ps. X streams (512 rows x K, from L2); the
   weight tiles cycle over a span of W bytes: 16 KB stays in L1, 48 KB is a column block's whole K
   at K = 768 (what the kernel cycles over), 1 MB comes from L2. With STORE=1, the four
   accumulator tiles are stored at each row block's end (every K / 32 steps, as the kernel stores
   a block for its epilogue) and zeroed. And the register-only rate (no loads) on each CPU given,
   side by side: whether the cores share an AMX unit.

       gcc -O2 -mamx-tile -mamx-bf16 -pthread -o /tmp/amx_tile_loads benchmarks/amx_tile_loads.c
       /tmp/amx_tile_loads                 # the table
       STORE=1 /tmp/amx_tile_loads         # with a block's stores
       /tmp/amx_tile_loads registers 0 1   # register-only, on CPUs 0 and 1 at once

   Linux 5.16 or later on a CPU with AMX-BF16 (the process asks for the tile state first). */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct __attribute__((aligned(64))) {
    unsigned char palette, start_row, reserved[14];
    unsigned short bytes_per_row[16];
    unsigned char rows[16];
} tile_config;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void configure(void) {  /* as kernels/amx.py's tile_configuration: 8 tiles of 16 x 64 bytes */
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

static double tflops(long steps, double seconds) { return steps * 4.0 * 16 * 16 * 32 * 2 / seconds / 1e12; }

/* k steps over 512 rows of X (K bf16 each) with the weight tiles cycling over w_span bytes */
static double k_steps(long K, long w_span, int store) {
    const long rows = 512, rounds = 100;
    char *x = aligned_alloc(4096, rows * K * 2), *w = aligned_alloc(4096, w_span);
    static float block[1024] __attribute__((aligned(64)));
    memset(x, 1, rows * K * 2);
    memset(w, 1, w_span);
    long steps = 0, w_at = 0;
    double started = now();
    for (long round = 0; round < rounds; round++)
        for (long row = 0; row < rows; row += 32) {
            if (store) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            }
            for (long k = 0; k < K / 32; k++, steps++) {
                _tile_loadd(4, x + row * K * 2 + k * 64, K * 2);
                _tile_loadd(5, x + (row + 16) * K * 2 + k * 64, K * 2);
                _tile_loadd(6, w + w_at, 64);
                _tile_loadd(7, w + w_at + w_span / 2, 64);  /* the column block's second 16 columns */
                w_at = (w_at + 1024) % (w_span / 2);
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
            if (store) {
                _tile_stored(0, block, 128); _tile_stored(1, block + 16, 128);
                _tile_stored(2, block + 512, 128); _tile_stored(3, block + 528, 128);
            }
        }
    double rate = tflops(steps, now() - started);
    free(x);
    free(w);
    return rate;
}

static void *registers_only(void *cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET((int)(long)cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
    configure();
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    const long steps = 20000000;
    double started = now();
    for (long i = 0; i < steps; i++) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    printf("CPU %ld, registers only: %.2f TFLOP/s\n", (long)cpu, tflops(steps, now() - started));
    return NULL;
}

int main(int argc, char **argv) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) {
        perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
        return 1;
    }
    if (argc > 1 && strcmp(argv[1], "registers") == 0) {
        pthread_t threads[64];
        int count = argc - 2 < 64 ? argc - 2 : 64;
        for (int i = 0; i < count; i++) pthread_create(&threads[i], NULL, registers_only, (void *)atol(argv[i + 2]));
        for (int i = 0; i < count; i++) pthread_join(threads[i], NULL);
        return 0;
    }
    configure();
    int store = getenv("STORE") != NULL;
    const long spans[] = {16 << 10, 24 << 10, 48 << 10, 1 << 20};
    printf("K = 768, 512 rows of X streaming%s; TFLOP/s by the weight tiles' span:\n", store ? ", a block's tiles stored" : "");
    for (int i = 0; i < 4; i++) printf("  W over %5ld KB: %.2f\n", spans[i] >> 10, k_steps(768, spans[i], store));
    return 0;
}
