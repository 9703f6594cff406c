/* Fused streaming statistics of a float32 array: one pass, no allocation.
 *
 * Computes, over x[0..n):
 *   out[GS_F_*], the offsets defined below:
 *   out[0] n, out[1] n_zero, out[2] n_nonfinite            (as doubles, exact below 2^53)
 *   out[3] sum x, out[4] sum |x|, out[5] sum x^2           (finite entries)
 *   out[6] sum ln|x|, out[7] sum ln^2|x|                   (non-zero finite entries)
 *   out[8] min |x|, out[9] max |x|                         (non-zero finite; NaN if none)
 *   (the scalar fields of a statistics vector in their order: the caller's vector takes them
 *   in place, as it takes hist and top)
 *   hist[0..277): counts of floor(log2|x|) from 2^-149 to 2^127 (non-zero finite entries), as
 *                 doubles (exact below 2^53), so that the caller's vector takes them in place;
 *                 hist == NULL skips them;
 *   top[0..k): the k largest non-zero finite |x|, descending (NaN where there are fewer);
 *   bh[0..2*(RANGE_BINS+1)) (bh == NULL skips them): per-block statistics for blocks of 16 and of
 *                 32 consecutive entries (the last block padded with zeros): for each size the
 *                 blocks without a normal finite entry, then the counts of the blocks' dynamic
 *                 ranges floor(log2 max|x|) - floor(log2 min|x|) over their normal finite entries,
 *                 in binades 0..RANGE_BINS-1 (the last bin open): from the exponent fields of the
 *                 bit patterns (subnormals, inf and NaN count as zeros), as
 *                 gradstats.stats.blocks counts them; added to bh (the caller zeroes it). Taken
 *                 per BLOCK while it is in L1, after the block's first pass.
 *
 * Two implementations of one block (BLOCK elements) give the same counts, extremes and top k
 * and sums that agree to float32 rounding:
 * - portable C that the compiler vectorises (`omp simd`), two loops per block: the sums of x,
 *   |x| and x^2, the counts and the extremes, then over the block in L1 the logarithms (one loop
 *   for both keeps more values live than AVX2's 16 vector registers: the spills cost 1.6x the
 *   time), both written out in AVX2 where the CPU has AVX2 and FMA (the same ln|x|); the binades,
 *   where the CPU has AVX2, bit-sliced in a window of 32 as the AVX-512 loop
 *   below counts them (hist2_t), else each entry's stored and counted afterwards in eight
 *   interleaved copies of the counts (runs of one bin, such as the zeros of a ReLU layer, would
 *   otherwise queue on one counter);
 * - AVX-512 intrinsics (x86-64 with AVX-512 F/BW/DQ, unless GS_PORTABLE is defined), two passes
 *   per block: the first finds the extremes and compacts the non-zero finite entries (one
 *   compare, b - 1 < bits(inf) - 1, and vpcompressd; the zeros, n less those, need no further
 *   work: most of a ReLU layer's gradient; a block whose maximum is inf or NaN is gone over
 *   again to count those); the second, over the compacted entries in L1, sums them, takes
 *   ln|x| and counts the binades: the block's largest |x| places a window of 32 binades
 *   ending two above it (kept while the blocks' maxima stay near its top), so that an entry's
 *   binade is one bit of its lane (one variable shift); these one-hot vectors are counted
 *   bit-sliced, each bit position on its own: carry-save adders sum 16 vectors at a time into
 *   bit planes of weight 1..8 (Harley-Seal: two instructions a vector), their carries 16 at a
 *   time into planes of weight 16..128, whose carries (256 each) are counted out at once; the
 *   planes are counted out (popcounts) when the window closes. Entries outside the window
 *   (rare) and subnormals are counted one by one. The cache lines of the next blocks are requested while a block computes.
 *
 * The top k are kept as bit patterns per thread (non-negative floats order like their bits). The
 * portable loop keeps a min-heap and scans a block for candidates only when its maximum beats the
 * heap's least, which after the first blocks is rare for data in random order (about k ln(n/k)
 * insertions in all); the AVX-512 loop compares every vector with the least of the top k so far,
 * gathers the entries above it and selects the k largest (vector quickselect) whenever a
 * thousand have gathered: data in ascending order cost 12 ns a value with a heap, 0.6 with this.
 * Classification is done on the integer bit pattern, so the result does not depend on
 * floating-point compiler flags. ln|x| is computed as e*ln2 + ln(m), m in [sqrt(1/2), sqrt(2)),
 * without division: the portable loop takes ln(m) = f - f^2/2 + f^3 P(f), f = m - 1, P a
 * polynomial of degree 7; the AVX-512 loop ln c + ln(1 + r), r = m/c - 1, with c one of 16 centres
 * held in a register and ln(1 + r) to r^5. Both are within 2 float32 ulps of ln|x| (measured: 1.1
 * and 1.7 at most).
 * Sums are accumulated in float32 per lane over a block and in double across blocks.
 * Where the CPU has fused multiply-add, the polynomial and the squares use it (fewer
 * instructions in an instruction-bound loop, and one rounding instead of two).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stddef.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* where each scalar statistic goes in out[]: the offsets of gradstats/stats/fields.py's declaration
 * (a test parses these lines and compares them with it; a statistic added there that the sweep must
 * compute gets its GS_F_ define here and its store below) */
#define GS_F_N 0
#define GS_F_N_ZERO 1
#define GS_F_N_NONFINITE 2
#define GS_F_SUM 3
#define GS_F_SUM_ABS 4
#define GS_F_SUM_SQ 5
#define GS_F_SUM_LN_ABS 6
#define GS_F_SUM_LN_ABS_SQ 7
#define GS_F_MIN_ABS 8
#define GS_F_MAX_ABS 9
#define GS_N_SCALARS 10
#define HIST_MIN_EXP (-149)
#define HIST_BINS 277
#define BLOCK 2048
#if defined(__FMA__) || defined(__aarch64__)
#define FMA(a, b, c) fmaf(a, b, c)
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif

#define MAX_TOP 256
#define RANGE_BINS 64    /* per-block dynamic ranges: binades 0..63, the last open */
#define CAND_CAP 1024    /* candidates for the top k gathered before a selection (AVX-512 loop) */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && !defined(GS_PORTABLE)
#define GS_AVX512 1
#include <immintrin.h>
#define HIST_COPIES 1    /* binade counts: one copy (the AVX-512 loop counts in registers) */
#else
#define GS_AVX512 0
#define HIST_COPIES 8    /* eight interleaved copies (see the portable loop) */
#endif
/* the portable loop's binade counts bit-sliced in AVX2 registers (hist2_t below) where the CPU has AVX2 */
#if !GS_AVX512 && defined(__AVX2__) && !defined(GS_PORTABLE)
#define GS_AVX2_HIST 1
#include <immintrin.h>
#else
#define GS_AVX2_HIST 0
#endif
/* ... and its first two loops too, where the CPU has FMA as well (the same ln|x| as the portable loop's) */
#if GS_AVX2_HIST && defined(__FMA__)
#define GS_AVX2_LOOP 1
#else
#define GS_AVX2_LOOP 0
#endif

#if GS_AVX2_HIST
/* The binade counts of a window of 32 binades (exponent fields base..base+31), bit-sliced as the AVX-512
 * loop counts them: an entry's binade is one bit of its 32-bit lane; 16 such one-hot vectors at a time are
 * summed by carry-save adders (Harley-Seal) into the bit planes c1 of weight 1, 2, 4, 8, their carries 16
 * at a time into c2 (weight 16 .. 128), whose carries (256) are counted out at once; the planes are
 * counted out when the window moves or the pass ends. */
typedef struct {
    __m256i c1[4], c2[4], ring[16], ring2[16];
    int nring, nring2, base;     /* base: the window's first exponent field; 0: no window */
} hist2_t;
#endif

