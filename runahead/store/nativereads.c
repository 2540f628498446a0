/* Expert reads on C threads that never take Python's GIL (runahead/store/native.py).

   A pool of threads takes jobs from a queue. A job is one expert: a plan (built once per expert by
   native.py, see PLAN below) and the address of the slot it fills. Each run of the plan is read with
   pread into the thread's aligned buffer (the whole aligned superset of the run where the file is
   opened O_DIRECT), or, for a run with file -1, taken from memory at the address the plan gives (the
   host store's image); then each part of the run is copied into the slot, converting its type where
   the slot's differs from the file's. A finished job goes on a list of completions; the first one
   after the list was drained writes one byte to a pipe, which the event loop watches, and the loop
   takes every completion at once (runahead_reads_drain). So a read costs the loop one callback per
   batch and nothing else: no Python thread takes the GIL while reads land.

   PLAN (int64): nruns, then per run: file, offset, nbytes, nparts, then per part:
   conversion (CONV_*), byte offset in the run, byte offset in the slot, bytes in the file.

   A job may carry a time on CLOCK_MONOTONIC before which it may not complete (the store's link cap,
   runahead.store.LinkCap): the thread that read it sleeps until then, so the read lands once, when
   the link would have carried it, to the tens of microseconds the kernel wakes a thread in, where
   the event loop's timers count whole milliseconds.

   Completions are (id, status, detail, landed): status 0, or an errno of a read, or STATUS_SHORT
   where the file ended before the run did; detail: the failed run's index in the plan; landed: when
   the job ended (CLOCK_MONOTONIC nanoseconds, after any wait for its time), so the loop, which may
   drain it much later (busy computing a group), knows when the link carried it.

   Threads never allocate: runahead_reads_submit grows the queue and the completion list (under the
   lock) so both hold every job submitted and not yet drained. */

#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#ifdef __F16C__
#include <immintrin.h>
#endif

enum { CONV_COPY = 0, CONV_BF16_F32 = 1, CONV_F16_F32 = 2, CONV_F32_BF16 = 3 };
enum { STATUS_SHORT = -1 };

typedef struct {
    int64_t id;
    const int64_t *plan;
    char *slot;
    int64_t until_ns; /* CLOCK_MONOTONIC nanoseconds before which it may not complete; 0: none */
} job_t;

typedef struct {
    int64_t id, status, detail, landed_ns;
} done_t;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t work;
    job_t *queue;
    int64_t head, queued, capacity; /* a ring of `capacity` jobs; `queued` from `head` */
    done_t *done;
    int64_t finished;    /* completions not yet drained */
    int64_t outstanding; /* jobs submitted and not yet drained */
    int signalled;       /* a byte is in the pipe for completions not yet drained */
    int closing;
    int wake_fd;
    int nthreads;
    pthread_t *threads;
    int nfiles;
    int *fds;
    int *direct;
    int64_t alignment, buffer_size;
    int64_t io_bytes;
} pool_t;

typedef uint16_t u16_any __attribute__((aligned(1), may_alias)); /* a run's bytes sit at any offset */
typedef uint32_t u32_any __attribute__((aligned(1), may_alias));

static uint32_t f16_bits_to_f32_bits(uint32_t h) {
    /* The half's exponent and mantissa shifted into a float's are its value times 2^-112, for normal
       and subnormal halves alike (exact: a power of two); infinities and NaNs keep every bit. */
    uint32_t magnitude = (h & 0x7fffu) << 13, sign = (h & 0x8000u) << 16;
    float scaled;
    uint32_t bits;
    memcpy(&scaled, &magnitude, 4);
    scaled *= 0x1p112f;
    memcpy(&bits, &scaled, 4);
    return sign | ((h & 0x7c00u) == 0x7c00u ? 0x7f800000u | magnitude : bits);
}

/* Copy `nbytes` of the file's type from `src` into `dst` in the slot's type. The loops are written
   for the compiler to vectorise (-O3): float32 -> bfloat16 rounds to nearest even, as torch does,
   and turns a NaN into 0x7fc0 (torch's own scalar and vector paths give NaNs other payloads). */
