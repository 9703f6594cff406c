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

typedef struct {
    float a, scale, maxv;
    int man_bits, emin, neg_zero;
    uint64_t prune_mix, round_mix;  /* mix64 of the two stream seeds */
} params_t;

static inline __attribute__((always_inline)) void
block_run(const float *restrict x, float *restrict out, int64_t lo, int64_t m, const params_t *p,
          int64_t *restrict cnt, double *restrict acc, const int PRUNE, const int QUANT, const int ROUNDING,
          const int SUBNORMALS) {
    int32_t nzero = 0, npruned = 0, nunder = 0, nover = 0, nnonfin = 0;   /* per block: m <= BLOCK */
    double sxo = 0.0, sxx = 0.0, sdd = 0.0, sxd = 0.0, sao = 0.0, sax = 0.0;
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
    const uint32_t e0bits = (uint32_t)(p->emin + 127) << 23;
    uint32_t pk1, pk2, rk1, rk2;   /* a block never straddles a multiple of 2^32: BLOCK divides it */
    seg_key(p->prune_mix, lo, &pk1, &pk2);
    seg_key(p->round_mix, lo, &rk1, &rk2);
    /* the sums are reduced in vector lanes (their order of summation is free: only the counts and
     * the output are exact); a serial double chain would keep the loop scalar, 5x slower */
    const uint32_t c0 = (uint32_t)lo;             /* the low index word in 32-bit lanes (m <= BLOCK) */
    const int mi = (int)m;
#pragma omp simd reduction(+:nzero, npruned, nunder, nover, nnonfin)
    for (int j = 0; j < mi; j++) {
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
            npruned += small & !up & (w != 0.f);
            w = sel(small, sel(up, a, 0.f), w);
        }
        float r = w;
        if (QUANT) {
            float ws = w * scale;
            int over = ws > maxv;
            nover += over;
            uint32_t rnd = ROUNDING == 1 ? word(c, rk1, rk2) : 0u;
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
                } else if (ROUNDING == 1) {
                    /* offset by 2^emin (float32 rounds to nearest even on the grid 2^(emin-23)),
                     * add the random bits, truncate, remove the offset (exact) */
                    float t = ws + min_normal;
                    rs = f_of((u_of(t) + add) & ~low) - min_normal;
                } else {
                    float q = sel(ws < min_normal, ws * inv_step, 0.f);  /* < 2^M there: exact */
                    rs = (float)(int32_t)q * step;
                }
            } else {
                if (ROUNDING == 0) {
                    rs = sel(ws > half_min_normal, min_normal, 0.f);
                } else if (ROUNDING == 1) {
                    /* ws / 2^(emin-23) rounded to nearest even, plus 23 random bits, carries */
                    uint32_t q = u_of(ws + min_normal) - e0bits;
                    rs = sel(q + (rnd >> 9) >= 0x800000u, min_normal, 0.f);
                } else {
                    rs = 0.f;
                }
            }
            float res = sel(ws < min_normal, rs, rn);
            res = sel(over | (res > maxv), maxv, res);              /* saturate, inf included */
            nunder += (res == 0.f) & (w != 0.f) & !isnan_;  /* NaN is never an underflow */
            r = res * inv_scale;
        }
        uint32_t rb = u_of(r);
        uint32_t sgn = sign & (rb == 0u ? zero_sign : 0xffffffffu);
        float o = f_of(rb | sgn);
        o = sel(isnan_, v, o);
        out[j] = o;
        nzero += o == 0.f;
        int fin = (vb & 0x7f800000u) != 0x7f800000u;
        nnonfin += !fin;
    }
    /* the sums, over the block again (in L1): o has x's sign (or is a zero), so x o = |x| |o| and
     * (o - x)^2 = (|o| - |x|)^2 need the two magnitudes alone (products exact in double) */
#pragma omp simd reduction(+:sxo, sxx, sdd, sxd, sao, sax)
    for (int j = 0; j < mi; j++) {
        uint32_t vb = u_of(x[j]);
        int fin = (vb & 0x7f800000u) != 0x7f800000u;
        double xa = (double)sel(fin, f_of(vb & 0x7fffffffu), 0.f);
        double oa = (double)sel(fin, f_of(u_of(out[j]) & 0x7fffffffu), 0.f);
        double d = oa - xa, xdd = xa * d;
        sxo = MADD(xa, oa, sxo); sxx = MADD(xa, xa, sxx); sdd = MADD(d, d, sdd); sxd = MADD(xdd, xdd, sxd);
        sao += oa; sax += xa;
    }
    cnt[0] += nzero; cnt[1] += npruned; cnt[2] += nunder; cnt[3] += nover; cnt[4] += nnonfin;
    acc[0] += sxo; acc[1] += sxx; acc[2] += sdd; acc[3] += sxd; acc[4] += sao; acc[5] += sax;
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