typedef struct {
    double n_zero, n_nonfinite, sum, sum_abs, sum_sq, sum_ln, sum_ln_sq;
    uint32_t minb, maxb;
    int64_t hist[HIST_COPIES][HIST_BINS + 1];
    int count_hist;              /* 0: skip the binade counts (hist == NULL) */
    int k, ntop;                 /* heap capacity and size */
    uint32_t top[MAX_TOP];       /* min-heap of the largest |x| bit patterns seen */
#if GS_AVX2_HIST
    hist2_t h2;
#endif
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

static inline float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

/* one block's dynamic range (hi, lo: the largest and least exponent field of its normal finite
 * entries; hi 0: none) into h: h[0] the blocks without one, h[1 + range] the others */
static inline void add_range(int64_t *h, int hi, int lo) {
    if (hi == 0) { h[0]++; return; }
    int r = hi - lo;
    h[1 + (r < RANGE_BINS ? r : RANGE_BINS - 1)]++;
}

/* The block statistics of x[0..m) (m a multiple of 32 but for the array's last BLOCK, which
 * starts at a multiple of 32): blocks of 16 into bh[0..RANGE_BINS], of 32 into the rest. */
static void block_ranges(const float *restrict x, int64_t m, int64_t *restrict bh) {
    int hi32 = 0, lo32 = 255;
    for (int64_t s = 0; s < m; s += 16) {
        int64_t e = s + 16 < m ? s + 16 : m;
        int hi = 0, lo = 255;
#pragma omp simd reduction(max:hi) reduction(min:lo)
        for (int64_t i = s; i < e; i++) {         /* branch-free: zeros among the entries mispredict */
            uint32_t b; memcpy(&b, &x[i], 4);
            int f = (int)((b >> 23) & 0xffu);
            int ok = (f != 0) & (f != 255);
            int fh = ok ? f : 0, fl = ok ? f : 255;
            hi = fh > hi ? fh : hi;
            lo = fl < lo ? fl : lo;
        }
        add_range(bh, hi, lo);
        hi32 = hi > hi32 ? hi : hi32;
        lo32 = lo < lo32 ? lo : lo32;
        if (((s / 16) & 1) || e == m) {       /* a block of 32 complete (or the array's last) */
            add_range(bh + RANGE_BINS + 1, hi32, lo32);
            hi32 = 0; lo32 = 255;
        }
    }
}

/* ln(1 + f) = f - f^2/2 + f^3 P(f) on f in [sqrt(1/2) - 1, sqrt(2) - 1]: P of degree 7, fitted to
 * the relative error of ln(1 + f) (at most 1.2 float32 ulps over the interval in float32 Horner) */
#define C7 (-0.07634228467941284f)
#define C6 0.12761472165584564f
#define C5 (-0.13160234689712524f)
#define C4 0.14201775193214417f
#define C3 (-0.16623353958129883f)
#define C2 0.20001226663589478f
#define C1 (-0.250008225440979f)
#define C0 0.3333333134651184f

/* ln of the normal float32 with bit pattern bs (sign clear) whose unbiased exponent is e (that of bs, or less
 * for a subnormal scaled into the normal range): e ln 2 + ln(m), m the mantissa in [sqrt(1/2), sqrt(2)]. The
 * split at sqrt(2) is an integer carry, without a compare or a select: bs + 0x4afb0c carries into the
 * exponent exactly where the mantissa field exceeds that of sqrt(2) (0x3504f3), and m is rebuilt from the
 * low bits (halved where it carried). */
static inline float ln_from_parts(uint32_t bs, int32_t e) {
    uint32_t t = bs + 0x4afb0cu;
    int32_t big = (int32_t)(t >> 23) - (int32_t)(bs >> 23);
    float mant = bits_to_float((t & 0x007fffffu) + 0x3f3504f4u);
    float fm = mant - 1.f, f2 = fm * fm;
    float p = C7;
    p = FMA(p, fm, C6); p = FMA(p, fm, C5); p = FMA(p, fm, C4); p = FMA(p, fm, C3);
    p = FMA(p, fm, C2); p = FMA(p, fm, C1); p = FMA(p, fm, C0);
    return FMA((float)(e + big), 0.693147180559945309f, FMA(f2 * fm, p, FMA(-0.5f, f2, fm)));
}

/* ln of a normal float32 bit pattern b (sign clear, exponent field in 1..254) */
static inline float ln_normal(uint32_t b) { return ln_from_parts(b, (int32_t)(b >> 23) - 127); }

#if GS_AVX2_HIST
/* a carry-save adder: h, l the high and low bits of a + b + c, bit by bit */
static inline void csa2(__m256i *h, __m256i *l, __m256i a, __m256i b, __m256i c) {
    __m256i u = _mm256_xor_si256(a, b);
    *h = _mm256_or_si256(_mm256_and_si256(a, b), _mm256_and_si256(u, c));
    *l = _mm256_xor_si256(u, c);
}

/* the 16 bit vectors d added, bit position by bit position, into the bit-sliced counts c[0..4) (weights
 * 1, 2, 4, 8); returns the carry out, of weight 16 */
static inline __m256i harley_seal16_2(__m256i *c, const __m256i *d) {
    __m256i ones = c[0], twos = c[1], fours = c[2], eights = c[3];
    __m256i eightsA, eightsB, sixteens;
    for (int h = 0; h < 2; h++) {
        const __m256i *e = d + 8 * h;
        __m256i twosA, twosB, foursA, foursB;
        csa2(&twosA, &ones, ones, e[0], e[1]);
        csa2(&twosB, &ones, ones, e[2], e[3]);
        csa2(&foursA, &twos, twos, twosA, twosB);
        csa2(&twosA, &ones, ones, e[4], e[5]);
        csa2(&twosB, &ones, ones, e[6], e[7]);
        csa2(&foursB, &twos, twos, twosA, twosB);
        csa2(h ? &eightsB : &eightsA, &fours, fours, foursA, foursB);
    }
    csa2(&sixteens, &eights, eights, eightsA, eightsB);
    c[0] = ones; c[1] = twos; c[2] = fours; c[3] = eights;
    return sixteens;
}

/* the counts bit plane p stands for (bit j of each lane: exponent field base + j), w each, into acc */
static void add_plane2(acc_t *acc, int base, __m256i p, int64_t w) {
    if (_mm256_testz_si256(p, p)) return;
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, p);
    for (int l = 0; l < 8; l++)
        for (uint32_t v = lanes[l]; v; v &= v - 1)
            acc->hist[0][base + __builtin_ctz(v) + 22] += w;
}

static void ring_full2(hist2_t *h, acc_t *acc) {
    h->ring2[h->nring2++] = harley_seal16_2(h->c1, h->ring);
    h->nring = 0;
    if (h->nring2 == 16) {
        add_plane2(acc, h->base, harley_seal16_2(h->c2, h->ring2), 256);
        h->nring2 = 0;
    }
}

/* the window's counts into acc->hist; the window closed */
static void window_flush2(acc_t *acc) {
    hist2_t *h = &acc->h2;
    if (h->base == 0) return;
    if (h->nring > 0) {
        while (h->nring < 16) h->ring[h->nring++] = _mm256_setzero_si256();
        ring_full2(h, acc);
    }
    if (h->nring2 > 0) {
        while (h->nring2 < 16) h->ring2[h->nring2++] = _mm256_setzero_si256();
        add_plane2(acc, h->base, harley_seal16_2(h->c2, h->ring2), 256);
        h->nring2 = 0;
    }
    for (int j = 0; j < 4; j++) {
        add_plane2(acc, h->base, h->c1[j], (int64_t)1 << j);
        add_plane2(acc, h->base, h->c2[j], (int64_t)16 << j);
        h->c1[j] = h->c2[j] = _mm256_setzero_si256();
    }
    h->base = 0;
}

/* The binades of the non-zero finite entries of a block without subnormals (maxb: its largest finite |x|
 * bits) into the window, moved first when the block's largest binade lies outside its top eight; entries
 * below the window (rare) are counted one by one. */
