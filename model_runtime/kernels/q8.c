// int4 weights times int8 activations (opt-in: `meshlm serve --activations int8`), as
// llama.cpp's Q4 x Q8 dot products: not torch's arithmetic, so not bit-identical to qmm.c's. The
// quality gate judges a version that uses it against bf16 (docs/ARCHITECTURE.md). Included at
// the end of qmm.c (its calls and threads), so step.c has it too.
//
// Activations: each row's groups of 32 as int8 q = round(x * 127 / max|x|) with d = max|x| / 127
// (llama.cpp's Q8_0). Per output column and group, with w = (c - 8) s + z:
//   sum x w = d * (s * sum(q c) + (z - 8 s) * sum(q))
// where sum(q c) is exact in int32 (4 code-activation products a lane and instruction); a mul
// and two FMAs a row and group bring it into the column's fp32 accumulator (d applied to the
// group's two terms at once: one op fewer than each term times d, batch 8's w13 1.09x as fast).
// The result is rounded to bf16.
//
// Weight layout (quant.py pack_q8): panels of 16 output columns, each [K / 8][16 lanes][4 bytes],
// byte j of lane c = code(k0 + j) | code(k0 + 4 + j) << 4 for the 8 k from k0: one 64-byte load
// gives 4 k of 16 columns in its low nibbles and the next 4 in its high ones. Scales and zeros
// are the int4 layout's (qmm.c), so a layer holds both code layouts and one sz.

typedef struct {
    const int8_t *q;  // [rows, K]
    const float *d;   // [rows, K / 32]
    const float *sq;  // [rows, K / 32] sum(q) of each group (an integer)
    int vnni;         // 1: the CPU has VNNI (avx512_vnni for the AVX-512 build, avx_vnni for AVX2)
} q8x_t;

// bytes of weights ahead of the one read that a kernel asks the cache for: a batch's step
// streams them slower than the prefetcher alone keeps up with (batch 8: +10 % tokens/s here)
#define Q8_AHEAD 2048

// x's K values (K % 32 == 0) as int8 groups
static void quantize_q8(const float *x, int K, int8_t *q, float *d, float *sq) {
    for (int g = 0; g < K / GROUP; g++) {
        vf a = vf_load(x + g * GROUP), b = vf_load(x + g * GROUP + 16);
        float amax = vf_max_all(vf_max(vf_abs(a), vf_abs(b)));
        vf id = vf_set1(amax > 0.0f ? 127.0f / amax : 0.0f);
        vf qa = vf_round(vf_mul(a, id)), qb = vf_round(vf_mul(b, id));
        vf_store_i8(q + g * GROUP, qa);
        vf_store_i8(q + g * GROUP + 16, qb);
        d[g] = amax / 127.0f;
        sq[g] = vf_sum(vf_add(qa, qb));  // a sum of integers < 2^24: exact
    }
}

