/* Fused streaming statistics of a float32 array: one pass, no allocation.
 *
 * Computes, over x[0..n):
 *   out[0] n_zero, out[1] n_nonfinite                      (as doubles, exact below 2^53)
 *   out[2] sum x, out[3] sum |x|, out[4] sum x^2           (finite entries)
 *   out[5] sum ln|x|, out[6] sum ln^2|x|                   (non-zero finite entries)
 *   out[7] min |x|, out[8] max |x|                         (non-zero finite; NaN if none)
 *   hist[0..277): counts of floor(log2|x|) from 2^-149 to 2^127 (non-zero finite entries;
 *                 hist == NULL skips them);
 *                 (a variant of the loop without the bin store measured 1.6-2.7x slower, not faster;
 *                 eight interleaved copies of the counts keep runs of one bin, such as the zeros
 *                 of a ReLU layer, from queueing on one counter)
 *   top[0..k): the k largest non-zero finite |x|, descending (NaN where there are fewer);
 *
 * The top k are kept in a min-heap of bit patterns per thread (non-negative floats order like
 * their bits); a block is scanned for candidates only when its maximum beats the heap's least,
 * which after the first blocks is rare (about k ln(n/k) insertions in all for data in random order).
 * Classification is done on the integer bit pattern, so the result does not depend on
 * floating-point compiler flags. ln|x| is computed as e*ln2 + ln(m), m in [sqrt(1/2), sqrt(2)),
 * with ln(m) = 2 atanh(t), t = (m-1)/(m+1), by its odd series to t^11 (|t| <= 0.1716, so the
 * truncation error is below 1e-10): within a few float32 ulps of logf, and vectorisable.
 * Sums are accumulated in float32 over blocks of BLOCK elements and in double across blocks.
 * Where the CPU has fused multiply-add, the series and the squares use it (fewer instructions
 * in an instruction-bound loop, and one rounding instead of two).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define HIST_MIN_EXP (-149)
#define HIST_BINS 277
#define BLOCK 2048
#if defined(__FMA__) || defined(__aarch64__)
#define FMA(a, b, c) fmaf(a, b, c)
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif

#define MAX_TOP 256

typedef struct {
    double n_zero, n_nonfinite, sum, sum_abs, sum_sq, sum_ln, sum_ln_sq;
    uint32_t minb, maxb;
    int64_t hist[8][HIST_BINS + 1];
    int count_hist;              /* 0: skip the binade counts (hist == NULL) */
    int k, ntop;                 /* heap capacity and size */
    uint32_t top[MAX_TOP];       /* min-heap of the largest |x| bit patterns seen */
} acc_t;

static void heap_push(acc_t *acc, uint32_t b) {
    uint32_t *h = acc->top;
    int i;
    if (acc->ntop < acc->k) {          /* sift up */
        i = acc->ntop++;
        while (i > 0 && h[(i - 1) / 2] > b) { h[i] = h[(i - 1) / 2]; i = (i - 1) / 2; }
        h[i] = b;
        return;
    }
    if (b <= h[0]) return;
    i = 0;                             /* replace the least, sift down */
    for (;;) {
        int c = 2 * i + 1;
        if (c >= acc->k) break;
        if (c + 1 < acc->k && h[c + 1] < h[c]) c++;
        if (h[c] >= b) break;
        h[i] = h[c]; i = c;
    }
    h[i] = b;
}

/* candidates of one block for the top k: non-zero finite bit patterns above the heap's least;
 * chunks of 32 whose (vectorised) maximum does not beat it are skipped without a scalar look */
static void block_top(const float *restrict x, int64_t m, acc_t *acc) {
    for (int64_t c = 0; c < m; c += 32) {
        int64_t e = c + 32 < m ? c + 32 : m;
        uint32_t mx = 0u;
#pragma omp simd reduction(max:mx)
        for (int64_t i = c; i < e; i++) {
            uint32_t raw; memcpy(&raw, &x[i], 4);
            uint32_t b = raw & 0x7fffffffu;
            b = b < 0x7f800000u ? b : 0u;
            mx = b > mx ? b : mx;
        }
        if (acc->ntop == acc->k && mx <= acc->top[0]) continue;
        for (int64_t i = c; i < e; i++) {
            uint32_t raw; memcpy(&raw, &x[i], 4);
            uint32_t b = raw & 0x7fffffffu;
            uint32_t thr = acc->ntop < acc->k ? 0u : acc->top[0];
            if (b > thr && b < 0x7f800000u) heap_push(acc, b);
        }
    }
}

