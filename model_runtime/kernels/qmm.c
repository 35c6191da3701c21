// Quantized matmuls for the int4 model. Written against simd.h's 16-lane vectors: one source,
// built for AVX-512 (libqmm.so) and for AVX2 + FMA (libqmm_avx2.so) with the same arithmetic, so
// both builds give the same bits.
//
// int4mm_bf16: y[M, N] = x[M, K] @ W.T for int4 weights in groups of 32 along K (w = (q - 8) *
// scale + zero), x and y bfloat16. Per output and group g the kernel sums the exact products
// x_k (q_k - 8) (a bf16 times a small integer: exact in fp32) in fp32, k + 1 then k for each
// pair k = 0, 2, .. 30 of the group, and adds the group into the output's fp32 accumulator as
//   acc = fma(sum_g, scale_g, fma(zero_g, xsum_g, acc))     (xsum_g: x summed over the group)
// rounded to bf16 (nearest even) at the end. The pairs in that order are what AVX-512 BF16's
// dot-product instruction (VDPBF16PS: the odd element's product, then the even one's, each
// added with one rounding, Intel SDM) computes, so where the CPU has it (qmm_set_dot) one
// instruction does two k steps of 16 outputs; elsewhere two FMAs do the same (a product that is
// exact rounds once in both), and the results are the same bits. The instruction treats
// denormal inputs as zero and flushes denormal results: the activations are flushed where they
// are prepared (acts_t), and a denormal group sum needs activations near 2^-126, which a
// model's never are. torch's int4pack kernel chains FMAs with the weight dequantized per k
// instead: slower than the dot products here (BENCHMARKS.md), results within one bf16 rounding
// of these.
//
// Weight layout (built by quant.py), in blocks of 64 output columns (4 panels of 16), so that a
// block's weights are one sequential stream: codes [N / 64][K / 8][4][16] 32-bit lanes (lane l
// of panel p at k0 = 8 i: column 16 p + l's codes at k0 + 2 j in bits 4 j, and at k0 + 2 j + 1
// in bits 16 + 4 j, j < 4), then scales and zeros [N / 64][K / 32][2][64] bf16. One 64-byte
// load gives four k pairs of a panel, each a shift away: as the dot product's bf16 words one
// word lookup a pair (a matmul of 8 rows 1.13-1.17x, of 1 row 1.41-1.49x as fast as a byte a pair
// zero-extended, shifted and merged before the lookup: AMD Zen 4, one thread, in cache).

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define GROUP 32
#define PANEL 16
#define BLOCK 64
#define PREFETCH 32  // k pairs ahead (2 KiB of codes)
#define MAX_ROWS 8

// a call's activations (int4 and int8 weights), rows of K
typedef struct {
    const float *x;      // [rows, K] fp32, each group of 32 split: x_k of its even k, then its odd
                         // ones (bf16 values, denormals flushed to zero)
    const uint16_t *xb;  // [rows, K] bf16, in order (flushed)
    const float *xs;     // [rows, K / 32] each group's sum
} acts_t;