static void convert(int64_t conv, char *dst, const char *src, int64_t nbytes) {
    int64_t i, n;
    switch (conv) {
    case CONV_BF16_F32: {
        const u16_any *s = (const u16_any *)src;
        u32_any *d = (u32_any *)dst;
        for (i = 0, n = nbytes / 2; i < n; i++) d[i] = (uint32_t)s[i] << 16;
        break;
    }
    case CONV_F16_F32: {
        const u16_any *s = (const u16_any *)src;
        u32_any *d = (u32_any *)dst;
        i = 0, n = nbytes / 2;
#ifdef __F16C__ /* the CPU's exact conversion, eight at a time */
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps((float *)(dst + 4 * i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; i++) d[i] = f16_bits_to_f32_bits(s[i]);
        break;
    }
    case CONV_F32_BF16: {
        const u32_any *s = (const u32_any *)src;
        u16_any *d = (u16_any *)dst;
        for (i = 0, n = nbytes / 4; i < n; i++) {
            uint32_t b = s[i];
            uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
            d[i] = (uint16_t)((int32_t)(b & 0x7fffffffu) > 0x7f800000 ? 0x7fc0u : rounded);
        }
        break;
    }
    default:
        memcpy(dst, src, (size_t)nbytes);
    }
}

/* Run one job with `buffer` (aligned, buffer_size bytes); returns its status, *detail as above. */
static int64_t run_job(pool_t *pool, char *buffer, const job_t *job, int64_t *detail) {
    const int64_t *p = job->plan;
    int64_t nruns = *p++;
    for (int64_t r = 0; r < nruns; r++) {
        int64_t file = p[0], offset = p[1], nbytes = p[2], nparts = p[3];
        const char *src;
        p += 4;
        if (file < 0) {
            src = (const char *)(intptr_t)offset;
        } else {
            int fd = __atomic_load_n(&pool->fds[file], __ATOMIC_ACQUIRE);
            int direct = __atomic_load_n(&pool->direct[file], __ATOMIC_ACQUIRE);
            int64_t a = pool->alignment;
            int64_t start = direct ? offset - offset % a : offset;
            int64_t stop = direct ? (offset + nbytes + a - 1) / a * a : offset + nbytes;
            int64_t need = offset + nbytes - start, got = 0;
            if (stop - start > pool->buffer_size) {
                *detail = r;
                return ENOBUFS;
            }
            while (got < need) {
                ssize_t n = pread(fd, buffer + got, (size_t)(stop - start - got), (off_t)(start + got));
                if (n < 0) {
                    if (errno == EINTR) continue;
                    *detail = r;
                    return errno;
                }
                if (n == 0) break;
                got += n;
            }
            __atomic_add_fetch(&pool->io_bytes, got, __ATOMIC_RELAXED);
            if (got < need) {
                *detail = r;
                return STATUS_SHORT;
            }
            src = buffer + (offset - start);
        }
        for (int64_t k = 0; k < nparts; k++, p += 4) convert(p[0], job->slot + p[2], src + p[1], p[3]);
    }
    return 0;
}

/* Sleep until CLOCK_MONOTONIC reads `until_ns`. */
static void sleep_until(int64_t until_ns) {
    struct timespec at = {(time_t)(until_ns / 1000000000), (long)(until_ns % 1000000000)};
#ifdef __linux__
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, NULL) == EINTR) {
    }
#else /* no absolute sleep: a relative one, again until the time has come */
    for (;;) {
        struct timespec now, left;
        clock_gettime(CLOCK_MONOTONIC, &now);
        int64_t rest = (int64_t)(at.tv_sec - now.tv_sec) * 1000000000 + (at.tv_nsec - now.tv_nsec);
        if (rest <= 0) break;
        left.tv_sec = (time_t)(rest / 1000000000);
        left.tv_nsec = (long)(rest % 1000000000);
        nanosleep(&left, NULL);
    }
#endif
}

static void *serve(void *arg) {
    pool_t *pool = arg;
    char *buffer = NULL;
#ifdef __linux__
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL); /* a paced read wakes on time, not up to 50 us late */
#endif
    size_t align = pool->alignment > 4096 ? (size_t)pool->alignment : 4096; /* a page at least */
    if (posix_memalign((void **)&buffer, align, (size_t)pool->buffer_size)) buffer = NULL;
    for (;;) {
        pthread_mutex_lock(&pool->lock);
        while (pool->queued == 0 && !pool->closing) pthread_cond_wait(&pool->work, &pool->lock);
        if (pool->queued == 0) {
            pthread_mutex_unlock(&pool->lock);
            break;
        }
        job_t job = pool->queue[pool->head];
        pool->head = (pool->head + 1) % pool->capacity;
        pool->queued--;
        pthread_mutex_unlock(&pool->lock);

        int64_t detail = 0, status = buffer ? run_job(pool, buffer, &job, &detail) : ENOMEM;
        if (status == 0 && job.until_ns > 0) sleep_until(job.until_ns); /* a failed read lands at once */

        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        int64_t landed_ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
        pthread_mutex_lock(&pool->lock);
        pool->done[pool->finished++] = (done_t){job.id, status, detail, landed_ns};
        int wake = !pool->signalled;
        pool->signalled = 1;
        pthread_mutex_unlock(&pool->lock);
        if (wake) {
            char byte = 1;
            while (write(pool->wake_fd, &byte, 1) < 0 && errno == EINTR) {
            }
        }
    }
    free(buffer);
    return NULL;
}

static void release(pool_t *pool) { /* the pool's memory (its lock and condition are the caller's) */
    free(pool->queue);
    free(pool->done);
    free(pool->fds);
    free(pool->direct);
    free(pool->threads);
    free(pool);
}

