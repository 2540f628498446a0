/* Products of float32 rows with Q4_0 / Q8_0 / BF16 / F16 matrices, read as the file stores them, and
 * with float32 matrices (a float32 checkpoint's experts: the same prefetched pass, one call per group)
 * (runahead.models.qkernel).
 *
 * y[r, i] = sum_k x[r, k] * w[i, k], w[i, k] = d * q exactly as ggml dequantizes it (d the block's fp16 scale
 * widened to float32, q the block's integer: nibble - 8 for Q4_0, int8 for Q8_0; the product is exact in
 * float32), or the bfloat16 / float16 weight widened to float32 (exact). A half-width matrix is read as
 * 32-weight "blocks" of 64 bytes with no scale. Each weight is formed in registers and used for up to 8
 * rows at once, so no float32 copy of a matrix is ever written. Each output sums its 32-weight blocks in
 * order, eight lanes at a time, then adds the lanes: the same order whatever the other rows, so a row's
 * result does not depend on its batch.
 *
 * One call runs a whole group: segment s multiplies rows [starts[s], stops[s]) of x by the matrix at
 * address weights[s]. Work is split into (segment, 32 outputs) units taken from a shared counter by
 * up to `threads` threads (the caller's and up to threads - 1 started here, one per THREAD_BYTES of
 * weights read: a small product runs on the caller's thread alone).
 *
 * Two bodies of `product`, one contract: with -mavx2 -mfma -mf16c (the loader passes them only on a CPU with
 * all three) the AVX2 intrinsics below; otherwise portable C written so that the compiler vectorizes it for
 * the target's baseline vector unit (NEON on arm64, SSE2 on x86-64): eight float lanes per output, summed
 * in the same tree order as the AVX2 body.
 *
 * Kind 5 (BF16 dot) is a BF16 matrix times rows that are themselves bfloat16 (x holds 2-byte values: a
 * bfloat16 compute's rows), with the CPU's bf16 dot products (VDPBF16PS: each pair's product exact, added
 * in float32 with round-to-nearest-even, subnormals flushed): only in the build with -mavx512bf16 (the
 * loader passes it only on a CPU with AVX-512 F, BW, VL and BF16). Sixteen float lanes per output, each
 * taking two weights of every 32-weight block, summed block after block and then in one tree order: as
 * in the other kinds, a row's result never depends on the rows beside it (but differs in its last bits
 * from kind 2's on widened rows).
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define ROWS 8   /* rows sharing one pass over a matrix row */
#define CHUNK 32 /* outputs per unit of work */

static const int64_t BLOCK_BYTES[6] = {18, 34, 64, 64, 128, 64}; /* bytes per 32 weights, by kind */
#define THREAD_BYTES (4 << 20)                                  /* weights read per thread started */
/* How far ahead of the rows being multiplied their matrix is prefetched into L2. A few-row product reads
 * each weight once and does little with it: without this, one core waits on memory for most of the call
 * (the medium model's bf16 gate|up [1024, 1024] times one row on a Zen 4 core: 0.36 ms from DRAM against
 * 0.11 from L3, 0.15-0.18 from DRAM with this). Into L2, not L1: prefetches into L1 hold the few L1 miss
 * buffers and gained less than half as much (docs/results-torch.md, "The kernel's reads prefetched"). */
#define PREFETCH_BYTES (32 << 10)

/* Rows of a matrix with rows of `stride` bytes that PREFETCH_BYTES spans (at least one). */
static inline int64_t rows_ahead(int64_t stride) { return stride >= PREFETCH_BYTES ? 1 : PREFETCH_BYTES / stride; }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RUNAHEAD_AVX2 1
#endif
#if defined(RUNAHEAD_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define RUNAHEAD_BF16_DOT 1
#endif

