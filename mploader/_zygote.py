"""A warm zygote: the process that spawn and forkserver workers are forked from.

One zygote per parent process, started when the first loader whose workers come
from it is constructed (:func:`warm_for_loader`; at the latest at its first worker,
or earlier by :func:`warm`): a fresh interpreter (``sys.executable``, the parent's
``sys.path``), single-threaded, that imports NumPy, mploader's worker modules (not
torch: the torch face's workers import it only at need), and -- before each fork --
the modules the loader's dataset, ``fetch`` and ``worker_init`` come from (torch
among them where they need it).  It never runs user code
besides those imports.

* The parent asks for a worker over a ``SOCK_SEQPACKET`` socket: one message, the
  worker's :class:`~mploader._worker.WorkerBoot` pickled, its descriptors (task
  socket, region memfd, spec memfd, busy cells, lifeline, status pipe) passed with
  ``SCM_RIGHTS`` (:func:`socket.send_fds`).  The zygote forks and replies with the
  pid; the child unpickles the spec from its memfd (:mod:`mploader._spec`) and runs
  the worker loop (:func:`mploader._worker.spawn_main`).  A start costs a fork of a
  small process: milliseconds, with no import and no unpickling of the dataset's
  arrays, and the workers of one loader initialise in parallel.
* The zygote is the workers' parent, so it reaps them and writes each one's wait
  status (4 bytes) into that worker's status pipe, whose read end the loader's
  process holds (:class:`ZygoteChild`, the ``process`` of a
  :class:`~mploader._channel.Channel`).  The pipe reads EOF without a status
  only if the zygote died before the worker: the status is then unknown.
* The zygote goes away with its parent: it polls a pidfd of the parent (or, where
  pidfd_open is refused, its socket, which reads EOF when the parent is gone) and
  then SIGKILLs the workers it still has and exits.  The workers also watch the
  parent themselves (:func:`mploader._ring.watch_parent`).
* Before each fork the zygote looks at the files of the user's modules it imported
  (:class:`_Sources`); one that changed since (edited, reloaded in a notebook) makes
  it refuse the start, and the parent starts a new zygote, which imports the files
  as they are, as a spawned child would (:func:`_retire`).
* ``MPLOADER_ZYGOTE=0`` in the environment turns it off: spawn and forkserver
  workers are then started by ``multiprocessing`` (a true spawn: a new interpreter
  per worker).

docs/design.md, "Workers", and docs/faces.md say how this differs from
``multiprocessing``'s spawn.
"""
from __future__ import annotations

import errno
import importlib
import io
import json
import multiprocessing.connection
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from . import _fds, _rng_state, _spec
from ._errors import UNKNOWN_STATUS, ExitStatus

#: The environment variable that turns the zygote off ("0").
ENV = "MPLOADER_ZYGOTE"
_STATUS = struct.Struct("<i")
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 16
#: Seconds the parent waits for the zygote's reply (its start included: importing
#: torch on a busy machine takes seconds).
REPLY_TIMEOUT_S = 120.0


def enabled() -> bool:
    """Whether spawn/forkserver workers come from the zygote (``MPLOADER_ZYGOTE`` is not "0")."""
    return os.environ.get(ENV, "1").strip() != "0"


# ---- the parent's side --------------------------------------------------------------

