// The few vector operations qmm.c and step.c use, on a 16-lane fp32 vector `vf`, for two
// instruction sets chosen by the compiler's target: AVX-512 F/BW (one __m512) or AVX2 + FMA
// (two __m256, masks emulated). One source, two builds (kernels/build.py): every operation
// gives the same bits in both, lane by lane (the same IEEE fp32 operations, FMAs fused in both,
// and the reductions add the same pairs in the same order), so the two builds compute the same
// results.

#ifndef MESHLM_SIMD_H
#define MESHLM_SIMD_H

#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)

typedef __m512 vf;   // 16 x fp32
typedef __m512i vu;  // 16 x uint32 (int4 codes)

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float f) { return _mm512_set1_ps(f); }
static inline vf vf_bits(uint32_t u) { return _mm512_castsi512_ps(_mm512_set1_epi32((int)u)); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b

// lanes [0, n) from p, the others `fill`; and lanes [0, n) to p (0 < n <= 16)
static inline vf vf_load_n(const float *p, int n, float fill) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), (__mmask16)((1u << n) - 1), p);
}
static inline void vf_store_n(float *p, int n, vf v) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}

// 16 bf16 widened exactly
static inline vf vf_load_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> 16 bf16 at p, round to nearest even (as torch's cvtfp32_bf16); a NaN lane becomes
// the top half of `nan`
static inline void vf_store_bf16(uint16_t *p, vf v, uint32_t nan) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, isnan, _mm512_set1_epi32((int)nan));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

// 64 bytes of int4 codes as 16 lanes of 32 bits
static inline vu vu_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }

// bits [shift, shift + 4) of each lane, q, as the float q - 8 (a table lookup on 4 bits)
static inline vf vf_code(vu b, int shift) {
    const __m512 lut = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    return _mm512_permutexvar_ps(_mm512_srli_epi32(b, (unsigned)shift), lut);
}

// v with each denormal lane a zero of its sign (as DAZ reads it)
static inline vf vf_daz(vf v) {
    __m512i u = _mm512_castps_si512(v);
    __mmask16 normal = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(
        _mm512_mask_mov_epi32(_mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000)), normal, u));
}

// the 32 lanes of a then b, split: `even` their lanes 0, 2, .. 30, `odd` 1, 3, .. 31
static inline void vf_split_pairs(vf a, vf b, vf *even, vf *odd) {
    const __m512i e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *even = _mm512_permutex2var_ps(a, e, b);
    *odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(e, _mm512_set1_epi32(1)), b);
}

// 32 int8 as floats: lane l of `even` q[2l], of `odd` q[2l + 1]
static inline void vf_i8_pairs(const int8_t *p, vf *even, vf *odd) {
    __m512i d = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)p));
    *even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 24), 24));
    *odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(d, 8));
}

// floor(v) for |v| < 2^31
static inline vf vf_floor(vf v) {
    return _mm512_cvtepi32_ps(
        _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
}

// 2^n for integer-valued n with -127 < n < 128
static inline vf vf_exp2i(vf n) {
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}

// v, with +0 in the lanes where x < lo
static inline vf vf_zero_where_lt(vf v, vf x, vf lo) {
    __mmask16 m = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OS);
    return _mm512_mask_blend_ps(m, v, _mm512_setzero_ps());
}

// The sum of the 16 lanes as a tree: 256-bit halves, 128-bit halves, then (q0 + q2) + (q1 + q3)
// (GCC's _mm512_reduce_add_ps, which torch is built with)
static inline float vf_sum(vf v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(q) + _mm_cvtss_f32(_mm_shuffle_ps(q, q, _MM_SHUFFLE(3, 2, 0, 1)));
}

