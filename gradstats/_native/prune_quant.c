/* Fused stochastic pruning and low-precision rounding of a float32 array: one pass.
 *
 * For each element v of x:
 *   1. prune (when a > 0): |v| >= a is kept; otherwise v becomes sign(v)*a with probability
 *      |v|/a, else 0 (unbiased);
 *   2. quantise (when quant != 0): w = v*scale is rounded to the format with man_bits mantissa
 *      bits, smallest normal exponent emin, largest finite value maxv (saturating: larger
 *      magnitudes and inf become maxv), with or without subnormals, by nearest-even,
 *      stochastic or toward-zero rounding; the result is divided by scale again. NaN stays NaN.
 * and counts: out[0] zeros in the result, out[1] entries set to zero by pruning,
 * out[2] non-zero entries flushed to zero by rounding (underflow), out[3] entries whose
 * scaled magnitude exceeded maxv (saturated, overflow).
 *
 * The uniforms come from a counter-based hash of (seed, index): reproducible, independent of
 * thread count, 24-bit resolution (a bias below 6e-8 of the rounding step).
 * Rounding works on the magnitude in double precision, where scaling by powers of two and the
 * rounding step are exact for every format up to 8 exponent bits.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK 4096

static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
    return h;
}

static inline double p2(int k) {           /* 2^k as a double, |k| < 1000 */
    uint64_t b = (uint64_t)(k + 1023) << 52; double d; memcpy(&d, &b, 8); return d;
}

typedef struct {
    float a, scale, maxv;
    int quant, man_bits, emin, subnormals, rounding;   /* rounding: 0 nearest, 1 stochastic, 2 toward zero */
    uint32_t seed_lo, seed_hi;
} params_t;

static inline __attribute__((always_inline)) void
block_run(const float *restrict x, float *restrict out, int64_t lo, int64_t m, const params_t *p,
          int64_t *restrict cnt, const int PRUNE, const int QUANT, const int ROUNDING, const int SUBNORMALS) {
    int64_t nzero = 0, npruned = 0, nunder = 0, nover = 0;
    const double inv_scale = 1.0 / (double)p->scale;
    const double maxv = (double)p->maxv;
    const double min_normal = p2(p->emin);
    const float a = p->a;
    const double da = (double)a;
#pragma omp simd reduction(+:nzero, npruned, nunder, nover)
    for (int64_t j = 0; j < m; j++) {
        uint32_t idx = (uint32_t)(lo + j);
        uint32_t base = mix32(idx * 2u + p->seed_lo) ^ p->seed_hi;
        float v = x[j];
        float av = fabsf(v);
        double sgn = v < 0.f ? -1.0 : 1.0;
        double w = (double)av;
        int isnan_ = v != v;
        /* 1. stochastic pruning */
        if (PRUNE) {
            float u = (float)(mix32(base) >> 8) * (1.0f / 16777216.0f);
            int small = av < a;
            int up = u * a < av;
            w = small ? (up ? da : 0.0) : w;
            npruned += small & !up & (av != 0.f);
        }
        double r = w;
        if (QUANT) {
            double ws = w * (double)p->scale;
            nover += (ws > maxv) & !isnan_;
            /* exponent of ws (ws < 2^128 * scale: double keeps it exact) */
            uint64_t wb; memcpy(&wb, &ws, 8);
            int e = (int)((wb >> 52) & 0x7ff) - 1023;
            int ee = e < p->emin ? p->emin : e;
            double q = ws * p2(p->man_bits - ee);         /* in units of the step */
            double qr;
            if (ROUNDING == 1) {
                double u2 = (double)(mix32(base ^ 0x68e31da4u) >> 8) * (1.0 / 16777216.0);
                qr = floor(q + u2);
            } else if (ROUNDING == 2) {
                qr = trunc(q);
            } else {
                qr = nearbyint(q);                        /* ties to even */
            }
            double res = qr * p2(ee - p->man_bits);
            if (!SUBNORMALS) {
                /* below the smallest normal only 0 and min_normal exist */
                double lowres;
                if (ROUNDING == 1) {
                    double u3 = (double)(mix32(base ^ 0x2545f491u) >> 8) * (1.0 / 16777216.0);
                    lowres = (u3 * min_normal < ws) ? min_normal : 0.0;
                } else if (ROUNDING == 2) {
                    lowres = 0.0;
                } else {
                    lowres = ws > 0.5 * min_normal ? min_normal : 0.0;
                }
                res = ws < min_normal ? lowres : res;
            }
            res = res > maxv ? maxv : res;
            res = ws > maxv ? maxv : res;             /* saturate, inf included */
            nunder += (res == 0.0) & (ws != 0.0) & !isnan_;
            r = res * inv_scale;
        }
        float o = (float)(sgn * r);
        o = isnan_ ? v : o;
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
                          uint64_t seed, int nthreads, int64_t *counts) {
    params_t p = {a, scale, maxv, quant, man_bits, emin, subnormals, rounding,
                  (uint32_t)seed, (uint32_t)(seed >> 32)};
    int64_t total[4] = {0, 0, 0, 0};
    if (rounding < 0 || rounding > 2) return -1;
    runner_t run = RUNNERS[a > 0.f][quant != 0][rounding][subnormals != 0];
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
