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
 * scaled magnitude exceeded maxv (saturated, overflow).
 *
 * Rounding works on the float32 bit pattern of w:
 * - w >= 2^emin (the format's normal range): the low 23-M mantissa bits are dropped after
 *   adding half an ulp less one plus the kept lsb (ties to even), or uniform random bits
 *   (stochastic); a carry moves into the exponent;
 * - w < 2^emin (its subnormal range), step 2^(emin-M): nearest is (w + C) - C with
 *   C = 2^(emin-M+23), whose ulp is that step; stochastic and toward zero truncate w/step + u;
 * - without subnormals only 0 and 2^emin exist below 2^emin.
 * This needs emin - M >= -126 (every format with at most 8 exponent bits and the usual bias).
 *
 * The uniforms come from a counter-based hash of (seed, index): reproducible and independent
 * of the thread count; 24-bit uniforms for pruning and subnormal rounding, 23-M random bits
 * for stochastic rounding in the normal range. The index enters as 2 i + seed_lo in 32-bit
 * arithmetic, and from 2^31 on also as a key of i >> 31 xored into seed_hi (high_key; 0 below
 * 2^31, whose uniforms are as they always were), so no two entries of a tensor share a hash input.
 *
 * With quant = 0 this is also the CPU float32 path of gradstats.pruning.stochastic_prune
 * (gradstats/ops/cpu.py: native_uniforms reproduces the pruning uniforms there).
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK 4096

static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
    return h;
}

/* The key of entries i >= 2^31, from i >> 31 (0 below). Constant over a block: BLOCK divides 2^31. */
static inline uint32_t high_key(int64_t i, uint32_t seed_hi) {
    uint32_t hi = (uint32_t)(i >> 31);
    return hi ? mix32(hi * 0x9e3779b9u + seed_hi) : 0u;
}

/* The hash of entry i from which its pruning uniform and its rounding bits derive. */
static inline uint32_t entry_hash(int64_t i, uint32_t seed_lo, uint32_t keyed_hi) {
    return mix32((uint32_t)i * 2u + seed_lo) ^ keyed_hi;
}

/* The 24-bit pruning uniform in [0, 1) of an entry's hash. */
static inline float prune_uniform(uint32_t base) {
    return (float)(mix32(base) >> 8) * (1.0f / 16777216.0f);
}