typedef struct {
    /* 0: Q4_0 (18-byte blocks), 1: Q8_0 (34-byte blocks), 2: BF16, 3: F16 (64-byte blocks), 4: F32,
     * 5: BF16 times bfloat16 rows (x holds 2-byte values) */
    int kind;
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

static inline __m256 half8(int kind, __m128i h) { /* 8 bfloat16 (kind 2) or float16 (3) -> float32, exact */
    if (kind == 3) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The 32 weights of one block as four vectors of eight float32. */
static inline __attribute__((always_inline)) void block_weights(int kind, const uint8_t *block, __m256 out[4]) {
    if (kind == 4) { /* 32 float32 weights, as they are */
        for (int c = 0; c < 4; c++) out[c] = _mm256_loadu_ps((const float *)block + 8 * c);
        return;
    }
    if (kind >= 2) { /* 32 half-width weights, 8 per load */
        const __m128i *h = (const __m128i *)block;
        for (int c = 0; c < 4; c++) out[c] = half8(kind, _mm_loadu_si128(h + c));
        return;
    }
    uint16_t half;
    memcpy(&half, block, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(half));
    __m128i q0, q1;
    if (kind == 0) { /* weights 0-15: low nibbles, 16-31: high nibbles */
        const __m128i q = _mm_loadu_si128((const __m128i *)(block + 2)), low = _mm_set1_epi8(0x0F);
        q0 = _mm_sub_epi8(_mm_and_si128(q, low), _mm_set1_epi8(8));
        q1 = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_set1_epi8(8));
    } else {
        q0 = _mm_loadu_si128((const __m128i *)(block + 2));
        q1 = _mm_loadu_si128((const __m128i *)(block + 18));
    }
    out[0] = widen(q0, d), out[1] = widen(_mm_srli_si128(q0, 8), d);
    out[2] = widen(q1, d), out[3] = widen(_mm_srli_si128(q1, 8), d);
}

/* Outputs i .. i + outs - 1 of `rows` rows (outs * rows <= 8 accumulators: several outputs at once keep
 * a one- or two-row product from waiting on one accumulator's chain). Each output's sum runs in the
 * same order whatever `rows` and `outs` are. */
static inline __attribute__((always_inline)) void outputs(int kind, const uint8_t *w, const float *x, float *y,
                                                          const int rows, int64_t n, int64_t k, int64_t i,
                                                          const int outs) {
    const int64_t blocks = k / 32, block_bytes = BLOCK_BYTES[kind], stride = blocks * block_bytes;
    const uint8_t *ahead = w + rows_ahead(stride) * stride; /* never dereferenced: prefetches do not fault */
    __m256 acc[4][ROWS];
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++) acc[o][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * 32;
        for (int o = 0; o < outs; o++) {
            __m256 wv[4];
            _mm_prefetch((const char *)(ahead + (i + o) * stride + b * block_bytes), _MM_HINT_T1);
            block_weights(kind, w + (i + o) * stride + b * block_bytes, wv);
            for (int r = 0; r < rows; r++) {
                const float *xr = xb + r * k;
                __m256 a = acc[o][r];
                for (int c = 0; c < 4; c++) a = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(xr + 8 * c), a);
                acc[o][r] = a;
            }
        }
    }
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++) y[r * n + i + o] = lane_sum(acc[o][r]);
}

#ifdef RUNAHEAD_BF16_DOT
/* Kind 5: outputs i .. i + outs - 1 of `rows` bfloat16 rows (x: 2-byte values, stride k) times a BF16
 * matrix, with VDPBF16PS; the lanes of each output summed in one order whatever `rows` and `outs`. */
static inline __attribute__((always_inline)) void dot_outputs(const uint8_t *w, const uint16_t *x, float *y,
                                                              const int rows, int64_t n, int64_t k, int64_t i,
                                                              const int outs) {
    const int64_t blocks = k / 32, stride = blocks * 64;
    const uint8_t *ahead = w + rows_ahead(stride) * stride; /* never dereferenced: prefetches do not fault */
    __m512 acc[4][ROWS];
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++) acc[o][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *xb = x + b * 32;
        for (int o = 0; o < outs; o++) {
            _mm_prefetch((const char *)(ahead + (i + o) * stride + b * 64), _MM_HINT_T1);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (i + o) * stride + b * 64);
            for (int r = 0; r < rows; r++)
                acc[o][r] = _mm512_dpbf16_ps(acc[o][r], wv, (__m512bh)_mm512_loadu_si512(xb + r * k));
        }
    }
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++) {
            const __m512 a = acc[o][r];
            const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
            y[r * n + i + o] = lane_sum(_mm256_add_ps(_mm512_castps512_ps256(a), high));
        }
}
#endif

#define RUN(ROWS_, OUTS_)                                                                                   \
    for (; i + (OUTS_) <= i1; i += (OUTS_)) outputs(kind, w, x, y, ROWS_, n, k, i, OUTS_);                  \
    for (; i < i1; i++) outputs(kind, w, x, y, ROWS_, n, k, i, 1);                                          \
    return;
#define DOT(ROWS_, OUTS_)                                                                                   \
    for (; i + (OUTS_) <= i1; i += (OUTS_)) dot_outputs(w, rows16, y, ROWS_, n, k, i, OUTS_);               \
    for (; i < i1; i++) dot_outputs(w, rows16, y, ROWS_, n, k, i, 1);                                       \
    return;

/* The body for `rows` rows: outputs a few at a time where the rows are few (1-2 rows: 4 outputs at once,
 * 3-4 rows: 2), so each pass keeps up to 8 accumulators busy. */
#define BY_ROWS(BODY)                                                                                       \
    switch (rows) {                                                                                         \
    case 1: BODY(1, 4)                                                                                      \
    case 2: BODY(2, 4)                                                                                      \
    case 3: BODY(3, 2)                                                                                      \
    case 4: BODY(4, 2)                                                                                      \
    case 5: BODY(5, 1)                                                                                      \
    case 6: BODY(6, 1)                                                                                      \
    case 7: BODY(7, 1)                                                                                      \
    default: BODY(8, 1)                                                                                     \
    }