static void block_hist2(const float *restrict x, int64_t m, uint32_t maxb, acc_t *acc) {
    hist2_t *h = &acc->h2;
    if (maxb == 0u) return;                       /* no non-zero finite entry */
    int top = (int)(maxb >> 23);
    if (h->base == 0 || top > h->base + 31 || top < h->base + 24) {
        window_flush2(acc);
        int base = top - 29;
        h->base = base < 1 ? 1 : (base > 223 ? 223 : base);
    }
    const __m256i ABS = _mm256_set1_epi32(0x7fffffff), INF = _mm256_set1_epi32(0x7f800000);
    const __m256i ONE = _mm256_set1_epi32(1), ZERO = _mm256_setzero_si256();
    const __m256i BASE = _mm256_set1_epi32(h->base);
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
        __m256i b = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), ABS);
        /* non-zero and finite (b has its sign bit clear: signed compares) */
        __m256i nz = _mm256_and_si256(_mm256_cmpgt_epi32(b, ZERO), _mm256_cmpgt_epi32(INF, b));
        __m256i idx = _mm256_sub_epi32(_mm256_srli_epi32(b, 23), BASE);
        /* a shift by a negative count (below the window) gives 0 */
        h->ring[h->nring] = _mm256_and_si256(_mm256_sllv_epi32(ONE, idx), nz);
        int below = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_and_si256(nz, idx)));   /* idx < 0 */
        if (__builtin_expect(below != 0, 0)) {
            uint32_t bb[8];
            _mm256_storeu_si256((__m256i *)bb, b);
            while (below) { int l = __builtin_ctz((unsigned)below); below &= below - 1; acc->hist[0][(bb[l] >> 23) + 22]++; }
        }
        if (++h->nring == 16) ring_full2(h, acc);
    }
    for (; i < m; i++) {
        uint32_t raw; memcpy(&raw, &x[i], 4);
        uint32_t b = raw & 0x7fffffffu;
        if (b != 0u && b < 0x7f800000u) acc->hist[0][(b >> 23) + 22]++;
    }
}
#endif

#if !GS_AVX512    /* the portable block loop */
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

/* a block's first loop, summed: sums of x, |x| and x^2 over its finite entries (float32, per lane), its
 * zeros and non-finite entries, and its extremes (bit patterns of |x|: the least non-zero finite one,
 * 0x7fffffff where none, and the largest finite one, 0 where none) */
typedef struct {
    float s, sa, ss;
    int32_t nzero, nnonfin;
    uint32_t minb, maxb;
} part_t;

/* the first loop over x[0..m) added to p (the compiler's vectorisation) */
static void block_sums_c(const float *restrict x, int64_t m, part_t *p) {
    float s = 0.f, sa = 0.f, ss = 0.f;
    int32_t nzero = 0, nnonfin = 0;
    uint32_t minb = 0x7fffffffu, maxb = 0u;
#pragma omp simd reduction(+:s, sa, ss, nzero, nnonfin) reduction(min:minb) reduction(max:maxb)
    for (int64_t i = 0; i < m; i++) {
        uint32_t raw; memcpy(&raw, &x[i], 4);
        uint32_t b = raw & 0x7fffffffu;
        int fin = b < 0x7f800000u;
        int nz = fin & (b != 0u);
        nzero += (b == 0u);
        nnonfin += !fin;
        float v = fin ? x[i] : 0.f;
        float a = fin ? bits_to_float(b) : 0.f;
        s += v; sa += a; ss = FMA(v, v, ss);
        uint32_t bmin = nz ? b : 0x7fffffffu;
        uint32_t bmax = fin ? b : 0u;
        minb = bmin < minb ? bmin : minb;
        maxb = bmax > maxb ? bmax : maxb;
    }
    p->s += s; p->sa += sa; p->ss += ss; p->nzero += nzero; p->nnonfin += nnonfin;
    if (minb < p->minb) p->minb = minb;
    if (maxb > p->maxb) p->maxb = maxb;
}

/* the sums of ln|x| and ln^2|x| over the non-zero finite entries of x[0..m), none of them subnormal, added
 * to sl and sl2 (the compiler's vectorisation) */
static void block_ln_c(const float *restrict x, int64_t m, float *sl_, float *sl2_) {
    float sl = 0.f, sl2 = 0.f;
#pragma omp simd reduction(+:sl, sl2)
    for (int64_t i = 0; i < m; i++) {
        uint32_t raw; memcpy(&raw, &x[i], 4);
        uint32_t b = raw & 0x7fffffffu;
        int nz = (b != 0u) & (b < 0x7f800000u);
        float ln = nz ? ln_normal(b) : 0.f;
        sl += ln; sl2 = FMA(ln, ln, sl2);
    }
    *sl_ += sl; *sl2_ += sl2;
}

#if GS_AVX2_LOOP
/* horizontal sums and extremes of 8 lanes */
static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
static inline int32_t hsum8i(__m256i v) {
    int32_t l[8]; _mm256_storeu_si256((__m256i *)l, v);
    return l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}
static inline uint32_t hred8u(__m256i v, int max) {
    uint32_t l[8], r; _mm256_storeu_si256((__m256i *)l, v);
    r = l[0];
    for (int j = 1; j < 8; j++) r = max ? (l[j] > r ? l[j] : r) : (l[j] < r ? l[j] : r);
    return r;
}

/* block_sums_c in AVX2, two sets of accumulators (the adds' latency), the last m % 16 entries handed to it.
 * The least non-zero finite |x| is the unsigned least of (b & finite) - 1 plus one: zeros and non-finite
 * entries become 0xffffffff. */
static void block_sums_avx2(const float *restrict x, int64_t m, part_t *p) {
    const __m256i ABS = _mm256_set1_epi32(0x7fffffff), INF = _mm256_set1_epi32(0x7f800000);
    const __m256i ZERO = _mm256_setzero_si256(), MONE = _mm256_set1_epi32(-1);
    __m256 s[2], sa[2], ss[2];
    __m256i nzero[2], nfin[2], mn[2], mx[2];
    for (int u = 0; u < 2; u++) {
        s[u] = sa[u] = ss[u] = _mm256_setzero_ps();
        nzero[u] = nfin[u] = mx[u] = ZERO;
        mn[u] = MONE;
    }
    int64_t mv = m & ~(int64_t)15;
    for (int64_t i = 0; i < mv; i += 16) {
        for (int u = 0; u < 2; u++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(x + i + 8 * u));
            __m256i b = _mm256_and_si256(raw, ABS);
            __m256i fin = _mm256_cmpgt_epi32(INF, b);          /* b has its sign bit clear: signed compares */
            nzero[u] = _mm256_sub_epi32(nzero[u], _mm256_cmpeq_epi32(b, ZERO));
            nfin[u] = _mm256_sub_epi32(nfin[u], fin);
            __m256 v = _mm256_castsi256_ps(_mm256_and_si256(raw, fin));
            __m256i bf = _mm256_and_si256(b, fin);
            s[u] = _mm256_add_ps(s[u], v);
            sa[u] = _mm256_add_ps(sa[u], _mm256_castsi256_ps(bf));
            ss[u] = _mm256_fmadd_ps(v, v, ss[u]);
            mx[u] = _mm256_max_epu32(mx[u], bf);
            mn[u] = _mm256_min_epu32(mn[u], _mm256_add_epi32(bf, MONE));
        }
    }
    if (mv > 0) {
        uint32_t lo = hred8u(_mm256_min_epu32(mn[0], mn[1]), 0);
        uint32_t hi = hred8u(_mm256_max_epu32(mx[0], mx[1]), 1);
        p->s += hsum8(_mm256_add_ps(s[0], s[1]));
        p->sa += hsum8(_mm256_add_ps(sa[0], sa[1]));
        p->ss += hsum8(_mm256_add_ps(ss[0], ss[1]));
        p->nzero += hsum8i(_mm256_add_epi32(nzero[0], nzero[1]));
        p->nnonfin += (int32_t)mv - hsum8i(_mm256_add_epi32(nfin[0], nfin[1]));
        lo = lo == 0xffffffffu ? 0x7fffffffu : lo + 1u;
        if (lo < p->minb) p->minb = lo;
        if (hi > p->maxb) p->maxb = hi;
    }
    block_sums_c(x + mv, m - mv, p);
}

/* block_ln_c in AVX2: ln_normal's operations in its order, lane by lane (the same ln|x|, bit for bit), two sets
 * of accumulators, the last m % 16 entries handed to it. MASKED 0: the caller has found no zero and no
 * non-finite entry in x[0..m), so no lane is masked (five operations of 27 fewer for each 8 entries). */
