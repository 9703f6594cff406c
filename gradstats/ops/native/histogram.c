/* The histogram rule's distribution (gradstats/pruning/histogram.py, LogHistogram): its tables built once,
 * then the stochastic operator's expected sparsity at a threshold and the threshold of a target sparsity.
 *
 * The same float operations as the Python class, in the same order (C99 without contraction: no fused
 * multiply-add; exp and log of the same C library), so both give the same doubles bit for bit; the Python
 * class is the reference, and the fall-back where no C compiler is found. What apply's refresh solves on
 * every call (about 100 us of Python floats a layer) costs a few microseconds here.
 *
 * The distribution: counts of the non-zero finite |g| in contiguous bins [lower, upper), the zero count,
 * the total n and `atoms` (magnitudes known exactly, each a step of 1/n). F, the cumulative fraction, is
 * known at the edges and is a monotone cubic (PCHIP, Fritsch-Butland) in l = ln|g| between them;
 * S(a) = (1/a) integral_0^a F(x) dx, taken in closed form on each cubic piece.
 *
 * The table (doubles; gs_hist_table_len(nb, na) of them), after a header of 6:
 *   x[nb+1] (exp(l): the edges as the breakpoints evaluate them), l[nb+1], F[nb+1], J[nb+1] (J_k = integral
 *   up to x_k), c[4 nb] (the pieces' cubic coefficients), g0[nb] (each piece's G(0)), atoms[na] (ascending),
 *   cs[na+1] (their running sums), bv[nb+1+na] (the breakpoints: edges and atoms, ascending, edges first among
 *   equals), bi[nb+1+na] (an edge's index, or -1 for an atom), and the bins as given: counts[nb], lower[nb],
 *   upper[nb] (what the class's properties read back).
 * With nb = 0 the distribution has no bins (atoms only).
 */
#include <math.h>
#include <stdint.h>

enum { H_NB, H_NA, H_N, H_NZ, H_FF, H_BIN, HEAD };

typedef struct {
    int64_t nb, na, nbp;
    double n, n_zero, ff;
    int binned;
    double *x, *l, *F, *J, *c, *g0, *atoms, *cs, *bv, *bi;
} hist_t;

int64_t gs_hist_table_len(int64_t nb, int64_t na) {
    return HEAD + 4 * (nb + 1) + 4 * nb + nb + na + (na + 1) + 2 * (nb + 1 + na) + 3 * nb;
}

static hist_t view(const double *tab) {
    hist_t h;
    h.nb = (int64_t)tab[H_NB];
    h.na = (int64_t)tab[H_NA];
    h.n = tab[H_N];
    h.n_zero = tab[H_NZ];
    h.ff = tab[H_FF];
    h.binned = tab[H_BIN] != 0.0;
    h.nbp = (h.binned ? h.nb + 1 : 0) + h.na;
    double *p = (double *)tab + HEAD;
    h.x = p; p += h.nb + 1;
    h.l = p; p += h.nb + 1;
    h.F = p; p += h.nb + 1;
    h.J = p; p += h.nb + 1;
    h.c = p; p += 4 * h.nb;
    h.g0 = p; p += h.nb;
    h.atoms = p; p += h.na;
    h.cs = p; p += h.na + 1;
    h.bv = p; p += h.nb + 1 + h.na;
    h.bi = p;
    return h;
}

/* Where the atoms (part 0) and the bins as given (part 1: counts, lower, upper) start in a built table. */
int64_t gs_hist_offset(const double *tab, int part) {
    hist_t h = view(tab);
    return part == 0 ? h.atoms - tab : h.bi + h.nb + 1 + h.na - tab;
}

static double sign_of(double v) { return (double)((v > 0) - (v < 0)); }

/* G(t), with e^(l_k) (G(T) - G(0)) the integral of F(l_k + t) e^(l_k + t) over [0, T] on the piece c */
static double piece_g(const double *c, double t) {
    double c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
    double p = ((c0 * t + c1) * t + c2) * t + c3;
    double d1 = (3 * c0 * t + 2 * c1) * t + c2;
    double d2 = 6 * c0 * t + 2 * c1;
    return exp(t) * (p - d1 + d2 - 6 * c0);
}

static double pchip_edge(double h0, double h1, double m0, double m1) {
    double d = ((2 * h0 + h1) * m0 - h0 * m1) / (h0 + h1);
    if (sign_of(d) != sign_of(m0)) return 0.0;
    if (sign_of(m0) != sign_of(m1) && fabs(d) > 3.0 * fabs(m0)) return 3.0 * m0;
    return d;
}

/* Build the table of the bins (counts, lower, upper: nb each) and the atoms (na, ascending). Returns 0, or -1
 * where the Python class would raise or order its breakpoints otherwise (edges not positive, finite and
 * strictly increasing, atoms not ascending, n not positive): the caller then builds it in Python. */
