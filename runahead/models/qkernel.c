/* Products of float32 rows with Q4_0 / Q8_0 matrices, read as the file stores them (runahead.models.qkernel).
 *
 * y[r, i] = sum_k x[r, k] * w[i, k], w[i, k] = d * q exactly as ggml dequantizes it (d the block's fp16 scale
 * widened to float32, q the block's integer: nibble - 8 for Q4_0, int8 for Q8_0; the product is exact in
 * float32). Each weight is formed in registers and used for up to 8 rows at once, so no float32 copy of a
 * matrix is ever written. Each output sums its 32-weight blocks in order, eight lanes at a time, then adds
 * the lanes: the same order whatever the other rows, so a row's result does not depend on its batch.
 *
 * One call runs a whole group: segment s multiplies rows [starts[s], stops[s]) of x by the matrix at
 * address weights[s]. Work is split into (segment, 32 outputs) units taken from a shared counter by
 * `threads` threads (the caller's and threads - 1 started here).
 *
 * Two bodies of `product`, one contract: with -mavx2 -mfma -mf16c (the loader passes them only on a CPU with
 * all three) the AVX2 intrinsics below; otherwise portable C written so that the compiler vectorizes it for
 * the target's baseline vector unit (NEON on arm64, SSE2 on x86-64): eight float lanes per output, summed
 * in the same tree order as the AVX2 body.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define ROWS 8   /* rows sharing one pass over a matrix row */
#define CHUNK 32 /* outputs per unit of work */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RUNAHEAD_AVX2 1
#endif

typedef struct {
    int kind; /* 0: Q4_0 (18-byte blocks), 1: Q8_0 (34-byte blocks) */
    const float *x;
    float *y;
    int64_t n, k, segments, units_per_segment, units;
    const int64_t *weights, *starts, *stops;
    int64_t next; /* the next unit to take (atomic) */
} work_t;

#ifdef RUNAHEAD_AVX2
static inline float lane_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 widen(__m128i q, __m256 d) { /* 8 int8 (low half of q) times d */
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
}

/* Outputs [i0, i1) of `rows` (<= ROWS) rows x (stride k) into y (stride n), matrix w. */
static void product(int kind, const uint8_t *w, const float *x, float *y, int rows, int64_t n, int64_t k,
                    int64_t i0, int64_t i1) {
    const int64_t blocks = k / 32, block_bytes = kind == 0 ? 18 : 34;
    const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    for (int64_t i = i0; i < i1; i++) {
        __m256 acc[ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        const uint8_t *block = w + i * blocks * block_bytes;
        for (int64_t b = 0; b < blocks; b++, block += block_bytes) {
            uint16_t half;
            memcpy(&half, block, 2);
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(half));
            __m128i q0, q1;
            if (kind == 0) { /* weights 0-15: low nibbles, 16-31: high nibbles */
                const __m128i q = _mm_loadu_si128((const __m128i *)(block + 2));
                q0 = _mm_sub_epi8(_mm_and_si128(q, low), eight);
                q1 = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low), eight);
            } else {
                q0 = _mm_loadu_si128((const __m128i *)(block + 2));
                q1 = _mm_loadu_si128((const __m128i *)(block + 18));
            }
            const __m256 w0 = widen(q0, d), w1 = widen(_mm_srli_si128(q0, 8), d);
            const __m256 w2 = widen(q1, d), w3 = widen(_mm_srli_si128(q1, 8), d);
            const float *xb = x + b * 32;
            for (int r = 0; r < rows; r++) {
                const float *xr = xb + r * k;
                __m256 a = acc[r];
                a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a);
                a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a);
                a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a);
                a = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a);
                acc[r] = a;
            }
        }
        for (int r = 0; r < rows; r++) y[r * n + i] = lane_sum(acc[r]);
    }
}
#else
static inline float half_to_float(uint16_t h) { /* IEEE binary16 -> binary32, exact */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    uint32_t bits;
    float f;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in float32 */
        f = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static void product(int kind, const uint8_t *w, const float *x, float *y, int rows, int64_t n, int64_t k,
                    int64_t i0, int64_t i1) {
    const int64_t blocks = k / 32, block_bytes = kind == 0 ? 18 : 34;
    for (int64_t i = i0; i < i1; i++) {
        float acc[ROWS][8];
        memset(acc, 0, sizeof acc);
        const uint8_t *block = w + i * blocks * block_bytes;
        for (int64_t b = 0; b < blocks; b++, block += block_bytes) {
            uint16_t half;
            memcpy(&half, block, 2);
            const float d = half_to_float(half);
            float wb[32];
            if (kind == 0) { /* weights 0-15: low nibbles, 16-31: high nibbles */
                for (int j = 0; j < 16; j++) {
                    wb[j] = d * (float)((int)(block[2 + j] & 0x0F) - 8);
                    wb[j + 16] = d * (float)((int)(block[2 + j] >> 4) - 8);
                }
            } else {
                for (int j = 0; j < 32; j++) wb[j] = d * (float)(int8_t)block[2 + j];
            }
            const float *xb = x + b * 32;
            for (int r = 0; r < rows; r++) {
                const float *xr = xb + r * k;
                for (int c = 0; c < 4; c++)
                    for (int l = 0; l < 8; l++) acc[r][l] += wb[c * 8 + l] * xr[c * 8 + l];
            }
        }
        for (int r = 0; r < rows; r++) {
            const float *a = acc[r];
            y[r * n + i] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        }
    }
}
#endif

static void *worker(void *arg) {
    work_t *job = (work_t *)arg;
    for (;;) {
        const int64_t unit = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (unit >= job->units) return NULL;
        const int64_t s = unit / job->units_per_segment, i0 = (unit % job->units_per_segment) * CHUNK;
        const int64_t i1 = i0 + CHUNK < job->n ? i0 + CHUNK : job->n;
        const uint8_t *w = (const uint8_t *)(intptr_t)job->weights[s];
        for (int64_t r = job->starts[s]; r < job->stops[s]; r += ROWS) {
            const int rows = job->stops[s] - r < ROWS ? (int)(job->stops[s] - r) : ROWS;
            product(job->kind, w, job->x + r * job->k, job->y + r * job->n, rows, job->n, job->k, i0, i1);
        }
    }
}

/* y [P, n] = each segment's rows of x [P, k] times its matrix [n, k]; returns 0, or -1 on bad arguments. */
int runahead_grouped_product(int kind, const float *x, float *y, int64_t n, int64_t k, int64_t segments,
                             const int64_t *weights, const int64_t *starts, const int64_t *stops,
                             int threads) {
    if ((kind != 0 && kind != 1) || k % 32 || n <= 0 || segments < 0) return -1;
    work_t job = {kind, x, y, n, k, segments, (n + CHUNK - 1) / CHUNK, 0, weights, starts, stops, 0};
    job.units = job.segments * job.units_per_segment;
    pthread_t helpers[64];
    int started = 0;
    for (; started < threads - 1 && started < 64 && started + 1 < job.units; started++)
        if (pthread_create(&helpers[started], NULL, worker, &job)) break;
    worker(&job);
    for (int t = 0; t < started; t++) pthread_join(helpers[t], NULL);
    return 0;
}
