/* A stand-alone check of runahead/models/qkernel.c, for builds this machine cannot run natively (the
 * portable body as compiled for arm64/NEON, run under qemu-user): see bench/qkernel-cross.sh.
 *
 * Random Q4_0 and Q8_0 matrices (block scales are fp16 values drawn across the whole range, subnormals
 * included), random float32 rows; runahead_grouped_product over several segments, with 1 and 3 threads,
 * against a float64 reference that decodes the scales with the compiler's own _Float16. Passes when every
 * output is within 4e-6 of sum |x| |w| (float32 rounding of the sum) and a row computed alone equals it
 * computed in its batch, bit for bit. Prints the worst relative error; exits non-zero on a failure.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int runahead_grouped_product(int kind, const float *x, float *y, int64_t n, int64_t k, int64_t segments,
                             const int64_t *weights, const int64_t *starts, const int64_t *stops, int threads);

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) { /* xorshift64* */
    state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
    return (uint32_t)((state * 0x2545F4914F6CDD1Dull) >> 32);
}
static float uniform(void) { return (float)next() / 4294967296.0f * 2.0f - 1.0f; }

static double scale_of(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, 2);
    return (double)h;
}

static double weight(int kind, const uint8_t *w, int64_t k, int64_t i, int64_t j) {
    const int64_t block_bytes = kind == 0 ? 18 : 34;
    const uint8_t *block = w + (i * (k / 32) + j / 32) * block_bytes;
    uint16_t bits;
    memcpy(&bits, block, 2);
    const int64_t t = j % 32;
    const int q = kind == 0 ? (t < 16 ? (block[2 + t] & 0x0F) : (block[2 + t - 16] >> 4)) - 8 : (int8_t)block[2 + t];
    return scale_of(bits) * q;
}

static int check(int kind, int threads) {
    enum { N = 72, K = 128, P = 21, S = 3 };
    const int64_t block_bytes = kind == 0 ? 18 : 34, bytes = N * (K / 32) * block_bytes;
    uint8_t *mats[S];
    int64_t addresses[S], starts[S] = {0, 1, 12}, stops[S] = {1, 12, P};
    for (int s = 0; s < S; s++) {
        mats[s] = malloc(bytes);
        for (int64_t b = 0; b < bytes; b++) mats[s][b] = (uint8_t)next();
        for (int64_t blk = 0; blk < N * (K / 32); blk++) { /* finite scales: exponent 0..29 (subnormals too) */
            uint16_t bits = (uint16_t)((next() & 0x83FFu) | ((next() % 30u) << 10));
            memcpy(mats[s] + blk * block_bytes, &bits, 2);
        }
        addresses[s] = (int64_t)(intptr_t)mats[s];
    }
    float *x = malloc(sizeof(float) * P * K), *y = malloc(sizeof(float) * P * N), alone[N];
    for (int i = 0; i < P * K; i++) x[i] = uniform();
    if (runahead_grouped_product(kind, x, y, N, K, S, addresses, starts, stops, threads)) return 1;
    double worst = 0;
    int failures = 0;
    for (int s = 0; s < S; s++)
        for (int64_t r = starts[s]; r < stops[s]; r++)
            for (int64_t i = 0; i < N; i++) {
                double want = 0, size = 0;
                for (int64_t j = 0; j < K; j++) {
                    const double wj = weight(kind, mats[s], K, i, j);
                    want += x[r * K + j] * wj, size += fabs(x[r * K + j] * wj);
                }
                const double error = size > 0 ? fabs(y[r * N + i] - want) / size : fabs(y[r * N + i]);
                worst = error > worst ? error : worst;
                failures += !(error <= 4e-6);
            }
    const int64_t one[1] = {0}, row[1] = {1}, mat[1] = {addresses[1]};
    if (runahead_grouped_product(kind, x + 5 * K, alone, N, K, 1, mat, one, row, threads)) return 1;
    const int same = memcmp(alone, y + 5 * N, sizeof alone) == 0;
    printf("%s, %d thread(s): worst error %.2e of sum|x||w|, %d outside 4e-6, row alone %s\n",
           kind == 0 ? "Q4_0" : "Q8_0", threads, worst, failures, same ? "identical" : "DIFFERS");
    for (int s = 0; s < S; s++) free(mats[s]);
    free(x), free(y);
    return failures || !same;
}

int main(void) {
    int failed = 0;
    for (int kind = 0; kind < 2; kind++)
        for (int threads = 1; threads <= 3; threads += 2) failed |= check(kind, threads);
    puts(failed ? "FAILED" : "passed");
    return failed;
}