// lane j = vf_sum(v[j]): the same additions of the same pairs, the 16 trees side by side. The
// network leaves the sum of its input i in lane 4 (i % 4) + i / 4, so the inputs go in
// transposed.
static inline vf vf_sums16(const vf *v) {
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

// torch's vec_reduce_all on 16 lanes: lane i with i ^ 8, then ^ 4, ^ 2, ^ 1
static inline float vf_sum_xor(vf v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
    return _mm512_cvtss_f32(v);
}

// --- int8 activations for int4 weights (q8.c): 64 bytes `vb` (16 lanes of 4 bytes) and 16 int32
// lanes `vi`. The products are exact integers, so both builds give the same sums.
typedef __m512i vb;
typedef __m512i vi;
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vb vb_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vb vb_nibble_lo(vb b) { return _mm512_and_si512(b, _mm512_set1_epi8(15)); }
static inline vb vb_nibble_hi(vb b) {
    return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(15));
}
// lane l += the dot product of its 4 unsigned bytes in w with the 4 signed bytes of x4 (the
// same 4 for every lane). maddubs's int16 pair sums cannot saturate: codes < 16, |x| <= 127.
static inline vi vi_dot4(vi acc, vb w, int32_t x4) {
    __m512i p = _mm512_maddubs_epi16(w, _mm512_set1_epi32(x4));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
// the same with VNNI's one instruction (the caller is built for it: Q8_VNNI in q8.c)
#define VNNI __attribute__((target("avx512vnni")))
static inline VNNI vi vi_dot4_vnni(vi acc, vb w, int32_t x4) {
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
}
// lane l += the dot product of its 4 full unsigned bytes in w with x4's (q8.c's head): as
// vi_dot4 on the low and the high nibbles (so that maddubs cannot saturate), the high one x 16
static inline vi vi_dot4_u8(vi acc, vb w, int32_t x4) {
    vi hi = vi_dot4(_mm512_setzero_si512(), vb_nibble_hi(w), x4);
    return vi_dot4(_mm512_add_epi32(acc, _mm512_slli_epi32(hi, 4)), vb_nibble_lo(w), x4);
}
static inline VNNI vi vi_dot4_u8_vnni(vi acc, vb w, int32_t x4) { return vi_dot4_vnni(acc, w, x4); }
static inline vi vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline vf vf_of_vi(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vf vf_abs(vf v) { return _mm512_abs_ps(v); }
static inline float vf_max_all(vf v) { return _mm512_reduce_max_ps(v); }  // exact in any order
static inline vf vf_round(vf v) {  // to the nearest integer, ties to even
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// 16 integer-valued lanes in [-128, 127] as int8 at p
static inline void vf_store_i8(int8_t *p, vf v) {
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
}

// --- AVX-512 BF16's dot product (qmm.c's int4 and int8 kernels, where the CPU has avx512_bf16:
// the caller checks): 16 lanes of a bf16 pair each
#define SIMD_BF16_DOT 1
#define BF16_DOT __attribute__((target("avx512bf16")))
typedef __m512i vpair;
// bits [4 j, 4 j + 4) of each 16-bit word of b (vu_load), q, as the bf16 q - 8: one word lookup
// in a table of (i % 16) - 8, which reads the low 5 bits of each index
static inline vpair vpair_code(vu b, int j) {
    static const uint16_t minus8[32] = {
        0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
        0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
        0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
        0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0};
    return _mm512_permutexvar_epi16(_mm512_srli_epi16(b, (unsigned)(4 * j)),
                                    _mm512_loadu_si512((const void *)minus8));
}
// lane l = (acc + w_hi x_hi) + w_lo x_lo, each sum rounded (x2: the bf16 pair lo | hi << 16)
static inline BF16_DOT vf vf_dot_pair(vf acc, vpair w, uint32_t x2) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32((int)x2));
}
// the same with lane l's own pair: the bf16 x[2l], x[2l + 1]
static inline BF16_DOT vf vf_dot_pairs(vf acc, vpair w, const uint16_t *x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512((const void *)x));
}
// 32 int8 as bf16 (exact: |q| <= 128), in order
static inline BF16_DOT vpair vpair_i8(const int8_t *p) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

#elif defined(__AVX2__) && defined(__FMA__)

// lanes 0-7 in lo, 8-15 in hi
typedef struct {
    __m256 lo, hi;
} vf;
typedef struct {
    __m256i lo, hi;
} vu;