int gs_hist_build(const double *counts, const double *lower, const double *upper, int64_t nb, int64_t n,
                  int64_t n_zero, const double *atoms, int64_t na, double *tab) {
    if (n <= 0 || nb < 0 || na < 0) return -1;
    tab[H_NB] = (double)nb;
    tab[H_NA] = (double)na;
    tab[H_N] = (double)n;
    tab[H_NZ] = (double)n_zero;
    tab[H_BIN] = nb > 0;
    hist_t h = view(tab);
    double total = 0.0;
    for (int64_t i = 0; i < nb; i++) total += counts[i];
    tab[H_FF] = ((double)n_zero + total + (double)na) / (double)n;
    for (int64_t k = 0; k < na; k++) {
        if (!(atoms[k] > 0 && isfinite(atoms[k])) || (k > 0 && !(atoms[k] >= atoms[k - 1]))) return -1;
        h.atoms[k] = atoms[k];
    }
    h.cs[0] = 0.0;
    for (int64_t k = 0; k < na; k++) h.cs[k + 1] = h.cs[k] + atoms[k];
    if (nb > 0) {
        double x0 = lower[0];
        if (!(x0 > 0 && isfinite(x0))) return -1;
        h.l[0] = log(x0);
        for (int64_t i = 0; i < nb; i++) {
            if (!(upper[i] > 0 && isfinite(upper[i]))) return -1;
            h.l[i + 1] = log(upper[i]);
            if (!(h.l[i + 1] > h.l[i])) return -1;
        }
        double cum = (double)n_zero;
        h.F[0] = cum / (double)n;
        for (int64_t i = 0; i < nb; i++) {
            cum += counts[i];
            h.F[i + 1] = cum / (double)n;
        }
        if (nb >= 2) {
            /* the node derivatives (scipy's PchipInterpolator), in J's slots until the pieces are made */
            double *d = h.J;
            int64_t m = nb + 1;
            for (int64_t i = 0; i < m; i++) d[i] = 0.0;
            for (int64_t i = 1; i < m - 1; i++) {
                double hk0 = h.l[i] - h.l[i - 1], hk1 = h.l[i + 1] - h.l[i];
                double m0 = (h.F[i] - h.F[i - 1]) / hk0, m1 = (h.F[i + 1] - h.F[i]) / hk1;
                if (sign_of(m1) != sign_of(m0) || m1 == 0 || m0 == 0) continue;
                double w1 = 2 * hk1 + hk0, w2 = hk1 + 2 * hk0;
                d[i] = 1.0 / ((w1 / m0 + w2 / m1) / (w1 + w2));
            }
            double h0 = h.l[1] - h.l[0], h1 = h.l[2] - h.l[1];
            double e0 = pchip_edge(h0, h1, (h.F[1] - h.F[0]) / h0, (h.F[2] - h.F[1]) / h1);
            double hl = h.l[m - 1] - h.l[m - 2], hl1 = h.l[m - 2] - h.l[m - 3];
            double e1 = pchip_edge(hl, hl1, (h.F[m - 1] - h.F[m - 2]) / hl, (h.F[m - 2] - h.F[m - 3]) / hl1);
            d[0] = e0;
            d[m - 1] = e1;
            for (int64_t i = 0; i < nb; i++) {
                double dx = h.l[i + 1] - h.l[i];
                double slope = (h.F[i + 1] - h.F[i]) / dx;
                double t = (d[i] + d[i + 1] - 2 * slope) / dx;
                double *c = h.c + 4 * i;
                c[0] = t / dx;
                c[1] = (slope - d[i]) / dx - t;
                c[2] = d[i];
                c[3] = h.F[i];
            }
        } else {                                       /* a single bin: linear */
            h.c[0] = 0.0;
            h.c[1] = 0.0;
            h.c[2] = (h.F[1] - h.F[0]) / (h.l[1] - h.l[0]);
            h.c[3] = h.F[0];
        }
        h.J[0] = h.F[0] * x0;
        double acc = 0.0;
        for (int64_t i = 0; i < nb; i++) {
            const double *c = h.c + 4 * i;
            acc += exp(h.l[i]) * (piece_g(c, h.l[i + 1] - h.l[i]) - (c[3] - c[2] + 2 * c[1] - 6 * c[0]));
            h.J[i + 1] = h.J[0] + acc;
            h.g0[i] = piece_g(c, 0.0);
        }
        for (int64_t i = 0; i <= nb; i++) h.x[i] = exp(h.l[i]);
        for (int64_t i = 1; i <= nb; i++)
            if (!(h.x[i] >= h.x[i - 1])) return -1;
    }
    double *given = h.bi + nb + 1 + na;
    for (int64_t i = 0; i < nb; i++) {
        given[i] = counts[i];
        given[nb + i] = lower[i];
        given[2 * nb + i] = upper[i];
    }
    /* the breakpoints: edges and atoms merged, edges first among equals (a stable sort of edges then atoms) */
    int64_t ne = h.binned ? nb + 1 : 0, i = 0, k = 0, j = 0;
    while (i < ne || k < na) {
        if (k >= na || (i < ne && h.x[i] <= h.atoms[k])) {
            h.bv[j] = h.x[i];
            h.bi[j++] = (double)i++;
        } else {
            h.bv[j] = h.atoms[k++];
            h.bi[j++] = -1.0;
        }
    }
    return 0;
}