static inline __attribute__((always_inline)) void
block_ln_avx2_(const float *restrict x, int64_t m, float *sl_, float *sl2_, const int MASKED) {
    const __m256i ABS = _mm256_set1_epi32(0x7fffffff), INF = _mm256_set1_epi32(0x7f800000);
    const __m256i ZERO = _mm256_setzero_si256(), CARRY = _mm256_set1_epi32(0x4afb0c);
    const __m256i MANT = _mm256_set1_epi32(0x007fffff), REBASE = _mm256_set1_epi32(0x3f3504f4);
    const __m256i BIAS = _mm256_set1_epi32(127);
    const __m256 ONE = _mm256_set1_ps(1.f), HALF = _mm256_set1_ps(-0.5f), LN2 = _mm256_set1_ps(0.693147180559945309f);
    __m256 sl[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, sl2[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t mv = m & ~(int64_t)15;
    for (int64_t i = 0; i < mv; i += 16) {
        for (int u = 0; u < 2; u++) {
            __m256i b = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i + 8 * u)), ABS);
            __m256i t = _mm256_add_epi32(b, CARRY);
            __m256 ef = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(t, 23), BIAS));   /* e + big */
            __m256 fm = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(_mm256_and_si256(t, MANT), REBASE)), ONE);
            __m256 f2 = _mm256_mul_ps(fm, fm);
            __m256 q = _mm256_set1_ps(C7);
            q = _mm256_fmadd_ps(q, fm, _mm256_set1_ps(C6)); q = _mm256_fmadd_ps(q, fm, _mm256_set1_ps(C5));
            q = _mm256_fmadd_ps(q, fm, _mm256_set1_ps(C4)); q = _mm256_fmadd_ps(q, fm, _mm256_set1_ps(C3));
            q = _mm256_fmadd_ps(q, fm, _mm256_set1_ps(C2)); q = _mm256_fmadd_ps(q, fm, _mm256_set1_ps(C1));
            q = _mm256_fmadd_ps(q, fm, _mm256_set1_ps(C0));
            __m256 r = _mm256_fmadd_ps(_mm256_mul_ps(f2, fm), q, _mm256_fmadd_ps(HALF, f2, fm));
            __m256 ln = _mm256_fmadd_ps(ef, LN2, r);
            if (MASKED)
                ln = _mm256_and_ps(ln, _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(b, ZERO),
                                                                            _mm256_cmpgt_epi32(INF, b))));
            sl[u] = _mm256_add_ps(sl[u], ln);
            sl2[u] = _mm256_fmadd_ps(ln, ln, sl2[u]);
        }
    }
    if (mv > 0) {
        *sl_ += hsum8(_mm256_add_ps(sl[0], sl[1]));
        *sl2_ += hsum8(_mm256_add_ps(sl2[0], sl2[1]));
    }
    block_ln_c(x + mv, m - mv, sl_, sl2_);
}
static void block_ln_avx2(const float *restrict x, int64_t m, float *sl, float *sl2) { block_ln_avx2_(x, m, sl, sl2, 1); }
static void block_ln_avx2_all(const float *restrict x, int64_t m, float *sl, float *sl2) {
    block_ln_avx2_(x, m, sl, sl2, 0);
}
#define BLOCK_SUMS block_sums_avx2
#define BLOCK_LN block_ln_avx2
#define BLOCK_LN_ALL block_ln_avx2_all
#else
#define BLOCK_SUMS block_sums_c
#define BLOCK_LN block_ln_c
#define BLOCK_LN_ALL block_ln_c
#endif

/* One block: the sums of x, |x|, x^2, the zeros and non-finite entries and the extremes in one loop, then
 * the logarithms in a second over the block in L1 (one loop for all of it keeps more values live than
 * the 16 vector registers of AVX2 hold: its spills cost more than the second load), and the binades,
 * where counted, in a third. A block without subnormal entries (nearly all) takes ln_normal; one with
 * them the general form, binades included. With AVX2 and FMA the first two loops are written out
 * (block_sums_avx2, block_ln_avx2): the compiler's kept its reductions in memory. */
static void block_stats(const float *restrict x, int64_t m, acc_t *acc) {
    int16_t bins[BLOCK];
    part_t p = {0.f, 0.f, 0.f, 0, 0, 0x7fffffffu, 0u};
    BLOCK_SUMS(x, m, &p);
    float sl = 0.f, sl2 = 0.f;
    uint32_t minb = p.minb, maxb = p.maxb;
    int binned = 0;                                      /* bins[] holds the block's binades */
    if (minb >= 0x00800000u) {                           /* no subnormals */
        if (p.nzero == 0 && p.nnonfin == 0) BLOCK_LN_ALL(x, m, &sl, &sl2);    /* (a convolution's, as a rule) */
        else BLOCK_LN(x, m, &sl, &sl2);
        if (acc->count_hist) {      /* a loop of its own: the sums then do not depend on whether it runs */
#if GS_AVX2_HIST
            block_hist2(x, m, maxb, acc);
#else
            binned = 1;
#pragma omp simd
            for (int64_t i = 0; i < m; i++) {
                uint32_t raw; memcpy(&raw, &x[i], 4);
                uint32_t b = raw & 0x7fffffffu;
                int nz = (b != 0u) & (b < 0x7f800000u);
                bins[i] = (int16_t)(nz ? (int32_t)(b >> 23) - 127 - HIST_MIN_EXP : HIST_BINS);
            }
#endif
        }
    } else {
#pragma omp simd reduction(+:sl, sl2)
        for (int64_t i = 0; i < m; i++) {
            uint32_t raw; memcpy(&raw, &x[i], 4);
            uint32_t b = raw & 0x7fffffffu;
            uint32_t f = b >> 23;
            int nz = (f != 255u) & (b != 0u);
            int sub = (f == 0u);
            float a = bits_to_float(b);
            float as = sub ? a * 8388608.f : a;
            uint32_t bs; memcpy(&bs, &as, 4);
            int32_t e = (int32_t)(bs >> 23) - 127 - (sub ? 23 : 0);
            float ln = ln_from_parts(bs, e);
            ln = nz ? ln : 0.f;
            sl += ln; sl2 = FMA(ln, ln, sl2);
            bins[i] = (int16_t)(nz ? e - HIST_MIN_EXP : HIST_BINS);
        }
        binned = 1;
    }
    acc->n_zero += p.nzero; acc->n_nonfinite += p.nnonfin;
    acc->sum += p.s; acc->sum_abs += p.sa; acc->sum_sq += p.ss; acc->sum_ln += sl; acc->sum_ln_sq += sl2;
    if (minb < acc->minb) acc->minb = minb;
    if (maxb > acc->maxb) acc->maxb = maxb;
    if (acc->k > 0 && maxb != 0u && (acc->ntop < acc->k || maxb > acc->top[0])) block_top(x, m, acc);
    if (!acc->count_hist || !binned) return;
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
        acc->hist[0][bins[i]]++; acc->hist[1][bins[i + 1]]++;
        acc->hist[2][bins[i + 2]]++; acc->hist[3][bins[i + 3]]++;
        acc->hist[4][bins[i + 4]]++; acc->hist[5][bins[i + 5]]++;
        acc->hist[6][bins[i + 6]]++; acc->hist[7][bins[i + 7]]++;
    }
    for (; i < m; i++) acc->hist[0][bins[i]]++;
}
#endif


#if GS_AVX512

typedef struct {
    __m512d s, sa, ss, sl, sl2;        /* per-lane sums in double, across blocks */
    __m512i minb;
    /* the binade counts of the window (its 32 binades: the 32 bits of a lane), bit-sliced: ring
     * holds the one-hot vectors of pass 2 not yet summed, c1 the counts' bits of weight 1, 2, 4, 8
     * per lane and binade, ring2 the carries (16s) not yet summed, c2 the bits of weight 16..128 */
    __m512i c1[4], c2[4];
    int nring, nring2;
    int base;                           /* exponent field of the window's first binade; 0: none */
    int ncand;                          /* candidates for the top k since the last selection */
    /* buffers last (gs_stats_f32 zeroes what precedes ring) */
    __m512i ring[16], ring2[16];
    uint32_t cand[CAND_CAP + MAX_TOP + 16];
} vacc_t;