typedef struct {
    acts_t x;
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

// K values x (bf16 values in fp32, K % 32 == 0) as acts_t's row: xf split, xb, xs
static void prep_acts(const float *x, int K, float *xf, uint16_t *xb, float *xs) {
    for (int g = 0; g < K / GROUP; g++) {
        const int at = g * GROUP;
        vf a = vf_daz(vf_load(x + at)), b = vf_daz(vf_load(x + at + 16)), even, odd;
        vf_store_bf16(xb + at, a, 0x7fc00000);  // bf16 values: exact
        vf_store_bf16(xb + at + 16, b, 0x7fc00000);
        vf_split_pairs(a, b, &even, &odd);
        vf_store(xf + at, even);
        vf_store(xf + at + 16, odd);
        xs[g] = vf_sum(vf_add(even, odd));
    }
}

// k pair p (k = g * 32 + kk + 2 p) of 16 columns' codes in b (vu_load: the layout above) for R
// rows, into the group sums ga[r][c]: FMAs (every build)
#define PAIR_FMA(R, c, b, p)                                                                      \
    do {                                                                                          \
        vf w0_ = vf_code(b, 4 * (p)), w1_ = vf_code(b, 16 + 4 * (p));                             \
        for (int r = 0; r < R; r++) {                                                             \
            /* the group split: x of k in [0], of k + 1 in [GROUP / 2] */                         \
            const float *x_ = j->x.x + r * K + g * GROUP + kk / 2 + (p);                          \
            ga[r][c] = vf_fma(vf_set1(x_[GROUP / 2]), w1_, ga[r][c]);                             \
            ga[r][c] = vf_fma(vf_set1(x_[0]), w0_, ga[r][c]);                                     \
        }                                                                                         \
    } while (0)

// four k pairs (k = g * 32 + kk, .. + 7) of CW panels from cp on: a 64-byte load a panel,
// then pair by pair each panel's. Every loop here unrolled, so that each shift is a constant and
// each sum a register (left to the compiler, the FMAs' loop over panels stayed rolled, its sums
// in memory: a matmul of 8 rows 1.8x slower).
#define QUAD(R, CW, cp, PAIR)                                                                     \
    do {                                                                                          \
        vu b_[CW];                                                                                \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) b_[c] = vu_load((cp) + c * 64);      \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) PAIR(R, c, b_[c], 0);                \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) PAIR(R, c, b_[c], 1);                \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) PAIR(R, c, b_[c], 2);                \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) PAIR(R, c, b_[c], 3);                \
    } while (0)