static inline float f_of(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t u_of(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
/* branch-free select on bit masks (keeps the loop free of control flow) */
static inline float sel(int c, float a, float b) {
    uint32_t m = 0u - (uint32_t)(c != 0);
    return f_of((u_of(a) & m) | (u_of(b) & ~m));
}

typedef struct {
    float a, scale, maxv;
    int man_bits, emin, neg_zero;
    uint32_t seed_lo, seed_hi;
} params_t;

static inline __attribute__((always_inline)) void
block_run(const float *restrict x, float *restrict out, int64_t lo, int64_t m, const params_t *p,
          int64_t *restrict cnt, const int PRUNE, const int QUANT, const int ROUNDING, const int SUBNORMALS) {
    int32_t nzero = 0, npruned = 0, nunder = 0, nover = 0;   /* per block: m <= BLOCK */
    const float a = p->a, scale = p->scale, inv_scale = 1.0f / p->scale, maxv = p->maxv;
    const int drop = 23 - p->man_bits;
    const uint32_t low = drop > 0 ? ((1u << drop) - 1u) : 0u;
    const uint32_t half = drop > 0 ? (1u << (drop - 1)) - 1u : 0u;
    const uint32_t rshift = 32 - drop;
    const float min_normal = f_of((uint32_t)(p->emin + 127) << 23);
    const float half_min_normal = 0.5f * min_normal;
    const float step = f_of((uint32_t)(p->emin - p->man_bits + 127) << 23);
    const float inv_step = 1.0f / step;
    const float magic = f_of((uint32_t)(p->emin - p->man_bits + 23 + 127) << 23);
    const uint32_t zero_sign = p->neg_zero ? 0x80000000u : 0u;
    const uint32_t seed_lo = p->seed_lo, keyed_hi = p->seed_hi ^ high_key(lo, p->seed_hi);
    for (int64_t j = 0; j < m; j++) {
        uint32_t base = entry_hash(lo + j, seed_lo, keyed_hi);
        float v = x[j];
        uint32_t vb = u_of(v);
        uint32_t sign = vb & 0x80000000u;
        float w = f_of(vb & 0x7fffffffu);
        int isnan_ = v != v;
        if (PRUNE) {
            float u = prune_uniform(base);
            int small = w < a;
            int up = u * a < w;
            npruned += small & !up & (w != 0.f);
            w = sel(small, sel(up, a, 0.f), w);
        }
        float r = w;
        if (QUANT) {
            float ws = w * scale;
            int over = ws > maxv;
            nover += over;
            uint32_t rnd = mix32(base ^ 0x68e31da4u);
            uint32_t wb = u_of(ws);
            uint32_t add;
            if (ROUNDING == 0) add = half + ((wb >> drop) & 1u);
            else if (ROUNDING == 1) add = drop > 0 ? (rnd >> rshift) : 0u;
            else add = 0u;
            float rn = f_of((wb + add) & ~low);
            float rs;
            if (SUBNORMALS) {
                if (ROUNDING == 0) {
                    rs = (ws + magic) - magic;
                } else {
                    float uq = ROUNDING == 1 ? (float)(rnd & 0xffffffu) * (1.0f / 16777216.0f) : 0.f;
                    float q = sel(ws < min_normal, ws * inv_step, 0.f);  /* < 2^M there: exact */
                    rs = (float)(int32_t)(q + uq) * step;
                }
            } else {
                if (ROUNDING == 0) {
                    rs = sel(ws > half_min_normal, min_normal, 0.f);
                } else if (ROUNDING == 1) {
                    float uq = (float)(rnd & 0xffffffu) * (1.0f / 16777216.0f);
                    rs = sel(uq * min_normal < ws, min_normal, 0.f);
                } else {
                    rs = 0.f;
                }
            }
            float res = sel(ws < min_normal, rs, rn);
            res = sel(over | (res > maxv), maxv, res);              /* saturate, inf included */
            nunder += (res == 0.f) & (w != 0.f);
            r = res * inv_scale;
        }
        uint32_t rb = u_of(r);
        uint32_t sgn = sign & (rb == 0u ? zero_sign : 0xffffffffu);
        float o = f_of(rb | sgn);
        o = sel(isnan_, v, o);
        out[j] = o;
        nzero += o == 0.f;
    }
    cnt[0] += nzero; cnt[1] += npruned; cnt[2] += nunder; cnt[3] += nover;
}

/* one specialised copy of the loop per combination of the switches */
#define VARIANT(PR, QU, RO, SU) \
    static void run_##PR##QU##RO##SU(const float *x, float *out, int64_t lo, int64_t m, \
                                     const params_t *p, int64_t *cnt) { \
        block_run(x, out, lo, m, p, cnt, PR, QU, RO, SU); }
#define VARIANTS(PR, QU) VARIANT(PR, QU, 0, 0) VARIANT(PR, QU, 0, 1) VARIANT(PR, QU, 1, 0) \
    VARIANT(PR, QU, 1, 1) VARIANT(PR, QU, 2, 0) VARIANT(PR, QU, 2, 1)
VARIANTS(0, 0) VARIANTS(0, 1) VARIANTS(1, 0) VARIANTS(1, 1)

typedef void (*runner_t)(const float *, float *, int64_t, int64_t, const params_t *, int64_t *);
static const runner_t RUNNERS[2][2][3][2] = {
    {{{run_0000, run_0001}, {run_0010, run_0011}, {run_0020, run_0021}},
     {{run_0100, run_0101}, {run_0110, run_0111}, {run_0120, run_0121}}},
    {{{run_1000, run_1001}, {run_1010, run_1011}, {run_1020, run_1021}},
     {{run_1100, run_1101}, {run_1110, run_1111}, {run_1120, run_1121}}},
};

int gs_prune_quantize_f32(const float *x, float *out, int64_t n, float a, float scale, int quant,
                          int man_bits, int emin, float maxv, int subnormals, int rounding,
                          int neg_zero, uint64_t seed, int nthreads, int64_t *counts) {
    if (rounding < 0 || rounding > 2) return -1;
    if (quant && (man_bits < 0 || man_bits > 23 || emin - man_bits < -126 || emin > 127)) return -2;
    params_t p = {a, scale, maxv, man_bits, emin, neg_zero, (uint32_t)seed, (uint32_t)(seed >> 32)};
    runner_t run = RUNNERS[a > 0.f][quant != 0][rounding][subnormals != 0];
    int64_t total[4] = {0, 0, 0, 0};
    int64_t nblocks = (n + BLOCK - 1) / BLOCK;
    if (nthreads < 1) nthreads = 1;
#ifdef _OPENMP
    if (n < 65536) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
#endif
    {
        int64_t c[4] = {0, 0, 0, 0};
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t k = 0; k < nblocks; k++) {
            int64_t lo = k * BLOCK, m = n - lo < BLOCK ? n - lo : BLOCK;
            run(x + lo, out + lo, lo, m, &p, c);
        }
#ifdef _OPENMP
#pragma omp critical
#endif
        {
            for (int j = 0; j < 4; j++) total[j] += c[j];
        }
    }
    for (int j = 0; j < 4; j++) counts[j] = total[j];
    return 0;
}

/* The pruning uniforms of entries start .. start + n - 1 for `seed` (what the kernel draws for
 * them, whatever the tensor's length): for tests and reproduction. */
void gs_prune_uniforms(uint64_t seed, int64_t start, int64_t n, float *out) {
    uint32_t seed_lo = (uint32_t)seed, seed_hi = (uint32_t)(seed >> 32);
    for (int64_t j = 0; j < n; j++) {
        int64_t i = start + j;
        out[j] = prune_uniform(entry_hash(i, seed_lo, seed_hi ^ high_key(i, seed_hi)));
    }
}