class ZygoteChild:
    """The parent's handle on the exit status of a worker the zygote forked, read
    from its status pipe (``sentinel``): the ``process`` of a ``Channel``,
    with ``multiprocessing.Process``'s ``join``/``exitcode``/``pid``.
    ``exit_status``: the :class:`~mploader._errors.ExitStatus` once known."""

    def __init__(self, pid: int, status_fd: int) -> None:
        self.pid = pid
        self.sentinel = status_fd
        self.exit_status: ExitStatus | None = None

    @property
    def exitcode(self) -> int | None:
        s = self.exit_status
        if s is None or (s.exitcode is None and s.signal is None):
            return None
        return s.exitcode if s.exitcode is not None else -(s.signal or 0)

    def join(self, timeout: float | None = None) -> None:
        if self.exit_status is not None:
            return
        try:
            if timeout is not None:
                ready = select.poll()
                ready.register(self.sentinel, select.POLLIN)
                if not ready.poll(max(0, int(timeout * 1000))):
                    return
            data = os.read(self.sentinel, _STATUS.size)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EINTR):
                return
            data = b""  # closed here: treat as ended, status unknown
        if len(data) == _STATUS.size:
            self.exit_status = ExitStatus.from_wait_status(_STATUS.unpack(data)[0])
        else:  # EOF: the zygote died before reporting, and the worker has exited
            self.exit_status = UNKNOWN_STATUS

    def is_alive(self) -> bool:
        self.join(0)
        return self.exit_status is None

    def close(self) -> None:
        """(``multiprocessing.Process.close``) Nothing to release: the status pipe
        belongs to the ``Channel`` (its ``pidfd``)."""


class _Zygote:
    """This process's zygote (None until started; a forked child starts its own).
    ``inside``: this process is a zygote, or a worker it forked.  ``booting``: this
    process is a zygote, or a worker it forked that has not unpacked its spec yet:
    its imports run user modules, and it starts no zygote (:func:`_start`)."""

    pid = -1
    proc: subprocess.Popen | None = None
    sock: socket.socket | None = None
    lock = threading.Lock()
    seq = 0                     # the number of the last request
    inside = False
    booting = False
    inherited: list[subprocess.Popen] = []   # the zygotes of the processes this one was forked from
    # Zygotes replaced because a module they imported changed on disk (_retire): each
    # exits once the workers it forked have exited; their sockets are closed then.
    retired: list[tuple[subprocess.Popen, socket.socket]] = []
    rng_switch: str | None = None   # MPLOADER_RNG_FALLBACK when the zygote checked the RNG layout
    importing_main = False          # this zygote imports the parent's main script now (_import_main)


def _after_fork_in_child() -> None:
    # A forked child of the parent must not hold the parent's end of the socket: the
    # zygote would not see EOF when the parent dies.  (Not closed through the socket
    # object: another thread of the parent may have been using it.)
    sock = _Zygote.sock
    # The parent's Popen of its zygote is kept, unused: dropped, its __del__ would warn
    # that the zygote "is still running" (a ResourceWarning in every forked worker
    # under -X dev) and queue it for a waitpid that is not this child's to make.
    if _Zygote.proc is not None:
        _Zygote.inherited.append(_Zygote.proc)
    retired, _Zygote.retired = _Zygote.retired, []
    _Zygote.inherited += [proc for proc, _ in retired]
    _Zygote.sock, _Zygote.proc, _Zygote.pid = None, None, -1
    _Zygote.lock = threading.Lock()
    for held in [sock, *(s for _, s in retired)]:
        if held is not None:
            try:
                os.close(held.detach())
            except OSError:
                pass


os.register_at_fork(after_in_child=_after_fork_in_child)


def _preload(extra: Iterable[str] = ()) -> list[str]:
    """What a new zygote imports: NumPy, the torch face's worker module where this
    process uses the torch face (it imports torch only at need), and ``extra``.  Not
    torch itself, even where this process imported it: a NumPy dataset's workers never
    need it (1.2 s of the first loader's start, issue 27); a loader whose dataset,
    ``collate_fn`` or ``worker_init_fn`` comes from a module that imports torch, or
    whose pickle names torch, has it imported before its workers are forked."""
    mods = ["numpy"]
    if "mploader.torch" in sys.modules:
        mods.append("mploader._torch_worker")
    return mods + [m for m in extra if m not in mods]


