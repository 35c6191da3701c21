// Quantized matmuls for the int4 model, bit-identical to torch's AVX-512 kernels. Written against
// simd.h's 16-lane vectors: one source, built for AVX-512 (libqmm.so) and for AVX2 + FMA
// (libqmm_avx2.so) with the same arithmetic, so both builds give the same bits.
//
// int4mm_bf16: y[M, N] = x[M, K] @ W.T for int4 weights in groups of 32 along K (w = (q - 8) * scale + zero),
// x and y bfloat16: the same arithmetic as torch's AVX-512 `_weight_int4pack_mm_for_cpu`, so the
// results are bit-identical to it. Every output is one fp32 FMA chain over k = 0 .. K-1 (the
// weight dequantized by fma(q - 8, scale, zero), then acc = fma(x, w, acc)), rounded to bf16
// (nearest even) at the end. What differs is the work around that chain: x is widened to fp32
// once per call (torch widens and broadcasts it per weight column block and per row), a code
// byte holds k and k + 1 of one column so one load feeds two k steps, and a block of up to 8
// rows shares each dequantized weight vector. N is split across torch's OpenMP threads.
//
// Weight layout (built by quant.py), in blocks of 64 output columns (4 panels of 16), so that a
// block's weights are one sequential stream: codes [N / 64][K / 2][64] bytes (byte c of row i:
// column c's code at k = 2i in the low nibble, k = 2i + 1 in the high one), then scales and
// zeros [N / 64][K / 32][2][64] bf16.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define GROUP 32
#define PANEL 16
#define BLOCK 64
#define PREFETCH 32  // k pairs ahead (2 KiB of codes)
#define MAX_ROWS 8

typedef struct {
    const float *x;  // [rows, K] fp32
    int rows, K, N;
    const uint8_t *codes;
    const uint16_t *sz;
    uint16_t *y;  // [rows, N] bf16, row stride N
} job_t;