static inline vf vf_of(__m256 lo, __m256 hi) {
    vf r = {lo, hi};
    return r;
}
static inline vf vf_zero(void) { return vf_of(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float f) { return vf_of(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
static inline vf vf_bits(uint32_t u) {
    __m256 b = _mm256_castsi256_ps(_mm256_set1_epi32((int)u));
    return vf_of(b, b);
}
static inline vf vf_load(const float *p) {
    return vf_of(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
}
static inline void vf_store(float *p, vf v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
#define VF_BINARY(name, op) \
    static inline vf name(vf a, vf b) { return vf_of(op(a.lo, b.lo), op(a.hi, b.hi)); }
VF_BINARY(vf_add, _mm256_add_ps)
VF_BINARY(vf_sub, _mm256_sub_ps)
VF_BINARY(vf_mul, _mm256_mul_ps)
VF_BINARY(vf_div, _mm256_div_ps)
VF_BINARY(vf_min, _mm256_min_ps)
VF_BINARY(vf_max, _mm256_max_ps)
static inline vf vf_fma(vf a, vf b, vf c) {
    return vf_of(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf vf_fnma(vf a, vf b, vf c) {
    return vf_of(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}

// all ones in the lanes i < n
static inline __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf vf_load_n(const float *p, int n, float fill) {
    __m256i m0 = lanes_below(n), m1 = lanes_below(n - 8);
    __m256 f = _mm256_set1_ps(fill);
    return vf_of(_mm256_blendv_ps(f, _mm256_maskload_ps(p, m0), _mm256_castsi256_ps(m0)),
                 _mm256_blendv_ps(f, _mm256_maskload_ps(p + 8, m1), _mm256_castsi256_ps(m1)));
}
static inline void vf_store_n(float *p, int n, vf v) {
    _mm256_maskstore_ps(p, lanes_below(n), v.lo);
    _mm256_maskstore_ps(p + 8, lanes_below(n - 8), v.hi);
}

static inline __m256 bf16x8_to_f32(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vf_load_bf16(const uint16_t *p) {
    return vf_of(bf16x8_to_f32(p), bf16x8_to_f32(p + 8));
}

// the rounded bf16 of each lane in its low 16 bits
static inline __m256i f32x8_to_bf16(__m256 v, uint32_t nan) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32((int)nan)), isnan));
    return _mm256_srli_epi32(r, 16);
}
static inline void vf_store_bf16(uint16_t *p, vf v, uint32_t nan) {
    // packus interleaves the 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7): reorder
    __m256i h = _mm256_packus_epi32(f32x8_to_bf16(v.lo, nan), f32x8_to_bf16(v.hi, nan));
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(h, 0xD8));
}

static inline vu vu_load(const uint8_t *p) {
    vu r = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
    return r;
}
// q - 8 for bits [shift, shift + 4) q (exact: small integers)
static inline __m256 minus8(__m256i b, int shift) {
    __m256i q = _mm256_and_si256(_mm256_srli_epi32(b, shift), _mm256_set1_epi32(15));
    return _mm256_sub_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(8.0f));
}
static inline vf vf_code(vu b, int shift) {
    return vf_of(minus8(b.lo, shift), minus8(b.hi, shift));
}

static inline __m256 daz8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i den = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)),
                                     _mm256_setzero_si256());
    __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(u, sign, den));
}
static inline vf vf_daz(vf v) { return vf_of(daz8(v.lo), daz8(v.hi)); }

// even and odd lanes of two 8-lane vectors, in order (shuffle_ps works within 128-bit halves)
static inline __m256 even8(__m256 a, __m256 b) {
    return _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
}
static inline __m256 odd8(__m256 a, __m256 b) {
    return _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}
static inline void vf_split_pairs(vf a, vf b, vf *even, vf *odd) {
    *even = vf_of(even8(a.lo, a.hi), even8(b.lo, b.hi));
    *odd = vf_of(odd8(a.lo, a.hi), odd8(b.lo, b.hi));
}

static inline __m256 i8_even(__m256i d) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(d, 24), 24));
}
static inline void vf_i8_pairs(const int8_t *p, vf *even, vf *odd) {
    __m256i d0 = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)p));
    __m256i d1 = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
    *even = vf_of(i8_even(d0), i8_even(d1));
    *odd = vf_of(_mm256_cvtepi32_ps(_mm256_srai_epi32(d0, 8)),
                 _mm256_cvtepi32_ps(_mm256_srai_epi32(d1, 8)));
}

static inline vf vf_floor(vf v) { return vf_of(_mm256_floor_ps(v.lo), _mm256_floor_ps(v.hi)); }

static inline __m256 exp2i8(__m256 n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
static inline vf vf_exp2i(vf n) { return vf_of(exp2i8(n.lo), exp2i8(n.hi)); }

static inline vf vf_zero_where_lt(vf v, vf x, vf lo) {
    return vf_of(_mm256_andnot_ps(_mm256_cmp_ps(x.lo, lo.lo, _CMP_LT_OS), v.lo),
                 _mm256_andnot_ps(_mm256_cmp_ps(x.hi, lo.hi, _CMP_LT_OS), v.hi));
}

// the same tree as the AVX-512 vf_sum: lane i + lane i + 8, then 128-bit halves, then pairs
static inline float vf_sum(vf v) {
    __m256 h = _mm256_add_ps(v.lo, v.hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(q) + _mm_cvtss_f32(_mm_shuffle_ps(q, q, _MM_SHUFFLE(3, 2, 0, 1)));
}

// lane j of the result = vf_sum(v[j]) for 8 inputs (their 256-bit halves already added)
static inline __m256 sums8(const __m256 *h) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; i++)  // 128-bit halves: [t_i | t_i+4]
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(h[i], h[i + 4], 0x20),
                             _mm256_permute2f128_ps(h[i], h[i + 4], 0x31));
    for (int i = 0; i < 2; i++)  // (q0 + q2, q1 + q3)
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xee));
    return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xdd));
}
static inline vf vf_sums16(const vf *v) {
    __m256 h[16];
    for (int j = 0; j < 16; j++) h[j] = _mm256_add_ps(v[j].lo, v[j].hi);
    return vf_of(sums8(h), sums8(h + 8));
}

