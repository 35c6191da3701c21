// One decode step of the int4 model in one native call: every row is one new token
// (T = 1), all layers and the final norm and head run inside one OpenMP region of torch's own team
// (GOMP_parallel once per step, GOMP_barrier between phases) instead of thousands of torch ops.
//
// The arithmetic follows model.py's rounding points: bf16 after rms_norm (fp32 normalize times the
// weight), RoPE as torch's complex multiply of fp32 pairs (ac - bd, ad + bc: products
// rounded, no FMA), K/V written to the paged cache, silu and mul and the residual adds each
// rounded to bf16, and the matmuls are qmm.c's (as Int4Linear's and Int8Linear's). Attention
// follows torch's CPU flash kernel (fp32 scores, softmax probabilities rounded to bf16 before
// they weigh V, blocks of 512 keys) but its exp and dot-product order are not torch's, so its
// output may differ from SDPA's in the last bit.

#include "qmm.c"

#include <math.h>

#pragma clang fp contract(off)

typedef struct {
    const uint8_t *codes;
    const uint16_t *sz;
    const uint8_t *codes8;  // q8.c's layout, or NULL
} q4_t;

typedef struct {
    q4_t wqkv, wo, w13, w2;
    const uint16_t *attn_norm, *ffn_norm;
} layer_t;

typedef struct {
    int n_layers, dim, n_heads, n_kv, head_dim, hidden, vocab, ctx;
    float eps;
    const layer_t *layers;
    const uint16_t *norm;
    const int8_t *head_q;
    const uint16_t *head_scales;
    const float *rope;  // [ctx, head_dim / 2, (cos, sin)]
    int q8;             // the linear layers take int8 activations (q8.c; codes8 set): 1, or 2
                        // with VNNI's instruction
    const uint8_t *head8;  // q8: the head in q8.c's layout
} model_t;

typedef struct {
    int B, L;
    const int64_t *tokens;       // [B] token ids (embedded from the tied int8 head)
    const int64_t *pos;          // [B] positions
    const int64_t *write_slots;  // [B]
    const int64_t *gather;       // [B, L] slots each row attends
    const uint8_t *mask;         // bool [B, L], NULL: every slot attended
    uint16_t *kv;                // [n_layers, n_slots, 2, n_kv, head_dim] bf16
    int64_t n_slots;
    float *logits;  // [B, vocab] fp32: bf16 values, as torch's head then .float()
    // prefill rows (native_attention alone): > 0, every row reads gather's first row, row b
    // its first keys0 + b slots (causal; mask unused); 0, gather and mask as above
    int keys0;
} step_t;

typedef void (*gomp_barrier_fn)(void);
static gomp_barrier_fn gomp_barrier;
static omp_int_fn omp_num_threads;

void step_set_gomp(void *parallel, void *thread_num, void *num_threads, void *barrier) {
    qmm_set_gomp(parallel, thread_num);
    omp_num_threads = (omp_int_fn)num_threads;
    gomp_barrier = (gomp_barrier_fn)barrier;
}

// keys ahead of the one read whose K the cache is asked for (and the key's V, read after the
// scores): a key's K of one K/V head is 128 of its slot's 768 bytes, and with the hardware
// prefetcher alone attention waited on memory (SmolLM2-135M, batch 8: 4.2 -> 2.2 M cycles a step)
#define KV_AHEAD 16
#define KV_SPLIT 512  // keys per block of torch's flash attention (kv_seq_len >= 512)