/* The k largest of acc->top[0..ntop) and c[0..nc) into acc->top, the least of them first (the
 * bar a further candidate has to clear); c has room for MAX_TOP + 16 more entries. A three-way
 * quickselect whose partitions are vector compares and compressed stores: a candidate costs a
 * few cycles here, where a push into a heap costs tens of nanoseconds of unpredictable branches
 * (and the candidates of a tensor come in runs: a channel on a larger scale than those before). */
static void top_select(acc_t *acc, uint32_t *c, int nc) {
    static const int SMALL = 32;
    uint32_t bufa[CAND_CAP + MAX_TOP + 32], bufb[CAND_CAP + MAX_TOP + 32];
    uint32_t *res = acc->top;
    int k = acc->k, got = 0;
    memcpy(c + nc, acc->top, (size_t)acc->ntop * 4);
    nc += acc->ntop;
    uint32_t *src = c, *gt = bufa, *lt = bufb;
    int n = nc, need = nc < k ? nc : k;
    while (need > 0) {
        if (n <= SMALL) {               /* insertion sort, descending; the first need are kept */
            for (int i = 1; i < n; i++) {
                uint32_t v = src[i];
                int j = i;
                while (j > 0 && src[j - 1] < v) { src[j] = src[j - 1]; j--; }
                src[j] = v;
            }
            memcpy(res + got, src, (size_t)need * 4);
            got += need;
            break;
        }
        uint32_t a = src[0], b = src[n / 2], d = src[n - 1];        /* median of three */
        uint32_t p = a < b ? (b < d ? b : (a < d ? d : a)) : (a < d ? a : (b < d ? d : b));
        const __m512i P = _mm512_set1_epi32((int)p);
        int ng = 0, nl = 0;
        for (int i = 0; i < n; i += 16) {
            __mmask16 ok = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
            __m512i v = _mm512_maskz_loadu_epi32(ok, src + i);
            __mmask16 g = _mm512_mask_cmpgt_epu32_mask(ok, v, P), l = _mm512_mask_cmplt_epu32_mask(ok, v, P);
            _mm512_storeu_si512(gt + ng, _mm512_maskz_compress_epi32(g, v));
            _mm512_storeu_si512(lt + nl, _mm512_maskz_compress_epi32(l, v));
            ng += __builtin_popcount((unsigned)g);
            nl += __builtin_popcount((unsigned)l);
        }
        int ne = n - ng - nl;
        uint32_t *spare = src;
        if (ng >= need) {               /* all of the k largest left are above p */
            src = gt; n = ng; gt = spare;
            continue;
        }
        memcpy(res + got, gt, (size_t)ng * 4);
        got += ng; need -= ng;
        int take = ne < need ? ne : need;
        for (int i = 0; i < take; i++) res[got + i] = p;
        got += take; need -= take;
        src = lt; n = nl; lt = spare;
    }
    acc->ntop = got;
    int least = 0;
    for (int i = 1; i < got; i++) if (res[i] < res[least]) least = i;
    uint32_t t = res[0]; res[0] = res[least]; res[least] = t;
}

/* The sixteen pieces of [sqrt(1/2), sqrt(2)) that the top four mantissa bits of b - LN_OFF select
 * (LN_OFF: the bits of sqrt(1/2); see pass 2): 1/c rounded to float32 for c the centre of each
 * (c = 1 exactly for the piece that holds 1, so that ln|x| keeps its relative accuracy near
 * |x| = 1), and ln c = -ln(1/c) */
#define LN_OFF 0x3f3504f3u
static const float INV_CENTRE[16] = {
    1.383639216e+00f, 1.326292038e+00f, 1.273509383e+00f, 1.224767089e+00f,
    1.179618359e+00f, 1.137680054e+00f, 1.098621249e+00f, 1.062155485e+00f,
    1.028032660e+00f, 1.000000000e+00f, 9.341747165e-01f, 8.826409578e-01f,
    8.364956379e-01f, 7.949355841e-01f, 7.573097944e-01f, 7.230848670e-01f};
static const float LN_CENTRE[16] = {
    -3.247171414e-01f, -2.823871073e-01f, -2.417763835e-01f, -2.027506944e-01f,
    -1.651909613e-01f, -1.289911483e-01f, -9.405598381e-02f, -6.030031997e-02f,
    -2.764693743e-02f, 0.0f, 6.809179564e-02f, 1.248367773e-01f,
    1.785339733e-01f, 2.294941939e-01f, 2.779828696e-01f, 3.242286820e-01f};