// torch's vec_reduce_all on 16 lanes: lane i with i ^ 8, then ^ 4, ^ 2, ^ 1
static inline float vf_sum_xor(vf v) {
    __m256 h = _mm256_add_ps(v.lo, v.hi);
    h = _mm256_add_ps(h, _mm256_permute2f128_ps(h, h, 0x01));
    h = _mm256_add_ps(h, _mm256_shuffle_ps(h, h, 0x4E));
    h = _mm256_add_ps(h, _mm256_shuffle_ps(h, h, 0xB1));
    return _mm256_cvtss_f32(h);
}

// --- int8 activations for int4 weights (q8.c), as the AVX-512 ones: lanes 0-7 in lo
typedef struct {
    __m256i lo, hi;
} vb;
typedef vb vi;
static inline vi vi_zero(void) {
    vi r = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    return r;
}
static inline vb vb_load(const uint8_t *p) {
    vb r = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
    return r;
}
static inline vb vb_nibble_lo(vb b) {
    const __m256i m = _mm256_set1_epi8(15);
    vb r = {_mm256_and_si256(b.lo, m), _mm256_and_si256(b.hi, m)};
    return r;
}
static inline vb vb_nibble_hi(vb b) {
    const __m256i m = _mm256_set1_epi8(15);
    vb r = {_mm256_and_si256(_mm256_srli_epi16(b.lo, 4), m),
            _mm256_and_si256(_mm256_srli_epi16(b.hi, 4), m)};
    return r;
}
static inline __m256i dot4x8(__m256i acc, __m256i w, __m256i x) {
    __m256i p = _mm256_maddubs_epi16(w, x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline vi vi_dot4(vi acc, vb w, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
    vi r = {dot4x8(acc.lo, w.lo, x), dot4x8(acc.hi, w.hi, x)};
    return r;
}
#define VNNI __attribute__((target("avxvnni")))
static inline VNNI vi vi_dot4_vnni(vi acc, vb w, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
    vi r = {_mm256_dpbusd_avx_epi32(acc.lo, w.lo, x), _mm256_dpbusd_avx_epi32(acc.hi, w.hi, x)};
    return r;
}
static inline vi vi_dot4_u8(vi acc, vb w, int32_t x4) {
    vi hi = vi_dot4(vi_zero(), vb_nibble_hi(w), x4);
    acc.lo = _mm256_add_epi32(acc.lo, _mm256_slli_epi32(hi.lo, 4));
    acc.hi = _mm256_add_epi32(acc.hi, _mm256_slli_epi32(hi.hi, 4));
    return vi_dot4(acc, vb_nibble_lo(w), x4);
}
static inline VNNI vi vi_dot4_u8_vnni(vi acc, vb w, int32_t x4) { return vi_dot4_vnni(acc, w, x4); }
static inline vi vi_set1(int32_t v) {
    vi r = {_mm256_set1_epi32(v), _mm256_set1_epi32(v)};
    return r;
}
static inline vf vf_of_vi(vi v) {
    return vf_of(_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi));
}
static inline vf vf_abs(vf v) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return vf_of(_mm256_and_ps(v.lo, m), _mm256_and_ps(v.hi, m));
}
static inline float vf_max_all(vf v) {
    __m256 h = _mm256_max_ps(v.lo, v.hi);
    __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_max_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(2, 3, 0, 1))));
}
static inline vf vf_round(vf v) {
#define ROUND_EVEN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    return vf_of(_mm256_round_ps(v.lo, ROUND_EVEN), _mm256_round_ps(v.hi, ROUND_EVEN));
#undef ROUND_EVEN
}
static inline void vf_store_i8(int8_t *p, vf v) {
    __m256i w = _mm256_packs_epi32(_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi));
    w = _mm256_permute4x64_epi64(w, 0xD8);  // packs interleaves 128-bit lanes
    __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128((__m128i *)p, b);
}

#else
#error "build with AVX-512 F/BW or AVX2 + FMA (kernels/build.py)"
#endif

#endif