def _start(extra: Iterable[str] = ()) -> None:
    """Start this process's zygote (the caller holds the lock), preloading ``extra``
    modules besides NumPy and mploader's (:func:`_preload`).

    Raises
    ------
    RuntimeError
        This process is a zygote, or one of its workers still unpacking its spec
        (``_Zygote.booting``), as ``multiprocessing``'s spawn refuses a start in a
        child that has not finished its bootstrapping phase: a module that iterates
        a spawn or forkserver loader when it is imported, imported there to find
        the dataset's class, would otherwise start a zygote that imports it again,
        without end (tests/test_zygote.py::test_a_module_iterating_a_loader_at_import_fails_once).
    """
    if _Zygote.booting:
        raise RuntimeError(
            "a spawn or forkserver loader was iterated while mploader's zygote or a new worker "
            "imported the module that defines it (as multiprocessing's spawn refuses a start before "
            "the process has finished its bootstrapping phase): iterate loaders in a function or "
            "under `if __name__ == '__main__':`, not when a module is imported")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        ours_fd = _fds.off_stdio(ours.detach())
        theirs_fd = _fds.off_stdio(theirs.detach())
    except BaseException:
        ours.close()
        theirs.close()
        raise
    sock = socket.socket(fileno=ours_fd)
    try:
        path = [p for p in sys.path if isinstance(p, str)]  # (each request brings the whole of it)
        boot = json.dumps({"path": path, "argv": [a for a in sys.argv if isinstance(a, str)], "parent": os.getpid(),
                           "fd": theirs_fd, "preload": _preload(extra)})
        code = ("import sys, json; a = json.loads(sys.argv[1]); sys.path[:] = a['path']; "
                "from mploader._zygote import main; main(a)")
        args = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", code, boot]  # type: ignore[attr-defined]
        with _fds.stdio_reserved():
            proc = subprocess.Popen(args, pass_fds=[theirs_fd], stdin=subprocess.DEVNULL, close_fds=True)
    except BaseException:
        sock.close()
        os.close(theirs_fd)
        raise
    os.close(theirs_fd)
    _Zygote.proc, _Zygote.sock, _Zygote.pid = proc, sock, os.getpid()


def _ensure(extra: Iterable[str] = ()) -> socket.socket:
    if _Zygote.pid == os.getpid() and _Zygote.proc is not None and _Zygote.proc.poll() is None:
        assert _Zygote.sock is not None
        return _Zygote.sock
    if _Zygote.sock is not None and _Zygote.pid == os.getpid():
        _Zygote.sock.close()
    _Zygote.sock = None
    if _Zygote.proc is not None and _Zygote.pid == os.getpid():
        _Zygote.proc.wait()  # (it died: reap it)
    _start(extra)
    assert _Zygote.sock is not None
    return _Zygote.sock


def warm(modules: Iterable[str] = ()) -> None:
    """Start this process's zygote now, if it is not running (it then preloads NumPy,
    mploader's worker modules and ``modules`` while this process goes on); a no-op
    where the zygote is turned off.

    Raises
    ------
    OSError
        The interpreter could not be started (no process, no descriptor).
    """
    if not enabled():
        return
    with _Zygote.lock:
        _ensure(modules)


def loader_start_method(context: Any) -> str:
    """The start method of a loader's ``multiprocessing_context``: a name, a context
    (``get_start_method()``), or None for ``multiprocessing``'s default -- the method
    set with ``set_start_method``, else the platform's default (the first of
    ``get_all_start_methods()``; read without fixing it, so the user may still set it)."""
    if context is None:
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if isinstance(context, str):
        return context
    return str(context.get_start_method())


def warm_for_loader(context: Any, num_workers: int, objects: Iterable[Any] = ()) -> bool:
    """A loader is constructed: start this process's zygote now if the loader's
    workers will come from it (``num_workers > 0`` under spawn or forkserver, see
    :func:`loader_start_method`), so that its imports (torch: about a second) overlap
    what the user does between constructing the loader and its first ``iter()``.
    The zygote then also preloads the modules that ``objects`` (the dataset,
    ``collate_fn``, ``worker_init_fn``; None is skipped), their classes or those
    classes' bases come from, ``__main__`` excepted, as it would before the first
    worker (a dataset class defined in a script, on torch's ``Dataset``: torch).

    Returns whether a zygote is running now.  Never raises for the zygote's start: a
    start that fails here (no process or descriptor left) is tried again, and
    reported, at the first worker's start.
    """
    if num_workers <= 0 or not enabled() or _Zygote.inside:
        # (inside a zygote: a module it preloads that builds a loader at import must
        # not start a zygote of the zygote, and so on)
        return False
    try:
        method = loader_start_method(context)
    except (AttributeError, TypeError, ValueError):
        return False   # torch's own validation of the context reports it
    if method not in ("spawn", "forkserver"):
        return False
    modules = []
    for obj in objects:
        if obj is None:
            continue
        named = [getattr(obj, "__module__", None)]   # a function's
        named += [getattr(cls, "__module__", None) for cls in type(obj).__mro__]   # its class's and their bases'
        for m in named:
            if isinstance(m, str) and m not in ("__main__", "builtins") and m not in modules:
                modules.append(m)
    try:
        warm(modules)
    except OSError:
        return False
    return zygote_pid() is not None


