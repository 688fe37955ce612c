# cython: language_level=3, boundscheck=False, wraparound=False
"""The scheduler's steps that an interrupt must not split (docs/design.md, "Faults").

A signal handler that raises (Ctrl-C's KeyboardInterrupt, a SIGTERM or SIGALRM
handler) runs in the main thread at its next bytecode, whichever thread the kernel
delivered the signal to: any thread that does not block it (a BLAS pool, a logging
thread, tqdm's monitor), where CPython's C handler only sets a flag.  No signal mask
of one thread keeps the handler out of a section.  So each change of the
scheduler's state that must not be split is one call here: between its first
change and its last it runs no Python bytecode (only C: the ring's methods, and
list, deque, dict, set and attribute operations on objects without Python-level
hooks), and an interrupt lands before it or after it.  The scheduler
(mploader/_scheduler.py) owns the state and decides; these are its steps.
:func:`serial_next`, a face iterator's ``__next__``, carries a batch from the run
to the caller the same way.
"""
from libc.errno cimport EAGAIN
from cpython.bytes cimport PyBytes_AS_STRING

from mploader._protocol cimport write_loop

from mploader._errors import WorkerTraceback


cdef inline _buffer(dict outbox, worker, task, bytes frame):
    """Queue ``frame`` (``task``'s record; None: a RETIRE) on ``worker``'s channel
    (``worker.pending``), which is then in ``outbox`` (the scheduler's channels that
    hold records)."""
    (<list>worker.pending).append((task, frame))
    outbox[worker] = None


def dispatch(sched, run, task, bytes frame, region, retire):
    """Dispatch ``task`` (made from the head of ``run.pushback``; ``frame`` its task
    record) in one step: E1 on ``task.slot`` when it is a slot (``region.assign``,
    which raises SlotStateError before anything changed), ``sched.seq`` past the
    task's, the record buffered on the worker's channel (``sched.outbox``), the task appended to
    ``run.inflight`` and to its worker's ``outstanding``, the head of
    ``run.pushback`` dropped, the worker's ``sent`` counted; ``retire`` (a RETIRE
    record, or None) is buffered after the record and marks the worker retiring."""
    worker = task.worker
    cdef Py_ssize_t slot = task.slot
    if slot >= 0:
        region.assign(slot, task.seq)   # E1
    sched.seq = task.seq + 1
    cdef dict outbox = sched.outbox
    _buffer(outbox, worker, task, frame)
    run.inflight.append(task)
    worker.outstanding.append(task)
    run.pushback.popleft()
    worker.sent += 1
    if retire is not None:
        worker.retiring = True
        _buffer(outbox, worker, None, retire)


def hand_over(sched, task, worker, bytes frame, list items):
    """Give ``task``, whose record ``frame`` (``items[0]``, a dead worker's unsent
    records) never reached its worker, to ``worker`` in one step: the task's worker,
    ``worker.outstanding`` and ``sent``, the record buffered on ``worker``'s channel
    (``sched.outbox``), and ``items[0]`` dropped."""
    task.worker = worker
    worker.outstanding.append(task)
    worker.sent += 1
    _buffer(sched.outbox, worker, task, frame)
    del items[0]


def flush(sched):
    """Send the records buffered on each channel of ``sched.outbox`` (the channels
    that hold records; a channel's ``pending``: ``[(task, frame), ...]``) with one
    non-blocking ``send()`` per channel, and record what was sent in the same step:
    what a full socket did not take stays in the channel's ``pending`` (the tail of
    a record the worker has begun to receive as an item without a task: that task is
    the worker's already), what a closed socket (a dead worker) did not take whole
    goes to its ``unsent``; ``sched.outbox`` keeps the channels that still hold
    records.  The sends release the GIL."""
    cdef dict outbox = sched.outbox
    cdef dict keep = {}
    cdef list items
    cdef bytes data, frame
    cdef const char *p
    cdef Py_ssize_t n, sent, start, end, k
    cdef int fd, err
    sched.outbox = keep
    for worker in outbox:
        items = worker.pending
        if not items:
            if worker.unsent:
                keep[worker] = None
            continue
        data = items[0][1] if len(items) == 1 else b"".join([item[1] for item in items])
        fd = worker.fd
        p = PyBytes_AS_STRING(data)
        n = len(data)
        with nogil:
            err = write_loop(fd, p, n, &sent, True)
        worker.pending = []
        if not err:
            if worker.unsent:
                keep[worker] = None
            continue
        end = 0
        for k in range(len(items)):
            frame = items[k][1]
            start = end
            end = end + len(frame)
            if end > sent:
                if err == EAGAIN:  # (EWOULDBLOCK on Linux)
                    if start >= sent:
                        worker.pending = items[k:]
                    else:
                        worker.pending = [(None, frame[sent - start:])] + items[k + 1:]
                else:
                    (<list>worker.unsent).extend(items[k:])
                break
        if worker.pending or worker.unsent:
            keep[worker] = None


