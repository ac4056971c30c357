/* The thread split shared by the native kernels: included after the source's `Work` type, whose `first` and `last`
 * (int64_t) bound the range one thread takes. Built with OpenMP (`plugformer.native`'s first choice of flags), the
 * ranges run on the OpenMP runtime's threads: torch's own pool where torch loaded libgomp.so.1 (its Linux wheels do),
 * the soname this library asks for. Threads of our own would share the cores with torch's workers, which spin for a
 * while after each of torch's parallel regions: at N = 512, one call of the band's forward took 5.2 ms on 1 thread,
 * 5.8 ms on 2 of our threads after a matmul, 2.8 ms on torch's pool. Without OpenMP, POSIX threads. The cache key of
 * a build hashes this header with the source (`plugformer.native.library_path`). */
#ifndef PLUGFORMER_PARALLEL_H
#define PLUGFORMER_PARALLEL_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>

/* Splits [0, total) into at most `threads` ranges of `base`, one per thread of the OpenMP team; returns 0. */
static int parallel(Work base, int64_t total, int threads, void *(*body)(void *)) {
    if (threads > total) threads = (int)total;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        Work work = base;
        work.first = total * t / count;
        work.last = total * (t + 1) / count;
        body(&work);
    }
    return 0;
}

#else
#include <pthread.h>

#define MAX_THREADS 256

/* Splits [0, total) into `threads` ranges of `base`, runs the first on the calling thread; returns 0, or -1 if a
 * thread could not be started (its range is then run on the calling thread: the result is the same). */
static int parallel(Work base, int64_t total, int threads, void *(*body)(void *)) {
    Work work[MAX_THREADS];
    pthread_t handles[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads > total) threads = (int)total;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    for (int t = 0; t < threads; t++) {
        work[t] = base;
        work[t].first = total * t / threads;
        work[t].last = total * (t + 1) / threads;
        if (t > 0) started[t] = pthread_create(&handles[t], NULL, body, &work[t]) == 0;
    }
    body(&work[0]);
    int status = 0;
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(handles[t], NULL);
        } else {
            body(&work[t]);
            status = -1;
        }
    }
    return status;
}

#endif /* _OPENMP */

#endif