typedef struct {
    const model_t *m;
    const step_t *s;
    int n;         // threads asked for (the team may have fewer: nested in another region)
    float *h;      // [B, dim] residual stream (bf16 values)
    float *xin;    // [B, max(dim, hidden)] matmul input (bf16 values)
    uint16_t *qkv; // [B, (n_heads + 2 n_kv) head_dim]
    uint16_t *o;   // [B, dim]
    uint16_t *gu;  // [B, 2 hidden]
    float *scratch;  // scratch_floats(L) per thread
    int layer;       // native_attention's
    int8_t *xq;      // q8: xin quantized, [B, max(dim, hidden)] and its d, sum(q) [B, that / 32]
    float *xd, *xs;
    // bf16 activations: each thread's own acts_t of the matmul input (every thread prepares it
    // for itself: a few microseconds, no barrier): split fp32 [B, in_w] and group sums
    // [B, in_w / 32] at pf + tid * pstride * (1 + 1/32), bf16 [B, in_w] at pb + tid * pstride
    float *pf;
    uint16_t *pb;
    size_t pstride;
    uint16_t *head;  // [B, vocab] bf16 logits
    int *nonfinite;  // set when a logit is inf or NaN
} team_arg_t;

static inline float bf(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float rnd(float f) { return bf(f32_to_bf16(f)); }

// rnd of each lane
static inline vf vf_rnd(vf v) {
    uint16_t h[16];
    vf_store_bf16(h, v, 0x7fc00000);
    return vf_load_bf16(h);
}

// h = rnd(h + o) over d values (d % 16 == 0: native_step checks the model's dims)
static void residual_add(float *h, const uint16_t *o, int d) {
    for (int i = 0; i < d; i += 16)
        vf_store(h + i, vf_rnd(vf_add(vf_load(h + i), vf_load_bf16(o + i))));
}

static void barrier(int n) {
    if (n > 1) gomp_barrier();
}

// y = bf16(x * rsqrt(mean(x^2) + eps) * w) in fp32, as torch's rms_norm on bf16
static void rms_norm(const float *x, const uint16_t *w, int d, float eps, float *y) {
    vf acc = vf_zero();
    int i = 0;
    for (; i + 16 <= d; i += 16) {
        vf v = vf_load(x + i);
        acc = vf_add(acc, vf_mul(v, v));
    }
    float ss = vf_sum(acc);
    for (; i < d; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)d + eps);
    const vf vr = vf_set1(r);
    for (i = 0; i + 16 <= d; i += 16)
        vf_store(y + i, vf_rnd(vf_mul(vf_mul(vf_load(x + i), vr), vf_load_bf16(w + i))));
    for (; i < d; i++) y[i] = rnd(x[i] * r * bf(w[i]));
}

// x [B, K] prepared for the int4 and int8 kernels in thread tid's own buffers
static acts_t prepared(const team_arg_t *t, int tid, const float *x, int K) {
    float *xf = t->pf + tid * (t->pstride + t->pstride / GROUP), *xs = xf + t->pstride;
    uint16_t *xb = t->pb + tid * t->pstride;
    for (int b = 0; b < t->s->B; b++)
        prep_acts(x + (size_t)b * K, K, xf + (size_t)b * K, xb + (size_t)b * K,
                  xs + (size_t)b * (K / GROUP));
    acts_t xa = {xf, xb, xs};
    return xa;
}

static void matmul(const team_arg_t *t, int tid, int n, const float *x, int K, int N,
                   const q4_t *w, uint16_t *y) {
    if (t->m->q8) {
        q8x_t xq = {t->xq, t->xd, t->xs, t->m->q8 == 2};
        call_t c = {t->s->B, K, N, w->codes8, w->sz, y, q8_columns, &xq};
        thread_share(&c, tid, n);
        return;
    }
    acts_t xa = prepared(t, tid, x, K);
    call_t c = {t->s->B, K, N, w->codes, w->sz, y, int4_columns, &xa};
    thread_share(&c, tid, n);
}

// q8: the int8 groups of values [off, off + len) of xin's row b, whose rows are K long (the
// next matmul's K): quantized where they are written, before the barrier ahead of the matmul
static void q8_row(const team_arg_t *t, int b, int K, int off, int len) {
    if (!t->m->q8) return;
    size_t at = (size_t)b * K + off, g = at / GROUP;
    quantize_q8(t->xin + at, len, t->xq + at, t->xd + g, t->xs + g);
}

