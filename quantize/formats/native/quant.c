/* Fused per-row conversion kernels for quantize (one pass per group, no temporaries).
 *
 * Bit-for-bit the math of quantize/formats/int4.py and fp8.py (which are tested against
 * compressed-tensors): FP8 e4m3 -> fp32 via a 256-entry table, times the block's
 * weight_scale_inv in fp32, rounded to bf16; per group absmax; scale = bf16(absmax / 7.5f)
 * (0 -> bf16 eps); q = rint(clamp(bf16(w / scale), -8, 7)); nibble = q + 8, two per byte, low
 * first. IEEE division, round-to-nearest-even bf16 as c10::BFloat16 does; built with
 * -ffp-contract=off so nothing is fused differently from torch's eager ops.
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

static inline void codes_pack(const float *w, int64_t g, float s, uint8_t *packed, double *sq_err, double *sq_ref, float *max_err) {
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

static inline float group_err(const float *w, int64_t g, float s, float norm) {
    float e = 0.f;
    for (int64_t k = 0; k < g; k++) {
        float x = rbf(w[k] / s);
        x = x < -8.f ? -8.f : (x > 7.f ? 7.f : x);
        x = rintf(x);
        e += powf(fabsf(x * s - w[k]), norm);
    }
    return e;
}

static inline float scale_of(float amax) {
    float s = rbf(amax / 7.5f);
    return s == 0.f ? EPS_BF16 : s;
}

static inline float mse_scale(const float *w, int64_t g, float amax, int grid, int steps, float norm) {
    float best_s = scale_of(amax), best_e = INFINITY;
    for (int i = 0; i <= steps; i++) {
        float p = (float)(1.0 - (double)i / (double)grid);
        float s = scale_of(rbf(amax * p));
        float e = group_err(w, g, s, norm);
        if (e < best_e) {
            best_e = e;
            best_s = s;
        }
    }
    return best_s;
}

int quant_rows(const void *src, int src_kind, const float *lut, const float *sinv, int64_t R, int64_t K,
               int64_t br, int64_t bc, int64_t sinv_cols, int64_t g, int observer, int grid, int steps, float norm,
               uint8_t *packed, uint16_t *scale_out, double *stats) {
    float w[MAXG];
    double sq_err = 0.0, sq_ref = 0.0;
    float max_err = 0.f;
    int bad = 0;
    const uint8_t *s8 = (const uint8_t *)src;
    const uint16_t *s16 = (const uint16_t *)src;
    const float *s32 = (const float *)src;
    if (g > MAXG || g % 2) return 2;
    for (int64_t r = 0; r < R; r++) {
        for (int64_t c0 = 0; c0 < K; c0 += g) {
            float amax = 0.f;
            if (src_kind == 0 || src_kind == 3 || src_kind == 4) {
                float sc = src_kind == 0 ? sinv[(r / br) * sinv_cols + c0 / bc] : (src_kind == 3 ? sinv[r] : sinv[0]);
                const uint8_t *p = s8 + r * K + c0;
                for (int64_t k = 0; k < g; k++) {
                    float v = rbf(lut[p[k]] * sc);
                    w[k] = v;
                    float a = fabsf(v);
                    amax = a > amax ? a : amax;
                    bad |= !(a <= 3.4028234e38f);
                }
            } else if (src_kind == 1) {
                const uint16_t *p = s16 + r * K + c0;
                for (int64_t k = 0; k < g; k++) {
                    float v = bf2f(p[k]);
                    w[k] = v;
                    float a = fabsf(v);
                    amax = a > amax ? a : amax;
                    bad |= !(a <= 3.4028234e38f);
                }
            } else {
                const float *p = s32 + r * K + c0;
                for (int64_t k = 0; k < g; k++) {
                    float v = rbf(p[k]); /* a bf16 module's weight, as compressed-tensors sees it */
                    w[k] = v;
                    float a = fabsf(v);
                    amax = a > amax ? a : amax;
                    bad |= !(a <= 3.4028234e38f);
                }
            }
            float s = observer == 0 ? scale_of(amax) : mse_scale(w, g, amax, grid, steps, norm);
            scale_out[r * (K / g) + c0 / g] = f2bf(s);
            codes_pack(w, g, s, packed + r * (K / 2) + c0 / 2, &sq_err, &sq_ref, &max_err);
        }
    }
    stats[0] += sq_err;
    stats[1] += sq_ref;
    if (max_err > stats[2]) stats[2] = max_err;
    return bad;
}

/* FP8 block dequant to bf16 bits: out[r, c] = bf16(lut[w] * sinv[r/br, c/bc]); returns 1 on NaN/Inf */
int dequant_rows(const uint8_t *src, const float *lut, const float *sinv, int64_t R, int64_t K, int64_t br,
                 int64_t bc, int64_t sinv_cols, int per_row, uint16_t *out) {
    int bad = 0;
    for (int64_t r = 0; r < R; r++) {
        for (int64_t c = 0; c < K; c++) {
            float sc = per_row == 2 ? sinv[0] : (per_row ? sinv[r] : sinv[(r / br) * sinv_cols + c / bc]);
            float v = lut[src[r * K + c]] * sc;
            bad |= !(fabsf(v) <= 3.4028234e38f);
            out[r * K + c] = f2bf(v);
        }
    }
    return bad;
}
