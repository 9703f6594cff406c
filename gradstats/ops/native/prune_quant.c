/* Fused stochastic pruning and low-precision rounding of a float32 array: one pass.
 *
 * For each element v of x:
 *   1. prune (when a > 0): |v| >= a is kept; otherwise v becomes sign(v)*a with probability
 *      |v|/a, else 0 (unbiased);
 *   2. quantise (when quant != 0): w = |v|*scale is rounded to the format with man_bits mantissa
 *      bits, smallest normal exponent emin, largest finite value maxv (saturating: larger
 *      magnitudes and inf become maxv), with or without subnormals, by nearest-even,
 *      stochastic or toward-zero rounding; the result is divided by scale again and takes v's
 *      sign (zeros are +0 in formats without -0). NaN stays NaN.
 * and counts: out[0] zeros in the result, out[1] non-zero entries set to zero by pruning,
 * out[2] non-zero entries flushed to zero by rounding (underflow), out[3] entries whose
 * scaled magnitude exceeded maxv (saturated, overflow), out[4] non-finite entries of x (NaN, inf);
 * and, when sums is not NULL, over the finite entries (double accumulators): sums[0] = sum x*o,
 * sums[1] = sum x^2, sums[2] = sum (o - x)^2, sums[3] = sum x^2 (o - x)^2, sums[4] = sum |o|,
 * sums[5] = sum |x|: the magnitude gain <o, x> / <x, x>, its sampling noise, the relative error and
 * the magnitude bias of the call, measured in the same pass (a second loop over each block of 4096
 * while it is in the L1 cache: the double accumulators beside the rounding's constants would spill
 * registers). The result has x's sign or is a zero, so the sums are formed from |x| and |o| alone.
 *
 * Rounding works on the float32 bit pattern of w:
 * - w >= 2^emin (the format's normal range): the low 23-M mantissa bits are dropped after
 *   adding half an ulp less one plus the kept lsb (ties to even), or uniform random bits
 *   (stochastic); a carry moves into the exponent;
 * - w < 2^emin (its subnormal range), step 2^(emin-M): nearest is (w + C) - C with
 *   C = 2^(emin-M+23), whose ulp is that step; toward zero truncates w/step; stochastic offsets
 *   w by 2^emin and then rounds as in the normal range;
 * - without subnormals only 0 and 2^emin exist below 2^emin.
 * This needs emin - M >= -126 (every format with at most 8 exponent bits and the usual bias).
 *
 * The random bits are the one counter-based stream of gradstats/ops/random.py (its numpy
 * reference_bits defines it word by word): a 32-bit word per (stream seed, element index),
 * reproducible and independent of the thread count. The caller passes two stream seeds derived
 * from the user's seed, one for pruning and one for rounding. Pruning keeps an entry when
 * u * a < |v| with u = (word >> 8) * 2^-24; stochastic rounding adds the top 23 - M bits of the
 * rounding word below the kept mantissa bits and truncates, below 2^emin after offsetting w by
 * 2^emin (so the grid is fixed), exactly as gradstats.quantize does; so the fused kernel equals
 * pruning then quantising with the same seed, bit for bit.
 *
 * With quant = 0 this is also the CPU float32 path of gradstats.pruning.stochastic_prune
 * (gradstats/ops/cpu.py; gradstats.ops.random.uniforms reproduces the pruning uniforms).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK 4096

/* The SplitMix64 finaliser: the segment key of 2^32 indices is mix64(mix64(seed) + hi * golden). */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The keys (k1, k2) of the segment of index i; `premixed` is mix64(stream seed). */
static inline void seg_key(uint64_t premixed, int64_t i, uint32_t *k1, uint32_t *k2) {
    uint64_t k = mix64(premixed + (uint64_t)(i >> 32) * 0x9e3779b97f4a7c15ull);
    *k1 = (uint32_t)k; *k2 = (uint32_t)(k >> 32);
}

/* The 32-bit word of the low index word c under the segment keys: a keyed multiply-xorshift hash,
 * a bijection of c for fixed keys. */
static inline uint32_t word(uint32_t c, uint32_t k1, uint32_t k2) {
    uint32_t h = (c + k1) * 0x7feb352du;
    h ^= h >> 16;
    h = h * 0x846ca68bu + k2;
    h ^= h >> 15;
    return h * 0x9e3779b1u;
}

/* The 24-bit pruning uniform in [0, 1) of a word. */
static inline float prune_uniform(uint32_t b) {
    return (float)(b >> 8) * (1.0f / 16777216.0f);
}

/* a * b + c for the double sums: one fused rounding where the CPU has FMA (the float32 rounding
 * above never contracts: -std=c99 keeps it exact as written) */
#ifdef __FMA__
#define MADD(a, b, c) fma(a, b, c)
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

