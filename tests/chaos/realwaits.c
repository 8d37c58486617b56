/* Preloaded before libfaketime into the chaos run's pollers and workers (tests/chaos/clock.py).
 *
 * libfaketime 0.9.10 (Debian 12) mistimes waits on the monotonic clock when it is left real
 * (FAKETIME_DONT_FAKE_MONOTONIC): clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME) fails with EINVAL
 * (libfaketime issue 426; Python 3.11's time.sleep), and pthread_cond_timedwait, which CPython's GIL
 * waits with, wakes up to 0.2 s late (a thread hand-off's p99 0.19 s instead of 0.1 ms), so a
 * threaded worker ran at a seventh of its speed.  These two go to glibc's own functions: a wait on
 * the monotonic clock is then exact, and one on the wall clock waits for the real wall clock to reach
 * a deadline computed from the faked one, as a process whose clock was really stepped does.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>

static void *libc_function(const char *name, const char *version) {
    void *libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    return libc ? dlvsym(libc, name, version) : NULL;
}

int pthread_cond_timedwait(pthread_cond_t *cond, pthread_mutex_t *mutex, const struct timespec *abstime) {
    static int (*real)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
    if (!real) real = libc_function("pthread_cond_timedwait", "GLIBC_2.3.2");
    return real(cond, mutex, abstime);
}

int clock_nanosleep(clockid_t clock, int flags, const struct timespec *request, struct timespec *remain) {
    static int (*real)(clockid_t, int, const struct timespec *, struct timespec *);
    if (!real) real = libc_function("clock_nanosleep", "GLIBC_2.17");
    return real(clock, flags, request, remain);
}