/* the number of atoms below a (bisect_left) and the atoms' share of the sparsity at a */
static double atoms_at(const hist_t *h, double a, int stochastic) {
    if (h->na == 0) return 0.0;
    int64_t lo = 0, hi = h->na;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (h->atoms[mid] < a) lo = mid + 1;
        else hi = mid;
    }
    return (stochastic ? (double)lo - h->cs[lo] / a : (double)lo) / h->n;
}

static double continuous_at(const hist_t *h, double la, int stochastic) {
    if (!h->binned) return h->n_zero / h->n;
    const double *l = h->l;
    int64_t nb = h->nb;
    if (la <= l[0]) return h->F[0];
    if (la >= l[nb]) {
        if (!stochastic) return h->F[nb];
        double a = exp(la);
        return (h->J[nb] + h->F[nb] * (a - exp(l[nb]))) / a;
    }
    int64_t lo = 0, hi = nb + 1;                        /* bisect_right(l, la) - 1 */
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (la < l[mid]) hi = mid;
        else lo = mid + 1;
    }
    int64_t k = lo - 1;
    double t = la - l[k];
    const double *c = h->c + 4 * k;
    if (!stochastic) return ((c[0] * t + c[1]) * t + c[2]) * t + c[3];
    return (h->J[k] + h->x[k] * (piece_g(c, t) - h->g0[k])) / exp(la);
}

/* the sparsity at a = e^la (the atoms compared with `a` itself where it is given: a > 0) */
static double at(const hist_t *h, double la, int stochastic, double a) {
    double s = continuous_at(h, la, stochastic);
    if (h->na) s += atoms_at(h, a > 0 ? a : exp(la), stochastic);
    return s;
}

static double at_breakpoint(const hist_t *h, int64_t j, int stochastic) {
    double v = h->bv[j];
    int64_t i = (int64_t)h->bi[j];
    double base = i >= 0 ? (stochastic ? h->J[i] / v : h->F[i]) : continuous_at(h, log(v), stochastic);
    return base + atoms_at(h, v, stochastic);
}

/* The expected zero fraction at a finite threshold a > 0 (LogHistogram.expected_sparsity). */
double gs_hist_sparsity(const double *tab, double a, int stochastic) {
    hist_t h = view(tab);
    if (!(a > 0) || (!h.binned && h.na == 0)) return h.n_zero / h.n;
    if (isinf(a)) return h.ff;
    return at(&h, log(a), stochastic, a);
}

/* The threshold whose expected sparsity is target in [0, 1) (LogHistogram.threshold). */
double gs_hist_threshold(const double *tab, double target, int stochastic) {
    hist_t h = view(tab);
    if (target * h.n <= h.n_zero || (!h.binned && h.na == 0)) return 0.0;
    if (target >= h.ff) return INFINITY;
    int64_t nbp = h.nbp, nb = h.nb;
    if (at_breakpoint(&h, nbp - 1, stochastic) < target) {      /* beyond every breakpoint */
        if (!stochastic) return h.bv[nbp - 1] * (1 + 0x1p-20);
        double m = h.cs[h.na] / h.n;
        if (h.binned) m += h.x[nb] * h.F[nb] - h.J[nb];
        return m / (h.ff - target);
    }
    int64_t lo_i = 0, hi_i = nbp;
    while (lo_i < hi_i) {
        int64_t mid = (lo_i + hi_i) / 2;
        if (at_breakpoint(&h, mid, stochastic) < target) lo_i = mid + 1;
        else hi_i = mid;
    }
    int64_t k = lo_i > 1 ? lo_i : 1;
    if (!stochastic && (!h.binned || h.bv[k - 1] >= h.x[nb])) return h.bv[k];
    double lo = log(h.bv[k - 1]), hi = log(h.bv[k]);
    if (!stochastic) {
        for (int it = 0; it < 200; it++) {
            double mid = 0.5 * (lo + hi);
            if (at(&h, mid, 0, 0.0) < target) lo = mid;
            else hi = mid;
            if (hi - lo < 4e-16 * fmax(1.0, fabs(mid))) break;
        }
        return exp(hi);
    }
    double f_lo = at_breakpoint(&h, k - 1, 1) - target, f_hi = at_breakpoint(&h, k, 1) - target;
    double x = 0.5 * (lo + hi);
    for (int it = 0; it < 100; it++) {
        double sx = at(&h, x, 1, 0.0);
        double f = sx - target;
        if (f == 0.0) break;
        if (f < 0) { lo = x; f_lo = f; }
        else { hi = x; f_hi = f; }
        double d = at(&h, x, 0, 0.0) - sx;
        double step = d > 0 ? f / d : NAN;
        if (fabs(step) <= 4e-16 * fmax(1.0, fabs(x))) { x -= step; break; }
        double nx = x - step;
        if (!(lo < nx && nx < hi)) {
            nx = f_hi > f_lo ? lo - f_lo * (hi - lo) / (f_hi - f_lo) : NAN;
            if (!(lo < nx && nx < hi)) nx = 0.5 * (lo + hi);
        }
        int done = fabs(nx - x) <= 4e-16 * fmax(1.0, fabs(x)) || hi - lo <= 4e-16 * fmax(1.0, fabs(x));
        x = nx;
        if (done) break;
    }
    return exp(x);
}