/* A pool of `nthreads` readers over `nfiles` descriptors; completions wake `wake_fd`. NULL on failure. */
void *runahead_reads_open(int nthreads, int nfiles, const int *fds, const int *direct, int64_t alignment,
                          int64_t buffer_size, int wake_fd) {
    pool_t *pool = calloc(1, sizeof(pool_t));
    if (!pool) return NULL;
    pool->nthreads = nthreads;
    pool->nfiles = nfiles;
    pool->alignment = alignment;
    pool->buffer_size = buffer_size;
    pool->wake_fd = wake_fd;
    pool->capacity = 64;
    pool->queue = malloc(sizeof(job_t) * (size_t)pool->capacity);
    pool->done = malloc(sizeof(done_t) * (size_t)pool->capacity);
    pool->fds = malloc(sizeof(int) * (size_t)(nfiles > 0 ? nfiles : 1));
    pool->direct = malloc(sizeof(int) * (size_t)(nfiles > 0 ? nfiles : 1));
    pool->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    if (!pool->queue || !pool->done || !pool->fds || !pool->direct || !pool->threads) goto fail;
    memcpy(pool->fds, fds, sizeof(int) * (size_t)nfiles);
    memcpy(pool->direct, direct, sizeof(int) * (size_t)nfiles);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->work, NULL);
    for (int i = 0; i < nthreads; i++) {
        if (pthread_create(&pool->threads[i], NULL, serve, pool)) {
            pthread_mutex_lock(&pool->lock);
            pool->closing = 1;
            pthread_cond_broadcast(&pool->work);
            pthread_mutex_unlock(&pool->lock);
            for (int k = 0; k < i; k++) pthread_join(pool->threads[k], NULL);
            goto fail;
        }
    }
    return pool;
fail:
    release(pool);
    return NULL;
}

/* Queue expert job `id`: `plan` into `slot`, completing no earlier than `until_ns` (CLOCK_MONOTONIC;
   0: as soon as it is read). 0, or -1 once the pool is closing, or ENOMEM. */
int runahead_reads_submit(void *handle, int64_t id, const int64_t *plan, char *slot, int64_t until_ns) {
    pool_t *pool = handle;
    pthread_mutex_lock(&pool->lock);
    if (pool->closing) {
        pthread_mutex_unlock(&pool->lock);
        return -1;
    }
    if (pool->outstanding == pool->capacity) { /* grow both: every undrained job has room in each */
        int64_t grown = 2 * pool->capacity;
        job_t *queue = malloc(sizeof(job_t) * (size_t)grown);
        done_t *done = realloc(pool->done, sizeof(done_t) * (size_t)grown);
        if (done) pool->done = done;
        if (!queue || !done) {
            free(queue);
            pthread_mutex_unlock(&pool->lock);
            return ENOMEM;
        }
        for (int64_t i = 0; i < pool->queued; i++) queue[i] = pool->queue[(pool->head + i) % pool->capacity];
        free(pool->queue);
        pool->queue = queue;
        pool->head = 0;
        pool->capacity = grown;
    }
    pool->queue[(pool->head + pool->queued) % pool->capacity] = (job_t){id, plan, slot, until_ns};
    pool->queued++;
    pool->outstanding++;
    pthread_cond_signal(&pool->work);
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

/* Move up to `most` completions into `out` (id, status, detail, landed_ns quadruples); returns how many. */
int64_t runahead_reads_drain(void *handle, int64_t *out, int64_t most) {
    pool_t *pool = handle;
    pthread_mutex_lock(&pool->lock);
    int64_t n = pool->finished < most ? pool->finished : most;
    memcpy(out, pool->done, sizeof(done_t) * (size_t)n);
    memmove(pool->done, pool->done + n, sizeof(done_t) * (size_t)(pool->finished - n));
    pool->finished -= n;
    pool->outstanding -= n;
    if (pool->finished == 0) pool->signalled = 0; /* the next completion writes to the pipe again */
    pthread_mutex_unlock(&pool->lock);
    return n;
}

/* Point file `file` at descriptor `fd` (a buffered reopen after O_DIRECT was refused). */
void runahead_reads_set_file(void *handle, int file, int fd, int direct) {
    pool_t *pool = handle;
    __atomic_store_n(&pool->direct[file], direct, __ATOMIC_RELEASE);
    __atomic_store_n(&pool->fds[file], fd, __ATOMIC_RELEASE);
}

/* Bytes read from files, alignment padding included. */
int64_t runahead_reads_io_bytes(void *handle) {
    return __atomic_load_n(&((pool_t *)handle)->io_bytes, __ATOMIC_RELAXED);
}

/* Refuse new jobs, let the queued ones run, join the threads. Completions stay to be drained. */
void runahead_reads_close(void *handle) {
    pool_t *pool = handle;
    pthread_mutex_lock(&pool->lock);
    pool->closing = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->nthreads; i++) pthread_join(pool->threads[i], NULL);
}

/* Free a closed pool. */
void runahead_reads_free(void *handle) {
    pool_t *pool = handle;
    pthread_mutex_destroy(&pool->lock);
    pthread_cond_destroy(&pool->work);
    release(pool);
}