def end_boot() -> None:
    """A worker forked from the zygote has unpacked its spec: from now on its user code
    (``worker_init_fn``, the dataset) may start loaders of its own, whose spawn and
    forkserver workers come from a zygote of this worker's."""
    _Zygote.booting = False


def zygote_pid() -> int | None:
    """The pid of this process's zygote, None if none is running."""
    proc = _Zygote.proc
    if proc is None or _Zygote.pid != os.getpid() or proc.poll() is not None:
        return None
    return proc.pid


class _FdPickler(pickle.Pickler):
    """Pickles a boot, its descriptors (``_fds.PassedFd``, Connections) as indices
    into the list of descriptors passed beside it."""

    def __init__(self, file: Any, fds: list[int]) -> None:
        super().__init__(file, protocol=5)
        self.fds = fds

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _fds.PassedFd):
            self.fds.append(obj.fd)
            return ("fd", len(self.fds) - 1)
        if isinstance(obj, multiprocessing.connection.Connection):
            self.fds.append(obj.fileno())
            return ("conn", len(self.fds) - 1)
        return None


class _FdUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, fds: list[int]) -> None:
        super().__init__(file)
        self.fds = fds

    def persistent_load(self, pid: Any) -> Any:
        kind, k = pid
        if kind == "fd":
            return self.fds[k]
        if kind == "conn":
            return multiprocessing.connection.Connection(self.fds[k])
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def start_worker(boot: Any, modules: frozenset[str], name: str) -> ZygoteChild:
    """Fork a worker from this process's zygote (started if needed) with ``boot``
    (its descriptors as ``_fds.PassedFd``/Connections, duplicated into the worker)
    after the zygote has imported ``modules``.  Returns its :class:`ZygoteChild`.

    Raises
    ------
    OSError
        The zygote could not be started, or died while starting the worker (the
        message says which, with its exit status).
    """
    status_r, status_w = _fds.pipe()
    try:
        fds: list[int] = []
        f = io.BytesIO()
        _FdPickler(f, fds).dump(boot)
        # The worker's stdout and stderr are this process's now, as a spawned child's
        # are (a logger may have redirected fd 1 or 2 since the zygote started).  Only
        # where this interpreter has that standard stream: in one started without it (a
        # daemon), a file opened later may sit at fd 1 or 2, and no worker's print may
        # reach it (the worker keeps the zygote's /dev/null, see _start).
        stdio = [fd for fd, stream in ((1, sys.__stdout__), (2, sys.__stderr__))
                 if stream is not None and _fds.is_open(fd)]
        fds += stdio
        fds.append(status_w)
        # The zygote reads the outer record; only the worker unpickles the boot (the
        # zygote never holds objects that own the passed descriptors).
        # (the spec names __main__ and only the main script itself defines it: _spec.MAIN)
        main = _spec.main_preparation() if _spec.MAIN in modules else {}
        message = pickle.dumps((sorted(modules - {_spec.MAIN}), sys.path, list(sys.argv), os.getcwd(),
                                dict(os.environ), name, stdio, main, f.getvalue()),
                               protocol=5)
        with _Zygote.lock:
            kind, value = pickle.loads(_ask(message, fds))
            if kind == "stale":
                # A module the zygote imported changed on disk since (edited, then
                # perhaps reloaded here: a notebook's autoreload).  A spawned child
                # imports the file as it is now: so does a new zygote.
                _retire()
                kind, value = pickle.loads(_ask(message, fds))
        os.close(status_w)
        status_w = -1
        if kind != "ok":
            raise OSError(errno.ECHILD, f"the zygote could not start {name}: {value}")
        return ZygoteChild(int(value), status_r)
    except BaseException:
        os.close(status_r)
        if status_w >= 0:
            os.close(status_w)
        raise