static inline float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

static void block_stats(const float *restrict x, int64_t m, acc_t *acc) {
    int16_t bins[BLOCK];
    float s = 0.f, sa = 0.f, ss = 0.f, sl = 0.f, sl2 = 0.f;
    int32_t nzero = 0, nnonfin = 0;
    uint32_t minb = 0x7fffffffu, maxb = 0u;
    const float LN2 = 0.693147180559945309f;
#pragma omp simd reduction(+:s, sa, ss, sl, sl2, nzero, nnonfin) reduction(min:minb) reduction(max:maxb)
    for (int64_t i = 0; i < m; i++) {
        uint32_t raw; memcpy(&raw, &x[i], 4);
        uint32_t b = raw & 0x7fffffffu;
        uint32_t f = b >> 23;
        int fin = f != 255u;
        int nz = fin & (b != 0u);
        int sub = (f == 0u);
        nzero += (b == 0u);
        nnonfin += !fin;
        float v = fin ? x[i] : 0.f;
        float a = fin ? bits_to_float(b) : 0.f;
        s += v; sa += a; ss = FMA(v, v, ss);
        /* subnormals: scale by 2^23 exactly, correct the exponent afterwards */
        float as = sub ? a * 8388608.f : a;
        uint32_t bs; memcpy(&bs, &as, 4);
        int32_t e = (int32_t)(bs >> 23) - 127 - (sub ? 23 : 0);
        float mant = bits_to_float((bs & 0x007fffffu) | 0x3f800000u);   /* in [1, 2) */
        int big = mant > 1.41421356f;
        mant = big ? mant * 0.5f : mant;
        float t = (mant - 1.f) / (mant + 1.f);
        float t2 = t * t;
        float p = 1.f / 11.f;
        p = FMA(p, t2, 1.f / 9.f);
        p = FMA(p, t2, 1.f / 7.f);
        p = FMA(p, t2, 1.f / 5.f);
        p = FMA(p, t2, 1.f / 3.f);
        p = FMA(p, t2, 1.f);
        float ln = FMA((float)(e + big), LN2, 2.f * t * p);
        ln = nz ? ln : 0.f;
        sl += ln; sl2 = FMA(ln, ln, sl2);
        uint32_t bmin = nz ? b : 0x7fffffffu;
        uint32_t bmax = fin ? b : 0u;
        minb = bmin < minb ? bmin : minb;
        maxb = bmax > maxb ? bmax : maxb;
        bins[i] = (int16_t)(nz ? e - HIST_MIN_EXP : HIST_BINS);
    }
    acc->n_zero += nzero; acc->n_nonfinite += nnonfin;
    acc->sum += s; acc->sum_abs += sa; acc->sum_sq += ss; acc->sum_ln += sl; acc->sum_ln_sq += sl2;
    if (minb < acc->minb) acc->minb = minb;
    if (maxb > acc->maxb) acc->maxb = maxb;
    if (acc->k > 0 && maxb != 0u && (acc->ntop < acc->k || maxb > acc->top[0])) block_top(x, m, acc);
    if (!acc->count_hist) return;
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
        acc->hist[0][bins[i]]++; acc->hist[1][bins[i + 1]]++;
        acc->hist[2][bins[i + 2]]++; acc->hist[3][bins[i + 3]]++;
        acc->hist[4][bins[i + 4]]++; acc->hist[5][bins[i + 5]]++;
        acc->hist[6][bins[i + 6]]++; acc->hist[7][bins[i + 7]]++;
    }
    for (; i < m; i++) acc->hist[0][bins[i]]++;
}


static int cmp_desc(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? 1 : (x > y ? -1 : 0);
}