// fp32 -> bf16, round to nearest even (NaN: 0x7fc0)
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// One block: R rows x C panels, panels [p0, p0 + C).
#define DEFINE_BLOCK(NAME, R, C)                                                                  \
    static void NAME(const job_t *j, int p0) {                                                    \
        const int K = j->K, KG = K / GROUP;                                                       \
        vf acc[R][C];                                                                             \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < C; c++) acc[r][c] = vf_zero();                                    \
        const uint8_t *cp[C];                                                                     \
        const uint16_t *sp[C];                                                                    \
        for (int c = 0; c < C; c++) {                                                             \
            int blk = (p0 + c) / 4, sub = (p0 + c) % 4;                                           \
            cp[c] = j->codes + (size_t)blk * (K / 2) * BLOCK + sub * PANEL;                       \
            sp[c] = j->sz + (size_t)blk * KG * 2 * BLOCK + sub * PANEL;                           \
        }                                                                                         \
        for (int g = 0; g < KG; g++) {                                                            \
            vf s[C], z[C];                                                                        \
            for (int c = 0; c < C; c++) {                                                         \
                s[c] = vf_load_bf16(sp[c] + g * 2 * BLOCK);                                       \
                z[c] = vf_load_bf16(sp[c] + g * 2 * BLOCK + BLOCK);                               \
            }                                                                                     \
            for (int kk = 0; kk < GROUP; kk += 2) {                                               \
                const int k = g * GROUP + kk;                                                     \
                _mm_prefetch((const char *)(cp[0] + (size_t)(k / 2 + PREFETCH) * BLOCK), _MM_HINT_T0); \
                for (int c = 0; c < C; c++) {                                                     \
                    vu b = vu_load_u8(cp[c] + (size_t)(k / 2) * BLOCK);                           \
                    vf w0 = vf_fma(vf_nibble_lo(b), s[c], z[c]);                                  \
                    vf w1 = vf_fma(vf_nibble_hi(b), s[c], z[c]);                                  \
                    for (int r = 0; r < R; r++)                                                   \
                        acc[r][c] = vf_fma(vf_set1(j->x[r * K + k]), w0, acc[r][c]);              \
                    for (int r = 0; r < R; r++)                                                   \
                        acc[r][c] = vf_fma(vf_set1(j->x[r * K + k + 1]), w1, acc[r][c]);          \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < C; c++)                                                           \
                vf_store_bf16(j->y + (size_t)r * j->N + (p0 + c) * PANEL, acc[r][c], 0xffff0000); \
    }

// Panels per block by rows: 16 accumulators at most, so that they stay in AVX-512's 32 registers
// (the same on AVX2, where a vector takes 2 of its 16: fewer panels were no faster at 1 row and
// up to 1.5x slower at 4 and 8)
#define W1 4
#define W2 4
#define W3 4
#define W4 4
#define W5 2
#define W6 2
#define W7 2
#define W8 2
DEFINE_BLOCK(wide_1, 1, W1)
DEFINE_BLOCK(wide_2, 2, W2)
DEFINE_BLOCK(wide_3, 3, W3)
DEFINE_BLOCK(wide_4, 4, W4)
DEFINE_BLOCK(wide_5, 5, W5)
DEFINE_BLOCK(wide_6, 6, W6)
DEFINE_BLOCK(wide_7, 7, W7)
DEFINE_BLOCK(wide_8, 8, W8)
DEFINE_BLOCK(one_1, 1, 1)
DEFINE_BLOCK(one_2, 2, 1)
DEFINE_BLOCK(one_3, 3, 1)
DEFINE_BLOCK(one_4, 4, 1)
DEFINE_BLOCK(one_5, 5, 1)
DEFINE_BLOCK(one_6, 6, 1)
DEFINE_BLOCK(one_7, 7, 1)
DEFINE_BLOCK(one_8, 8, 1)

typedef void (*block_fn)(const job_t *, int);
static const block_fn WIDE[MAX_ROWS + 1] = {0,      wide_1, wide_2, wide_3, wide_4,
                                            wide_5, wide_6, wide_7, wide_8};
static const int WIDTH[MAX_ROWS + 1] = {0, W1, W2, W3, W4, W5, W6, W7, W8};
static const block_fn ONE[MAX_ROWS + 1] = {0, one_1, one_2, one_3, one_4,
                                           one_5, one_6, one_7, one_8};

// One call: x widened, the weights, and `run` for output columns [a, b) of every row.
typedef struct call {
    const float *x;
    int M, K, N;
    const uint8_t *codes;  // int4: the blocks above; int8: [N][K] int8
    const uint16_t *sz;    // int4: scales and zeros; int8: [N] bf16 scales
    uint16_t *y;
    void (*run)(const struct call *, int a, int b);
    const void *aux;  // run's own (q8.c: the quantized activations)
} call_t;

static void int4_columns(const call_t *c, int a, int b) {
    a /= PANEL, b /= PANEL;
    for (int m0 = 0; m0 < c->M; m0 += MAX_ROWS) {
        int rows = c->M - m0 < MAX_ROWS ? c->M - m0 : MAX_ROWS;
        job_t j = {c->x + (size_t)m0 * c->K, rows, c->K, c->N, c->codes, c->sz,
                   c->y + (size_t)m0 * c->N};
        int w = WIDTH[rows], p = a;
        for (; p + w <= b; p += w) WIDE[rows](&j, p);
        for (; p < b; p++) ONE[rows](&j, p);
    }
}

// int8mm_bf16: y = x @ (W * scale).T for int8 weights [N, K] with one bf16 scale per output, as
// torch's AVX-512 `_weight_int8pack_mm`: 16 fp32 lanes per output, lane l an FMA chain over
// k = l, l + 16, ... of x * (float(q) * scale), the lanes summed as a tree (256-bit halves,
// 128-bit halves, then pairs: GCC's _mm512_reduce_add_ps, which torch is built with), rounded to
// bf16. Up to 8 rows share each widened weight vector. The trees of 16 outputs of a row run side
// by side (vf_sums16): the same additions of the same pairs, 45 instructions instead of ~200.

// R rows x C outputs from n0: the 16-lane accumulators into acc[r * 16 + n0 % 16 + i]
#define DEFINE_INT8(NAME, R, C)                                                                   \
    static void NAME(const call_t *c, int m0, int n0, vf *out) {                                  \
        const int K = c->K;                                                                       \
        const float *x = c->x + (size_t)m0 * K;                                                   \
        const int8_t *q = (const int8_t *)c->codes + (size_t)n0 * K;                              \
        vf acc[R][C], s[C];                                                                       \
        for (int i = 0; i < C; i++) {                                                             \
            uint32_t u = (uint32_t)c->sz[n0 + i] << 16;                                           \
            float f;                                                                              \
            memcpy(&f, &u, 4);                                                                    \
            s[i] = vf_set1(f);                                                                    \
        }                                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int i = 0; i < C; i++) acc[r][i] = vf_zero();                                    \
        for (int k = 0; k < K; k += 16) {                                                         \
            for (int i = 0; i < C; i++) {                                                         \
                vf w = vf_mul(vf_load_i8(q + (size_t)i * K + k), s[i]);                           \
                for (int r = 0; r < R; r++)                                                       \
                    acc[r][i] = vf_fma(vf_load(x + (size_t)r * K + k), w, acc[r][i]);             \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int i = 0; i < C; i++) out[r * 16 + n0 % 16 + i] = acc[r][i];                    \
    }

// One output per call, whatever the rows: 2-2.8x faster for the 49152 x 576 head at 1 row than
// 4 outputs per call (AMD Zen 4, 2 threads: AVX-512 1.0 ms vs 2.5, AVX2 1.2 vs 3.3), no slower at
// 8 rows
#define INT8_OUTPUTS 1
DEFINE_INT8(int8_1, 1, INT8_OUTPUTS)
DEFINE_INT8(int8_2, 2, INT8_OUTPUTS)
DEFINE_INT8(int8_3, 3, INT8_OUTPUTS)
DEFINE_INT8(int8_4, 4, INT8_OUTPUTS)
DEFINE_INT8(int8_5, 5, INT8_OUTPUTS)
DEFINE_INT8(int8_6, 6, INT8_OUTPUTS)
DEFINE_INT8(int8_7, 7, INT8_OUTPUTS)
DEFINE_INT8(int8_8, 8, INT8_OUTPUTS)

typedef void (*int8_fn)(const call_t *, int, int, vf *);
static const int8_fn INT8[MAX_ROWS + 1] = {0,      int8_1, int8_2, int8_3, int8_4,
                                           int8_5, int8_6, int8_7, int8_8};

static void int8_columns(const call_t *c, int a, int b) {
    vf acc[MAX_ROWS * 16];
    for (int m0 = 0; m0 < c->M; m0 += MAX_ROWS) {
        int rows = c->M - m0 < MAX_ROWS ? c->M - m0 : MAX_ROWS;
        for (int n16 = a; n16 < b; n16 += 16) {
            for (int n = n16; n < n16 + 16; n += INT8_OUTPUTS) INT8[rows](c, m0, n, acc);
            for (int r = 0; r < rows; r++) {
                // NaN as f32_to_bf16
                vf_store_bf16(c->y + (size_t)(m0 + r) * c->N + n16, vf_sums16(acc + r * 16),
                              0x7fc00000);
            }
        }
    }
}

// --- threads: torch's own OpenMP team (libgomp's C ABI, set by qmm_set_gomp), so that the
// kernel's threads are the ones torch already runs and spins, not a second set competing for
// the same cores
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_fn)(void);
static gomp_parallel_fn gomp_parallel;
static omp_int_fn omp_thread_num;