def pull(run, Py_ssize_t n):
    """Append up to ``n`` items of ``run.source`` (the sampler's task stream) to
    ``run.pushback``; returns how many (fewer than ``n``: the source is exhausted).
    Each item is appended in the step that takes it from the source.  An exception
    raised by the source (a handler's KeyboardInterrupt included: the source is
    Python code) is recorded in ``run.source_error`` in the same step, then
    propagates: a generator it passed through is finished, and the run must not
    take the StopIteration that follows for the end of the pass."""
    source = run.source
    pushback = run.pushback
    cdef Py_ssize_t k = 0
    try:
        while k < n:
            item = next(source)
            pushback.append(item)
            k += 1
    except StopIteration:
        pass
    except BaseException as exc:
        run.source_error = exc
        raise
    return k


def hand_off(run, task, value, bint failed, mailbox, side=None):
    """The consume tail in one step: ``run.handoff`` = ``value`` (``failed``: an
    exception that ``next()`` raises -- the worker's, or the reason the batch cannot
    be read), ``task`` consumed and off its worker's ``outstanding``, then the
    batch's message out of ``mailbox`` (the pipe; None for a slot) and the lease out
    of ``task.box`` (E4 when nothing else holds it; last, as a lease's release hook
    may run Python code).  A tagged run (``run.tagged``: the torch and Chainer faces)
    gets ``(worker id, batch index, value, failed, side)`` -- who built which batch,
    as the scheduler knows it, and the batch's side record (``bytes`` or None:
    mploader._face.Face.side) -- and raises nothing: the face decides."""
    if getattr(run, "tagged", False):
        value = (task.worker.wid, task.batch_index, value, failed, side)
        failed = False
    run.handoff = value
    run.failed = failed
    task.consumed = True
    worker = task.worker
    out = worker.outstanding
    if out and out[0] is task:
        out.popleft()
        if worker.done > 0:
            worker.done -= 1
    elif task in out:
        out.remove(task)
        worker.done = 0
    if mailbox is not None:
        (<dict>mailbox).pop(task.seq, None)
    del (<list>task.box)[:]


def follow_pipe(task):
    """``task``'s batch did not fit the region and follows on its worker's pipe (its
    slot holds a PIPE record): in one step the task waits on the pipe from now on and
    the lease leaves ``task.box`` (E4)."""
    task.via_pipe = True
    del (<list>task.box)[:]


def drop_stale(task, pipe_seqs):
    """A stale ``task`` (of an abandoned run) whose batch is there (its lease in
    ``task.box``) or comes by pipe, in one step: its seq joins ``pipe_seqs`` (the
    scheduler's set of pipe messages to drop; None when nothing comes by pipe), the
    task is marked done (``consumed``) and the lease leaves ``task.box`` (E4)."""
    if pipe_seqs is not None:
        (<set>pipe_seqs).add(task.seq)
    task.consumed = True
    del (<list>task.box)[:]


cdef _count(progress):
    """``progress.received()`` (mploader._state.MapProgress) for the next batch in
    order, in C: the prefix ``consumed`` moves past it and past the batches of
    ``ahead`` that follow it (received before a checkpoint with ``in_order=False``),
    in one store; indices it passed stay in ``ahead`` (readers skip them)."""
    consumed = progress.consumed + 1
    ahead = progress.ahead
    if ahead:
        while consumed in ahead:
            consumed += 1
    progress.consumed = consumed