// R rows x one panel of 16 columns
#define DEFINE_Q8(NAME, R, ATTR, DOT4)                                                             \
    static ATTR void NAME(const call_t *c, const q8x_t *x, int panel) {                           \
        const int K = c->K, KG = K / GROUP;                                                       \
        const uint8_t *wp = c->codes + (size_t)panel * (K / 8) * 64;                              \
        const uint16_t *sp = c->sz + (size_t)(panel / 4) * KG * 2 * BLOCK + (panel % 4) * PANEL;  \
        vf acc[R];                                                                                \
        for (int r = 0; r < R; r++) acc[r] = vf_zero();                                           \
        for (int g = 0; g < KG; g++) {                                                            \
            vi is[R];                                                                             \
            for (int r = 0; r < R; r++) is[r] = vi_zero();                                        \
            for (int ch = 0; ch < GROUP / 8; ch++) {                                              \
                const uint8_t *at = wp + (size_t)(g * (GROUP / 8) + ch) * 64;                     \
                _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                           \
                vb b = vb_load(at), lo = vb_nibble_lo(b), hi = vb_nibble_hi(b);                   \
                for (int r = 0; r < R; r++) {                                                     \
                    int32_t x4[2];                                                                \
                    memcpy(x4, x->q + (size_t)r * K + g * GROUP + ch * 8, 8);                     \
                    is[r] = DOT4(is[r], lo, x4[0]);                                               \
                    is[r] = DOT4(is[r], hi, x4[1]);                                               \
                }                                                                                 \
            }                                                                                     \
            vf s = vf_load_bf16(sp + g * 2 * BLOCK), z = vf_load_bf16(sp + g * 2 * BLOCK + BLOCK); \
            vf zz = vf_fnma(vf_set1(8.0f), s, z);                                                 \
            for (int r = 0; r < R; r++) {                                                         \
                vf f = vf_fma(vf_set1(x->sq[r * KG + g]), zz, vf_mul(vf_of_vi(is[r]), s));        \
                acc[r] = vf_fma(f, vf_set1(x->d[r * KG + g]), acc[r]);                            \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            vf_store_bf16(c->y + (size_t)r * c->N + panel * PANEL, acc[r], 0xffff0000);           \
    }

#define NO_ATTR
DEFINE_Q8(q8_1, 1, NO_ATTR, vi_dot4)
DEFINE_Q8(q8_2, 2, NO_ATTR, vi_dot4)
DEFINE_Q8(q8_3, 3, NO_ATTR, vi_dot4)
DEFINE_Q8(q8_4, 4, NO_ATTR, vi_dot4)
DEFINE_Q8(q8_5, 5, NO_ATTR, vi_dot4)
DEFINE_Q8(q8_6, 6, NO_ATTR, vi_dot4)
DEFINE_Q8(q8_7, 7, NO_ATTR, vi_dot4)
DEFINE_Q8(q8_8, 8, NO_ATTR, vi_dot4)
// the same sums with VNNI's dot-product instruction, for a CPU that has it (q8x_t.vnni)
DEFINE_Q8(q8v_1, 1, VNNI, vi_dot4_vnni)
DEFINE_Q8(q8v_2, 2, VNNI, vi_dot4_vnni)
DEFINE_Q8(q8v_3, 3, VNNI, vi_dot4_vnni)
DEFINE_Q8(q8v_4, 4, VNNI, vi_dot4_vnni)
DEFINE_Q8(q8v_5, 5, VNNI, vi_dot4_vnni)
DEFINE_Q8(q8v_6, 6, VNNI, vi_dot4_vnni)
DEFINE_Q8(q8v_7, 7, VNNI, vi_dot4_vnni)
DEFINE_Q8(q8v_8, 8, VNNI, vi_dot4_vnni)

typedef void (*q8_fn)(const call_t *, const q8x_t *, int);
static const q8_fn Q8[2][MAX_ROWS + 1] = {
    {0, q8_1, q8_2, q8_3, q8_4, q8_5, q8_6, q8_7, q8_8},
    {0, q8v_1, q8v_2, q8v_3, q8v_4, q8v_5, q8v_6, q8v_7, q8v_8}};

// The int8 head (int8mm_bf16's weights: one scale per output) on int8 activations, in its own
// layout (quant.py pack_head_q8): [N / 16][K / 4][16 lanes][4 bytes], byte j of lane c = weight
// (c, k0 + j) + 128, unsigned as VNNI's instruction takes them. Per output and group the int32
// sum starts at -128 sum(q), so it ends as sum(q w) exactly; y = scale * sum over groups of
// d * that.
#define DEFINE_HEAD8(NAME, R, ATTR, DOT4)                                                         \
    static ATTR void NAME(const call_t *c, const q8x_t *x, int panel) {                           \
        const int K = c->K, KG = K / GROUP;                                                       \
        const uint8_t *wp = c->codes + (size_t)panel * K * PANEL;                                 \
        vf acc[R];                                                                                \
        for (int r = 0; r < R; r++) acc[r] = vf_zero();                                           \
        for (int g = 0; g < KG; g++) {                                                            \
            vi is[R];                                                                             \
            for (int r = 0; r < R; r++) is[r] = vi_set1(-128 * (int32_t)x->sq[r * KG + g]);       \
            for (int ch = 0; ch < GROUP / 4; ch++) {                                              \
                const uint8_t *at = wp + (size_t)(g * (GROUP / 4) + ch) * 64;                     \
                _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                           \
                vb b = vb_load(at);                                                               \
                for (int r = 0; r < R; r++) {                                                     \
                    int32_t x4;                                                                   \
                    memcpy(&x4, x->q + (size_t)r * K + g * GROUP + ch * 4, 4);                    \
                    is[r] = DOT4(is[r], b, x4);                                                   \
                }                                                                                 \
            }                                                                                     \
            for (int r = 0; r < R; r++)                                                           \
                acc[r] = vf_fma(vf_of_vi(is[r]), vf_set1(x->d[r * KG + g]), acc[r]);              \
        }                                                                                         \
        vf scale = vf_load_bf16(c->sz + (size_t)panel * PANEL);                                   \
        for (int r = 0; r < R; r++)                                                               \
            vf_store_bf16(c->y + (size_t)r * c->N + panel * PANEL, vf_mul(acc[r], scale),         \
                          0x7fc00000);                                                            \
    }

DEFINE_HEAD8(head8_1, 1, NO_ATTR, vi_dot4_u8)
DEFINE_HEAD8(head8_2, 2, NO_ATTR, vi_dot4_u8)
DEFINE_HEAD8(head8_3, 3, NO_ATTR, vi_dot4_u8)
DEFINE_HEAD8(head8_4, 4, NO_ATTR, vi_dot4_u8)
DEFINE_HEAD8(head8_5, 5, NO_ATTR, vi_dot4_u8)
DEFINE_HEAD8(head8_6, 6, NO_ATTR, vi_dot4_u8)
DEFINE_HEAD8(head8_7, 7, NO_ATTR, vi_dot4_u8)
DEFINE_HEAD8(head8_8, 8, NO_ATTR, vi_dot4_u8)
DEFINE_HEAD8(head8v_1, 1, VNNI, vi_dot4_u8_vnni)
DEFINE_HEAD8(head8v_2, 2, VNNI, vi_dot4_u8_vnni)
DEFINE_HEAD8(head8v_3, 3, VNNI, vi_dot4_u8_vnni)
DEFINE_HEAD8(head8v_4, 4, VNNI, vi_dot4_u8_vnni)
DEFINE_HEAD8(head8v_5, 5, VNNI, vi_dot4_u8_vnni)
DEFINE_HEAD8(head8v_6, 6, VNNI, vi_dot4_u8_vnni)
DEFINE_HEAD8(head8v_7, 7, VNNI, vi_dot4_u8_vnni)
DEFINE_HEAD8(head8v_8, 8, VNNI, vi_dot4_u8_vnni)

static const q8_fn HEAD8[2][MAX_ROWS + 1] = {
    {0, head8_1, head8_2, head8_3, head8_4, head8_5, head8_6, head8_7, head8_8},
    {0, head8v_1, head8v_2, head8v_3, head8v_4, head8v_5, head8v_6, head8v_7, head8v_8}};

// call_t's run for int8 activations: c->aux is the q8x_t of all c->M rows, `fns` the kernels
static void q8_panels(const call_t *c, int a, int b, const q8_fn fns[2][MAX_ROWS + 1]) {
    const q8x_t *x = (const q8x_t *)c->aux;
    const int KG = c->K / GROUP;
    for (int m0 = 0; m0 < c->M; m0 += MAX_ROWS) {
        int rows = c->M - m0 < MAX_ROWS ? c->M - m0 : MAX_ROWS;
        call_t part = *c;
        part.y = c->y + (size_t)m0 * c->N;
        q8x_t xs = {x->q + (size_t)m0 * c->K, x->d + (size_t)m0 * KG, x->sq + (size_t)m0 * KG,
                    x->vnni};
        for (int p = a / PANEL; p < b / PANEL; p++) fns[x->vnni][rows](&part, &xs, p);
    }
}

static void q8_columns(const call_t *c, int a, int b) { q8_panels(c, a, b, Q8); }
static void head8_columns(const call_t *c, int a, int b) { q8_panels(c, a, b, HEAD8); }

// y[M, N] bf16 = x[M, K] bf16 @ W.T with x quantized to int8, by `run` (its weights and sz in
// its layout above); vnni as q8x_t's. 0, or -1 when the shapes are not supported, -2 out of memory.
static int q8_call(const uint16_t *x, int M, int K, const uint8_t *codes, const uint16_t *sz,
                   int N, uint16_t *y, int threads, int vnni,
                   void (*run)(const call_t *, int, int)) {
    if (M <= 0 || K % GROUP || N % BLOCK || threads < 1) return -1;
    const int KG = K / GROUP;
    float *xf = widen(x, (size_t)M * K);
    int8_t *q = (int8_t *)malloc((size_t)M * K);
    float *ds = (float *)malloc((size_t)M * KG * 2 * sizeof(float));
    int rc = -2;
    if (xf && q && ds) {
        for (int r = 0; r < M; r++)
            quantize_q8(xf + (size_t)r * K, K, q + (size_t)r * K, ds + (size_t)r * KG,
                        ds + (size_t)(M + r) * KG);
        q8x_t xq = {q, ds, ds + (size_t)M * KG, vnni != 0};
        call_t c = {M, K, N, codes, sz, y, run, &xq};
        dispatch(&c, threads);
        rc = 0;
    }
    free(xf);
    free(q);
    free(ds);
    return rc;
}

// the int4 linears' (codes: pack_q8) and the int8 head's (codes: pack_head_q8, sz its scales)
int int4mm_q8(const uint16_t *x, int M, int K, const uint8_t *codes, const uint16_t *sz, int N,
              uint16_t *y, int threads, int vnni) {
    return q8_call(x, M, K, codes, sz, N, y, threads, vnni, q8_columns);
}

int int8mm_q8(const uint16_t *x, int M, int K, const uint8_t *codes, const uint16_t *scales, int N,
              uint16_t *y, int threads, int vnni) {
    return q8_call(x, M, K, codes, scales, N, y, threads, vnni, head8_columns);
}