// rows [r0, r1) of thread tid of n
static void rows_of(int B, int tid, int n, int *r0, int *r1) {
    *r0 = B * tid / n;
    *r1 = B * (tid + 1) / n;
}

// RoPE on q and k, rounded back to bf16, and K/V of every row into its cache slot
static void rope_and_store(const team_arg_t *t, int layer, int b) {
    const model_t *m = t->m;
    const step_t *s = t->s;
    const int hd = m->head_dim, nq = m->n_heads + m->n_kv, width = (nq + m->n_kv) * hd;
    uint16_t *row = t->qkv + (size_t)b * width;
    const float *f = m->rope + (size_t)s->pos[b] * hd;
    for (int h = 0; h < nq; h++) {
        uint16_t *p = row + h * hd;
        for (int i = 0; i < hd / 2; i++) {
            float a = bf(p[2 * i]), bb = bf(p[2 * i + 1]), c = f[2 * i], d = f[2 * i + 1];
            float ac = a * c, bd = bb * d, ad = a * d, bc = bb * c;
            p[2 * i] = f32_to_bf16(ac - bd);
            p[2 * i + 1] = f32_to_bf16(ad + bc);
        }
    }
    size_t kvw = (size_t)2 * m->n_kv * hd;
    uint16_t *dst = s->kv + ((size_t)layer * s->n_slots + (size_t)s->write_slots[b]) * kvw;
    memcpy(dst, row + (size_t)m->n_heads * hd, kvw * sizeof(uint16_t));
}

// torch's Vectorized<float>::exp_u20 (AVX-512 and AVX2 alike), which its flash attention uses
// for the softmax
static inline vf exp_u20(vf x) {
    const vf log2e = vf_bits(0x3fb8aa3b), ln2 = vf_bits(0x3f317218);
    const vf lo = vf_bits(0xc2aeac50), hi = vf_bits(0x42b17218), one = vf_set1(1.f);
    vf v = vf_max(vf_min(x, hi), lo);
    vf fx = vf_floor(vf_fma(v, log2e, vf_set1(0.5f)));
    vf r = vf_fnma(fx, ln2, v);
    vf y = vf_fma(r, vf_set1(0.00828929059f), vf_set1(0.0418978221f));
    y = vf_fma(r, y, vf_set1(0.166676521f));
    y = vf_fma(r, y, vf_set1(0.499991506f));
    y = vf_fma(r, y, vf_set1(0.999999701f));
    y = vf_fma(r, y, one);
    vf p2 = vf_zero_where_lt(vf_exp2i(vf_sub(fx, one)), x, lo);
    return vf_mul(vf_mul(y, p2), vf_set1(2.f));
}

// the hd bf16 values at p into the cache
static inline void prefetch_row(const uint16_t *p, int hd) {
    for (int c = 0; c < hd * 2; c += 64) _mm_prefetch((const char *)p + c, _MM_HINT_T0);
}

