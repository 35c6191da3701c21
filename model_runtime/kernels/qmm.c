// Quantized matmuls for the int4 model on AVX-512 CPUs, bit-identical to torch's kernels.
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

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16, round to nearest even (NaN kept quiet), as torch's cvtfp32_bf16
static inline __m256i f32x16_to_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xffff0000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// One block: R rows x C panels, panels [p0, p0 + C).
#define DEFINE_BLOCK(R, C)                                                                        \
    static void block_##R##_##C(const job_t *j, int p0) {                                        \
        const int K = j->K, KG = K / GROUP;                                                       \
        const __m512 lut = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8); \
        __m512 acc[R][C];                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                          \
        const uint8_t *cp[C];                                                                     \
        const uint16_t *sp[C];                                                                    \
        for (int c = 0; c < C; c++) {                                                             \
            int blk = (p0 + c) / 4, sub = (p0 + c) % 4;                                           \
            cp[c] = j->codes + (size_t)blk * (K / 2) * BLOCK + sub * PANEL;                       \
            sp[c] = j->sz + (size_t)blk * KG * 2 * BLOCK + sub * PANEL;                           \
        }                                                                                         \
        for (int g = 0; g < KG; g++) {                                                            \
            __m512 s[C], z[C];                                                                    \
            for (int c = 0; c < C; c++) {                                                         \
                s[c] = bf16x16_to_f32(sp[c] + g * 2 * BLOCK);                                     \
                z[c] = bf16x16_to_f32(sp[c] + g * 2 * BLOCK + BLOCK);                             \
            }                                                                                     \
            for (int kk = 0; kk < GROUP; kk += 2) {                                               \
                const int k = g * GROUP + kk;                                                     \
                _mm_prefetch((const char *)(cp[0] + (size_t)(k / 2 + PREFETCH) * BLOCK), _MM_HINT_T0); \
                for (int c = 0; c < C; c++) {                                                     \
                    __m128i b8 = _mm_loadu_si128((const __m128i *)(cp[c] + (size_t)(k / 2) * BLOCK)); \
                    __m512i b = _mm512_cvtepu8_epi32(b8);                                         \
                    __m512 w0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(b, lut), s[c], z[c]);       \
                    __m512 w1 = _mm512_fmadd_ps(                                                  \
                        _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), s[c], z[c]);         \
                    for (int r = 0; r < R; r++)                                                   \
                        acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(j->x[r * K + k]), w0, acc[r][c]); \
                    for (int r = 0; r < R; r++)                                                   \
                        acc[r][c] =                                                               \
                            _mm512_fmadd_ps(_mm512_set1_ps(j->x[r * K + k + 1]), w1, acc[r][c]);  \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < C; c++)                                                           \
                _mm256_storeu_si256((__m256i *)(j->y + (size_t)r * j->N + (p0 + c) * PANEL),      \
                                    f32x16_to_bf16(acc[r][c]));                                   \
    }

// C panels per block by rows: 16 accumulators at most, so they stay in registers
DEFINE_BLOCK(1, 4)
DEFINE_BLOCK(2, 4)
DEFINE_BLOCK(3, 4)
DEFINE_BLOCK(4, 4)
DEFINE_BLOCK(5, 2)
DEFINE_BLOCK(6, 2)
DEFINE_BLOCK(7, 2)
DEFINE_BLOCK(8, 2)
DEFINE_BLOCK(1, 1)
DEFINE_BLOCK(2, 1)
DEFINE_BLOCK(3, 1)
DEFINE_BLOCK(4, 1)
DEFINE_BLOCK(5, 1)
DEFINE_BLOCK(6, 1)
DEFINE_BLOCK(7, 1)
DEFINE_BLOCK(8, 1)

typedef void (*block_fn)(const job_t *, int);
static const block_fn WIDE[MAX_ROWS + 1] = {0, block_1_4, block_2_4, block_3_4, block_4_4,
                                            block_5_2, block_6_2, block_7_2, block_8_2};
static const int WIDTH[MAX_ROWS + 1] = {0, 4, 4, 4, 4, 2, 2, 2, 2};
static const block_fn ONE[MAX_ROWS + 1] = {0, block_1_1, block_2_1, block_3_1, block_4_1,
                                           block_5_1, block_6_1, block_7_1, block_8_1};