static inline float f_of(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t u_of(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
/* branch-free select on bit masks (keeps the loop free of control flow) */
static inline float sel(int c, float a, float b) {
    uint32_t m = 0u - (uint32_t)(c != 0);
    return f_of((u_of(a) & m) | (u_of(b) & ~m));
}

/* The call's sums over x[0..m) and its result o (see the top of the file) added to acc, reduced in vector
 * lanes (their order of summation is free: only the counts and the output are exact; a serial double chain
 * would keep the loop scalar, 5x slower): o has x's sign
 * (or is a zero), so x o = |x| |o| and (o - x)^2 = (|o| - |x|)^2 need the two magnitudes alone (products
 * exact in double); non-finite x are left out. A loop of its own over data in L1: the double
 * accumulators beside the rounding's constants would spill registers. */
/* sums_run over a block without non-finite entries (the common case: the caller has counted them), the same
 * values with fewer operations: |x| and |o| without the select of the finite ones. With AVX2 and FMA (and
 * without AVX-512, whose 32 registers hold the compiler's twelve accumulators) written out: four doubles a
 * register, eight entries a step whose two halves are added before they meet the six accumulators (one
 * dependent add a step; the compiler's version spilled four of its twelve to the stack): 0.6 -> 0.4 ns a
 * value. */
static inline __attribute__((always_inline)) void
sums_run_finite_c(const float *restrict x, const float *restrict out, int m, double *restrict acc) {
    double sxo = 0.0, sxx = 0.0, sdd = 0.0, sxd = 0.0, sao = 0.0, sax = 0.0;
#pragma omp simd reduction(+:sxo, sxx, sdd, sxd, sao, sax)
    for (int j = 0; j < m; j++) {
        double xa = (double)fabsf(x[j]);
        double oa = (double)fabsf(out[j]);
        double d = oa - xa, xdd = xa * d;
        sxo = MADD(xa, oa, sxo); sxx = MADD(xa, xa, sxx); sdd = MADD(d, d, sdd); sxd = MADD(xdd, xdd, sxd);
        sao += oa; sax += xa;
    }
    acc[0] += sxo; acc[1] += sxx; acc[2] += sdd; acc[3] += sxd; acc[4] += sao; acc[5] += sax;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(GS_PORTABLE)
#define GS_AVX2 1
#include <immintrin.h>
static inline __attribute__((always_inline)) void
sums_run_finite(const float *restrict x, const float *restrict out, int m, double *restrict acc) {
    const __m128 absm = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    __m256d sxo = _mm256_setzero_pd(), sxx = sxo, sdd = sxo, sxd = sxo, sao = sxo, sax = sxo;
    int j = 0;
    for (; j + 8 <= m; j += 8) {
        __m256d xa = _mm256_cvtps_pd(_mm_and_ps(_mm_loadu_ps(x + j), absm));
        __m256d oa = _mm256_cvtps_pd(_mm_and_ps(_mm_loadu_ps(out + j), absm));
        __m256d ya = _mm256_cvtps_pd(_mm_and_ps(_mm_loadu_ps(x + j + 4), absm));
        __m256d pa = _mm256_cvtps_pd(_mm_and_ps(_mm_loadu_ps(out + j + 4), absm));
        __m256d d = _mm256_sub_pd(oa, xa), e = _mm256_sub_pd(pa, ya);
        __m256d xd = _mm256_mul_pd(xa, d), ye = _mm256_mul_pd(ya, e);
        sxo = _mm256_add_pd(sxo, _mm256_fmadd_pd(xa, oa, _mm256_mul_pd(ya, pa)));
        sxx = _mm256_add_pd(sxx, _mm256_fmadd_pd(xa, xa, _mm256_mul_pd(ya, ya)));
        sdd = _mm256_add_pd(sdd, _mm256_fmadd_pd(d, d, _mm256_mul_pd(e, e)));
        sxd = _mm256_add_pd(sxd, _mm256_fmadd_pd(xd, xd, _mm256_mul_pd(ye, ye)));
        sao = _mm256_add_pd(sao, _mm256_add_pd(oa, pa));
        sax = _mm256_add_pd(sax, _mm256_add_pd(xa, ya));
    }
    double t[6][4];
    _mm256_storeu_pd(t[0], sxo); _mm256_storeu_pd(t[1], sxx); _mm256_storeu_pd(t[2], sdd);
    _mm256_storeu_pd(t[3], sxd); _mm256_storeu_pd(t[4], sao); _mm256_storeu_pd(t[5], sax);
    for (int k = 0; k < 6; k++) acc[k] += (t[k][0] + t[k][1]) + (t[k][2] + t[k][3]);
    sums_run_finite_c(x + j, out + j, m - j, acc);        /* the last m % 8 entries */
}
#else
#define GS_AVX2 0
#define sums_run_finite sums_run_finite_c
#endif

static inline __attribute__((always_inline)) void
sums_run(const float *restrict x, const float *restrict out, int m, double *restrict acc) {
    double sxo = 0.0, sxx = 0.0, sdd = 0.0, sxd = 0.0, sao = 0.0, sax = 0.0;
#pragma omp simd reduction(+:sxo, sxx, sdd, sxd, sao, sax)
    for (int j = 0; j < m; j++) {
        uint32_t vb = u_of(x[j]);
        int fin = (vb & 0x7f800000u) != 0x7f800000u;
        double xa = (double)sel(fin, f_of(vb & 0x7fffffffu), 0.f);
        double oa = (double)sel(fin, f_of(u_of(out[j]) & 0x7fffffffu), 0.f);
        double d = oa - xa, xdd = xa * d;
        sxo = MADD(xa, oa, sxo); sxx = MADD(xa, xa, sxx); sdd = MADD(d, d, sdd); sxd = MADD(xdd, xdd, sxd);
        sao += oa; sax += xa;
    }
    acc[0] += sxo; acc[1] += sxx; acc[2] += sdd; acc[3] += sxd; acc[4] += sao; acc[5] += sax;
}

typedef struct {
    float a, scale, maxv;
    int man_bits, emin, neg_zero;
    uint64_t prune_mix, round_mix;  /* mix64 of the two stream seeds */
} params_t;

/* The constants of rounding to a format with man_bits mantissa bits, smallest normal exponent emin and
 * largest finite value maxv (see the top of the file). */
typedef struct {
    int drop;
    uint32_t low, half, rshift, e0bits;
    float maxv, min_normal, half_min_normal, step, inv_step, magic;
} rconst_t;

static inline rconst_t rconsts(int man_bits, int emin, float maxv) {
    rconst_t k;
    k.drop = 23 - man_bits;
    k.low = k.drop > 0 ? ((1u << k.drop) - 1u) : 0u;
    k.half = k.drop > 0 ? (1u << (k.drop - 1)) - 1u : 0u;
    k.rshift = (uint32_t)(32 - k.drop);
    k.maxv = maxv;
    k.min_normal = f_of((uint32_t)(emin + 127) << 23);
    k.half_min_normal = 0.5f * k.min_normal;
    k.step = f_of((uint32_t)(emin - man_bits + 127) << 23);
    k.inv_step = 1.0f / k.step;
    k.magic = f_of((uint32_t)(emin - man_bits + 23 + 127) << 23);
    k.e0bits = (uint32_t)(emin + 127) << 23;
    return k;
}

/* The non-negative float32 ws (inf included; NaN means nothing, the caller replaces it) rounded to the
 * format of k by ROUNDING (0 nearest-even, 1 stochastic with the word rnd, 2 toward zero), saturated at
 * its max: the rounding of the top of the file, shared by the per-tensor and the block-scaled loops. */
static inline __attribute__((always_inline)) float
round_mag(float ws, uint32_t rnd, const rconst_t k, const int ROUNDING, const int SUBNORMALS) {
    uint32_t wb = u_of(ws);
    uint32_t add;
    if (ROUNDING == 0) add = k.half + ((wb >> k.drop) & 1u);
    else if (ROUNDING == 1) add = k.drop > 0 ? (rnd >> k.rshift) : 0u;
    else add = 0u;
    float rn = f_of((wb + add) & ~k.low);
    float rs;
    if (SUBNORMALS) {
        if (ROUNDING == 0) {
            rs = (ws + k.magic) - k.magic;
        } else if (ROUNDING == 1) {
            /* offset by 2^emin (float32 rounds to nearest even on the grid 2^(emin-23)),
             * add the random bits, truncate, remove the offset (exact) */
            float t = ws + k.min_normal;
            rs = f_of((u_of(t) + add) & ~k.low) - k.min_normal;
        } else {
            float q = sel(ws < k.min_normal, ws * k.inv_step, 0.f);  /* < 2^M there: exact */
            rs = (float)(int32_t)q * k.step;
        }
    } else {
        if (ROUNDING == 0) {
            rs = sel(ws > k.half_min_normal, k.min_normal, 0.f);
        } else if (ROUNDING == 1) {
            /* ws / 2^(emin-23) rounded to nearest even, plus 23 random bits, carries */
            uint32_t q = u_of(ws + k.min_normal) - k.e0bits;
            rs = sel(q + (rnd >> 9) >= 0x800000u, k.min_normal, 0.f);
        } else {
            rs = 0.f;
        }
    }
    float res = sel(ws < k.min_normal, rs, rn);
    return sel((ws > k.maxv) | (res > k.maxv), k.maxv, res);              /* saturate, inf included */
}

#if GS_AVX2
/* word() on eight consecutive low index words c */
static inline __m256i word8(__m256i c, __m256i k1, __m256i k2) {
    __m256i h = _mm256_mullo_epi32(_mm256_add_epi32(c, k1), _mm256_set1_epi32(0x7feb352d));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_add_epi32(_mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x846ca68bu)), k2);
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    return _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x9e3779b1u));
}

