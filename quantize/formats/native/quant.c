/* Fused per-row conversion kernels for quantize (one pass per group, no temporaries).
 *
 * Bit-for-bit the math of quantize/formats/int4.py and fp8.py (which are tested against
 * compressed-tensors): FP8 e4m3 -> fp32 via a 256-entry table, times the block's
 * weight_scale_inv in fp32, rounded to bf16; per group absmax; scale = bf16(absmax / 7.5f)
 * (0 -> bf16 eps); q = rint(clamp(bf16(w / scale), -8, 7)); nibble = q + 8, two per byte, low
 * first. IEEE division, round-to-nearest-even bf16 as c10::BFloat16 does; built with
 * -ffp-contract=off so nothing is fused differently from torch's eager ops. Two grids (observer 0:
 * minmax, 2: fullrange); the mse observer's clipping search runs on the torch path, which is also what
 * `check --source` re-derives it with (a search in another order of addition picks the neighbouring
 * shrink at a near-tie).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float rbf(float f) { return bf2f(f2bf(f)); }

#define MAXG 128
#define EPS_BF16 0.0078125f

static inline void codes_pack(const float *w, int64_t g, float s, uint8_t *packed, double *sq_err, double *sq_ref,
                              float *max_err) {
    double se = 0.0, sr = 0.0;
    float me = *max_err;
    for (int64_t k = 0; k < g; k += 2) {
        float x0 = rbf(w[k] / s), x1 = rbf(w[k + 1] / s);
        x0 = x0 < -8.f ? -8.f : (x0 > 7.f ? 7.f : x0);
        x1 = x1 < -8.f ? -8.f : (x1 > 7.f ? 7.f : x1);
        x0 = rintf(x0);
        x1 = rintf(x1);
        float d0 = x0 * s - w[k], d1 = x1 * s - w[k + 1];
        se += (double)d0 * d0 + (double)d1 * d1;
        sr += (double)w[k] * w[k] + (double)w[k + 1] * w[k + 1];
        float a0 = fabsf(d0), a1 = fabsf(d1);
        if (a0 > me) me = a0;
        if (a1 > me) me = a1;
        packed[k >> 1] = (uint8_t)(((int)x0 + 8) | (((int)x1 + 8) << 4));
    }
    *sq_err += se;
    *sq_ref += sr;
    *max_err = me;
}

typedef union { float f; uint32_t u; } fu32;

/* bf16 round of a vector element without branches (NaN handled by the amax check) */
static inline float rbf_nn(float f) {
    fu32 x;
    x.f = f;
    x.u = (x.u + 0x7FFFu + ((x.u >> 16) & 1u)) & 0xFFFF0000u;
    return x.f;
}

#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: (x + M) - M rounds half to even for |x| < 2^22 */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "row_minmax packs nibble pairs as little-endian 16-bit words" /* the build fails: the torch path runs */
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
#define V16(f) ((v16f){0} + (f))

/* lane by lane, m ? a : b (m from a vector comparison: all ones or zero) */
static inline v16f sel(v16i m, v16f a, v16f b) { return (v16f)((m & (v16i)a) | (~m & (v16i)b)); }