static inline __m512d cvt_lo(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
static inline __m512d cvt_hi(__m512 v) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* a carry-save adder: h, l the high and low bits of a + b + c, bit by bit */
static inline void csa(__m512i *h, __m512i *l, __m512i a, __m512i b, __m512i c) {
    *h = _mm512_ternarylogic_epi32(a, b, c, 0xe8);
    *l = _mm512_ternarylogic_epi32(a, b, c, 0x96);
}

/* eight bit vectors d added into the bit-sliced counts ones, twos, fours; returns the carry
 * of weight 8 */
static inline __m512i csa8(__m512i *ones, __m512i *twos, __m512i *fours, const __m512i *d) {
    __m512i twosA, twosB, foursA, foursB, eights;
    csa(&twosA, ones, *ones, d[0], d[1]);
    csa(&twosB, ones, *ones, d[2], d[3]);
    csa(&foursA, twos, *twos, twosA, twosB);
    csa(&twosA, ones, *ones, d[4], d[5]);
    csa(&twosB, ones, *ones, d[6], d[7]);
    csa(&foursB, twos, *twos, twosA, twosB);
    csa(&eights, fours, *fours, foursA, foursB);
    return eights;
}

/* Harley-Seal: adds the 16 bit vectors d, bit position by bit position, into the bit-sliced
 * counts c[0..4) (weights 1, 2, 4, 8); returns the carry out, of weight 16 (15 adders, two
 * instructions each, for 16 vectors) */
static inline __m512i harley_seal16(__m512i *c, const __m512i *d) {
    __m512i ones = c[0], twos = c[1], fours = c[2], eights = c[3], sixteens;   /* in registers */
    __m512i eightsA = csa8(&ones, &twos, &fours, d), eightsB = csa8(&ones, &twos, &fours, d + 8);
    csa(&sixteens, &eights, eights, eightsA, eightsB);
    c[0] = ones; c[1] = twos; c[2] = fours; c[3] = eights;
    return sixteens;
}

/* the counts that bit plane p (bit j of each lane: binade base + j) stands for, w each */
static void add_plane(acc_t *acc, int base, __m512i p, int64_t w) {
    if (!_mm512_test_epi32_mask(p, p)) return;
    for (int j = 0; j < 32; j++)
        acc->hist[0][base + j + 22] += w * __builtin_popcount((unsigned)_mm512_test_epi32_mask(p, _mm512_set1_epi32((int)(1u << j))));
}

/* a full ring of one-hot vectors summed into c1 (the caller empties the ring); its carry into
 * ring2, summed into c2 when full */
static void ring_full(vacc_t *va, acc_t *acc) {
    va->ring2[va->nring2++] = harley_seal16(va->c1, va->ring);
    if (va->nring2 == 16) {
        add_plane(acc, va->base, harley_seal16(va->c2, va->ring2), 256);
        va->nring2 = 0;
    }
}

/* the window's counts into acc->hist; the window closed */
static void window_flush(vacc_t *va, acc_t *acc) {
    if (va->base == 0) return;
    if (va->nring > 0) {
        while (va->nring < 16) va->ring[va->nring++] = _mm512_setzero_si512();
        ring_full(va, acc);
        va->nring = 0;
    }
    if (va->nring2 > 0) {
        while (va->nring2 < 16) va->ring2[va->nring2++] = _mm512_setzero_si512();
        add_plane(acc, va->base, harley_seal16(va->c2, va->ring2), 256);
        va->nring2 = 0;
    }
    for (int j = 0; j < 4; j++) {
        add_plane(acc, va->base, va->c1[j], (int64_t)1 << j);
        add_plane(acc, va->base, va->c2[j], (int64_t)16 << j);
        va->c1[j] = va->c2[j] = _mm512_setzero_si512();
    }
    va->base = 0;
}

/* scalar handling of subnormal lanes: ln|x| and the binade */
static void subnormal_lanes(const uint32_t *bits, __mmask16 k, acc_t *acc, double *sl, double *sl2) {
    while (k) {
        int j = __builtin_ctz(k); k &= k - 1;
        float a = bits_to_float(bits[j] & 0x7fffffffu) * 8388608.f;
        uint32_t bs; memcpy(&bs, &a, 4);
        int32_t e = (int32_t)(bs >> 23) - 127 - 23;
        float ln = ln_from_parts(bs, e);
        *sl += ln; *sl2 += (double)ln * ln;
        if (acc->count_hist) acc->hist[0][e - HIST_MIN_EXP]++;
    }
}

/* pass 2's running state: per-lane float sums over the block, the subnormals' log sums */
typedef struct {
    __m512 s, sa, ss, sl, sl2;
    double dsl, dsl2;
    int nring;                          /* va->nring while the block runs */
} p2_t;

/* One vector of pass 2 (16 compacted entries at p). nrm: the lanes that hold entries; masked,
 * subs, hist: whether nrm may lack lanes, subnormals may occur, binades are counted. Always
 * inlined, so that each loop gets the variant it needs with the flags folded away.
 * ln|x| = k ln2 + ln c + ln(1 + r): |x| = 2^k m, m in [sqrt(1/2), sqrt(2)) (from b - OFF: its
 * exponent field is k, its top four mantissa bits pick the piece of that range that holds m,
 * whose c comes from a register), r = m/c - 1, |r| < 0.039, and ln(1 + r) to r^5 (truncation
 * below 6e-10 absolute, 2e-8 relative). */
static inline __attribute__((always_inline)) void pass2_vec(
        const uint32_t *p, __mmask16 nrm, const int masked, const int subs, const int hist, __m512i BASE,
        p2_t *st, acc_t *acc, vacc_t *va, int64_t v, int64_t next1, const float *pf) {
    const __m512i ABS = _mm512_set1_epi32(0x7fffffff), ONE = _mm512_set1_epi32(1);
    const __m512 LN2 = _mm512_set1_ps(0.693147180559945309f);
    __m512i raw = _mm512_load_si512(p);
    __m512 xv = _mm512_castsi512_ps(raw);
    __m512i b = _mm512_and_si512(raw, ABS);
    st->s = _mm512_add_ps(st->s, xv);
    st->sa = _mm512_add_ps(st->sa, _mm512_castsi512_ps(b));
    st->ss = _mm512_fmadd_ps(xv, xv, st->ss);
    if (16 * v < next1) _mm_prefetch((const char *)(pf + 16 * v), _MM_HINT_T0);
    int lanes_out = masked;
    if (subs) {
        __mmask16 sub = _mm512_mask_cmplt_epu32_mask(nrm, b, _mm512_set1_epi32(0x00800000));
        if (sub) {
            subnormal_lanes(p, sub, acc, &st->dsl, &st->dsl2);   /* signed bits */
            nrm &= ~sub;
        }
        lanes_out = 1;
    }
    __m512i ix = _mm512_sub_epi32(b, _mm512_set1_epi32((int)LN_OFF));
    __m512i j = _mm512_srli_epi32(ix, 19);                /* the permutes read its low 4 bits */
    __m512 ef = _mm512_cvtepi32_ps(_mm512_srai_epi32(ix, 23));
    __m512i kbits = _mm512_and_si512(ix, _mm512_set1_epi32((int)0xff800000u));   /* k << 23 */
    __m512 mant = _mm512_castsi512_ps(_mm512_sub_epi32(b, kbits));
    __m512 r = _mm512_fmsub_ps(mant, _mm512_permutexvar_ps(j, _mm512_loadu_ps(INV_CENTRE)), _mm512_set1_ps(1.f));
    __m512 q = _mm512_fmadd_ps(r, _mm512_set1_ps(0.2f), _mm512_set1_ps(-0.25f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f / 3.f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(-0.5f));
    __m512 l1r = _mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r);
    __m512 ln = _mm512_fmadd_ps(ef, LN2, _mm512_add_ps(_mm512_permutexvar_ps(j, _mm512_loadu_ps(LN_CENTRE)), l1r));
    if (lanes_out) {
        st->sl = _mm512_mask_add_ps(st->sl, nrm, st->sl, ln);
        st->sl2 = _mm512_mask3_fmadd_ps(ln, ln, st->sl2, nrm);
    } else {
        st->sl = _mm512_add_ps(st->sl, ln);
        st->sl2 = _mm512_fmadd_ps(ln, ln, st->sl2);
    }
    if (hist) {
        __m512i e = _mm512_srli_epi32(b, 23);
        __m512i idx = _mm512_sub_epi32(e, BASE);
        /* the binade as one bit of the lane (a shift by 32 or more, or by a negative count, is 0:
         * below or above the window, the padding, subnormals) */
        __m512i hot = lanes_out ? _mm512_maskz_sllv_epi32(nrm, ONE, idx) : _mm512_sllv_epi32(ONE, idx);
        __mmask16 out = lanes_out ? _mm512_mask_cmpgt_epu32_mask(nrm, idx, _mm512_set1_epi32(31))
                                  : _mm512_cmpgt_epu32_mask(idx, _mm512_set1_epi32(31));
        if (__builtin_expect(out != 0, 0)) {
            uint32_t ev[16];
            _mm512_storeu_si512(ev, e);
            while (out) { int i = __builtin_ctz(out); out &= out - 1; acc->hist[0][ev[i] + 22]++; }
        }
        va->ring[st->nring] = hot;
        if (++st->nring == 16) {
            ring_full(va, acc);
            st->nring = 0;
        }
    }
}

/* ahead: how many entries of this thread's part follow the block (their cache lines are requested
 * early: those of the next block during pass 2, which works from L1, those of the block after
 * it into L2 during pass 1; a gradient fresh from the backward pass is mostly beyond L2) */
static void block_stats_avx512(const float *restrict x, int64_t m, int64_t ahead, acc_t *acc, vacc_t *va) {
    const __m512i ABS = _mm512_set1_epi32(0x7fffffff), INF = _mm512_set1_epi32(0x7f800000);
    const __m512i ONE = _mm512_set1_epi32(1), FINLIM = _mm512_set1_epi32(0x7f7fffff);
    uint32_t nzb[BLOCK + 16] __attribute__((aligned(64)));   /* the non-zero finite x (bits) */
    int64_t nvec = (m + 15) / 16, pos = 0;
    int64_t next1 = ahead < BLOCK ? ahead : BLOCK, next2 = ahead < 2 * BLOCK ? ahead - BLOCK : BLOCK;
    __mmask16 tail = (m % 16) ? (__mmask16)((1u << (m % 16)) - 1u) : (__mmask16)0xffff;

    /* pass 1 over x: the extremes; the non-zero finite entries compacted into nzb (zeros and
     * non-finite entries are the rest, m - pos: told apart afterwards, see below); entries above
     * thr are candidates for the top k (thr: the least of the top k once there are k; all ones
     * when k = 0), gathered in va->cand and selected from when it fills */
    __m512i vmax = _mm512_setzero_si512(), minb = _mm512_set1_epi32(0x7fffffff);
    __m512i thr = _mm512_set1_epi32((int)(acc->k == 0 ? 0xffffffffu : acc->ntop < acc->k ? 0u : acc->top[0]));
    uint32_t *cand = va->cand;
    int ncand = va->ncand;
    int64_t nfull = m / 16;
    for (int64_t v = 0; v < nvec; v++) {
        /* the last vector's lanes past m load as +0: they count as zeros, which m - pos - ... undoes */
        __m512i raw = v < nfull ? _mm512_loadu_si512(x + 16 * v) : _mm512_maskz_loadu_epi32(tail, x + 16 * v);
        if (16 * v < next2) _mm_prefetch((const char *)(x + m + BLOCK + 16 * v), _MM_HINT_T1);
        __m512i b = _mm512_and_si512(raw, ABS);
        /* non-zero and finite in one compare: b - 1 below the bits of inf, less one */
        __mmask16 nz = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(b, ONE), FINLIM);
        vmax = _mm512_max_epu32(vmax, b);                /* non-finite ones too: see below */
        minb = _mm512_mask_min_epu32(minb, nz, minb, b);
        __mmask16 cnd = _mm512_mask_cmpgt_epu32_mask(nz, b, thr);
        if (__builtin_expect(cnd != 0, 0)) {
            _mm512_storeu_si512(cand + ncand, _mm512_maskz_compress_epi32(cnd, b));
            ncand += __builtin_popcount((unsigned)cnd);
            if (ncand > CAND_CAP - 16) {
                top_select(acc, cand, ncand);
                ncand = 0;
                if (acc->ntop == acc->k) thr = _mm512_set1_epi32((int)acc->top[0]);
            }
        }
        _mm512_storeu_si512(nzb + pos, _mm512_maskz_compress_epi32(nz, raw));
        pos += __builtin_popcount((unsigned)nz);
    }
    int64_t nonfin = 0;
    if (__builtin_expect((uint32_t)_mm512_reduce_max_epu32(vmax) >= 0x7f800000u, 0)) {
        /* the block holds inf or NaN (rare): count them, and take the maximum again without them */
        vmax = _mm512_setzero_si512();
        for (int64_t v = 0; v < nvec; v++) {
            __mmask16 ok = v < nfull ? (__mmask16)0xffff : tail;
            __m512i b = _mm512_and_si512(_mm512_maskz_loadu_epi32(ok, x + 16 * v), ABS);
            __mmask16 fin = _mm512_mask_cmplt_epu32_mask(ok, b, INF);
            nonfin += __builtin_popcount((unsigned)(ok & ~fin));
            vmax = _mm512_mask_max_epu32(vmax, fin, vmax, b);
        }
    }
    va->ncand = ncand;
    _mm512_storeu_si512(nzb + pos, _mm512_setzero_si512());     /* +0 pads the last vector */
    uint32_t maxb = (uint32_t)_mm512_reduce_max_epu32(vmax);
    for (int64_t i = 16 * ((pos + 15) / 16); i < next1; i += 16)    /* what pass 2 will not request */
        _mm_prefetch((const char *)(x + m + i), _MM_HINT_T0);
    int has_sub = pos > 0 && (uint32_t)_mm512_reduce_min_epu32(minb) < 0x00800000u;

    /* the window of binades for this block (kept while the blocks' maxima stay near its top) */
    int count_hist = acc->count_hist && pos > 0;
    int base = va->base;
    if (count_hist) {
        int top = (int)(maxb >> 23);
        if (top < 1) top = 1;
        if (base == 0 || top > base + 31 || top < base + 24) {
            window_flush(va, acc);
            base = top - 29;
            if (base < 1) base = 1;
            if (base > 223) base = 223;
            va->base = base;
        }
    }

    /* pass 2 over the non-zero finite entries (in L1): sums, ln|x|, the binade counts; the full
     * vectors of a block without subnormals (nearly all) in a loop with no masks at all */
    p2_t st;
    st.s = st.sa = st.ss = st.sl = st.sl2 = _mm512_setzero_ps();
    st.dsl = st.dsl2 = 0.;
    st.nring = va->nring;
    const __m512i BASE = _mm512_set1_epi32(base);
    int64_t nfv = pos / 16;
    const float *pf = x + m;                 /* the next block: its lines requested from here */
    if (!has_sub && count_hist)
        for (int64_t v = 0; v < nfv; v++) pass2_vec(nzb + 16 * v, 0xffff, 0, 0, 1, BASE, &st, acc, va, v, next1, pf);
    else if (!has_sub)
        for (int64_t v = 0; v < nfv; v++) pass2_vec(nzb + 16 * v, 0xffff, 0, 0, 0, BASE, &st, acc, va, v, next1, pf);
    else
        for (int64_t v = 0; v < nfv; v++)
            pass2_vec(nzb + 16 * v, 0xffff, 0, 1, count_hist, BASE, &st, acc, va, v, next1, pf);
    if (pos % 16)      /* the last vector: the padding zeros add nothing to the sums, its mask
                        * keeps them out of the rest */
        pass2_vec(nzb + 16 * nfv, (__mmask16)((1u << (pos % 16)) - 1u), 1, has_sub, count_hist, BASE, &st,
                  acc, va, nfv, next1, pf);
    __m512 s = st.s, sa = st.sa, ss = st.ss, sl = st.sl, sl2 = st.sl2;
    double dsl = st.dsl, dsl2 = st.dsl2;
    va->nring = st.nring;
    va->s = _mm512_add_pd(va->s, _mm512_add_pd(cvt_lo(s), cvt_hi(s)));
    va->sa = _mm512_add_pd(va->sa, _mm512_add_pd(cvt_lo(sa), cvt_hi(sa)));
    va->ss = _mm512_add_pd(va->ss, _mm512_add_pd(cvt_lo(ss), cvt_hi(ss)));
    va->sl = _mm512_add_pd(va->sl, _mm512_add_pd(cvt_lo(sl), cvt_hi(sl)));
    va->sl2 = _mm512_add_pd(va->sl2, _mm512_add_pd(cvt_lo(sl2), cvt_hi(sl2)));
    va->minb = _mm512_min_epu32(va->minb, minb);
    acc->sum_ln += dsl; acc->sum_ln_sq += dsl2;
    acc->n_zero += (double)(m - pos - nonfin);
    acc->n_nonfinite += (double)nonfin;
    if (maxb > acc->maxb) acc->maxb = maxb;
}
#endif