static inline int32_t hsum8i(__m256i v) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1)));
}

/* block_run's loop over x[0..m & ~7) in AVX2 for a format with subnormals (every per-tensor format the kernel
 * is called with) rounded to nearest or stochastically, or for pruning alone: its operations lane by lane,
 * the same outputs bit for bit (each selection on the bit pattern it reads), the counts added to cnt5 (zeros,
 * pruned, underflow, overflow, non-finite). Returns the entries done; block_run's loop does the rest. The
 * compiler's version of the loop kept its constants on the stack and made every select a blend of two
 * computed halves: 72 instructions for 8 entries. */
static inline __attribute__((always_inline)) int
block_run_avx2(const float *restrict x, float *restrict out, uint32_t c0, int m, float a, float scale,
               float inv_scale, const rconst_t k, uint32_t zero_sign, uint32_t pk1, uint32_t pk2, uint32_t rk1,
               uint32_t rk2, int32_t *cnt5, const int PRUNE, const int QUANT, const int ROUNDING) {
    const __m256i ABS = _mm256_set1_epi32(0x7fffffff), SIGN = _mm256_set1_epi32((int)0x80000000u);
    const __m256i EXP = _mm256_set1_epi32(0x7f800000), ZERO = _mm256_setzero_si256();
    const __m256 A = _mm256_set1_ps(a), SCALE = _mm256_set1_ps(scale), INV = _mm256_set1_ps(inv_scale);
    const __m256 MAXV = _mm256_set1_ps(k.maxv), MINN = _mm256_set1_ps(k.min_normal);
    const __m256 MAGIC = _mm256_set1_ps(k.magic), U24 = _mm256_set1_ps(1.0f / 16777216.0f);
    const __m256i NLOW = _mm256_set1_epi32((int)~k.low), HALF = _mm256_set1_epi32((int)k.half);
    const __m256i ONE = _mm256_set1_epi32(1), MONE = _mm256_set1_epi32(-1), ZSIGN = _mm256_set1_epi32((int)zero_sign);
    const __m128i DROP = _mm_cvtsi32_si128(k.drop), RSHIFT = _mm_cvtsi32_si128((int)k.rshift);
    const __m256i PK1 = _mm256_set1_epi32((int)pk1), PK2 = _mm256_set1_epi32((int)pk2);
    const __m256i RK1 = _mm256_set1_epi32((int)rk1), RK2 = _mm256_set1_epi32((int)rk2);
    __m256i c = _mm256_add_epi32(_mm256_set1_epi32((int)c0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i EIGHT = _mm256_set1_epi32(8);
    __m256i nzero = ZERO, npruned = ZERO, nunder = ZERO, nover = ZERO, nnonfin = ZERO;
    int mv = m & ~7;
    for (int j = 0; j < mv; j += 8, c = _mm256_add_epi32(c, EIGHT)) {
        __m256i vb = _mm256_loadu_si256((const __m256i *)(x + j));
        __m256i sign = _mm256_and_si256(vb, SIGN);
        __m256i wb = _mm256_and_si256(vb, ABS);
        __m256i isnan_ = _mm256_cmpgt_epi32(wb, EXP);                 /* wb >= 0: signed compares */
        nnonfin = _mm256_sub_epi32(nnonfin, _mm256_cmpeq_epi32(_mm256_and_si256(vb, EXP), EXP));
        __m256 w = _mm256_castsi256_ps(wb);
        if (PRUNE) {
            __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(word8(c, PK1, PK2), 8)), U24);
            __m256 small = _mm256_cmp_ps(w, A, _CMP_LT_OQ);
            __m256 up = _mm256_cmp_ps(_mm256_mul_ps(u, A), w, _CMP_LT_OQ);
            __m256i dropped = _mm256_andnot_si256(_mm256_castps_si256(up), _mm256_castps_si256(small));
            npruned = _mm256_sub_epi32(npruned, _mm256_andnot_si256(_mm256_cmpeq_epi32(wb, ZERO), dropped));
            w = _mm256_blendv_ps(w, _mm256_and_ps(up, A), small);
        }
        __m256 r = w;
        if (QUANT) {
            __m256 ws = _mm256_mul_ps(w, SCALE);
            __m256 over = _mm256_cmp_ps(ws, MAXV, _CMP_GT_OQ);
            nover = _mm256_sub_epi32(nover, _mm256_castps_si256(over));
            __m256i wsb = _mm256_castps_si256(ws), add;
            if (ROUNDING == 0) add = _mm256_add_epi32(HALF, _mm256_and_si256(_mm256_srl_epi32(wsb, DROP), ONE));
            else add = _mm256_srl_epi32(word8(c, RK1, RK2), RSHIFT);     /* a count of 32 gives 0, as drop 0 asks */
            __m256 rn = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(wsb, add), NLOW));
            __m256 rs;
            if (ROUNDING == 0) {
                rs = _mm256_sub_ps(_mm256_add_ps(ws, MAGIC), MAGIC);
            } else {
                __m256i t = _mm256_castps_si256(_mm256_add_ps(ws, MINN));
                rs = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(t, add), NLOW)), MINN);
            }
            __m256 res = _mm256_blendv_ps(rn, rs, _mm256_cmp_ps(ws, MINN, _CMP_LT_OQ));
            res = _mm256_blendv_ps(res, MAXV, _mm256_or_ps(over, _mm256_cmp_ps(res, MAXV, _CMP_GT_OQ)));
            __m256i flushed = _mm256_cmpeq_epi32(_mm256_castps_si256(res), ZERO);   /* res >= 0 or NaN */
            __m256i kept = _mm256_or_si256(_mm256_cmpeq_epi32(_mm256_castps_si256(w), ZERO), isnan_);
            nunder = _mm256_sub_epi32(nunder, _mm256_andnot_si256(kept, flushed));
            r = _mm256_mul_ps(res, INV);
        }
        __m256i rb = _mm256_castps_si256(r);
        __m256i sgn = _mm256_and_si256(sign, _mm256_blendv_epi8(MONE, ZSIGN, _mm256_cmpeq_epi32(rb, ZERO)));
        __m256i o = _mm256_blendv_epi8(_mm256_or_si256(rb, sgn), vb, isnan_);
        _mm256_storeu_si256((__m256i *)(out + j), o);
        nzero = _mm256_sub_epi32(nzero, _mm256_cmpeq_epi32(_mm256_and_si256(o, ABS), ZERO));
    }
    cnt5[0] += hsum8i(nzero); cnt5[1] += hsum8i(npruned); cnt5[2] += hsum8i(nunder);
    cnt5[3] += hsum8i(nover); cnt5[4] += hsum8i(nnonfin);
    return mv;
}
#endif

