/*
 * mploader ring: per-process helpers -- the cached pid and the parent watch.
 * See ring.h.
 */
#define _GNU_SOURCE
#include "ring.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 /* same number on every architecture */
#endif

/* ---- cached pid ---- */

/* Relaxed everywhere: the value is only ever this process's own pid, written by
 * this process (pid_init, or the atfork child handler that runs before fork()
 * returns in the child, when the child has a single thread). */
static _Atomic pid_t g_pid;
static pthread_once_t g_pid_once = PTHREAD_ONCE_INIT;

static void pid_after_fork(void) { atomic_store_explicit(&g_pid, getpid(), memory_order_relaxed); }

static void pid_init(void) {
    atomic_store_explicit(&g_pid, getpid(), memory_order_relaxed);
    (void)pthread_atfork(NULL, NULL, pid_after_fork);
}

pid_t mpl_self_pid(void) {
    pthread_once(&g_pid_once, pid_init);
    return atomic_load_explicit(&g_pid, memory_order_relaxed);
}

/* ---- parent watch ---- */

static void *watch_parent_thread(void *arg) {
    int pfd = (int)(intptr_t)arg;
    struct pollfd p = {.fd = pfd, .events = POLLIN, .revents = 0};
    for (;;) {
        int n = poll(&p, 1, -1);
        if (n > 0)
            break; /* POLLIN: the process exited (or POLLNVAL/POLLERR: cannot watch; act as gone) */
        if (n < 0 && errno != EINTR)
            break;
    }
    kill(getpid(), SIGKILL);
    _exit(1); /* not reached */
}

int mpl_watch_parent(pid_t parent_pid) {
    int pfd = (int)syscall(SYS_pidfd_open, parent_pid, 0); /* O_CLOEXEC is implied */
    if (pfd < 0) {
        if (errno == ESRCH)
            _exit(1); /* already gone and reaped */
        return MPL_ESYS;
    }
    struct pollfd p = {.fd = pfd, .events = POLLIN, .revents = 0};
    if (poll(&p, 1, 0) > 0)
        _exit(1); /* already exited (a zombie not reaped yet) */
    /* The watcher thread inherits a full signal mask: signals meant for the worker
     * (SIGINT, SIGTERM handlers) are never delivered to it. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_t t;
    int rc = pthread_attr_init(&attr);
    if (rc == 0) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        rc = pthread_create(&t, &attr, watch_parent_thread, (void *)(intptr_t)pfd);
        pthread_attr_destroy(&attr);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        close(pfd);
        errno = rc;
        return MPL_ESYS;
    }
    return MPL_OK;
}