/* bf16 round (rbf_nn) of 16 lanes */
static inline v16f rbf16(v16f f) {
    v16u u = (v16u)f;
    return (v16f)((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

/* the codes q of 16 weights on scale s, as floats: rint(clamp(bf16(w / s), -8, 7)); a NaN weight is
 * flagged by the caller (the job fails) */
static inline v16f codes16(v16f wv, v16f sv) {
    const v16f lo = V16(-8.f), hi = V16(7.f), magic = V16(ROUND_MAGIC);
    v16f x = rbf16(wv / sv);
    x = sel(x < lo, lo, x);
    x = sel(x > hi, hi, x);
    return (x + magic) - magic;
}

/* 16 codes as 8 bytes at pk: nibbles q + 8, two a byte, low first. A pair as one little-endian 16-bit
 * word is lo + 256 hi (each < 16), and (v | v >> 4)'s low byte is lo | hi << 4 */
static inline void pack16(v16f x, uint8_t *pk) {
    v16b c = __builtin_convertvector(__builtin_convertvector(x, v16i) + 8, v16b);
    v8h v;
    memcpy(&v, &c, sizeof v);
    v8b byte = __builtin_convertvector(v | (v >> 4), v8b);
    memcpy(pk, &byte, sizeof byte);
}

/* the sum of 8 double lanes, in lane order */
static inline double hsum8(v8d v) {
    double l[8], t = 0.0;
    memcpy(l, &v, sizeof l);
    for (int i = 0; i < 8; i++) t += l[i];
    return t;
}

/* 16 float lanes as two halves of 8 double lanes (exact) */
static inline void halves8(v16f v, v8d *lo, v8d *hi) {
    v8f a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (char *)&v + sizeof a, sizeof b);
    *lo = __builtin_convertvector(a, v8d);
    *hi = __builtin_convertvector(b, v8d);
}

/* the largest of m and 16 float lanes (a NaN lane ignored, as the scalar loops ignore one) */
static inline float hmax16(v16f v, float m) {
    float l[16];
    memcpy(l, &v, sizeof l);
    for (int i = 0; i < 16; i++) m = l[i] > m ? l[i] : m;
    return m;
}
#endif

/* float8_e4m3fn -> fp32 exactly, vectorizable: normal 2^(e-7)(1+m/8), subnormal m*2^-9, 0x7F/0xFF NaN.
 * No fp32 subnormal is formed or operated on: arithmetic on one costs a microcode assist on many x86
 * cores (a source of uniformly random codes, 1/16 of them subnormal, converted 3.4x slower per element).
 * A normal code's fp32 bits are built directly (its exponent rebiased by 127 - 7 = 120); a subnormal code
 * (or zero) is decoded as if its exponent were 1, 2^-6 (1 + m/8), and 2^-6 taken off: m * 2^-9, exact.
 * The 2^-6 (or 0) is made from its bits: an int-to-float conversion here keeps gcc from vectorizing the
 * loop. Sign and NaN patched in. Tested for all 256 codes. */
static inline float fp8_dec(uint8_t c) {
    int32_t cc = c;
    uint32_t sub = 1u - ((((uint32_t)cc >> 3 & 15u) + 15u) >> 4); /* 1 for exponent bits 0, else 0 */
    fu32 x, k;
    x.u = ((uint32_t)(cc & 0x7F) << 20) + ((120u + sub) << 23);
    k.u = sub * 0x3C800000u; /* 2^-6, or +0 */
    x.f -= k.f;
    x.u |= (uint32_t)(cc & 0x80) << 24;
    x.u = (cc & 0x7F) == 0x7F ? 0x7FC00000u : x.u;
    return x.f;
}

#define MAXK 65536

/* one row, minmax observer, in vectorizable passes; returns 1 on NaN/Inf */
static int row_minmax(float *w, int64_t K, int64_t g, uint8_t *packed, uint16_t *scale_out, float *sc,
                      double *sq_err, double *sq_ref, float *max_err) {
    int64_t G = K / g;
    int bad = 0;
    for (int64_t j = 0; j < G; j++) {
        uint32_t m = 0;
        const float *wg = w + j * g;
        for (int64_t k = 0; k < g; k++) {
            fu32 x;
            x.f = wg[k];
            uint32_t u = x.u & 0x7FFFFFFFu;
            m = u > m ? u : m;
        }
        bad |= m >= 0x7F800000u;
        fu32 am;
        am.u = m;
        float amax = am.f;
        float s = rbf(amax / 7.5f);
        sc[j] = s == 0.f ? EPS_BF16 : s;
        scale_out[j] = f2bf(sc[j]);
    }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* 16 lanes in GCC/clang vector types, one AVX-512 register: lane l takes the group's elements
     * l, l + 16, ... in order, so the sums are the scalar loop's lanes, and each lane does the same
     * IEEE operations as the scalar code, so the codes are identical. Written out because gcc
     * vectorized the scalar form with mask juggling, its lane sums on the stack and a scalar
     * nibble pack: 17.0 -> 11.1 ms a 2048 x 6144 expert (AMD EPYC, AVX-512). Without AVX-512 the
     * same code was slower than the scalar form (two AVX2 registers and narrowing shuffles:
     * 60 -> 83 ms), so there the scalar form stays. */
    v16f se = {0}, sr = {0}, me = {0};
    for (int64_t j = 0; j < G; j++) {
        const float *wg = w + j * g;
        const v16f sv = V16(sc[j]);
        uint8_t *pk = packed + j * (g / 2);
        for (int64_t k = 0; k < g; k += 16) {
            v16f wv;
            memcpy(&wv, wg + k, sizeof wv);
            v16f x = codes16(wv, sv);
            v16f d = x * sv - wv;
            se += d * d;
            sr += wv * wv;
            v16f a = (v16f)((v16u)d & 0x7FFFFFFFu);
            me = sel(a > me, a, me);
            pack16(x, pk + k / 2);
        }
    }
#else
    float q[MAXG];
    float se[16] = {0}, sr[16] = {0}, me[16] = {0};
    for (int64_t j = 0; j < G; j++) {
        const float *wg = w + j * g;
        float s = sc[j];
        for (int64_t k = 0; k < g; k++) {
            float x = rbf_nn(wg[k] / s);
            x = x < -8.f ? -8.f : x;
            x = x > 7.f ? 7.f : x;
            q[k] = (x + ROUND_MAGIC) - ROUND_MAGIC;
        }
        for (int64_t k = 0; k < g; k += 16)
            for (int l = 0; l < 16; l++) {
                float d = q[k + l] * s - wg[k + l];
                se[l] += d * d;
                sr[l] += wg[k + l] * wg[k + l];
                float a = d < 0 ? -d : d;
                me[l] = a > me[l] ? a : me[l];
            }
        uint8_t *pk = packed + j * (g / 2);
        for (int64_t k = 0; k < g / 2; k++)
            pk[k] = (uint8_t)(((int32_t)q[2 * k] + 8) | (((int32_t)q[2 * k + 1] + 8) << 4));
    }
#endif
    double a = 0.0, b = 0.0;
    float mx = *max_err;
    float lse[16], lsr[16], lme[16]; /* the 16 lanes, from the vectors or the arrays alike */
    memcpy(lse, &se, sizeof lse);
    memcpy(lsr, &sr, sizeof lsr);
    memcpy(lme, &me, sizeof lme);
    for (int l = 0; l < 16; l++) {
        a += lse[l];
        b += lsr[l];
        mx = lme[l] > mx ? lme[l] : mx;
    }
    *sq_err += a;
    *sq_ref += b;
    *max_err = mx;
    return bad;
}

/* row r of the source decoded into bf16-rounded fp32 (src_kind 0: FP8 + block scales, 3: FP8 + per-row,
 * 4: FP8 + one scale, 1: bf16, 2: fp32) */
static void decode_row(const void *src, int src_kind, const float *sinv, int64_t r, int64_t K, int64_t br,
                       int64_t bc, int64_t sinv_cols, float *wrow) {
    if (src_kind == 0 || src_kind == 3 || src_kind == 4) {
        const uint8_t *p = (const uint8_t *)src + r * K;
        int64_t step = src_kind == 0 ? bc : K;
        for (int64_t c0 = 0; c0 < K; c0 += step) {
            float scv = src_kind == 0 ? sinv[(r / br) * sinv_cols + c0 / bc] : (src_kind == 3 ? sinv[r] : sinv[0]);
            int64_t c1 = c0 + step < K ? c0 + step : K;
            for (int64_t c = c0; c < c1; c++) wrow[c] = rbf_nn(fp8_dec(p[c]) * scv);
        }
    } else if (src_kind == 1) {
        const uint16_t *p = (const uint16_t *)src + r * K;
        for (int64_t c = 0; c < K; c++) wrow[c] = bf2f(p[c]);
    } else {
        const float *p = (const float *)src + r * K;
        for (int64_t c = 0; c < K; c++) wrow[c] = rbf_nn(p[c]);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* codes_pack on 16 lanes: the same per-element operations (codes as row_minmax's pass; the error
 * d in fp32, squared in double as codes_pack squares it), summed in 8 double lanes per sum (another
 * order of addition, ~1e-16 relative), the max exactly. */
static inline void codes_pack16(const float *w, int64_t g, float s, uint8_t *pk, v8d *se, v8d *sr, v16f *me) {
    const v16f sv = V16(s);
    for (int64_t k = 0; k < g; k += 16) {
        v16f wv;
        memcpy(&wv, w + k, sizeof wv);
        v16f x = codes16(wv, sv);
        v16f d = x * sv - wv;
        v16f a = (v16f)((v16u)d & 0x7FFFFFFFu);
        *me = sel(a > *me, a, *me);
        v8d d0, d1, x0, x1;
        halves8(d, &d0, &d1);
        halves8(wv, &x0, &x1);
        *se += d0 * d0;
        *se += d1 * d1;
        *sr += x0 * x0;
        *sr += x1 * x1;
        pack16(x, pk + k / 2);
    }
}
#endif

/* which form of row_minmax's pass, fullrange's codes and error_rows this build has: 16 (AVX-512 vector
 * types) or 1 (scalar) */
int minmax_lanes(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return 16;
#else
    return 1;
#endif
}

int quant_rows(const void *src, int src_kind, const float *lut, const float *sinv, int64_t R, int64_t K,
               int64_t br, int64_t bc, int64_t sinv_cols, int64_t g, int observer, uint8_t *packed,
               uint16_t *scale_out, double *stats) {
    float wrow[MAXK];
    float sc[MAXK / 16];
    double sq_err = 0.0, sq_ref = 0.0;
    float max_err = 0.f;
    int bad = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    v8d fse = {0}, fsr = {0}; /* fullrange's sums and max, in lanes */
    v16f fme = {0};
#endif
    (void)lut;
    if (g > MAXG || g % 16 || K > MAXK || K % g || (observer != 0 && observer != 2)) return 2;
    for (int64_t r = 0; r < R; r++) {
        decode_row(src, src_kind, sinv, r, K, br, bc, sinv_cols, wrow);
        if (observer == 0) {
            bad |= row_minmax(wrow, K, g, packed + r * (K / 2), scale_out + r * (K / g), sc, &sq_err, &sq_ref,
                              &max_err);
            continue;
        }
        for (int64_t c0 = 0; c0 < K; c0 += g) {
            const float *w = wrow + c0;
            float amax = 0.f;
            for (int64_t k = 0; k < g; k++) {
                float a = fabsf(w[k]);
                amax = a > amax ? a : amax;
                bad |= !(a <= 3.4028234e38f);
            }
            /* fullrange: the signed extreme (the first of largest magnitude) on code -8; the first element
             * whose magnitude is amax (NaN skipped, as the loop above skips it): the one a running
             * "a > m" search keeps */
            int64_t k = 0;
            while (k < g - 1 && !(fabsf(w[k]) == amax)) k++;
            float s = rbf(w[k] / -8.f);
            s = s == 0.f ? EPS_BF16 : s;
            scale_out[r * (K / g) + c0 / g] = f2bf(s);
#if defined(__AVX512F__) && defined(__AVX512BW__)
            codes_pack16(w, g, s, packed + r * (K / 2) + c0 / 2, &fse, &fsr, &fme);
#else
            codes_pack(w, g, s, packed + r * (K / 2) + c0 / 2, &sq_err, &sq_ref, &max_err);
#endif
        }
    }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    sq_err += hsum8(fse);
    sq_ref += hsum8(fsr);
    max_err = hmax16(fme, max_err);
#endif
    stats[0] += sq_err;
    stats[1] += sq_ref;
    if (max_err > stats[2]) stats[2] = max_err;
    return bad;
}

/* FP8 block dequant to bf16 bits: out[r, c] = bf16(fp8(w) * sinv[r/br, c/bc]); returns 1 on NaN/Inf.
 * Laid out as decode_row: one scale per run of columns, so that the inner loop has no index arithmetic
 * and vectorizes. */
int dequant_rows(const uint8_t *src, const float *lut, const float *sinv, int64_t R, int64_t K, int64_t br,
                 int64_t bc, int64_t sinv_cols, int per_row, uint16_t *out) {
    (void)lut;
    int bad = 0;
    int64_t step = per_row ? K : bc;
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *p = src + r * K;
        uint16_t *o = out + r * K;
        for (int64_t c0 = 0; c0 < K; c0 += step) {
            float sc = per_row == 2 ? sinv[0] : (per_row ? sinv[r] : sinv[(r / br) * sinv_cols + c0 / bc]);
            int64_t c1 = c0 + step < K ? c0 + step : K;
            for (int64_t c = c0; c < c1; c++) {
                float v = fp8_dec(p[c]) * sc;
                bad |= !(fabsf(v) <= 3.4028234e38f);
                o[c] = f2bf(v);
            }
        }
    }
    return bad;
}

/* stored codes (nibble = q + 8, two per byte, low first) and bf16 scales against the source rows, as
 * int4.error_sums measures them: the product code x scale rounded to bf16 (compressed-tensors'
 * decompression in the scale dtype), its difference from the bf16-rounded weight in fp32, squares in
 * fp32 summed in double; stats += (sq_err, sq_ref), stats[2] = max(max |err|). Returns 1 on NaN/Inf in
 * the source, 2 on a shape quant.c does not take. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* error_rows for groups of a multiple of 16, 16 lanes (AVX-512): the same per-element IEEE operations
 * (the product code x scale rounded to bf16, a NaN product to bf16's NaN as rbf does; squares in
 * fp32), the squares summed in double in 8 lanes each (another order of addition: ~1e-16 relative),
 * the max exactly. 33.1 -> 21.3 ms a 2048 x 7168 FP8 expert on one core (AMD EPYC). */
static int error_rows16(const void *src, int src_kind, const float *sinv, int64_t R, int64_t K, int64_t br,
                        int64_t bc, int64_t sinv_cols, int64_t g, const uint8_t *packed, const uint16_t *scale,
                        double *stats) {
    float wrow[MAXK];
    v8d se = {0}, sr = {0};
    v16f me = {0};
    v16i badv = {0};
    const v16f fmax = V16(3.4028234e38f), qnan = (v16f)((v16u){0} + 0x7FC00000u);
    for (int64_t r = 0; r < R; r++) {
        decode_row(src, src_kind, sinv, r, K, br, bc, sinv_cols, wrow);
        const uint8_t *pk = packed + r * (K / 2);
        const uint16_t *srow = scale + r * (K / g);
        for (int64_t c0 = 0; c0 < K; c0 += g) {
            const v16f sv = V16(bf2f(srow[c0 / g]));
            for (int64_t k = c0; k < c0 + g; k += 16) {
                /* 8 bytes -> 16 nibbles in order: each byte widened to 16 bits, its high nibble moved
                 * to the high byte; little-endian, the bytes then read lo0 hi0 lo1 hi1 ... */
                v8b b;
                memcpy(&b, pk + k / 2, sizeof b);
                v8h h = __builtin_convertvector(b, v8h);
                h = (h & 0x0F) | ((h & 0xF0) << 4);
                v16b c;
                memcpy(&c, &h, sizeof c);
                v16f x = __builtin_convertvector(__builtin_convertvector(c, v16i) - 8, v16f) * sv;
                v16f prod = sel(x != x, qnan, rbf16(x));
                v16f wv;
                memcpy(&wv, wrow + k, sizeof wv);
                v16f d = prod - wv;
                v16f a = (v16f)((v16u)d & 0x7FFFFFFFu), aw = (v16f)((v16u)wv & 0x7FFFFFFFu);
                me = sel(a > me, a, me);
                badv |= ~(aw <= fmax);
                v8d lo, hi; /* squares in fp32, as error_rows squares them, then summed in double */
                halves8(d * d, &lo, &hi);
                se += lo;
                se += hi;
                halves8(wv * wv, &lo, &hi);
                sr += lo;
                sr += hi;
            }
        }
    }
    int32_t lbad[16];
    int bad = 0;
    memcpy(lbad, &badv, sizeof lbad);
    for (int l = 0; l < 16; l++) bad |= lbad[l] != 0;
    stats[0] += hsum8(se);
    stats[1] += hsum8(sr);
    float mx = hmax16(me, 0.f);
    if (mx > stats[2]) stats[2] = mx;
    return bad;
}
#endif

int error_rows(const void *src, int src_kind, const float *sinv, int64_t R, int64_t K, int64_t br, int64_t bc,
               int64_t sinv_cols, int64_t g, const uint8_t *packed, const uint16_t *scale, double *stats) {
    float wrow[MAXK];
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (g % 16 == 0 && g <= MAXG && K <= MAXK && K % g == 0)
        return error_rows16(src, src_kind, sinv, R, K, br, bc, sinv_cols, g, packed, scale, stats);
#endif
    double sq_err = 0.0, sq_ref = 0.0;
    float max_err = 0.f;
    int bad = 0;
    if (g > MAXG || g % 2 || K > MAXK || K % g) return 2;
    for (int64_t r = 0; r < R; r++) {
        decode_row(src, src_kind, sinv, r, K, br, bc, sinv_cols, wrow);
        const uint8_t *pk = packed + r * (K / 2);
        const uint16_t *sr = scale + r * (K / g);
        for (int64_t c0 = 0; c0 < K; c0 += g) {
            float s = bf2f(sr[c0 / g]);
            double gse = 0.0, grr = 0.0;
            for (int64_t k = c0; k < c0 + g; k++) {
                uint8_t b = pk[k >> 1];
                int q = (int)((k & 1) ? (b >> 4) : (b & 15)) - 8;
                float d = rbf((float)q * s) - wrow[k];
                float a = fabsf(d);
                float se = d * d, rr = wrow[k] * wrow[k]; /* squared in fp32, as torch's pow(2) */
                bad |= !(fabsf(wrow[k]) <= 3.4028234e38f);
                max_err = a > max_err ? a : max_err;
                gse += (double)se;
                grr += (double)rr;
            }
            sq_err += gse;
            sq_ref += grr;
        }
    }
    stats[0] += sq_err;
    stats[1] += sq_ref;
    if (max_err > stats[2]) stats[2] = max_err;
    return bad;
}