static inline __attribute__((always_inline)) void
block_run(const float *restrict x, float *restrict out, int64_t lo, int64_t m, const params_t *p,
          int64_t *restrict cnt, double *restrict acc, const int PRUNE, const int QUANT, const int ROUNDING,
          const int SUBNORMALS) {
    /* per block: m <= BLOCK. Each count is a conditional increment (c ? n + 1 : n), which the compiler makes one
     * masked vector add, where n += c takes two operations (the mask made a vector, then added) */
    int32_t nzero = 0, npruned = 0, nunder = 0, nover = 0, nnonfin = 0;
    const float a = p->a, scale = p->scale, inv_scale = 1.0f / p->scale, maxv = p->maxv;
    const rconst_t k = rconsts(p->man_bits, p->emin, maxv);
    const uint32_t zero_sign = p->neg_zero ? 0x80000000u : 0u;
    uint32_t pk1, pk2, rk1, rk2;   /* a block never straddles a multiple of 2^32: BLOCK divides it */
    seg_key(p->prune_mix, lo, &pk1, &pk2);
    seg_key(p->round_mix, lo, &rk1, &rk2);
    const uint32_t c0 = (uint32_t)lo;             /* the low index word in 32-bit lanes (m <= BLOCK) */
    const int mi = (int)m;
    int j0 = 0;
#if GS_AVX2
    if (!QUANT || (SUBNORMALS && ROUNDING != 2)) {
        int32_t c5[5] = {0, 0, 0, 0, 0};
        j0 = block_run_avx2(x, out, c0, mi, a, scale, inv_scale, k, zero_sign, pk1, pk2, rk1, rk2, c5,
                            PRUNE, QUANT, ROUNDING);
        nzero = c5[0]; npruned = c5[1]; nunder = c5[2]; nover = c5[3]; nnonfin = c5[4];
    }
#endif
#pragma omp simd reduction(+:nzero, npruned, nunder, nover, nnonfin)
    for (int j = j0; j < mi; j++) {
        const uint32_t c = c0 + (uint32_t)j;
        float v = x[j];
        uint32_t vb = u_of(v);
        uint32_t sign = vb & 0x80000000u;
        float w = f_of(vb & 0x7fffffffu);
        int isnan_ = v != v;
        if (PRUNE) {
            float u = prune_uniform(word(c, pk1, pk2));
            int small = w < a;
            int up = u * a < w;
            npruned = (small & !up & (w != 0.f)) ? npruned + 1 : npruned;
            w = sel(small, sel(up, a, 0.f), w);
        }
        float r = w;
        if (QUANT) {
            float ws = w * scale;
            nover = (ws > maxv) ? nover + 1 : nover;
            float res = round_mag(ws, ROUNDING == 1 ? word(c, rk1, rk2) : 0u, k, ROUNDING, SUBNORMALS);
            nunder = ((res == 0.f) & (w != 0.f) & !isnan_) ? nunder + 1 : nunder;   /* NaN is never an underflow */
            r = res * inv_scale;
        }
        uint32_t rb = u_of(r);
        uint32_t sgn = sign & (rb == 0u ? zero_sign : 0xffffffffu);
        float o = f_of(rb | sgn);
        o = sel(isnan_, v, o);
        out[j] = o;
        nzero = (o == 0.f) ? nzero + 1 : nzero;
        nnonfin = ((vb & 0x7f800000u) == 0x7f800000u) ? nnonfin + 1 : nnonfin;
    }
    /* the sums, over the block again (in L1) */
    if (nnonfin == 0) sums_run_finite(x, out, mi, acc);
    else sums_run(x, out, mi, acc);
    cnt[0] += nzero; cnt[1] += npruned; cnt[2] += nunder; cnt[3] += nover; cnt[4] += nnonfin;
}