#if GS_AVX512
/* index vectors of the reduction tree below: level h (8, 4, 2, 1) puts in output lane j the two
 * partials lo, hi of group q = j / h (offset r = j % h) of A (q < 8 / h) or B */
static __m512i TREE_LO[4], TREE_HI[4], EVEN16, ODD16;
static void tree_init(void) {
    int32_t lo[16], hi[16];
    for (int l = 0, h = 8; l < 4; l++, h /= 2) {
        for (int j = 0; j < 16; j++) {
            int q = j / h, r = j % h, from_b = q >= 8 / h, qq = q % (8 / h);
            lo[j] = 16 * from_b + qq * 2 * h + r;
            hi[j] = 16 * from_b + qq * 2 * h + h + r;
        }
        TREE_LO[l] = _mm512_loadu_si512(lo);
        TREE_HI[l] = _mm512_loadu_si512(hi);
    }
    for (int j = 0; j < 16; j++) { lo[j] = (2 * j) % 16; hi[j] = (2 * j + 1) % 16; }
    EVEN16 = _mm512_loadu_si512(lo);
    ODD16 = _mm512_loadu_si512(hi);
}

/* the 16 vectors v[0..16) -> one vector whose lane j is the maximum (max != 0) or minimum of v[j] */
static inline __m512i tree16(__m512i *v, int max) {
    for (int l = 0, n = 16; l < 4; l++, n /= 2)
        for (int i = 0; i < n / 2; i++) {
            __m512i a = _mm512_permutex2var_epi32(v[2 * i], TREE_LO[l], v[2 * i + 1]);
            __m512i b = _mm512_permutex2var_epi32(v[2 * i], TREE_HI[l], v[2 * i + 1]);
            v[i] = max ? _mm512_max_epu32(a, b) : _mm512_min_epu32(a, b);
        }
    return v[0];
}

/* block_ranges, 16 blocks of 16 at a time: the exponent fields of 16 vectors (0 where not normal
 * finite, for the maxima; 255 for the minima) reduced lane-wise by a tree of permutes into one
 * vector per statistic, adjacent lanes paired for the blocks of 32; the rest of the chunk by the
 * portable loop. Range counts go to four interleaved copies (runs of one range would queue
 * on one counter), summed into bh at the end. */