// One call: x widened, the weights, and `run` for output columns [a, b) of every row.
typedef struct call {
    const float *x;
    int M, K, N;
    const uint8_t *codes;  // int4: the blocks above; int8: [N][K] int8
    const uint16_t *sz;    // int4: scales and zeros; int8: [N] bf16 scales
    uint16_t *y;
    void (*run)(const struct call *, int a, int b);
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
// by side (reduce16x16): the same additions of the same pairs, 45 instructions instead of ~200.
static inline float reduce16(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(q) + _mm_cvtss_f32(_mm_shuffle_ps(q, q, _MM_SHUFFLE(3, 2, 0, 1)));
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// lane j = the tree sum of v[j]'s 16 lanes. The network leaves the sum of its input i in lane
// 4 (i % 4) + i / 4, so the inputs go in transposed.
static inline __m512 reduce16x16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int p = 0; p < 8; p++) {  // 256-bit halves: lane i + lane i + 8
        const int i = 2 * p, j = 2 * p + 1;
        __m512 a = v[(i % 4) * 4 + i / 4], b = v[(j % 4) * 4 + j / 4];
        t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    }
    for (int k = 0; k < 4; k++)  // 128-bit halves
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0xdd));
    for (int m = 0; m < 2; m++)  // (q0 + q2, q1 + q3)
        w[m] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xdd));
}

// R rows x C outputs from n0: the 16-lane accumulators into acc[r * 16 + n0 % 16 + i]
#define DEFINE_INT8(R, C)                                                                         \
    static void int8_##R##_##C(const call_t *c, int m0, int n0, __m512 *out) {                    \
        const int K = c->K;                                                                       \
        const float *x = c->x + (size_t)m0 * K;                                                   \
        const int8_t *q = (const int8_t *)c->codes + (size_t)n0 * K;                              \
        __m512 acc[R][C], s[C];                                                                   \
        for (int i = 0; i < C; i++) {                                                             \
            uint32_t u = (uint32_t)c->sz[n0 + i] << 16;                                           \
            float f;                                                                              \
            memcpy(&f, &u, 4);                                                                    \
            s[i] = _mm512_set1_ps(f);                                                             \
        }                                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int i = 0; i < C; i++) acc[r][i] = _mm512_setzero_ps();                          \
        for (int k = 0; k < K; k += 16) {                                                         \
            for (int i = 0; i < C; i++) {                                                         \
                __m128i b8 = _mm_loadu_si128((const __m128i *)(q + (size_t)i * K + k));           \
                __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b8)), s[i]);     \
                for (int r = 0; r < R; r++)                                                       \
                    acc[r][i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (size_t)r * K + k), w,        \
                                                acc[r][i]);                                       \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int i = 0; i < C; i++) out[r * 16 + n0 % 16 + i] = acc[r][i];                    \
    }

DEFINE_INT8(1, 4)
DEFINE_INT8(2, 4)
DEFINE_INT8(3, 4)
DEFINE_INT8(4, 4)
DEFINE_INT8(5, 2)
DEFINE_INT8(6, 2)
DEFINE_INT8(7, 2)
DEFINE_INT8(8, 2)

typedef void (*int8_fn)(const call_t *, int, int, __m512 *);
static const int8_fn INT8[MAX_ROWS + 1] = {0, int8_1_4, int8_2_4, int8_3_4, int8_4_4,
                                           int8_5_2, int8_6_2, int8_7_2, int8_8_2};

static void int8_columns(const call_t *c, int a, int b) {
    __m512 acc[MAX_ROWS * 16];
    for (int m0 = 0; m0 < c->M; m0 += MAX_ROWS) {
        int rows = c->M - m0 < MAX_ROWS ? c->M - m0 : MAX_ROWS;
        for (int n16 = a; n16 < b; n16 += 16) {
            for (int n = n16; n < n16 + 16; n += WIDTH[rows]) INT8[rows](c, m0, n, acc);
            for (int r = 0; r < rows; r++) {
                __m512 sum = reduce16x16(acc + r * 16);
                __m512i u = _mm512_castps_si512(sum);
                __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
                __mmask16 nan = _mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q);
                u = _mm512_mask_mov_epi32(u, nan, _mm512_set1_epi32(0x7fc00000));  // as f32_to_bf16
                _mm256_storeu_si256((__m256i *)(c->y + (size_t)(m0 + r) * c->N + n16),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
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

// Widen x to fp32, then run the call over `threads` threads (the caller included).
static int run_call(call_t *c, const uint16_t *x, int threads) {
    float *xf = (float *)malloc((size_t)c->M * c->K * sizeof(float));
    if (!xf) return -1;
    size_t n = (size_t)c->M * c->K, i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(xf + i, bf16x16_to_f32(x + i));
    for (; i < n; i++) {
        uint32_t u = (uint32_t)x[i] << 16;
        memcpy(xf + i, &u, 4);
    }
    c->x = xf;
    if (threads > c->N / BLOCK) threads = c->N / BLOCK;
    if (threads == 1 || !gomp_parallel) {
        thread_share(c, 0, 1);
    } else {
        team_t t = {c, threads};
        gomp_parallel(team_share, &t, (unsigned)threads, 0);
    }
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