/* one specialised copy of the loop per combination of the switches */
#define VARIANT(PR, QU, RO, SU) \
    static void run_##PR##QU##RO##SU(const float *x, float *out, int64_t lo, int64_t m, \
                                     const params_t *p, int64_t *cnt, double *acc) { \
        block_run(x, out, lo, m, p, cnt, acc, PR, QU, RO, SU); }
#define VARIANTS(PR, QU) VARIANT(PR, QU, 0, 0) VARIANT(PR, QU, 0, 1) VARIANT(PR, QU, 1, 0) \
    VARIANT(PR, QU, 1, 1) VARIANT(PR, QU, 2, 0) VARIANT(PR, QU, 2, 1)
VARIANTS(0, 0) VARIANTS(0, 1) VARIANTS(1, 0) VARIANTS(1, 1)

typedef void (*runner_t)(const float *, float *, int64_t, int64_t, const params_t *, int64_t *, double *);
static const runner_t RUNNERS[2][2][3][2] = {
    {{{run_0000, run_0001}, {run_0010, run_0011}, {run_0020, run_0021}},
     {{run_0100, run_0101}, {run_0110, run_0111}, {run_0120, run_0121}}},
    {{{run_1000, run_1001}, {run_1010, run_1011}, {run_1020, run_1021}},
     {{run_1100, run_1101}, {run_1110, run_1111}, {run_1120, run_1121}}},
};

int gs_prune_quantize_f32(const float *x, float *out, int64_t n, float a, float scale, int quant,
                          int man_bits, int emin, float maxv, int subnormals, int rounding,
                          int neg_zero, uint64_t prune_seed, uint64_t round_seed, int nthreads,
                          int64_t *counts, double *sums) {
    if (rounding < 0 || rounding > 2) return -1;
    if (quant && (man_bits < 0 || man_bits > 23 || emin - man_bits < -126 || emin > 127)) return -2;
    params_t p = {a, scale, maxv, man_bits, emin, neg_zero, mix64(prune_seed), mix64(round_seed)};
    runner_t run = RUNNERS[a > 0.f][quant != 0][rounding][subnormals != 0];
    int64_t total[5] = {0, 0, 0, 0, 0};
    double totals[6] = {0, 0, 0, 0, 0, 0};
    int64_t nblocks = (n + BLOCK - 1) / BLOCK;
    if (nthreads < 1) nthreads = 1;
#ifdef _OPENMP
    if (n < 65536) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
#endif
    {
        int64_t c[5] = {0, 0, 0, 0, 0};
        double acc[6] = {0, 0, 0, 0, 0, 0};
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t k = 0; k < nblocks; k++) {
            int64_t lo = k * BLOCK, m = n - lo < BLOCK ? n - lo : BLOCK;
            run(x + lo, out + lo, lo, m, &p, c, acc);
        }
#ifdef _OPENMP
#pragma omp critical
#endif
        {
            for (int j = 0; j < 5; j++) total[j] += c[j];
            for (int j = 0; j < 6; j++) totals[j] += acc[j];
        }
    }
    for (int j = 0; j < 5; j++) counts[j] = total[j];
    if (sums) for (int j = 0; j < 6; j++) sums[j] = totals[j];
    return 0;
}

/* ---- block-scaled formats: MX (E8M0 block scales) and NVFP4 (E4M3 block scales under a float32 tensor
 * scale), the blocks of gradstats/ops/layout.py ("rows": B consecutive channels of one token) ----
 *
 * x is a (P, K, Q) array (K the channels, the blocks' dim; a convolution's gradient: P the batch, Q the
 * pixels), blocks of B channels at each (p, q), the last block of each p and q padded. Each element is
 * pruned as in the per-tensor loop (the pruning stream at its flat index), its block's decode scale X is
 * taken from the largest finite magnitude after pruning (gradstats/ops/block_scales.py's rule, on the same
 * bits), and it is rounded as Q(|y| / X) * X (the rounding stream at its index in the blocked layout
 * (p Q + q) KP + k, KP = B ceil(K / B), as gradstats.ops.layout.to_blocks orders it); an E4M3 scale of 0
 * encodes its block as zeros. So the result equals gradstats.quantize's (and the Triton block kernel's)
 * bit for bit, and the counts are those of gradstats.ops.fused.prune_quantize ("saturated": entries whose
 * |y| / X exceeds the format's max where X > 0). Indices below 2^32 (the caller checks). */
typedef struct {
    params_t e;               /* the element format and the streams (e.scale unused) */
    int e4m3, sround;         /* E4M3 scales (NVFP4) or E8M0 with rounding 0 floor, 1 ceil, 2 even, 3 rceil */
    int fmt_emax, fmt_man_bits;
    float fmax, t;            /* the element format's max; NVFP4's tensor scale */
    int64_t K, Q, B, KP;
} bparams_t;

/* The decode scale of a block whose largest finite magnitude has the float32 bits mb: E8M0, 2^e with e as
 * gradstats.ops.block_scales.mx_shared_exponent computes it (SROUND 0 floor, 1 ceil, 2 even, 3 rceil),
 * clamped to [-127, 127]; or (E4M3) NVFP4's e4m3fn(min(amax / (fmax t), 448)) t, nearest-even (0 marks a
 * block encoded as zeros). Branch-free for given switches: a loop over blocks vectorises. */