static void block_ranges_avx512(const float *restrict x, int64_t m, int64_t *restrict bh) {
    const __m512i EXP = _mm512_set1_epi32(0xff), E255 = _mm512_set1_epi32(255), Z = _mm512_setzero_si512();
    const __m512i TOPBIN = _mm512_set1_epi32(RANGE_BINS - 1);
    int64_t nfull = m / 16;
    int64_t h4[4][2][RANGE_BINS + 1];
    memset(h4, 0, sizeof h4);
    int64_t v = 0;
    const __m512i ABS = _mm512_set1_epi32(0x7fffffff), ONE = _mm512_set1_epi32(1);
    for (; v + 16 <= nfull; v += 16) {
        __m512i hi[16], lo[16];
        /* fast: the maxima of the fields (zeros and subnormals have 0), the minima of field - 1
         * (0 wraps to the largest unsigned value), then + 1 */
        for (int i = 0; i < 16; i++) {
            __m512i f = _mm512_srli_epi32(_mm512_and_si512(_mm512_loadu_si512(x + 16 * (v + i)), ABS), 23);
            hi[i] = f;
            lo[i] = _mm512_sub_epi32(f, ONE);
        }
        __m512i H = tree16(hi, 1), Lm1 = tree16(lo, 0);   /* least field - 1 (all ones: none) */
        if (__builtin_expect(_mm512_cmpeq_epi32_mask(H, E255) != 0, 0)) {
            /* inf or NaN among them (rare): again, with those counted as zeros */
            for (int i = 0; i < 16; i++) {
                __m512i f = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(x + 16 * (v + i)), 23), EXP);
                __mmask16 nrm = _mm512_mask_cmpneq_epi32_mask(_mm512_cmpneq_epi32_mask(f, Z), f, E255);
                hi[i] = _mm512_maskz_mov_epi32(nrm, f);
                lo[i] = _mm512_mask_mov_epi32(E255, nrm, f);
            }
            H = tree16(hi, 1);
            Lm1 = _mm512_sub_epi32(tree16(lo, 0), ONE);
        }
        __m512i H32 = _mm512_max_epu32(_mm512_permutexvar_epi32(EVEN16, H), _mm512_permutexvar_epi32(ODD16, H));
        __m512i L32 = _mm512_add_epi32(_mm512_min_epu32(_mm512_permutexvar_epi32(EVEN16, Lm1),
                                                        _mm512_permutexvar_epi32(ODD16, Lm1)), ONE);
        __m512i L = _mm512_add_epi32(Lm1, ONE);
        /* bin: 0 for a block without a normal entry, else 1 + min(range, RANGE_BINS - 1) */
        __m512i b16 = _mm512_maskz_add_epi32(_mm512_cmpneq_epi32_mask(H, Z),
                                             _mm512_min_epu32(_mm512_sub_epi32(H, L), TOPBIN), _mm512_set1_epi32(1));
        __m512i b32 = _mm512_maskz_add_epi32(_mm512_cmpneq_epi32_mask(H32, Z),
                                             _mm512_min_epu32(_mm512_sub_epi32(H32, L32), TOPBIN), _mm512_set1_epi32(1));
        int32_t c16[16], c32[16];
        _mm512_storeu_si512(c16, b16);
        _mm512_storeu_si512(c32, b32);
        for (int j = 0; j < 16; j++) h4[j & 3][0][c16[j]]++;
        for (int j = 0; j < 8; j++) h4[j & 3][1][c32[j]]++;
    }
    /* the rest (fewer than 16 blocks of 16; v * 16 a multiple of 32, so blocks of 32 stay aligned) */
    if (16 * v < m) block_ranges(x + 16 * v, m - 16 * v, bh);
    for (int c = 0; c < 4; c++)
        for (int s = 0; s < 2; s++)
            for (int j = 0; j < RANGE_BINS + 1; j++) bh[s * (RANGE_BINS + 1) + j] += h4[c][s][j];
}
#endif

static int cmp_desc(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? 1 : (x > y ? -1 : 0);
}

int gs_stats_f32(const float *x, int64_t n, double *out, double *hist, double *top, int k, int nthreads,
                 int64_t *bh) {
    if (k < 0 || k > MAX_TOP) return 1;
    acc_t total;
    memset(&total, 0, sizeof total);
    total.minb = 0x7fffffffu;
    total.k = k;
    total.count_hist = hist != NULL;
    int64_t nblocks = (n + BLOCK - 1) / BLOCK;
    if (nthreads < 1) nthreads = 1;
#if GS_AVX512
    if (bh != NULL) tree_init();       /* before the threads start: they only read the tables */
#endif
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
        int64_t lbh[2 * (RANGE_BINS + 1)];
        memset(lbh, 0, sizeof lbh);
#if GS_AVX512
        vacc_t va;      /* everything but the buffers (ring, ring2, cand: written before read) */
        memset(&va, 0, offsetof(vacc_t, ring));
        va.minb = _mm512_set1_epi32(0x7fffffff);
#endif
        /* each thread takes one contiguous run of blocks (and requests its next blocks early) */
        int64_t kbeg = 0, kend = nblocks;
#ifdef _OPENMP
        {
            int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            kbeg = nblocks * t / nt; kend = nblocks * (t + 1) / nt;
        }
#endif
        for (int64_t k = kbeg; k < kend; k++) {
            int64_t lo = k * BLOCK, m = n - lo < BLOCK ? n - lo : BLOCK;
#if GS_AVX512
            int64_t part_end = kend * BLOCK < n ? kend * BLOCK : n;
            block_stats_avx512(x + lo, m, part_end - lo - m, &acc, &va);
            if (bh != NULL) block_ranges_avx512(x + lo, m, lbh);      /* the block still in L1 */
#else
            block_stats(x + lo, m, &acc);
            if (bh != NULL) block_ranges(x + lo, m, lbh);
#endif
        }
#if GS_AVX2_HIST
        window_flush2(&acc);
#endif
#if GS_AVX512
        if (va.ncand > 0) top_select(&acc, va.cand, va.ncand);
        window_flush(&va, &acc);
        acc.sum += _mm512_reduce_add_pd(va.s); acc.sum_abs += _mm512_reduce_add_pd(va.sa);
        acc.sum_sq += _mm512_reduce_add_pd(va.ss); acc.sum_ln += _mm512_reduce_add_pd(va.sl);
        acc.sum_ln_sq += _mm512_reduce_add_pd(va.sl2);
        {
            uint32_t mb = (uint32_t)_mm512_reduce_min_epu32(va.minb);
            if (mb < acc.minb) acc.minb = mb;
        }
#endif
#ifdef _OPENMP
#pragma omp critical
#endif
        {
            total.n_zero += acc.n_zero; total.n_nonfinite += acc.n_nonfinite;
            total.sum += acc.sum; total.sum_abs += acc.sum_abs; total.sum_sq += acc.sum_sq;
            total.sum_ln += acc.sum_ln; total.sum_ln_sq += acc.sum_ln_sq;
            if (acc.minb < total.minb) total.minb = acc.minb;
            if (acc.maxb > total.maxb) total.maxb = acc.maxb;
            for (int j = 0; j < HIST_COPIES; j++)
                for (int b = 0; b < HIST_BINS; b++) total.hist[0][b] += acc.hist[j][b];
            for (int j = 0; j < acc.ntop; j++) heap_push(&total, acc.top[j]);
            if (bh != NULL)
                for (int j = 0; j < 2 * (RANGE_BINS + 1); j++) bh[j] += lbh[j];
        }
    }
    double nnz = (double)n - total.n_zero - total.n_nonfinite;
    out[GS_F_N] = (double)n; out[GS_F_N_ZERO] = total.n_zero; out[GS_F_N_NONFINITE] = total.n_nonfinite;
    out[GS_F_SUM] = total.sum; out[GS_F_SUM_ABS] = total.sum_abs; out[GS_F_SUM_SQ] = total.sum_sq;
    out[GS_F_SUM_LN_ABS] = total.sum_ln; out[GS_F_SUM_LN_ABS_SQ] = total.sum_ln_sq;
    out[GS_F_MIN_ABS] = nnz > 0 ? (double)bits_to_float(total.minb) : NAN;
    out[GS_F_MAX_ABS] = nnz > 0 ? (double)bits_to_float(total.maxb) : NAN;
    if (hist != NULL)
        for (int b = 0; b < HIST_BINS; b++) hist[b] = (double)total.hist[0][b];
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