def _ask(message: bytes, fds: list[int]) -> bytes:
    """Send one request, return the zygote's reply to it.

    Each request carries a number that the reply repeats: a reply left unread by a
    request that was interrupted (Ctrl-C while waiting) is skipped, never taken for
    this one's.  A zygote found dead before the request is sent is replaced; one that
    dies after it was sent fails this start (the worker it may have forked sees its
    task socket close and exits), it is not asked twice."""
    _Zygote.seq += 1
    seq = _Zygote.seq
    if _Zygote.retired:
        _prune_retired()
    for attempt in (0, 1):
        sock = _ensure()
        try:
            socket.send_fds(sock, [struct.pack("<Q", seq) + message], fds)
        except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as exc:
            proc = _Zygote.proc
            code = proc.wait() if proc is not None else None
            if attempt:
                raise OSError(errno.ECHILD, f"the zygote died before it could start a worker (exit status "
                                            f"{code})") from exc
            continue
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            ready = select.poll()
            ready.register(sock, select.POLLIN)
            if not ready.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"the zygote (pid {zygote_pid()}) did not answer within {REPLY_TIMEOUT_S} s")
            try:
                reply = sock.recv(_MAX_MESSAGE)
            except (BrokenPipeError, ConnectionResetError):
                reply = b""
            if not reply:
                proc = _Zygote.proc
                code = proc.wait() if proc is not None else None
                raise OSError(errno.ECHILD, f"the zygote died while starting a worker (exit status {code})")
            if struct.unpack_from("<Q", reply)[0] == seq:
                return reply[8:]
    raise AssertionError("unreachable")


def _retire() -> None:
    """The running zygote reported a module changed on disk: the next request starts a
    new one.  The old one starts no more workers and exits once those it forked have
    exited (their exit statuses still reach their status pipes); it is reaped, and
    its socket closed, at the next request (:func:`_prune_retired`).  The caller
    holds the lock."""
    if _Zygote.proc is not None and _Zygote.sock is not None and _Zygote.pid == os.getpid():
        _Zygote.retired.append((_Zygote.proc, _Zygote.sock))
    _Zygote.proc = _Zygote.sock = None


def _prune_retired() -> None:
    """Reap the retired zygotes that have exited and close their sockets."""
    keep = []
    for proc, sock in _Zygote.retired:
        if proc.poll() is None:
            keep.append((proc, sock))
        else:
            sock.close()
    _Zygote.retired = keep


# ---- the zygote's side --------------------------------------------------------------