static inline __attribute__((always_inline)) float
scale_of(uint32_t mb, const bparams_t *p, const rconst_t e4, const int E4M3, const int SROUND) {
    if (E4M3) {
        float v = f_of(mb) / (p->fmax * p->t);
        v = v > 448.f ? 448.f : v;
        return round_mag(v, 0u, e4, 0, 1) * p->t;
    }
    int e;
    if (SROUND == 3) {     /* rceil: ceil(log2(amax / fmax)) on the bits of the float32 quotient */
        uint32_t vb = u_of(f_of(mb) / p->fmax);
        int ex = (int)(vb >> 23);
        e = ex > 0 ? ex - 127 + ((vb & 0x7fffffu) != 0u) : (vb > 0x400000u ? -126 : -127);
    } else {
        uint32_t ab = mb;
        if (SROUND == 2) ab = (ab + (1u << (22 - p->fmt_man_bits))) & 0x7f800000u;
        e = (int)((ab >> 23) & 0xffu) - 127;
        if (SROUND == 1) e += (ab & 0x7fffffu) != 0u;
        e -= p->fmt_emax;
    }
    e = mb == 0u ? -127 : e;
    e = e < -127 ? -127 : e > 127 ? 127 : e;
    return f_of(e >= -126 ? (uint32_t)(e + 127) << 23 : 0x400000u);
}

/* X[0..nb) the decode scales of blocks whose largest finite magnitudes have the bits mb[0..nb). */
static void scales_run(const uint32_t *restrict mb, float *restrict X, int nb, const bparams_t *p,
                       const rconst_t e4) {
#define SCALES(E, R) do { _Pragma("omp simd") for (int j = 0; j < nb; j++) X[j] = scale_of(mb[j], p, e4, E, R); } while (0)
    if (p->e4m3) SCALES(1, 0);
    else if (p->sround == 0) SCALES(0, 0);
    else if (p->sround == 1) SCALES(0, 1);
    else if (p->sround == 2) SCALES(0, 2);
    else SCALES(0, 3);
#undef SCALES
}

/* The bits of |v| where v is finite, else 0 (a block's maximum leaves inf and NaN out). */
static inline uint32_t finite_bits(float v) {
    uint32_t b = u_of(v) & 0x7fffffffu;
    return b < 0x7f800000u ? b : 0u;
}

/* The rounding of one run of m pruned values y (signed) with their decode scales X (per element), the
 * input x beside them for the non-finite count, into out; the rounding stream's counter of element j is
 * c0 + j * cstep. (The sums are the caller's: sums_run over whole tiles.) */
static inline __attribute__((always_inline)) void
block_round(const float *restrict x, const float *restrict y, const float *restrict X, float *restrict out, int m,
            uint32_t c0, uint32_t cstep, uint32_t rk1, uint32_t rk2, const rconst_t k, uint32_t zero_sign,
            int64_t *restrict cnt, const int ROUNDING, const int SUBNORMALS) {
    int32_t nzero = 0, nunder = 0, nover = 0, nnonfin = 0;
#pragma omp simd reduction(+:nzero, nunder, nover, nnonfin)
    for (int j = 0; j < m; j++) {
        float v = y[j], Xj = X[j];
        uint32_t vb = u_of(v);
        float w = f_of(vb & 0x7fffffffu);
        int isnan_ = v != v, live = Xj > 0.f;
        float Xd = sel(live, Xj, 1.f);
        float ws = w / Xd;
        nover += (ws > k.maxv) & live;
        float res = round_mag(ws, ROUNDING == 1 ? word(c0 + (uint32_t)j * cstep, rk1, rk2) : 0u, k, ROUNDING,
                              SUBNORMALS);
        float r = sel(live, res * Xd, 0.f);
        uint32_t rb = u_of(r);
        float o = f_of(rb | (vb & 0x80000000u & (rb == 0u ? zero_sign : 0xffffffffu)));
        o = sel(isnan_, v, o);
        out[j] = o;
        nunder += (o == 0.f) & (w != 0.f) & !isnan_;
        nzero += o == 0.f;
        nnonfin += (u_of(x[j]) & 0x7f800000u) == 0x7f800000u;
    }
    cnt[0] += nzero; cnt[2] += nunder; cnt[3] += nover; cnt[4] += nnonfin;
}

/* Stochastic pruning of x[0..m) at a (a > 0) into y, the pruning stream at flat indices c0 + j; returns
 * the non-zero entries set to zero. */
static inline int32_t block_prune(const float *restrict x, float *restrict y, int m, uint32_t c0, float a,
                                  uint32_t pk1, uint32_t pk2) {
    int32_t npruned = 0;
#pragma omp simd reduction(+:npruned)
    for (int j = 0; j < m; j++) {
        uint32_t vb = u_of(x[j]);
        float w = f_of(vb & 0x7fffffffu);
        float u = prune_uniform(word(c0 + (uint32_t)j, pk1, pk2));
        int small = w < a, up = u * a < w;
        npruned += small & !up & (w != 0.f);
        y[j] = f_of(u_of(sel(small, sel(up, a, 0.f), w)) | (vb & 0x80000000u));
    }
    return npruned;
}

#define QCHUNK 1024   /* the most columns (tokens) of a tile: B rows of them stay in L2 */

/* Elements per unit of work along a token's channels when Q == 1 (a multiple of the block size): a linear
 * layer's gradient, or a 1-d tensor, splits into units of about this many values. */
#define ROWCHUNK 4096

/* The units of work of a (P, K, Q) tensor: for Q == 1, P tokens times the chunks of ROWCHUNK channels (whole
 * blocks) of each; otherwise P (a token's channel blocks times its Q pixels). */
static int64_t row_chunk(const bparams_t *p) { return p->B * (ROWCHUNK / p->B > 0 ? ROWCHUNK / p->B : 1); }

/* The units u0..u1 of one thread: for Q == 1 a unit is a run of whole blocks of one token's contiguous
 * channels; otherwise a token, its tiles B channels x up to QCHUNK pixels, each row contiguous, a block a
 * column (the whole tile contiguous where Q <= QCHUNK). */
