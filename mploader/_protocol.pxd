# What mploader/_protocol.pyx shares with other Cython modules (cimport): the write
# loop behind write_all and send_upto, for the scheduler's flush step
# (mploader/_steps.pyx), which sends and records what was sent in one C call.

cdef int write_loop(int fd, const char *p, Py_ssize_t n, Py_ssize_t *done, bint nonblocking) noexcept nogil
    # Write n bytes from p to fd, continuing writes cut short (a full pipe, a signal);
    # done[0] = the bytes written.  nonblocking: send(MSG_DONTWAIT | MSG_NOSIGNAL) on a
    # socket (stops at EAGAIN once it is full), else a blocking write().
    # On success returns 0; on failure the failing call's errno (done[0] says how far).