/* LogHistogram.from_binades of a statistics row (gradstats/pruning/histogram.py): the counts of floor(log2|g|)
 * hist[0..nh) from binade min_exp, the row's largest magnitudes top[0..nt) (NaN, inf and 0 ignored) taken out of their binades as atoms, the empty bins at both ends trimmed, the top bin ending at the
 * smallest atom (or max_abs), the lowest starting at min_abs; then gs_hist_build. tab holds
 * gs_hist_table_len(nh, nt) doubles. Returns 0; -2 where top holds a magnitude outside the binades; -3 where
 * top is not the largest magnitudes the counts hold (the class's two ValueErrors); -1 as gs_hist_build. */
int gs_hist_build_binades(const double *hist, int64_t nh, int64_t min_exp, int64_t n, int64_t n_zero,
                          const double *top, int64_t nt, double min_abs, double max_abs, double *tab) {
    if (nh < 0 || nt < 0 || nh > 4096 || nt > 4096) return -1;
    double h[nh > 0 ? nh : 1], t[nt > 0 ? nt : 1], lower[nh > 0 ? nh : 1], upper[nh > 0 ? nh : 1];
    for (int64_t i = 0; i < nh; i++) h[i] = hist[i];
    int64_t na = 0;
    for (int64_t k = 0; k < nt; k++) {
        double v = top[k];
        if (isfinite(v) && v != 0) t[na++] = fabs(v);
    }
    for (int64_t k = 1; k < na; k++) {               /* ascending (insertion: a few dozen values) */
        double v = t[k];
        int64_t j = k - 1;
        while (j >= 0 && t[j] > v) { t[j + 1] = t[j]; j--; }
        t[j + 1] = v;
    }
    for (int64_t k = 0; k < na; k++) {
        int e;
        frexp(t[k], &e);
        int64_t j = (int64_t)e - 1 - min_exp;
        if (!(0 <= j && j < nh)) return -2;
        h[j] -= 1.0;
    }
    if (na) {
        int e;
        frexp(t[0], &e);
        int64_t j0 = (int64_t)e - 1 - min_exp;
        for (int64_t i = 0; i < nh; i++)
            if (h[i] < 0 || (i > j0 && h[i] != 0)) return -3;
    }
    int64_t i0 = -1, i1 = -1;
    for (int64_t i = 0; i < nh; i++)
        if (h[i] > 0) { if (i0 < 0) i0 = i; i1 = i; }
    if (i0 < 0) return gs_hist_build(h, lower, upper, 0, n, n_zero, t, na, tab);
    int64_t nb = i1 - i0 + 1;
    for (int64_t i = 0; i < nb; i++) {
        lower[i] = ldexp(1.0, (int)(i0 + i + min_exp));
        upper[i] = 2.0 * lower[i];
    }
    double top_edge = na ? t[0] : max_abs;
    if (top_edge > 0 && isfinite(top_edge)) {               /* a sliver, where the bin is one value */
        double a = upper[nb - 1] < top_edge ? upper[nb - 1] : top_edge, b = lower[nb - 1] * (1 + 0x1p-30);
        upper[nb - 1] = a >= b ? a : b;
    }
    if (min_abs > 0 && isfinite(min_abs)) {
        double a = lower[0] > min_abs ? lower[0] : min_abs, b = upper[0] * (1 - 0x1p-30);
        lower[0] = a <= b ? a : b;
    }
    return gs_hist_build(h + i0, lower, upper, nb, n, n_zero, t, na, tab);
}