static void blocks_tokens(const float *x, float *out, int64_t u0, int64_t u1, const bparams_t *p,
                          int PRUNE, int ROUNDING, int SUBNORMALS, int64_t *cnt, double *acc) {
    const int64_t K = p->K, Q = p->Q, B = p->B, KP = p->KP;
    const rconst_t k = rconsts(p->e.man_bits, p->e.emin, p->e.maxv), e4 = rconsts(3, -6, 448.f);
    const uint32_t zero_sign = p->e.neg_zero ? 0x80000000u : 0u;
    uint32_t pk1, pk2, rk1, rk2;
    seg_key(p->e.prune_mix, 0, &pk1, &pk2);
    seg_key(p->e.round_mix, 0, &rk1, &rk2);
    const int64_t CH = row_chunk(p), nch = (K + CH - 1) / CH;
    const int64_t row = Q == 1 ? CH : QCHUNK;           /* a row of a tile, at most */
    const int64_t nbmax = Q == 1 ? CH / B : QCHUNK;
    float *y = (float *)malloc(sizeof(float) * (size_t)(Q == 1 ? CH : B * QCHUNK));
    float *X = (float *)malloc(sizeof(float) * (size_t)row);
    float *Xb = (float *)malloc(sizeof(float) * (size_t)nbmax);
    uint32_t *mb = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)nbmax);
    if (y == NULL || X == NULL || Xb == NULL || mb == NULL) {
        free(y); free(X); free(Xb); free(mb); cnt[0] = -1; return;
    }
#define ROUND_RUN(XP, YP, SP, OP, M, C0, CS) do { \
        if (ROUNDING == 0 && SUBNORMALS) block_round(XP, YP, SP, OP, M, C0, CS, rk1, rk2, k, zero_sign, cnt, 0, 1); \
        else if (ROUNDING == 0) block_round(XP, YP, SP, OP, M, C0, CS, rk1, rk2, k, zero_sign, cnt, 0, 0); \
        else if (ROUNDING == 1 && SUBNORMALS) block_round(XP, YP, SP, OP, M, C0, CS, rk1, rk2, k, zero_sign, cnt, 1, 1); \
        else if (ROUNDING == 1) block_round(XP, YP, SP, OP, M, C0, CS, rk1, rk2, k, zero_sign, cnt, 1, 0); \
        else if (SUBNORMALS) block_round(XP, YP, SP, OP, M, C0, CS, rk1, rk2, k, zero_sign, cnt, 2, 1); \
        else block_round(XP, YP, SP, OP, M, C0, CS, rk1, rk2, k, zero_sign, cnt, 2, 0); } while (0)
    for (int64_t u = u0; u < u1; u++) {
        if (Q == 1) {
            const int64_t pi = u / nch, k0 = (u % nch) * CH, m = K - k0 < CH ? K - k0 : CH;
            const float *xr = x + pi * K + k0;
            const float *yr = xr;
            if (PRUNE) { cnt[1] += block_prune(xr, y, (int)m, (uint32_t)(pi * K + k0), p->e.a, pk1, pk2); yr = y; }
            int nb = (int)((m + B - 1) / B);
            for (int b = 0; b < nb; b++) {
                int64_t b0 = b * B, b1 = b0 + B < m ? b0 + B : m;
                uint32_t mx = 0u;
#pragma omp simd reduction(max:mx)
                for (int64_t j = b0; j < b1; j++) { uint32_t f = finite_bits(yr[j]); mx = f > mx ? f : mx; }
                mb[b] = mx;
            }
            scales_run(mb, Xb, nb, p, e4);
            for (int b = 0; b < nb; b++) {
                int64_t b0 = b * B, b1 = b0 + B < m ? b0 + B : m;
                float sc = Xb[b];
#pragma omp simd
                for (int64_t j = b0; j < b1; j++) X[j] = sc;
            }
            ROUND_RUN(xr, yr, X, out + pi * K + k0, (int)m, (uint32_t)(pi * KP + k0), 1u);
            sums_run(xr, out + pi * K + k0, (int)m, acc);
            continue;
        }
        const int64_t pi = u;
        for (int64_t kb = 0; kb < K; kb += B) {
            int64_t rows = kb + B < K ? B : K - kb;
            for (int64_t q0 = 0; q0 < Q; q0 += QCHUNK) {
                int qn = (int)(Q - q0 < QCHUNK ? Q - q0 : QCHUNK);
                int whole = qn == Q;                    /* the tile's rows are one contiguous span */
                int64_t off0 = (pi * K + kb) * Q + q0;
                if (PRUNE && whole)
                    cnt[1] += block_prune(x + off0, y, (int)(rows * Q), (uint32_t)off0, p->e.a, pk1, pk2);
                for (int j = 0; j < qn; j++) mb[j] = 0u;
                for (int64_t r = 0; r < rows; r++) {
                    int64_t off = off0 + r * Q;
                    float *yr = y + r * qn;
                    if (PRUNE && !whole) cnt[1] += block_prune(x + off, yr, qn, (uint32_t)off, p->e.a, pk1, pk2);
                    const float *src = PRUNE ? yr : x + off;
#pragma omp simd
                    for (int j = 0; j < qn; j++) { uint32_t f = finite_bits(src[j]); mb[j] = f > mb[j] ? f : mb[j]; }
                }
                scales_run(mb, X, qn, p, e4);
                for (int64_t r = 0; r < rows; r++) {
                    int64_t off = off0 + r * Q;
                    ROUND_RUN(x + off, PRUNE ? y + r * qn : x + off, X, out + off, qn,
                              (uint32_t)((pi * Q + q0) * KP + kb + r), (uint32_t)KP);
                    if (!whole) sums_run(x + off, out + off, qn, acc);
                }
                if (whole) sums_run(x + off0, out + off0, (int)(rows * Q), acc);
            }
        }
    }
#undef ROUND_RUN
    free(y); free(X); free(Xb); free(mb);
}

/* The largest finite |x| of x[0..n). */
static float finite_max(const float *x, int64_t n, int nthreads) {
    uint32_t mb = 0u;
#ifdef _OPENMP
    if (n < 65536) nthreads = 1;
#pragma omp parallel for simd reduction(max:mb) num_threads(nthreads) schedule(static)
#endif
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = u_of(x[i]) & 0x7fffffffu;
        b = b < 0x7f800000u ? b : 0u;
        mb = b > mb ? b : mb;
    }
    return f_of(mb);
}

/* Prune at a (0: none) and round to a block-scaled format, as above: x (P, K, Q) float32, out its result
 * (not x), blocks of B along K; the element format (man_bits, emin, maxv, subnormals, rounding, neg_zero
 * as gs_prune_quantize_f32 takes them), e4m3 (NVFP4: E4M3 block scales under the tensor scale
 * tmax / tdiv, tmax the largest magnitude after pruning, or tensor_amax where it is >= 0) or E8M0 scales
 * rounded by sround, fmt_emax and fmt_man_bits the element format's (for E8M0), fmax its max; the counts
 * and sums of gs_prune_quantize_f32. Returns 0, or a negative code for arguments it rejects (-3: no memory). */
