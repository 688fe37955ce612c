/*
 * mploader ring: per-process helpers -- the cached pid, descriptors kept off the
 * standard streams, pidfd_open, and the parent watch.  See ring.h.
 */
#define _GNU_SOURCE
#include "ring.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

/* ---- descriptors ---- */

int mpl_fd_off_stdio(int fd) {
    if (fd < 0 || fd > 2)
        return fd;
    /* A process started with fds 0..2 closed (daemon(3), some schedulers) hands
     * them out first: a print would then write into the ring or a pipe. */
    int hi = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    int e = errno;
    close(fd);
    errno = e;
    return hi;
}

int mpl_pidfd_open(pid_t pid) {
    /* Test switch: simulate a seccomp filter that refuses pidfd_open (older Docker
     * default profiles answer EPERM, a kernel before 5.3 ENOSYS). */
    const char *refuse = getenv("MPLOADER_TEST_REFUSE_PIDFD");
    if (refuse != NULL && refuse[0] != '\0') {
        errno = strcmp(refuse, "EPERM") == 0 ? EPERM : ENOSYS;
        return -1;
    }
    int fd = (int)syscall(SYS_pidfd_open, pid, 0); /* O_CLOEXEC is implied */
    if (fd < 0)
        return -1;
    return mpl_fd_off_stdio(fd);
}

int mpl_pidfd_refused(int err) { return err == ENOSYS || err == EPERM || err == EACCES; }

/* ---- parent watch ---- */

typedef struct watch_arg {
    int fd;           /* a pidfd, or (lifeline) the read end of the parent's pipe */
    int lifeline;     /* 1: fd is a pipe; EOF or POLLHUP means the parent is gone */
    pid_t parent_pid; /* lifeline: also gone once getppid() no longer returns it */
    int check_ppid;   /* lifeline: the parent was our parent when the watch began */
} watch_arg;

/* Lifeline mode: 1 if the parent is gone, after `revents` on its pipe. */
static int lifeline_gone(int fd, short revents) {
    if (revents & (POLLERR | POLLNVAL))
        return 1; /* cannot watch: act as gone */
    if (revents & POLLIN) {
        char buf[64];
        ssize_t n = read(fd, buf, sizeof buf); /* the parent never writes: bytes are ignored */
        return n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN);
    }
    return (revents & POLLHUP) != 0;
}

static void *watch_parent_thread(void *argp) {
    watch_arg a = *(watch_arg *)argp;
    free(argp);
    struct pollfd p = {.fd = a.fd, .events = POLLIN, .revents = 0};
    /* A lifeline's write end may also be held by some other forked child of the
     * parent (not exec'd, so O_CLOEXEC did not drop it); re-parenting shows the
     * parent's exit then, within the 250 ms poll period. */
    int period_ms = a.lifeline && a.check_ppid ? 250 : -1;
    for (;;) {
        int n = poll(&p, 1, period_ms);
        if (n > 0 && (!a.lifeline || lifeline_gone(a.fd, p.revents)))
            break; /* pidfd POLLIN: the process exited (or POLLNVAL/POLLERR: cannot watch; act as gone) */
        if (n == 0 && a.check_ppid && getppid() != a.parent_pid)
            break;
        if (n < 0 && errno != EINTR)
            break;
    }
    kill(getpid(), SIGKILL);
    _exit(1); /* not reached */
}

int mpl_watch_parent(pid_t parent_pid, int lifeline_fd) {
    watch_arg a = {.fd = mpl_pidfd_open(parent_pid), .lifeline = 0, .parent_pid = parent_pid, .check_ppid = 0};
    if (a.fd < 0) {
        if (errno == ESRCH)
            _exit(1); /* already gone and reaped */
        if (!mpl_pidfd_refused(errno) || lifeline_fd < 0)
            return MPL_ESYS;
        /* pidfd_open refused (seccomp, old kernel): the lifeline, a system call no
         * filter refuses.  Our own duplicate: the caller closes its copy. */
        a.fd = fcntl(lifeline_fd, F_DUPFD_CLOEXEC, 3);
        if (a.fd < 0)
            return MPL_ESYS;
        a.lifeline = 1;
        a.check_ppid = getppid() == parent_pid;
    }
    struct pollfd p = {.fd = a.fd, .events = POLLIN, .revents = 0};
    if (poll(&p, 1, 0) > 0 && (!a.lifeline || lifeline_gone(a.fd, p.revents)))
        _exit(1); /* already exited (a zombie not reaped yet; lifeline: its pipe is closed) */
    watch_arg *arg = malloc(sizeof *arg);
    if (arg == NULL) {
        close(a.fd);
        errno = ENOMEM;
        return MPL_ESYS;
    }
    *arg = a;
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
        rc = pthread_create(&t, &attr, watch_parent_thread, arg);
        pthread_attr_destroy(&attr);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        free(arg);
        close(a.fd);
        errno = rc;
        return MPL_ESYS;
    }
    return MPL_OK;
}