void qmm_set_gomp(void *parallel, void *thread_num) {
    gomp_parallel = (gomp_parallel_fn)parallel;
    omp_thread_num = (omp_int_fn)thread_num;
}

typedef struct {
    const call_t *c;
    int n;
} team_t;

// thread i of n: its share of the 64-column blocks
static void thread_share(const call_t *c, int i, int n) {
    int blocks = c->N / BLOCK;
    c->run(c, blocks * i / n * BLOCK, blocks * (i + 1) / n * BLOCK);
}

static void team_share(void *arg) {
    const team_t *t = (const team_t *)arg;
    thread_share(t->c, omp_thread_num(), t->n);
}

// x [n] bf16 widened to fp32 in a new buffer (free it), or NULL
static float *widen(const uint16_t *x, size_t n) {
    float *xf = (float *)malloc(n * sizeof(float));
    if (!xf) return NULL;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) vf_store(xf + i, vf_load_bf16(x + i));
    for (; i < n; i++) {
        uint32_t u = (uint32_t)x[i] << 16;
        memcpy(xf + i, &u, 4);
    }
    return xf;
}

// Run the call over `threads` threads (the caller included).
static void dispatch(const call_t *c, int threads) {
    if (threads > c->N / BLOCK) threads = c->N / BLOCK;
    if (threads == 1 || !gomp_parallel) {
        thread_share(c, 0, 1);
    } else {
        team_t t = {c, threads};
        gomp_parallel(team_share, &t, (unsigned)threads, 0);
    }
}

// Widen x to fp32, then run the call.
static int run_call(call_t *c, const uint16_t *x, int threads) {
    float *xf = widen(x, (size_t)c->M * c->K);
    if (!xf) return -1;
    c->x = xf;
    dispatch(c, threads);
    free(xf);
    return 0;
}

// Both return 0, or -1 when the shapes are not supported (the caller checks them first).
int int4mm_bf16(const uint16_t *x, int M, int K, const uint8_t *codes, const uint16_t *sz, int N,
                uint16_t *y, int threads) {
    if (M <= 0 || K % GROUP || N % BLOCK || threads < 1) return -1;
    call_t c = {0, M, K, N, codes, sz, y, int4_columns};
    return run_call(&c, x, threads);
}

int int8mm_bf16(const uint16_t *x, int M, int K, const int8_t *q, const uint16_t *scales, int N,
                uint16_t *y, int threads) {
    if (M <= 0 || K % 16 || N % BLOCK || threads < 1) return -1;
    call_t c = {0, M, K, N, (const uint8_t *)q, scales, y, int8_columns};
    return run_call(&c, x, threads);
}

#include "q8.c"  // int8 activations: the same calls and threads