// One row and its NH query heads h0 .. h0 + NH - 1 of one K/V head (head_dim 16 HD16): per head
// out = softmax(q k^T / sqrt(hd) + mask) v over the row's attended slots. The heads of a group
// share each key's K and V rows, widened once for all of them (GQA: SmolLM2's 9 query heads
// share 3 K/V heads); per head the operations and their order are those of NH = 1, so a head
// gives the same bits alone or grouped.
#define DEFINE_ATTEND(NAME, NH, HD16)                                                             \
    static void NAME(const team_arg_t *t, int layer, int b, int h0, float *scratch) {             \
        const model_t *m = t->m;                                                                  \
        const step_t *s = t->s;                                                                   \
        const int hd = 16 * HD16, L = s->L, g = h0 / (m->n_heads / m->n_kv);                      \
        const int width = (m->n_heads + 2 * m->n_kv) * hd;                                        \
        const size_t kvw = (size_t)2 * m->n_kv * hd;                                              \
        const uint16_t *base = s->kv + (size_t)layer * s->n_slots * kvw;                          \
        const int64_t *slots = s->gather + (s->keys0 ? 0 : (size_t)b * L);                        \
        const uint8_t *mask = s->mask && !s->keys0 ? s->mask + (size_t)b * L : NULL;              \
        /* keys past a row's last are skipped, not masked: the same bits (they add 0s) */        \
        const int n_keys = s->keys0 ? s->keys0 + b : L;                                           \
        const float scale = 1.0f / sqrtf((float)hd);                                              \
        float *sc[NH], mx[NH], sum[NH], bm[NH], nm[NH], corr[NH], bs[NH];                         \
        vf q[NH][HD16], acc[NH][HD16];                                                            \
        int nan[NH], live[NH];                                                                    \
        for (int r = 0; r < NH; r++) {                                                            \
            sc[r] = scratch + (size_t)r * L;                                                      \
            const uint16_t *qr = t->qkv + (size_t)b * width + (h0 + r) * hd;                      \
            for (int i = 0; i < HD16; i++) q[r][i] = vf_load_bf16(qr + 16 * i);                   \
            for (int i = 0; i < HD16; i++) acc[r][i] = vf_zero();                                 \
            mx[r] = -INFINITY, sum[r] = 0.0f, nan[r] = 0;                                         \
        }                                                                                         \
        for (int j0 = 0; j0 < n_keys; j0 += KV_SPLIT) {                                           \
            int j1 = j0 + KV_SPLIT < n_keys ? j0 + KV_SPLIT : n_keys;                             \
            for (int r = 0; r < NH; r++) bm[r] = -INFINITY;                                       \
            for (int j = j0; j < j1; j++) {                                                       \
                if (mask && !mask[j]) {                                                           \
                    for (int r = 0; r < NH; r++) sc[r][j] = -INFINITY;                            \
                    continue;                                                                     \
                }                                                                                 \
                const uint16_t *k = base + (size_t)slots[j] * kvw + (size_t)g * hd;               \
                if (j + KV_AHEAD < j1)                                                            \
                    prefetch_row(base + (size_t)slots[j + KV_AHEAD] * kvw + (size_t)g * hd, hd);  \
                prefetch_row(k + (size_t)m->n_kv * hd, hd); /* its V */                           \
                vf kk[HD16];                                                                      \
                for (int i = 0; i < HD16; i++) kk[i] = vf_load_bf16(k + 16 * i);                  \
                for (int r = 0; r < NH; r++) {                                                    \
                    vf d = vf_zero();                                                             \
                    for (int i = 0; i < HD16; i++) d = vf_fma(q[r][i], kk[i], d);                 \
                    float v = vf_sum(d) * scale;                                                  \
                    if (v > bm[r]) bm[r] = v;                                                     \
                    if (v != v) nan[r] = 1, v = -INFINITY;                                        \
                    sc[r][j] = v;                                                                 \
                }                                                                                 \
            }                                                                                     \
            for (int r = 0; r < NH; r++) {                                                        \
                nm[r] = bm[r] > mx[r] ? bm[r] : mx[r];                                            \
                live[r] = nm[r] != -INFINITY;                                                     \
                if (!live[r]) continue;                                                           \
                corr[r] = mx[r] == -INFINITY ? 0.0f : expf(mx[r] - nm[r]);                        \
                for (int i = 0; i < HD16; i++) acc[r][i] = vf_mul(acc[r][i], vf_set1(corr[r]));   \
                vf lanes = vf_zero();                                                             \
                for (int j = j0; j < j1; j += 16) {                                               \
                    int cnt = j1 - j < 16 ? j1 - j : 16;                                          \
                    vf p = exp_u20(vf_sub(vf_load_n(sc[r] + j, cnt, -INFINITY), vf_set1(nm[r]))); \
                    lanes = vf_add(lanes, p);                                                     \
                    vf_store_n(sc[r] + j, cnt, vf_rnd(p)); /* V is weighed by bf16 p */           \
                }                                                                                 \
                bs[r] = vf_sum_xor(lanes);                                                        \
            }                                                                                     \
            for (int j = j0; j < j1; j++) {                                                       \
                if (mask && !mask[j]) continue;                                                   \
                const uint16_t *v = base + (size_t)slots[j] * kvw + (size_t)(m->n_kv + g) * hd;   \
                vf vv[HD16];                                                                      \
                for (int i = 0; i < HD16; i++) vv[i] = vf_load_bf16(v + 16 * i);                  \
                for (int r = 0; r < NH; r++) {                                                    \
                    if (!live[r]) continue;                                                       \
                    vf pv = vf_set1(sc[r][j]);                                                    \
                    for (int i = 0; i < HD16; i++) acc[r][i] = vf_fma(pv, vv[i], acc[r][i]);      \
                }                                                                                 \
            }                                                                                     \
            for (int r = 0; r < NH; r++) {                                                        \
                if (!live[r]) continue;                                                           \
                sum[r] = sum[r] * corr[r] + bs[r];                                                \
                mx[r] = nm[r];                                                                    \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < NH; r++) {                                                            \
            float inv = nan[r] ? NAN : sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;                      \
            float *out = t->xin + (size_t)b * m->n_heads * hd + (h0 + r) * hd;                    \
            for (int i = 0; i < HD16; i++) {                                                      \
                uint16_t o[16];                                                                   \
                vf_store_bf16(o, vf_mul(acc[r][i], vf_set1(inv)), 0xffff0000);                    \
                vf_store(out + 16 * i, vf_load_bf16(o));                                          \
            }                                                                                     \
            q8_row(t, b, m->n_heads * hd, (h0 + r) * hd, hd);                                     \
        }                                                                                         \
    }

// one head, for every head_dim (16 to 128)
DEFINE_ATTEND(attend_1x1, 1, 1)
DEFINE_ATTEND(attend_1x2, 1, 2)
DEFINE_ATTEND(attend_1x3, 1, 3)
DEFINE_ATTEND(attend_1x4, 1, 4)
DEFINE_ATTEND(attend_1x5, 1, 5)
DEFINE_ATTEND(attend_1x6, 1, 6)
DEFINE_ATTEND(attend_1x7, 1, 7)
DEFINE_ATTEND(attend_1x8, 1, 8)
// the shapes with a grouped kernel: query heads per K/V head x head_dim / 16
DEFINE_ATTEND(attend_3x4, 3, 4)  // SmolLM2-135M
DEFINE_ATTEND(attend_4x8, 4, 8)  // Llama 3 8B
#define GQA_MAX 4                // scratch: scores of up to 4 heads a thread

typedef void (*attend_fn)(const team_arg_t *, int, int, int, float *);
static const attend_fn ONE_HEAD[9] = {0,          attend_1x1, attend_1x2, attend_1x3, attend_1x4,
                                      attend_1x5, attend_1x6, attend_1x7, attend_1x8};

static attend_fn grouped(const model_t *m) {
    const int rep = m->n_heads / m->n_kv, hd16 = m->head_dim / 16;
    if (rep == 3 && hd16 == 4) return attend_3x4;
    if (rep == 4 && hd16 == 8) return attend_4x8;
    return NULL;
}

// floats of scratch a thread: a group's scores
static size_t scratch_floats(int L) { return (size_t)GQA_MAX * L; }

// layer's attention, thread tid of n: (row, K/V head) tasks where a grouped kernel fits and there
// are enough of them to keep every thread busy, else (row, query head) ones; a thread takes a
// run of tasks, or every n-th of prefill rows (whose keys grow row by row)
static void attend_layer(const team_arg_t *t, int layer, int tid, int n, float *scratch) {
    const model_t *m = t->m;
    const int B = t->s->B, rep = m->n_heads / m->n_kv;
    attend_fn fn = grouped(m);
    const int grouped_tasks = fn && B * m->n_kv >= 2 * n;
    const int tasks = B * (grouped_tasks ? m->n_kv : m->n_heads);
    const int strided = t->s->keys0 > 0;
    const int k0 = strided ? tid : tasks * tid / n, k1 = strided ? tasks : tasks * (tid + 1) / n;
    for (int k = k0; k < k1; k += strided ? n : 1) {
        if (grouped_tasks)
            fn(t, layer, k / m->n_kv, (k % m->n_kv) * rep, scratch);
        else
            ONE_HEAD[m->head_dim / 16](t, layer, k / m->n_heads, k % m->n_heads, scratch);
    }
}

// --- attention alone, for a decode step that runs in torch ops otherwise (a bf16 model):
// torch's SDPA over the gathered cache costs ~4x this at batch 8

typedef struct {
    int B, L, n_heads, n_kv, head_dim, layer;
    const uint16_t *qkv;     // [B, (n_heads + 2 n_kv) head_dim] bf16, q after RoPE
    const int64_t *gather;   // [B, L] slots each row attends ([L] with keys0)
    const uint8_t *mask;     // bool [B, L], NULL: every slot attended
    const uint16_t *kv;      // the cache [n_layers, n_slots, 2, n_kv, head_dim] bf16
    int64_t n_slots;
    float *out;              // [B, n_heads head_dim]: bf16 values
    int keys0;               // prefill rows: step_t's
} attn_t;

static void attention_team(void *arg) {
    const team_arg_t *t = (const team_arg_t *)arg;
    const int n = t->n > 1 ? omp_num_threads() : 1, tid = n > 1 ? omp_thread_num() : 0;
    attend_layer(t, t->layer, tid, n, t->scratch + tid * scratch_floats(t->s->L));
}

// 0, or -1 when the shapes are not supported, -2 out of memory
int native_attention(const attn_t *a, int threads) {
    const int hd = a->head_dim;
    if (a->B <= 0 || a->L <= 0 || threads < 1 || hd % 16 || hd > 128 || a->n_kv <= 0 ||
        a->n_heads % a->n_kv || a->layer < 0 || a->keys0 < 0 ||
        (a->keys0 && a->keys0 + a->B - 1 > a->L))
        return -1;
    if (!gomp_parallel || !omp_num_threads) threads = 1;
    model_t m = {0};
    m.n_heads = a->n_heads, m.n_kv = a->n_kv, m.head_dim = hd;
    step_t s = {0};
    s.B = a->B, s.L = a->L, s.gather = a->gather, s.mask = a->mask, s.keys0 = a->keys0;
    s.kv = (uint16_t *)a->kv, s.n_slots = a->n_slots;
    float *scratch = (float *)malloc(threads * scratch_floats(a->L) * sizeof(float));
    if (!scratch) return -2;
    team_arg_t t = {&m, &s, threads, 0, a->out, (uint16_t *)a->qkv, 0, 0, scratch, a->layer};
    if (threads == 1)
        attention_team(&t);
    else
        gomp_parallel(attention_team, &t, (unsigned)threads, 0);
    free(scratch);
    return 0;
}

// x = rnd(rnd(silu(g)) * u) for gu = [g | u], F values each (F % 16 == 0), silu(g) = g / (1 +
// exp(-g)) with exp_u20 (torch's silu uses a 1-ulp exp: this one may round to the other bf16 now
// and then; 16 at a time)
static void silu_mul(const uint16_t *gu, int F, float *x) {
    const vf one = vf_set1(1.0f);
    for (int i = 0; i < F; i += 16) {
        vf g = vf_load_bf16(gu + i);
        vf s = vf_rnd(vf_div(g, vf_add(one, exp_u20(vf_sub(vf_zero(), g)))));
        vf_store(x + i, vf_rnd(vf_mul(s, vf_load_bf16(gu + F + i))));
    }
}

static void widen_logits(const team_arg_t *t, int tid, int n);

static void team(void *arg) {
    const team_arg_t *t = (const team_arg_t *)arg;
    const model_t *m = t->m;
    const step_t *s = t->s;
    const int n = t->n > 1 ? omp_num_threads() : 1, tid = n > 1 ? omp_thread_num() : 0;
    const int B = s->B, D = m->dim;
    const int hd = m->head_dim, F = m->hidden, width = (m->n_heads + 2 * m->n_kv) * hd;
    float *scratch = t->scratch + tid * scratch_floats(s->L);
    int r0, r1;
    rows_of(B, tid, n, &r0, &r1);
    for (int b = r0; b < r1; b++) {  // TiedInt8Embedding: bf16(q * scale), the product exact
        const int8_t *q = m->head_q + (size_t)s->tokens[b] * D;
        const float scale = bf(m->head_scales[s->tokens[b]]);
        for (int i = 0; i < D; i++) t->h[(size_t)b * D + i] = rnd((float)q[i] * scale);
        rms_norm(t->h + (size_t)b * D, m->layers[0].attn_norm, D, m->eps, t->xin + (size_t)b * D);
        q8_row(t, b, D, 0, D);
    }
    barrier(n);
    for (int l = 0; l < m->n_layers; l++) {
        const layer_t *ly = &m->layers[l];
        matmul(t, tid, n, t->xin, D, width, &ly->wqkv, t->qkv);
        barrier(n);
        for (int b = r0; b < r1; b++) rope_and_store(t, l, b);
        barrier(n);
        attend_layer(t, l, tid, n, scratch);
        barrier(n);
        matmul(t, tid, n, t->xin, m->n_heads * hd, D, &ly->wo, t->o);
        barrier(n);
        for (int b = r0; b < r1; b++) {
            float *h = t->h + (size_t)b * D;
            residual_add(h, t->o + (size_t)b * D, D);
            rms_norm(h, ly->ffn_norm, D, m->eps, t->xin + (size_t)b * D);
            q8_row(t, b, D, 0, D);
        }
        barrier(n);
        matmul(t, tid, n, t->xin, D, 2 * F, &ly->w13, t->gu);
        barrier(n);
        for (int b = r0; b < r1; b++) {
            silu_mul(t->gu + (size_t)b * 2 * F, F, t->xin + (size_t)b * F);
            q8_row(t, b, F, 0, F);
        }
        barrier(n);
        matmul(t, tid, n, t->xin, F, D, &ly->w2, t->o);
        barrier(n);
        const uint16_t *next = l + 1 < m->n_layers ? m->layers[l + 1].attn_norm : m->norm;
        for (int b = r0; b < r1; b++) {
            float *h = t->h + (size_t)b * D;
            residual_add(h, t->o + (size_t)b * D, D);
            rms_norm(h, next, D, m->eps, t->xin + (size_t)b * D);
            q8_row(t, b, D, 0, D);
        }
        barrier(n);
    }
    if (m->q8) {
        q8x_t xq = {t->xq, t->xd, t->xs, m->q8 == 2};
        call_t c = {B, D, m->vocab, m->head8, m->head_scales, t->head, head8_columns, &xq};
        thread_share(&c, tid, n);
    } else {
        acts_t xa = prepared(t, tid, t->xin, D);
        call_t c = {B, D, m->vocab, (const uint8_t *)m->head_q, m->head_scales, t->head,
                    int8_columns, &xa};
        thread_share(&c, tid, n);
    }
    widen_logits(t, tid, n);
}

// this thread's columns of the head's bf16 logits as fp32 into the step's logits (no torch op
// converts them after the step), and whether one is inf or NaN (x - x is NaN only for those:
// no torch op sums them for the guard either)
static void widen_logits(const team_arg_t *t, int tid, int n) {
    const int V = t->m->vocab;
    int a, e;
    share_of(V, tid, n, &a, &e);
    vf bad = vf_zero();
    for (int b = 0; b < t->s->B; b++)
        for (int i = a; i < e; i += 16) {
            vf v = vf_load_bf16(t->head + (size_t)b * V + i);
            vf_store(t->s->logits + (size_t)b * V + i, v);
            bad = vf_add(bad, vf_sub(v, v));
        }
    float z = vf_sum(bad);
    if (z != z) __atomic_store_n(t->nonfinite, 1, __ATOMIC_RELAXED);
}

// 0, or 1 when a logit is inf or NaN, -1 when the shapes or a token id are not supported (the
// caller falls back to torch), -2 out of memory
int native_step(const model_t *m, const step_t *s, int threads) {
    const int hd = m->head_dim;
    if (s->B <= 0 || s->L <= 0 || threads < 1 || hd % 16 || hd > 128 || m->n_heads % m->n_kv ||
        m->dim % GROUP || m->hidden % GROUP || (m->n_heads * hd) % GROUP ||
        ((m->n_heads + 2 * m->n_kv) * hd) % BLOCK || m->dim % BLOCK || (2 * m->hidden) % BLOCK ||
        m->vocab % BLOCK || (m->q8 && hd % GROUP))
        return -1;
    for (int b = 0; b < s->B; b++)
        if (s->pos[b] < 0 || s->pos[b] >= m->ctx || s->tokens[b] < 0 || s->tokens[b] >= m->vocab)
            return -1;
    const int B = s->B, D = m->dim, F = m->hidden;
    const int width = (m->n_heads + 2 * m->n_kv) * hd;
    int in_w = D > F ? D : F;
    if (m->n_heads * hd > in_w) in_w = m->n_heads * hd;
    if (!gomp_parallel || !gomp_barrier || !omp_num_threads) threads = 1;
    const size_t pstride = (size_t)B * in_w;  // in_w % 32 == 0: the checks above
    size_t floats = (size_t)B * D + (size_t)B * in_w + threads * scratch_floats(s->L);
    floats += threads * (pstride + pstride / GROUP);
    size_t halves = (size_t)B * width + (size_t)B * D + (size_t)B * 2 * F + threads * pstride;
    halves += (size_t)B * m->vocab;
    size_t q8_floats = m->q8 ? (size_t)B * in_w / GROUP * 2 : 0;  // d and sum(q) a group
    size_t q8_bytes = m->q8 ? (size_t)B * in_w : 0;
    float *mem = (float *)malloc((floats + q8_floats) * sizeof(float) + halves * sizeof(uint16_t) +
                                 q8_bytes);
    if (!mem) return -2;
    team_arg_t t = {m, s, threads, mem, mem + (size_t)B * D, 0, 0, 0, 0};
    t.scratch = t.xin + (size_t)B * in_w;
    t.xd = t.scratch + threads * scratch_floats(s->L);  // q8's (0 floats without)
    t.xs = t.xd + q8_floats / 2;
    t.pf = t.xs + q8_floats / 2;
    t.qkv = (uint16_t *)(t.pf + threads * (pstride + pstride / GROUP));
    t.o = t.qkv + (size_t)B * width;
    t.gu = t.o + (size_t)B * D;
    t.pb = t.gu + (size_t)B * 2 * F;
    t.pstride = pstride;
    t.head = t.pb + threads * pstride;
    t.xq = (int8_t *)(t.head + (size_t)B * m->vocab);
    int nonfinite = 0;
    t.nonfinite = &nonfinite;
    if (threads == 1)
        team(&t);
    else
        gomp_parallel(team, &t, (unsigned)threads, 0);
    free(mem);
    return nonfinite;
}