int gs_prune_quantize_blocks_f32(const float *x, float *out, int64_t P, int64_t K, int64_t Q, int64_t B, float a,
                                 int man_bits, int emin, float maxv, int subnormals, int rounding, int neg_zero,
                                 int e4m3, int sround, int fmt_emax, int fmt_man_bits, float fmax, float tdiv,
                                 float tensor_amax, uint64_t prune_seed, uint64_t round_seed, int nthreads,
                                 int64_t *counts, double *sums) {
    if (rounding < 0 || rounding > 2 || sround < 0 || sround > 3 || B < 1 || K < 1 || P < 0 || Q < 1) return -1;
    if (man_bits < 0 || man_bits > 23 || emin - man_bits < -126 || emin > 127) return -2;
    bparams_t p;
    params_t e = {a, 1.f, maxv, man_bits, emin, neg_zero, mix64(prune_seed), mix64(round_seed)};
    p.e = e;
    p.e4m3 = e4m3; p.sround = sround; p.fmt_emax = fmt_emax; p.fmt_man_bits = fmt_man_bits; p.fmax = fmax;
    p.K = K; p.Q = Q; p.B = B; p.KP = B * ((K + B - 1) / B);
    int64_t n = P * K * Q;
    if (nthreads < 1) nthreads = 1;
    p.t = 1.f;
    if (e4m3) {
        float tmax = tensor_amax;
        if (!(tmax >= 0.f)) {            /* the pruned tensor's largest: max|x| when kept, else a */
            tmax = finite_max(x, n, nthreads);
            if (a > tmax) tmax = a;      /* (with none rounded up to a every block is zeros either way) */
        }
        p.t = tmax > 0.f ? tmax / tdiv : 1.f;
    }
    const int64_t units = Q == 1 ? P * ((K + row_chunk(&p) - 1) / row_chunk(&p)) : P;
    int64_t total[5] = {0, 0, 0, 0, 0};
    double totals[6] = {0, 0, 0, 0, 0, 0};
    int failed = 0;
#ifdef _OPENMP
    if (n < 65536) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
#endif
    {
        int64_t c[5] = {0, 0, 0, 0, 0};
        double acc[6] = {0, 0, 0, 0, 0, 0};
        int64_t u0 = 0, u1 = units;
#ifdef _OPENMP
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        u0 = units * id / nt; u1 = units * (id + 1) / nt;
#endif
        if (u1 > u0) blocks_tokens(x, out, u0, u1, &p, a > 0.f, rounding, subnormals != 0, c, acc);
#ifdef _OPENMP
#pragma omp critical
#endif
        {
            if (c[0] < 0) failed = 1;
            for (int j = 0; j < 5; j++) total[j] += c[j];
            for (int j = 0; j < 6; j++) totals[j] += acc[j];
        }
    }
    if (failed) return -3;
    for (int j = 0; j < 5; j++) counts[j] = total[j];
    if (sums) for (int j = 0; j < 6; j++) sums[j] = totals[j];
    return 0;
}

/* The words of stream seed `seed` at indices start .. start + n - 1 (what the kernel draws for
 * them, whatever the tensor's length): for tests and reproduction. */
void gs_random_bits(uint64_t seed, int64_t start, int64_t n, uint32_t *out) {
    uint64_t pm = mix64(seed);
    uint32_t k1 = 0, k2 = 0;
    for (int64_t j = 0; j < n; j++) {
        int64_t i = start + j;
        if (j == 0 || (i & 0xffffffffll) == 0) seg_key(pm, i, &k1, &k2);
        out[j] = word((uint32_t)i, k1, k2);
    }
}

/* Stochastic pruning of a float64 array (no rounding): x where |x| >= a (NaN and inf too), else
 * a zero of x's sign or sign(x) * a, the latter when u * a < |x| (product rounded to float64) with
 * the 53-bit uniform u = ((p >> 8) * 2^29 + (q >> 3)) * 2^-53, p and q the words of the two stream
 * seeds (gradstats.ops.random: PRUNE and PRUNE_LOW). out may be x. Independent of nthreads. */
static void block_f64(const double *restrict x, double *restrict out, int64_t lo, int64_t m, double a,
                      uint64_t pmix, uint64_t qmix) {
    uint32_t pk1, pk2, qk1, qk2;
    seg_key(pmix, lo, &pk1, &pk2);
    seg_key(qmix, lo, &qk1, &qk2);
    for (int64_t j = 0; j < m; j++) {
        const uint32_t c = (uint32_t)(lo + j);
        uint64_t r = ((uint64_t)(word(c, pk1, pk2) >> 8) << 29) | (word(c, qk1, qk2) >> 3);
        double u = (double)(int64_t)r * 0x1p-53;
        double v = x[j];
        uint64_t vb; memcpy(&vb, &v, 8);
        uint64_t sign = vb & 0x8000000000000000ull;
        uint64_t wb = vb & 0x7fffffffffffffffull;
        double w; memcpy(&w, &wb, 8);
        double up = u * a < w ? a : 0.0;
        uint64_t ub; memcpy(&ub, &up, 8);
        ub |= sign;
        double t; memcpy(&t, &ub, 8);
        out[j] = w < a ? t : v;
    }
}

int gs_stochastic_prune_f64(const double *x, double *out, int64_t n, double a, uint64_t prune_seed,
                            uint64_t low_seed, int nthreads) {
    uint64_t pmix = mix64(prune_seed), qmix = mix64(low_seed);
    int64_t nblocks = (n + BLOCK - 1) / BLOCK;
    if (nthreads < 1) nthreads = 1;
#ifdef _OPENMP
    if (n < 65536) nthreads = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
#endif
    for (int64_t k = 0; k < nblocks; k++) {
        int64_t lo = k * BLOCK, m = n - lo < BLOCK ? n - lo : BLOCK;
        block_f64(x + lo, out + lo, lo, m, a, pmix, qmix);
    }
    return 0;
}