def serial_next(it):
    """A face iterator's ``__next__``: the next batch of ``it._gen`` (a
    :class:`~mploader._run.Run`, an in-process run, or the face's own body) with
    ``it._lock`` held (threads sharing the iterator get each batch once, in order),
    counted in ``it._progress`` (when not None: :func:`_count`).  A batch's own exception
    (its ``__cause__`` a :class:`~mploader._errors.WorkerTraceback`: the dataset's
    or collation's, which used up its batch) is counted there too; any other
    exception goes to ``it._ended(exc)`` first.  Then it propagates.  Written here,
    not in Python: from the run's ``__next__`` to the caller the batch, or the
    exception, passes through C only.  CPython runs pending signal handlers when a
    call returns into Python code (3.10: every call, and every jump; 3.11+: calls of
    C functions, such as a ``with``'s ``__exit__``), and one raising there dropped
    the batch on its way out (or, in ``_ended``, a batch's exception and its count).

    A face whose body is Python code (the torch and Chainer faces) takes each record
    from its run with :func:`take` into its box ``it._held`` (a list) and makes the
    batch from it; the box is emptied here once the body returned the batch, so an
    interrupt anywhere in the body leaves the record in the box, and the next call
    makes the batch from it again (the body's bookkeeping is idempotent per record)."""
    with it._lock:
        try:
            batch = next(it._gen)
        except BaseException as exc:
            progress = it._progress
            if progress is not None and isinstance(exc.__cause__, WorkerTraceback):
                _count(progress)   # (the Gluon face: the torch and Chainer bodies count theirs)
            else:
                it._ended(exc)
            raise
        held = getattr(it, "_held", None)
        if held is not None:
            del (<list>held)[:]
        progress = it._progress
        if progress is not None:
            _count(progress)
        return batch


def take(source, list box, companions=None):
    """``next(source)`` into the empty ``box`` in one step, with the first item of
    ``companions`` (a deque: the Chainer face's planned states, one per task in
    order) after it when given; nothing when ``box`` already holds a record (the
    previous call's body was interrupted: :func:`serial_next`).  Exceptions of
    ``source`` propagate and leave ``box`` empty."""
    if box:
        return
    record = next(source)
    box.append(record)
    if companions is not None:
        box.append(companions.popleft())


def take_pulled(run, list box):
    """An in-process run's next task record into the empty ``box`` in one step
    (nothing when ``box`` holds one): ``run.results`` (a ``queue.SimpleQueue``) is
    what the run's feeder thread pulled from the sampler, one record per token on
    ``run.tokens``; a token is put first unless ``run.asked`` says the one put by
    an interrupted call is still out.  The wait releases the GIL; an interrupt
    there changes nothing but ``run.asked``, and the record it was waiting for is
    the next call's.  The sampler (Python code) runs on the feeder thread, where no
    signal handler runs: an interrupt cannot finish its generator."""
    if box:
        return
    if not run.asked:
        run.tokens.put(None)
        run.asked = True
    record = run.results.get()
    run.asked = False
    box.append(record)


def abandon_runs(sched):
    """Make the batches in flight of the runs superseded or dropped since the last
    call stale, in one step: ``sched.dropped`` lists their weak references (a run's
    death appends its own, a C call), ``sched.runs`` maps each to the run's
    ``inflight`` deque; the tasks of the current ``sched.generation`` not yet
    consumed join ``sched.stale`` (freed by the reaper as they complete) and the
    deque is emptied.  A reference listed twice finds its deque empty."""
    cdef list dropped = sched.dropped
    cdef dict runs = sched.runs
    cdef list stale = sched.stale
    generation = sched.generation
    while dropped:
        inflight = runs.pop(dropped[len(dropped) - 1], None)
        if inflight is not None:
            for t in inflight:
                if t.generation == generation and not t.consumed:
                    t.stale = True
                    stale.append(t)
            inflight.clear()
        dropped.pop()


def adopt(run, staged, generation):
    """A new run takes over the tasks its engine dispatched ahead for it that its own
    pulls asked for (``staged``: the run of the next epoch's first tasks; the head of
    ``run.pushback``: the new run's own pulls), in one step; returns how many.  The
    prefix taken: each pulled task tuple ``==`` the staged task's ``source`` (same
    epoch, batch index and indices; a tuple whose ``==`` is not a plain truth value,
    such as one holding an index array, is taken as different), the staged task of
    the workers' ``generation``, neither stale nor consumed; up to the first that is
    not, or the shorter of the two.  Compared first (the only Python code it may run
    is an item's ``__eq__``, before anything moves), then those tasks move, in order,
    from ``staged.inflight`` to ``run.inflight``, and as many items leave the head of
    ``run.pushback`` (docs/design.md, "No gap between epochs")."""
    src = staged.inflight
    dst = run.inflight
    pushback = run.pushback
    cdef Py_ssize_t n = 0
    for item, task in zip(pushback, src):
        if task.generation != generation or task.stale or task.consumed:
            break
        try:
            if not item == task.source:
                break
        except Exception:   # an elementwise == (arrays): not taken over
            break
        n += 1
    cdef Py_ssize_t k = n
    while k > 0:
        dst.append(src.popleft())
        pushback.popleft()
        k -= 1
    return n