int gs_stats_f32(const float *x, int64_t n, double *out, int64_t *hist, double *top, int k, int nthreads) {
    if (k < 0 || k > MAX_TOP) return 1;
    acc_t total;
    memset(&total, 0, sizeof total);
    total.minb = 0x7fffffffu;
    total.k = k;
    total.count_hist = hist != NULL;
    int64_t nblocks = (n + BLOCK - 1) / BLOCK;
    if (nthreads < 1) nthreads = 1;
#ifdef _OPENMP
    if (n < 65536) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
#endif
    {
        acc_t acc;
        memset(&acc, 0, sizeof acc);
        acc.minb = 0x7fffffffu;
        acc.k = k;
        acc.count_hist = hist != NULL;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t k = 0; k < nblocks; k++) {
            int64_t lo = k * BLOCK, m = n - lo < BLOCK ? n - lo : BLOCK;
            block_stats(x + lo, m, &acc);
        }
#ifdef _OPENMP
#pragma omp critical
#endif
        {
            total.n_zero += acc.n_zero; total.n_nonfinite += acc.n_nonfinite;
            total.sum += acc.sum; total.sum_abs += acc.sum_abs; total.sum_sq += acc.sum_sq;
            total.sum_ln += acc.sum_ln; total.sum_ln_sq += acc.sum_ln_sq;
            if (acc.minb < total.minb) total.minb = acc.minb;
            if (acc.maxb > total.maxb) total.maxb = acc.maxb;
            for (int j = 0; j < 8; j++)
                for (int b = 0; b < HIST_BINS; b++) total.hist[0][b] += acc.hist[j][b];
            for (int j = 0; j < acc.ntop; j++) heap_push(&total, acc.top[j]);
        }
    }
    double nnz = (double)n - total.n_zero - total.n_nonfinite;
    out[0] = total.n_zero; out[1] = total.n_nonfinite;
    out[2] = total.sum; out[3] = total.sum_abs; out[4] = total.sum_sq;
    out[5] = total.sum_ln; out[6] = total.sum_ln_sq;
    out[7] = nnz > 0 ? (double)bits_to_float(total.minb) : NAN;
    out[8] = nnz > 0 ? (double)bits_to_float(total.maxb) : NAN;
    if (hist != NULL)
        for (int b = 0; b < HIST_BINS; b++) hist[b] = total.hist[0][b];
    qsort(total.top, (size_t)total.ntop, sizeof(uint32_t), cmp_desc);
    for (int j = 0; j < k; j++) top[j] = j < total.ntop ? (double)bits_to_float(total.top[j]) : NAN;
    return 0;
}


/* Counts of the float32 bit patterns of |x| shifted right by 23 - mbits: 2^mbits bins per binade
 * over all 256 exponent fields (counts[(256 << mbits)], zeros in bin 0, inf/NaN in the top
 * binade's bins), for the model-free threshold rule. Eight interleaved copies of 32-bit counts
 * per thread (an L1-sized table at mbits = 2), as above. mbits in 0..6; n below 2^34 (returns 2
 * beyond, where a copy's count could wrap). */
int gs_log2_hist_f32(const float *x, int64_t n, int mbits, int64_t *counts, int nthreads) {
    if (mbits < 0 || mbits > 6) return 1;
    if (n >= ((int64_t)1 << 34)) return 2;
    const int size = 256 << mbits, shift = 23 - mbits;
    memset(counts, 0, sizeof(int64_t) * (size_t)size);
    if (nthreads < 1) nthreads = 1;
#ifdef _OPENMP
    if (n < 65536) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
#endif
    {
        uint32_t *c = calloc((size_t)8 * size, sizeof(uint32_t));
        if (c != NULL) {
            int64_t nb = (n + BLOCK - 1) / BLOCK;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t k = 0; k < nb; k++) {
                int64_t lo = k * BLOCK, m = n - lo < BLOCK ? n - lo : BLOCK;
                const float *xb = x + lo;
                uint32_t key[BLOCK];
#pragma omp simd
                for (int64_t i = 0; i < m; i++) {
                    uint32_t raw; memcpy(&raw, &xb[i], 4);
                    key[i] = (raw & 0x7fffffffu) >> shift;
                }
                int64_t i = 0;
                for (; i + 8 <= m; i += 8)
                    for (int j = 0; j < 8; j++) c[(size_t)j * size + key[i + j]]++;
                for (; i < m; i++) c[key[i]]++;
            }
#ifdef _OPENMP
#pragma omp critical
#endif
            for (int j = 0; j < 8; j++)
                for (int b = 0; b < size; b++) counts[b] += c[(size_t)j * size + b];
            free(c);
        }
    }
    return 0;
}
