// The signed max-times contraction, blocked like a GEMM (semiring_backprop.kernels.native).
//
//   out_hi[i, k] = max_j max(hi[i, j] * w[j, k], lo[i, j] * w[j, k])
//   out_lo[i, k] = min_j min(hi[i, j] * w[j, k], lo[i, j] * w[j, k])
//
// (for a path hi >= lo, so max(hi * w, lo * w) is w * (hi if w >= 0 else lo): the sign
// select without a branch), over the entries j with a path (hi[i, j] != -inf: the
// semiring's zero never wins, even against a zero weight), with the first arg-max /
// arg-min j where asked. Two multiplies, two max and two min per (i, j, k): the
// register tile holds RB rows by NV vectors of output columns; the weights come packed
// as (p / TW, m, TW) panels of the tile's width TW (p padded to a multiple of it), so
// that a tile reads them in order. The caller guarantees that no
// NaN and no infinity other than the zero's is among the inputs (the vector max and min
// here do not propagate NaN), and runs disjoint row ranges on its threads.
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <limits>

namespace {

template <typename T>
struct V;

#if defined(__AVX512F__)
template <>
struct V<float> {
    using R = __m512;
    using M = __mmask16;
    static constexpr int W = 16;
    static R load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
    static R set1(float x) { return _mm512_set1_ps(x); }
    static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
    static R max(R a, R b) { return _mm512_max_ps(a, b); }
    static R min(R a, R b) { return _mm512_min_ps(a, b); }
    static M gt(R a, R b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
    static R pick(M m, R a, R b) { return _mm512_mask_blend_ps(m, a, b); }  // m ? b : a
    static R add(R a, R b) { return _mm512_add_ps(a, b); }
    static bool any(M m) { return m != 0; }
};
template <>
struct V<double> {
    using R = __m512d;
    using M = __mmask8;
    static constexpr int W = 8;
    static R load(const double* p) { return _mm512_loadu_pd(p); }
    static void store(double* p, R x) { _mm512_storeu_pd(p, x); }
    static R set1(double x) { return _mm512_set1_pd(x); }
    static R mul(R a, R b) { return _mm512_mul_pd(a, b); }
    static R max(R a, R b) { return _mm512_max_pd(a, b); }
    static R min(R a, R b) { return _mm512_min_pd(a, b); }
    static M gt(R a, R b) { return _mm512_cmp_pd_mask(a, b, _CMP_GT_OQ); }
    static R pick(M m, R a, R b) { return _mm512_mask_blend_pd(m, a, b); }
    static R add(R a, R b) { return _mm512_add_pd(a, b); }
    static bool any(M m) { return m != 0; }
};
constexpr int RB_VALUES = 4, RB_ARG = 2, NV = 3;  // (32 registers)
#elif defined(__AVX2__)
template <>
struct V<float> {
    using R = __m256;
    using M = __m256;
    static constexpr int W = 8;
    static R load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
    static R set1(float x) { return _mm256_set1_ps(x); }
    static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
    static R max(R a, R b) { return _mm256_max_ps(a, b); }
    static R min(R a, R b) { return _mm256_min_ps(a, b); }
    static M gt(R a, R b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
    static R pick(M m, R a, R b) { return _mm256_blendv_ps(a, b, m); }
    static R add(R a, R b) { return _mm256_add_ps(a, b); }
    static bool any(M m) { return _mm256_movemask_ps(m) != 0; }
};
template <>
struct V<double> {
    using R = __m256d;
    using M = __m256d;
    static constexpr int W = 4;
    static R load(const double* p) { return _mm256_loadu_pd(p); }
    static void store(double* p, R x) { _mm256_storeu_pd(p, x); }
    static R set1(double x) { return _mm256_set1_pd(x); }
    static R mul(R a, R b) { return _mm256_mul_pd(a, b); }
    static R max(R a, R b) { return _mm256_max_pd(a, b); }
    static R min(R a, R b) { return _mm256_min_pd(a, b); }
    static M gt(R a, R b) { return _mm256_cmp_pd(a, b, _CMP_GT_OQ); }
    static R pick(M m, R a, R b) { return _mm256_blendv_pd(a, b, m); }
    static R add(R a, R b) { return _mm256_add_pd(a, b); }
    static bool any(M m) { return _mm256_movemask_pd(m) != 0; }
};
constexpr int RB_VALUES = 2, RB_ARG = 1, NV = 2;  // (16 registers)
#else
template <typename T>
struct Scalar {
    using R = T;
    using M = bool;
    static constexpr int W = 1;
    static R load(const T* p) { return *p; }
    static void store(T* p, R x) { *p = x; }
    static R set1(T x) { return x; }
    static R mul(R a, R b) { return a * b; }
    static R max(R a, R b) { return a > b ? a : b; }
    static R min(R a, R b) { return a < b ? a : b; }
    static M gt(R a, R b) { return a > b; }
    static R pick(M m, R a, R b) { return m ? b : a; }
    static R add(R a, R b) { return a + b; }
    static bool any(M m) { return m; }
};
template <>
struct V<float> : Scalar<float> {};
template <>
struct V<double> : Scalar<double> {};
constexpr int RB_VALUES = 4, RB_ARG = 2, NV = 1;
#endif

// NV: vectors of output columns per tile; RB: rows per tile (values; with arg-max)

// One tile: rows i0 .. i0 + rb (rb <= RB) by columns k0 .. k0 + NV * W.
template <typename T, int RB, bool ARG, bool CHECK>
inline void tile(const T* hs, const T* ls, const T* w, int64_t m, int64_t k0,
                 T* ohi, T* olo, T* jhi, T* jlo, int64_t ldo) {
    using X = V<T>;
    using R = typename X::R;
    constexpr int64_t TW = NV * X::W;
    constexpr T NEG = -std::numeric_limits<T>::infinity();
    const R neg = X::set1(NEG), pos = X::set1(-NEG);
    R ah[RB][NV], al[RB][NV], ih[RB][NV], il[RB][NV];
    for (int r = 0; r < RB; ++r)
        for (int v = 0; v < NV; ++v) {
            ah[r][v] = neg;
            al[r][v] = pos;
            if (ARG) ih[r][v] = il[r][v] = X::set1(0);
        }
    for (int64_t j = 0; j < m; ++j) {
        const T* wj = w + (k0 / TW) * m * TW + j * TW;  // the packed panel: (tiles, m, TW)
        R wv[NV];
        for (int v = 0; v < NV; ++v) wv[v] = X::load(wj + v * X::W);
        const R jv = X::set1(static_cast<T>(j));
        for (int r = 0; r < RB; ++r) {
            const T h = hs[r * m + j];
            if (CHECK && h == NEG) continue;  // no path through j: the zero never wins
            const R hb = X::set1(h), lb = X::set1(ls[r * m + j]);
            for (int v = 0; v < NV; ++v) {
                const R a = X::mul(hb, wv[v]), b = X::mul(lb, wv[v]);
                const R top = X::max(a, b), bottom = X::min(a, b);
                if (ARG) {  // strictly better: the first j stays
                    auto up = X::gt(top, ah[r][v]);
                    ah[r][v] = X::pick(up, ah[r][v], top);
                    ih[r][v] = X::pick(up, ih[r][v], jv);
                    auto down = X::gt(al[r][v], bottom);
                    al[r][v] = X::pick(down, al[r][v], bottom);
                    il[r][v] = X::pick(down, il[r][v], jv);
                } else {
                    ah[r][v] = X::max(ah[r][v], top);
                    al[r][v] = X::min(al[r][v], bottom);
                }
            }
        }
    }
    for (int r = 0; r < RB; ++r) {
        for (int v = 0; v < NV; ++v) {
            const int64_t at = r * ldo + k0 + v * X::W;
            X::store(ohi + at, ah[r][v]);
            X::store(olo + at, al[r][v]);
            if (ARG) {
                X::store(jhi + at, ih[r][v]);
                X::store(jlo + at, il[r][v]);
            }
        }
    }
}

// Rows r0 .. r1 of the flattened (batch * n) rows; row i reads the weights of batch
// i / n (w_batch: the weights' batch stride, 0 for weights shared by every batch).
template <typename T, bool ARG>
void rows(const T* hs, const T* ls, const T* w, const uint8_t* live, int64_t n, int64_t m,
          int64_t pp, int64_t w_batch, int64_t r0, int64_t r1, T* ohi, T* olo, T* jhi,
          T* jlo) {
    constexpr int RB = ARG ? RB_ARG : RB_VALUES;
    constexpr int64_t TW = NV * V<T>::W;
    // columns in panels whose weights (m x panel) stay in the core's L2 while every row
    // block of the range reads them; a row block's fields stay in L1 across the panel
    const int64_t per_tile = m * TW * static_cast<int64_t>(sizeof(T));
    const int64_t panel = TW * (per_tile >= (1 << 20) ? 1 : (1 << 20) / per_tile);
    for (int64_t c0 = 0; c0 < pp; c0 += panel) {
        const int64_t c1 = c0 + panel < pp ? c0 + panel : pp;
        for (int64_t i = r0; i < r1;) {
            const int64_t b = i / n;
            const int64_t rb = (i + RB <= (b + 1) * n && i + RB <= r1) ? RB : 1;
            bool all_live = true;  // every entry of the tile's rows has a path: no test per j
            for (int64_t r = 0; r < rb; ++r) all_live = all_live && live[i + r];
            const T* wb = w + b * w_batch;
            const int64_t o = i * pp;
            T* jh = ARG ? jhi + o : nullptr;
            T* jl = ARG ? jlo + o : nullptr;
            const T *h = hs + i * m, *l = ls + i * m;
            for (int64_t k0 = c0; k0 < c1; k0 += TW) {
                if (rb == RB && all_live)
                    tile<T, RB, ARG, false>(h, l, wb, m, k0, ohi + o, olo + o, jh, jl, pp);
                else if (rb == RB)
                    tile<T, RB, ARG, true>(h, l, wb, m, k0, ohi + o, olo + o, jh, jl, pp);
                else if (all_live)
                    tile<T, 1, ARG, false>(h, l, wb, m, k0, ohi + o, olo + o, jh, jl, pp);
                else
                    tile<T, 1, ARG, true>(h, l, wb, m, k0, ohi + o, olo + o, jh, jl, pp);
            }
            i += rb;
        }
    }
}

// The k best sums of a max-plus contraction (TopK's): for row i and column c,
//
//   the K largest of m[i, j] + lw[c, j] over j, descending, with their first j,
//
// and whether they are decided: the K + 1 largest (with repeats) strictly decreasing,
// so that the K best are K distinct values, each at one j, whatever breaks ties further
// down. The weights come packed as for max-times, (p / TW, L, TW); one row at a time,
// K + 1 values and K indices per lane; a candidate that beats none of a vector's K + 1
// kept values (nearly all, once the first few are in) costs an add, a compare and a
// test. The caller guarantees no NaN and no +inf among the inputs (so no sum is NaN).
template <typename T, int K>
inline void kbest_tile(const T* mi, const T* w, int64_t L, int64_t k0, T* best, T* idx,
                       uint8_t* ok) {
    using X = V<T>;
    using R = typename X::R;
    constexpr int64_t TW = NV * X::W;
    const R neg = X::set1(-std::numeric_limits<T>::infinity());
    R v[K + 1][NV], ix[K][NV];
    for (int v_ = 0; v_ < NV; ++v_) {
        for (int t = 0; t <= K; ++t) v[t][v_] = neg;
        for (int t = 0; t < K; ++t) ix[t][v_] = X::set1(0);
    }
    const T* panel = w + (k0 / TW) * L * TW;
    for (int64_t j = 0; j < L; ++j) {
        const R mj = X::set1(mi[j]);
        const R jv = X::set1(static_cast<T>(j));
        for (int u = 0; u < NV; ++u) {
            const R s = X::add(mj, X::load(panel + j * TW + u * X::W));
            if (!X::any(X::gt(s, v[K][u]))) continue;  // beats none kept: the usual case
            typename X::M c[K + 1];
            for (int t = 0; t <= K; ++t) c[t] = X::gt(s, v[t][u]);  // (before any moves)
            for (int t = K; t >= 1; --t) {  // strictly greater: the first j stays first
                v[t][u] = X::pick(c[t - 1], X::pick(c[t], v[t][u], s), v[t - 1][u]);
                if (t < K) ix[t][u] = X::pick(c[t - 1], X::pick(c[t], ix[t][u], jv), ix[t - 1][u]);
            }
            v[0][u] = X::pick(c[0], v[0][u], s);
            ix[0][u] = X::pick(c[0], ix[0][u], jv);
        }
    }
    alignas(64) T vals[K + 1][TW], ids[K][TW];
    for (int u = 0; u < NV; ++u) {
        for (int t = 0; t <= K; ++t) X::store(vals[t] + u * X::W, v[t][u]);
        for (int t = 0; t < K; ++t) X::store(ids[t] + u * X::W, ix[t][u]);
    }
    for (int64_t c = 0; c < TW; ++c) {
        bool decided = true;
        for (int t = 0; t < K; ++t) {
            best[c * K + t] = vals[t][c];
            idx[c * K + t] = ids[t][c];
            decided = decided && vals[t][c] > vals[t + 1][c];
        }
        ok[c] = decided;
    }
}

// Rows r0 .. r1 of the flattened (batch * n) rows; best and idx (rows, pp, K), ok
// (rows, pp); row i reads the weights of batch i / n (w_batch 0: shared).
template <typename T, int K>
void kbest_rows(const T* ms, const T* w, int64_t n, int64_t L, int64_t pp, int64_t w_batch,
                int64_t r0, int64_t r1, T* best, T* idx, uint8_t* ok) {
    constexpr int64_t TW = NV * V<T>::W;
    const int64_t per_tile = L * TW * static_cast<int64_t>(sizeof(T));
    const int64_t panel = TW * (per_tile >= (1 << 20) ? 1 : (1 << 20) / per_tile);
    for (int64_t c0 = 0; c0 < pp; c0 += panel) {
        const int64_t c1 = c0 + panel < pp ? c0 + panel : pp;
        for (int64_t i = r0; i < r1; ++i) {
            const T* wb = w + (i / n) * w_batch;
            for (int64_t k0 = c0; k0 < c1; k0 += TW)
                kbest_tile<T, K>(ms + i * L, wb, L, k0, best + (i * pp + k0) * K,
                                 idx + (i * pp + k0) * K, ok + i * pp + k0);
        }
    }
}

template <typename T>
void kbest(const T* ms, const T* w, int64_t n, int64_t L, int64_t pp, int64_t w_batch,
           int64_t r0, int64_t r1, int64_t k, T* best, T* idx, uint8_t* ok) {
    switch (k) {
#define SBP_K(K) \
    case K:      \
        return kbest_rows<T, K>(ms, w, n, L, pp, w_batch, r0, r1, best, idx, ok);
        SBP_K(1) SBP_K(2) SBP_K(3) SBP_K(4) SBP_K(5) SBP_K(6) SBP_K(7) SBP_K(8)
#undef SBP_K
    }
}

}  // namespace

extern "C" {

// The tile's width in columns for the element size (4: float, 8: double): the padding
// of p the caller makes.
int64_t sbp_tile_width(int64_t itemsize) {
    return NV * (itemsize == 4 ? V<float>::W : V<double>::W);
}

void sbp_maxtimes_f32(const float* hs, const float* ls, const float* w, const uint8_t* live,
                      int64_t n, int64_t m, int64_t pp, int64_t w_batch, int64_t r0,
                      int64_t r1, float* ohi, float* olo, float* jhi, float* jlo) {
    if (jhi)
        rows<float, true>(hs, ls, w, live, n, m, pp, w_batch, r0, r1, ohi, olo, jhi, jlo);
    else
        rows<float, false>(hs, ls, w, live, n, m, pp, w_batch, r0, r1, ohi, olo, nullptr,
                           nullptr);
}

void sbp_maxtimes_f64(const double* hs, const double* ls, const double* w, const uint8_t* live,
                      int64_t n, int64_t m, int64_t pp, int64_t w_batch, int64_t r0,
                      int64_t r1, double* ohi, double* olo, double* jhi, double* jlo) {
    if (jhi)
        rows<double, true>(hs, ls, w, live, n, m, pp, w_batch, r0, r1, ohi, olo, jhi, jlo);
    else
        rows<double, false>(hs, ls, w, live, n, m, pp, w_batch, r0, r1, ohi, olo, nullptr,
                            nullptr);
}

// The k best (k = 1 .. 8) of a max-plus contraction: kbest above.
int64_t sbp_kbest_max(void) { return 8; }

void sbp_maxplus_kbest_f32(const float* ms, const float* w, int64_t n, int64_t L, int64_t pp,
                           int64_t w_batch, int64_t r0, int64_t r1, int64_t k, float* best,
                           float* idx, uint8_t* ok) {
    kbest<float>(ms, w, n, L, pp, w_batch, r0, r1, k, best, idx, ok);
}

void sbp_maxplus_kbest_f64(const double* ms, const double* w, int64_t n, int64_t L,
                           int64_t pp, int64_t w_batch, int64_t r0, int64_t r1, int64_t k,
                           double* best, double* idx, uint8_t* ok) {
    kbest<double>(ms, w, n, L, pp, w_batch, r0, r1, k, best, idx, ok);
}
}
