/* e^y in float for y in [-87, 80] (the caller clamps), branch-free so that the loops that call it vectorise it
 * inline (a libm call per element costs more than the arithmetic): y = n ln 2 + r with n = round(y / ln 2),
 * |r| <= ln(2) / 2, e^r by a degree-6 fit (max relative error 2e-9), times 2^n built in the exponent bits. */
#ifndef PLUGFORMER_EXPF_H
#define PLUGFORMER_EXPF_H

#include <stdint.h>

static inline float exp_clamped(float y) {
    const float n = (y * 1.4426950408889634f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (y - n * 0.693145751953125f) - n * 1.4286067653302226e-6f; /* y - n ln 2, ln 2 in two parts */
    float e = 1.3829420595802581e-3f;
    e = e * r + 8.374771520128483e-3f;
    e = e * r + 4.166835803302364e-2f;
    e = e * r + 1.666642083211891e-1f;
    e = e * r + 4.999999149303672e-1f;
    e = e * r + 1.0000000361258996f;
    e = e * r + 1.0000000005920209f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23}; /* 2^n */
    return e * scale.f;
}

#endif
