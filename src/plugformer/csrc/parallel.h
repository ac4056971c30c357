/* The thread split shared by the native kernels: included after the source's `Work` type, whose `first` and `last`
 * (int64_t) bound the range one thread takes. POSIX threads, no OpenMP runtime, so no second thread pool beside
 * torch's. The cache key of a build hashes this header with the source (`plugformer.native.library_path`). */
#ifndef PLUGFORMER_PARALLEL_H
#define PLUGFORMER_PARALLEL_H

#include <pthread.h>
#include <stdint.h>

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

#endif