// One block of 64 columns (4 panels) for R rows, CW panels at a time: group by group, the
// panels' group sums in registers, the block's accumulators (R > 2: partly on the stack) touched
// once a group, the group's 1 KiB of codes read from L1 by the panels after the first CW. R x CW
// independent sums hide the latency of the instruction that adds into one: at 8 rows 16 of them
// (CW 2) made a matmul 1.2x as fast as 8 (CW 1), with the dot product (AMD Zen 5).
#define DEFINE_BLOCK(NAME, R, CW, ATTR, PAIR)                                                     \
    static ATTR void NAME(const job_t *j, int blk) {                                              \
        const int K = j->K, KG = K / GROUP;                                                       \
        const uint8_t *cb = j->codes + (size_t)blk * (K / 2) * BLOCK;                             \
        const uint16_t *sb = j->sz + (size_t)blk * KG * 2 * BLOCK;                                \
        vf acc[R][4];                                                                             \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < 4; c++) acc[r][c] = vf_zero();                                    \
        for (int g = 0; g < KG; g++) {                                                            \
            const uint8_t *cg = cb + (size_t)g * (GROUP / 2) * BLOCK;                             \
            for (int c0 = 0; c0 < 4; c0 += CW) {                                                  \
                vf ga[R][CW];                                                                     \
                for (int r = 0; r < R; r++)                                                       \
                    for (int c = 0; c < CW; c++) ga[r][c] = vf_zero();                            \
                for (int kk = 0; kk < GROUP; kk += 8) {                                           \
                    const uint8_t *cq = cg + (size_t)(kk / 2) * BLOCK;                            \
                    for (int l = 0; l < 4 && c0 == 0; l++)                                        \
                        _mm_prefetch((const char *)(cq + (PREFETCH + l) * BLOCK), _MM_HINT_T0);   \
                    QUAD(R, CW, cq + c0 * 64, PAIR);                                              \
                }                                                                                 \
                for (int c = 0; c < CW; c++) {                                                    \
                    const uint16_t *sc = sb + g * 2 * BLOCK + (c0 + c) * PANEL;                   \
                    vf s = vf_load_bf16(sc), z = vf_load_bf16(sc + BLOCK);                        \
                    for (int r = 0; r < R; r++)                                                   \
                        acc[r][c0 + c] = vf_fma(                                                  \
                            ga[r][c], s, vf_fma(z, vf_set1(j->x.xs[r * KG + g]), acc[r][c0 + c]));\
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < 4; c++)                                                           \
                vf_store_bf16(j->y + (size_t)r * j->N + blk * BLOCK + c * PANEL, acc[r][c],      \
                              0xffff0000);                                                        \
    }
#define DEFINE_BLOCKS(P, ATTR, PAIR)                                                              \
    DEFINE_BLOCK(P##1, 1, 4, ATTR, PAIR)                                                          \
    DEFINE_BLOCK(P##2, 2, 4, ATTR, PAIR)                                                          \
    DEFINE_BLOCK(P##3, 3, 4, ATTR, PAIR)                                                          \
    DEFINE_BLOCK(P##4, 4, 4, ATTR, PAIR)                                                          \
    DEFINE_BLOCK(P##5, 5, 2, ATTR, PAIR)                                                          \
    DEFINE_BLOCK(P##6, 6, 2, ATTR, PAIR)                                                          \
    DEFINE_BLOCK(P##7, 7, 2, ATTR, PAIR)                                                          \
    DEFINE_BLOCK(P##8, 8, 2, ATTR, PAIR)
DEFINE_BLOCKS(int4_fma_, , PAIR_FMA)

typedef void (*block_fn)(const job_t *, int);
#define BLOCK_TABLE(P) {0, P##1, P##2, P##3, P##4, P##5, P##6, P##7, P##8}

#ifdef SIMD_BF16_DOT
// The same pairs with the dot-product instruction: pair p's codes for 16 columns as the bf16
// words (q_k - 8, q_k+1 - 8) of each 32-bit lane, the row's x_k, x_k+1 broadcast
#define PAIR_DOT(R, c, b, p)                                                                      \
    do {                                                                                          \
        vpair w_ = vpair_code(b, p);                                                              \
        for (int r = 0; r < R; r++) {                                                             \
            uint32_t x2_;                                                                         \
            memcpy(&x2_, j->x.xb + (size_t)r * K + g * GROUP + kk + 2 * (p), 4);                  \
            ga[r][c] = vf_dot_pair(ga[r][c], w_, x2_);                                            \
        }                                                                                         \
    } while (0)
DEFINE_BLOCKS(int4_dot_, BF16_DOT, PAIR_DOT)
static const block_fn BLOCKS[2][MAX_ROWS + 1] = {BLOCK_TABLE(int4_fma_), BLOCK_TABLE(int4_dot_)};
#else
static const block_fn BLOCKS[2][MAX_ROWS + 1] = {BLOCK_TABLE(int4_fma_), BLOCK_TABLE(int4_fma_)};
#endif

// 1: the int4 and int8 kernels use the dot-product instruction (the CPU has avx512_bf16; set
// once at load by kernels/qmm.py, the same bits either way)
static int use_dot;

void qmm_set_dot(int on) {
#ifdef SIMD_BF16_DOT
    use_dot = on != 0;
#else
    (void)on;
#endif
}

// One call: the weights, and `run` for output columns [a, b) of every row (the activations in
// `aux`, prepared as `run` reads them).
typedef struct call {
    int M, K, N;
    const uint8_t *codes;  // int4: the blocks above; int8: [N][K] int8
    const uint16_t *sz;    // int4: scales and zeros; int8: [N] bf16 scales
    uint16_t *y;
    void (*run)(const struct call *, int a, int b);
    const void *aux;  // run's own: acts_t, q8.c's quantized activations
} call_t;

static void int4_columns(const call_t *c, int a, int b) {
    const acts_t *x = (const acts_t *)c->aux;
    const int KG = c->K / GROUP;
    for (int m0 = 0; m0 < c->M; m0 += MAX_ROWS) {
        int rows = c->M - m0 < MAX_ROWS ? c->M - m0 : MAX_ROWS;
        job_t j = {{x->x + (size_t)m0 * c->K, x->xb + (size_t)m0 * c->K, x->xs + (size_t)m0 * KG},
                   rows, c->K, c->N, c->codes, c->sz, c->y + (size_t)m0 * c->N};
        for (int blk = a / BLOCK; blk < b / BLOCK; blk++) BLOCKS[use_dot][rows](&j, blk);
    }
}

// int8mm_bf16: y = (x @ W.T) * scale for int8 weights [N, K] with one bf16 scale per output.
// Per output 16 fp32 lanes: lane l sums, for each chunk of 32 k from k0, the exact products x q
// of k0 + 2l + 1 then k0 + 2l (the dot-product instruction's pairs, as the int4 kernel's: one
// instruction where the CPU has it, two FMAs elsewhere, the same bits); the lanes summed as a
// tree (vf_sums16), times the scale, rounded to bf16. Up to 8 rows share each weight vector.
// torch's `_weight_int8pack_mm` sums in another order (lane l over k = l, l + 16, ..., the
// weight times its scale first), slower at several rows (BENCHMARKS.md).

// the weights of the output HEAD_AHEAD rows on, a cache line a chunk pair: without it a matmul
// over the 49,152-row head waited on memory (AMD Zen 5, one thread: 1 row 818 -> 701 us, 8 rows
// 1.94 -> 1.60 ms; 16 and 48 rows ahead did as well or worse)
#define HEAD_AHEAD 24
#define HEAD_PREFETCH(h)                                                                          \
    if ((h) == 0) _mm_prefetch((const char *)(q + k + HEAD_AHEAD * K), _MM_HINT_T0)

#define CHUNK_FMA(R, h)                                                                           \
    do {                                                                                          \
        HEAD_PREFETCH(h);                                                                         \
        vf we_, wo_;                                                                              \
        vf_i8_pairs(q + k, &we_, &wo_);                                                           \
        for (int r = 0; r < R; r++) {                                                             \
            const float *x_ = xa->x + (size_t)(m0 + r) * K + k;                                   \
            acc[h][r] = vf_fma(vf_load(x_ + 16), wo_, acc[h][r]);                                 \
            acc[h][r] = vf_fma(vf_load(x_), we_, acc[h][r]);                                      \
        }                                                                                         \
    } while (0)

// R rows x output n: the 16-lane sums into out[r * 16 + n % 16]. Two sums a lane, of the even
// and the odd chunks of 32 k, added at the end: one alone waited on the latency of the
// instruction adding into it at 1 row (1.2x slower)
#define DEFINE_INT8(NAME, R, ATTR, CHUNK)                                                         \
    static ATTR void NAME(const call_t *c, int m0, int n, vf *out) {                              \
        const int K = c->K;                                                                       \
        const acts_t *xa = (const acts_t *)c->aux;                                                \
        const int8_t *q = (const int8_t *)c->codes + (size_t)n * K;                               \
        vf acc[2][R];                                                                             \
        for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = vf_zero();                            \
        int k = 0;                                                                                \
        for (; k + 2 * GROUP <= K; k += GROUP) {                                                  \
            CHUNK(R, 0);                                                                          \
            k += GROUP;                                                                           \
            CHUNK(R, 1);                                                                          \
        }                                                                                         \
        if (k < K) CHUNK(R, 0);                                                                   \
        for (int r = 0; r < R; r++) out[r * 16 + n % 16] = vf_add(acc[0][r], acc[1][r]);          \
    }
#define DEFINE_INT8S(P, ATTR, CHUNK)                                                              \
    DEFINE_INT8(P##1, 1, ATTR, CHUNK)                                                             \
    DEFINE_INT8(P##2, 2, ATTR, CHUNK)                                                             \
    DEFINE_INT8(P##3, 3, ATTR, CHUNK)                                                             \
    DEFINE_INT8(P##4, 4, ATTR, CHUNK)                                                             \
    DEFINE_INT8(P##5, 5, ATTR, CHUNK)                                                             \
    DEFINE_INT8(P##6, 6, ATTR, CHUNK)                                                             \
    DEFINE_INT8(P##7, 7, ATTR, CHUNK)                                                             \
    DEFINE_INT8(P##8, 8, ATTR, CHUNK)
DEFINE_INT8S(int8_fma_, , CHUNK_FMA)

typedef void (*int8_fn)(const call_t *, int, int, vf *);
#define INT8_TABLE(P) {0, P##1, P##2, P##3, P##4, P##5, P##6, P##7, P##8}
#ifdef SIMD_BF16_DOT
#define CHUNK_DOT(R, h)                                                                           \
    do {                                                                                          \
        HEAD_PREFETCH(h);                                                                         \
        vpair w_ = vpair_i8(q + k);                                                               \
        for (int r = 0; r < R; r++)                                                               \
            acc[h][r] = vf_dot_pairs(acc[h][r], w_, xa->xb + (size_t)(m0 + r) * K + k);           \
    } while (0)
DEFINE_INT8S(int8_dot_, BF16_DOT, CHUNK_DOT)
static const int8_fn INT8[2][MAX_ROWS + 1] = {INT8_TABLE(int8_fma_), INT8_TABLE(int8_dot_)};
#else
static const int8_fn INT8[2][MAX_ROWS + 1] = {INT8_TABLE(int8_fma_), INT8_TABLE(int8_fma_)};
#endif

static void int8_columns(const call_t *c, int a, int b) {
    vf acc[MAX_ROWS * 16];
    for (int m0 = 0; m0 < c->M; m0 += MAX_ROWS) {
        int rows = c->M - m0 < MAX_ROWS ? c->M - m0 : MAX_ROWS;
        for (int n16 = a; n16 < b; n16 += 16) {
            for (int n = n16; n < n16 + 16; n++) INT8[use_dot][rows](c, m0, n, acc);
            const vf s = vf_load_bf16(c->sz + n16);
            for (int r = 0; r < rows; r++) {
                // NaN as f32_to_bf16
                vf_store_bf16(c->y + (size_t)(m0 + r) * c->N + n16,
                              vf_mul(vf_sums16(acc + r * 16), s), 0x7fc00000);
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

// thread i of n: its share [a, b) of N columns, in 64-column blocks
static void share_of(int N, int i, int n, int *a, int *b) {
    int blocks = N / BLOCK;
    *a = blocks * i / n * BLOCK;
    *b = blocks * (i + 1) / n * BLOCK;
}

static void thread_share(const call_t *c, int i, int n) {
    int a, b;
    share_of(c->N, i, n, &a, &b);
    c->run(c, a, b);
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

// Run `run` over x [M, K] bf16 prepared (acts_t) with the weights: 0, or -1 when out of memory.
static int run_prepared(const uint16_t *x, int M, int K, const uint8_t *codes, const uint16_t *sz,
                        int N, uint16_t *y, int threads, void (*run)(const call_t *, int, int)) {
    const size_t n = (size_t)M * K;
    float *xf = widen(x, n);
    float *xs = (float *)malloc(n / GROUP * sizeof(float));
    uint16_t *xb = (uint16_t *)malloc(n * sizeof(uint16_t));
    int rc = -1;
    if (xf && xs && xb) {
        for (int r = 0; r < M; r++)  // in place: prep_acts reads a group before writing it
            prep_acts(xf + (size_t)r * K, K, xf + (size_t)r * K, xb + (size_t)r * K,
                      xs + (size_t)r * (K / GROUP));
        acts_t xa = {xf, xb, xs};
        call_t c = {M, K, N, codes, sz, y, run, &xa};
        dispatch(&c, threads);
        rc = 0;
    }
    free(xf);
    free(xs);
    free(xb);
    return rc;
}

// Both return 0, or -1 when the shapes are not supported (the caller checks them first) or out
// of memory.
int int4mm_bf16(const uint16_t *x, int M, int K, const uint8_t *codes, const uint16_t *sz, int N,
                uint16_t *y, int threads) {
    if (M <= 0 || K % GROUP || N % BLOCK || threads < 1) return -1;
    return run_prepared(x, M, K, codes, sz, N, y, threads, int4_columns);
}

int int8mm_bf16(const uint16_t *x, int M, int K, const int8_t *q, const uint16_t *scales, int N,
                uint16_t *y, int threads) {
    if (M <= 0 || K % GROUP || N % BLOCK || threads < 1) return -1;
    return run_prepared(x, M, K, (const uint8_t *)q, scales, N, y, threads, int8_columns);
}

#include "q8.c"  // int8 activations: the same calls and threads