def main(args: dict) -> None:
    """The zygote's main loop (runs in the process :func:`_start` made)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _Zygote.inside = True   # before the preloads (warm_for_loader); its workers inherit it
    _Zygote.booting = True  # for good here; a worker clears it once it has its spec (end_boot)
    parent = int(args["parent"])
    sys.argv = list(args["argv"])   # the parent's, for the preloads (see _fork_worker)
    sock = socket.socket(fileno=int(args["fd"]))
    for mod in ["numpy", "mploader._worker", "mploader._spec", "cloudpickle", *args["preload"]]:
        _try_import(mod)
    from . import _worker

    sources = _Sources()
    sources.watch()

    # The RNG layout check (``mploader._rng_state``: 1.4 ms of CPU and ~290 page copies
    # in each worker's first batch, issue 27) is done once here and inherited by the
    # workers, as by forked ones; a worker whose environment sets the switch otherwise
    # checks again (_fork_worker).
    _Zygote.rng_switch = os.environ.get(_rng_state.FORCE_ENV)
    _rng_state._calibrate()

    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    signal.set_wakeup_fd(wake_w)
    # The thread that started this process may have blocked SIGCHLD (a signal mask
    # survives fork and exec): its workers' deaths would never wake this loop, and the
    # loader would wait for its timeout.  Each worker gets the mask back.
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    try:
        parent_fd = os.pidfd_open(parent) if hasattr(os, "pidfd_open") else -1
    except OSError:
        parent_fd = -1
    if os.getppid() != parent:  # the parent died while this process started
        os._exit(0)
    children: dict[int, int] = {}   # pid -> the write end of its status pipe
    retiring = False   # a module changed on disk: no more workers, exit once the last one has
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    if parent_fd >= 0:
        poller.register(parent_fd, select.POLLIN)
    while True:
        if retiring and not children:   # (after a reap, or right after the refusal)
            os._exit(0)
        try:
            events = poller.poll()
        except InterruptedError:
            continue
        fds_ready = {fd for fd, _ in events}
        if wake_r in fds_ready:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        _reap(children)
        if parent_fd in fds_ready or (parent_fd < 0 and os.getppid() != parent):
            _die(children)
        if sock.fileno() in fds_ready:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
            except OSError:
                msg, fds = b"", []
            if not msg:
                _die(children)
            seq, msg = msg[:8], msg[8:]
            pid_or_error = _fork_worker(msg, fds, sock, wake_r, wake_w, parent_fd, children, _worker, mask, sources)
            try:
                sock.send(seq + pickle.dumps(pid_or_error))
            except OSError:  # the parent is gone
                _die(children)
            if pid_or_error[0] == "stale":
                retiring = True


class _Sources:
    """The files of the modules this zygote imported outside the interpreter's own
    directories (the standard library, site-packages): the user's modules, editable
    installs included, with each file's modification time (ns) and size when first
    seen.  A spawned child imports these files as they are when it starts; a worker
    forked from here would run the code this zygote imported, however long ago.  So
    before each fork :meth:`changed` looks at them again, and one that changed (edited,
    e.g. in a notebook with autoreload) makes this zygote refuse the start: the parent
    starts a new one (``_retire``)."""

    def __init__(self) -> None:
        import sysconfig

        dirs: set[str] = set()
        for key in ("stdlib", "platstdlib", "purelib", "platlib"):
            path = sysconfig.get_paths().get(key)
            if path:   # as named and as resolved (a module's __file__ is usually the former)
                dirs.update(os.path.join(p, "") for p in (os.path.abspath(path), os.path.realpath(path)))
        self.system = tuple(dirs)
        self.seen: set[str] = set()
        self.files: dict[str, tuple[int, int]] = {}

    def watch(self) -> None:
        """Note the files of the modules imported since the last call."""
        for name, module in list(sys.modules.items()):
            if name in self.seen:
                continue
            self.seen.add(name)
            path = getattr(module, "__file__", None)
            if not isinstance(path, str) or path.startswith(self.system):
                continue
            real = os.path.realpath(path)
            if real in self.files or real.startswith(self.system):
                continue
            try:
                st = os.stat(real)
            except OSError:   # (inside a zip, say: not watched)
                continue
            self.files[real] = (st.st_mtime_ns, st.st_size)

    def changed(self) -> str | None:
        """The first watched file that changed or went away, said in words; None if none."""
        for path, (mtime, size) in self.files.items():
            try:
                st = os.stat(path)
            except OSError:
                return f"{path} is gone"
            if (st.st_mtime_ns, st.st_size) != (mtime, size):
                return f"{path} changed on disk"
        return None


def _import_main(main: dict[str, str]) -> None:
    """Import the parent's main script (or ``-m`` module) as ``__mp_main__``, aliased
    ``__main__``, as a spawned child does (``multiprocessing.spawn.prepare``, which
    this calls): once per zygote, whose workers inherit it, as forkserver's server
    preloads it.  Only for a spec that names ``__main__`` and that cloudpickle could not
    pickle by value (:data:`mploader._spec.MAIN`).  A script that starts a loader's
    workers while it is imported so (no ``if __name__ == "__main__":`` guard) gets
    :func:`importing_main_error`, as spawn's children raise theirs."""
    import multiprocessing.spawn

    _Zygote.importing_main = True
    try:
        multiprocessing.spawn.prepare(main)
    finally:
        _Zygote.importing_main = False