/* Outputs [i0, i1) of `rows` (<= ROWS) rows x (stride k) into y (stride n), matrix w. */
static void product(int kind, const uint8_t *w, const float *x, float *y, int rows, int64_t n, int64_t k,
                    int64_t i0, int64_t i1) {
    int64_t i = i0;
#ifdef RUNAHEAD_BF16_DOT
    if (kind == 5) {
        const uint16_t *rows16 = (const uint16_t *)(const void *)x;
        BY_ROWS(DOT)
    }
#endif
    BY_ROWS(RUN)
}
#undef RUN
#undef DOT
#undef BY_ROWS
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

static inline float bfloat_to_float(uint16_t h) { /* bfloat16 is float32's top half: exact */
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void product(int kind, const uint8_t *w, const float *x, float *y, int rows, int64_t n, int64_t k,
                    int64_t i0, int64_t i1) {
    const int64_t blocks = k / 32, block_bytes = BLOCK_BYTES[kind], ahead = rows_ahead(blocks * block_bytes);
    for (int64_t i = i0; i < i1; i++) {
        float acc[ROWS][8];
        memset(acc, 0, sizeof acc);
        const uint8_t *block = w + i * blocks * block_bytes;
        for (int64_t b = 0; b < blocks; b++, block += block_bytes) {
            __builtin_prefetch(block + ahead * blocks * block_bytes, 0, 2); /* into L2, as the AVX2 body */
            float wb[32];
            uint16_t half;
            if (kind == 4) { /* 32 float32 weights, as they are */
                memcpy(wb, block, sizeof wb);
            } else if (kind >= 2) { /* 32 half-width weights, no scale */
                for (int j = 0; j < 32; j++) {
                    memcpy(&half, block + 2 * j, 2);
                    wb[j] = kind == 3 ? half_to_float(half) : bfloat_to_float(half);
                }
            } else {
                memcpy(&half, block, 2);
                const float d = half_to_float(half);
                if (kind == 0) { /* weights 0-15: low nibbles, 16-31: high nibbles */
                    for (int j = 0; j < 16; j++) {
                        wb[j] = d * (float)((int)(block[2 + j] & 0x0F) - 8);
                        wb[j + 16] = d * (float)((int)(block[2 + j] >> 4) - 8);
                    }
                } else {
                    for (int j = 0; j < 32; j++) wb[j] = d * (float)(int8_t)block[2 + j];
                }
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
        const int64_t row_bytes = job->k * (job->kind == 5 ? 2 : 4); /* bfloat16 rows, or float32 ones */
        for (int64_t r = job->starts[s]; r < job->stops[s]; r += ROWS) {
            const int rows = job->stops[s] - r < ROWS ? (int)(job->stops[s] - r) : ROWS;
            const float *x = (const float *)(const void *)((const uint8_t *)job->x + r * row_bytes);
            product(job->kind, w, x, job->y + r * job->n, rows, job->n, job->k, i0, i1);
        }
    }
}

/* y [P, n] = each segment's rows of x [P, k] times its matrix [n, k]; returns 0, or -1 on bad arguments. */
int runahead_grouped_product(int kind, const float *x, float *y, int64_t n, int64_t k, int64_t segments,
                             const int64_t *weights, const int64_t *starts, const int64_t *stops,
                             int threads) {
#ifdef RUNAHEAD_BF16_DOT
    const int kinds = 6;
#else
    const int kinds = 5; /* kind 5 only where the CPU's bf16 dot products are built in */
#endif
    if (kind < 0 || kind >= kinds || k % 32 || n <= 0 || segments < 0) return -1;
    work_t job = {kind, x, y, n, k, segments, (n + CHUNK - 1) / CHUNK, 0, weights, starts, stops, 0};
    job.units = job.segments * job.units_per_segment;
    /* A helper thread costs tens to hundreds of microseconds to start (more where an idle vCPU must be
     * woken): start one only per THREAD_BYTES of weights to read (rows past 8 read them again). */
    int64_t bytes = 0;
    for (int64_t s = 0; s < segments; s++)
        bytes += n * (k / 32) * BLOCK_BYTES[kind] * ((stops[s] - starts[s] + ROWS - 1) / ROWS);
    if (threads > 1 + bytes / THREAD_BYTES) threads = (int)(1 + bytes / THREAD_BYTES);
    pthread_t helpers[64];
    int started = 0;
    for (; started < threads - 1 && started < 64 && started + 1 < job.units; started++)
        if (pthread_create(&helpers[started], NULL, worker, &job)) break;
    worker(&job);
    for (int t = 0; t < started; t++) pthread_join(helpers[t], NULL);
    return 0;
}