def importing_main_error() -> RuntimeError | None:
    """The error for starting workers while the zygote imports the main script
    (:func:`_import_main`), or None."""
    if not _Zygote.importing_main:
        return None
    return RuntimeError(
        "mploader: the main script started a loader's workers while the zygote imported it as "
        "__mp_main__ (the dataset, collate_fn or worker_init_fn is defined in it and could not be "
        "pickled by value, so the workers import the script, as spawn's children do).  Guard the "
        "script's entry point with `if __name__ == \"__main__\":`, as spawn and forkserver require")


def _try_import(mod: str) -> None:
    if mod in sys.modules:
        return
    try:
        importlib.import_module(mod)
    except BaseException:  # noqa: BLE001 - the worker imports it again and reports the error
        pass


def _reap(children: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = children.pop(pid, -1)
        if fd >= 0:
            try:
                os.write(fd, _STATUS.pack(status))
            except OSError:
                pass
            os.close(fd)


def _die(children: dict[int, int]) -> None:
    """The parent is gone: so are its workers and this process."""
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)


def _set_environ(env: dict[str, str]) -> None:
    """Make ``os.environ`` (and the C environment) ``env``, changing only what
    differs: where nothing does (the common case), nothing is written, so no page
    inherited from the zygote is copied (a clear and refill cost each worker about
    150 page copies and 0.55 ms of CPU, issue 27)."""
    current = dict(os.environ)
    if current == env:
        return
    for key in current.keys() - env.keys():
        del os.environ[key]
    for key, value in env.items():
        if current.get(key) != value:
            os.environ[key] = value


def _fork_worker(msg: bytes, fds: list[int], sock: socket.socket, wake_r: int, wake_w: int, parent_fd: int,
                 children: dict[int, int], worker: Any, mask: Any, sources: _Sources) -> tuple[str, Any]:
    try:
        modules, path, argv, cwd, env, name, stdio, main, boot_bytes = pickle.loads(msg)
        # The imports below run user modules: they see the parent's sys.path, sys.argv
        # and working directory, as a spawned child's do (multiprocessing.spawn.prepare):
        # a module that parses sys.argv or opens a relative path at import works.
        if path != sys.path:
            sys.path[:] = path
        sys.argv = argv
        if cwd != os.getcwd():
            os.chdir(cwd)
        if main:
            _import_main(main)
        for mod in modules:
            _try_import(mod)
        sources.watch()
        changed = sources.changed()
    except BaseException as exc:  # noqa: BLE001 - told to the parent
        for fd in fds:
            os.close(fd)
        return ("error", f"{type(exc).__name__}: {exc}")
    if changed is not None:   # the parent starts a new zygote (_retire) and asks it
        for fd in fds:
            os.close(fd)
        return ("stale", changed)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the worker
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for fd in (wake_r, wake_w, parent_fd, sock.detach(), *children.values()):
                if fd >= 0:
                    os.close(fd)
            children.clear()
            # the parent's stdout/stderr, passed after the boot's own descriptors
            for target, fd in zip(stdio, fds[-1 - len(stdio):-1]):
                os.dup2(fd, target)
                os.close(fd)
            _set_environ(env)   # (the working directory was set before the imports)
            if env.get(_rng_state.FORCE_ENV) != _Zygote.rng_switch:
                _rng_state.recheck()
            boot = _FdUnpickler(io.BytesIO(boot_bytes), fds).load()
            worker.spawn_main(None, boot, end_boot)  # never returns
        except BaseException:  # noqa: BLE001 - the start failed: say why, exit 1
            import traceback

            traceback.print_exc()
        finally:
            os._exit(1)
    for fd in fds[:-1]:
        os.close(fd)
    children[pid] = fds[-1]   # the status pipe's write end
    return ("ok", pid)
