"""What a test may not leave behind, counted over this process tree only.

A :class:`Snapshot` records, without a garbage collection (cheap: ~1 ms):

* ``children``: this process's descendants (``/proc/<pid>/task/<tid>/children`` from this
  process down; psutil's ``children(recursive=True)`` where the kernel lacks it),
  less multiprocessing's per-process helper daemons (:func:`mp_helpers`);
* ``fds``: this process's open descriptors (``/proc/self/fd``), each as its
  ``readlink`` target and the inode it refers to, less the helpers' descriptors;
* ``maps``: the shared files this process maps (``/proc/self/maps`` lines naming a
  ``memfd:`` or a ``/dev/shm/`` file), as ``(device, inode) -> path``; a region that
  grows keeps its inode, a leaked region stays mapped after its fd is closed;
* ``shm``: the entries of ``/dev/shm`` and, separately, the names this process
  registered with multiprocessing's resource tracker (shared memory, semaphores) and
  did not unregister.

``after.leaks(before)`` names what is new.  ``/dev/shm`` is shared with every process
on the machine (a shared CI runner has other jobs' semaphores there), so a new entry
is blamed on the test only if this process tree made it: this process holds it open
or mapped, registered it with the resource tracker, or its name carries, as a
``_``/``.``/``-`` separated token, the pid of this process or of a child seen in
either snapshot (torch's ``torch_<pid>_...``).  An entry that another process makes
and removes, or keeps, is never counted.

multiprocessing's helpers (the resource tracker, the fork server, the resource
sharer's listener thread, the shared heap's arenas) and mploader's zygote (the parent
of spawn/forkserver workers, mploader/_zygote.py) are made on first use and live until
the interpreter exits, by design: they are recognised by the pid, descriptors and
inodes recorded for them, wherever in a test they start.  Their children are not:
a worker the zygote forked and nobody stopped is a leaked grandchild.
"""
from __future__ import annotations

import gc
import os
import re
import sys
from typing import Any

import psutil

SHM_DIR = "/dev/shm"
_TOKEN = re.compile(r"[_.\-]")


def mp_helpers() -> tuple[set[int], set[int], set[int]]:
    """``(pids, fds, inodes)`` of multiprocessing's per-process helpers now in this
    process tree, which live until the interpreter exits by design: the resource
    tracker (its pid, the pipe to it), the fork server (its pid, its "alive" pipe), the
    resource sharer (its listening socket), the shared heap's arenas behind
    ``multiprocessing.Value``/``Array`` (kept for reuse; each file is open twice and
    mapped, told by its inode), and mploader's zygote (its pid, its socket).  Only
    modules already imported are looked at (importing them starts nothing)."""
    pids: set[int] = set()
    fds: set[int] = set()
    inodes: set[int] = set()
    rt = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    fs = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    rs = getattr(sys.modules.get("multiprocessing.resource_sharer"), "_resource_sharer", None)
    heap = getattr(getattr(sys.modules.get("multiprocessing.heap"), "BufferWrapper", None), "_heap", None)
    for pid, fd in ((getattr(rt, "_pid", None), getattr(rt, "_fd", None)),
                    (getattr(fs, "_forkserver_pid", None), getattr(fs, "_forkserver_alive_fd", None))):
        if pid is not None:
            pids.add(pid)
        if fd is not None:
            fds.add(fd)
    zygote = getattr(sys.modules.get("mploader._zygote"), "_Zygote", None)  # mploader's own, one per process
    if zygote is not None and zygote.pid == os.getpid():
        if zygote.proc is not None:
            pids.add(zygote.proc.pid)
        if zygote.sock is not None and zygote.sock.fileno() >= 0:
            fds.add(zygote.sock.fileno())
    listener = getattr(getattr(rs, "_listener", None), "_listener", None)
    sock = getattr(listener, "_socket", None)
    if sock is not None and sock.fileno() >= 0:
        fds.add(sock.fileno())
    for arena in list(getattr(heap, "_arenas", ())):
        try:
            inodes.add(os.fstat(arena.fd).st_ino)
        except (AttributeError, OSError):  # closed, or not a file-backed arena
            pass
    return pids, fds, inodes


#: Linux's per-thread list of children (CONFIG_PROC_CHILDREN): walking this process's
#: own tree costs ~50 us; psutil's children() reads every process on the machine (~2 ms
#: with 120 processes, and a shared runner has thousands).
_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _descendants() -> set[int]:
    if not _PROC_CHILDREN:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    out: set[int] = set()
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone meanwhile
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            todo.extend(k for k in kids if k not in out)
            out.update(kids)
    return out


def child_pids() -> set[int]:
    """This process's descendants (zombies included), less multiprocessing's helper daemons."""
    return _descendants() - mp_helpers()[0]


def open_fds() -> dict[int, tuple[str, int]]:
    """``{fd: (readlink target, inode)}`` of this process's descriptors, less the
    helper daemons'.  The inode tells apart two memfds with the same name."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        path = f"/proc/self/fd/{name}"
        try:
            out[int(name)] = (os.readlink(path), os.stat(path).st_ino)
        except OSError:  # the fd listdir itself used, or one closed meanwhile by another thread
            pass
    _, helper_fds, helper_inodes = mp_helpers()
    return {fd: t for fd, t in out.items() if fd not in helper_fds and t[1] not in helper_inodes}


def shared_mappings() -> dict[tuple[str, int], str]:
    """``{(device, inode): path}`` of the memfds and ``/dev/shm`` files this process maps
    (less multiprocessing's heap arenas)."""
    out = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and ("memfd:" in parts[5] or parts[5].startswith(SHM_DIR + "/")):
                out[(parts[3], int(parts[4]))] = parts[5].strip()
    helper_inodes = mp_helpers()[2]
    return {key: path for key, path in out.items() if key[1] not in helper_inodes}


def memfd_mappings() -> list[str]:
    """Paths of the distinct memfds this process maps (the ring's region, busy cells)."""
    return sorted(p for p in shared_mappings().values() if "memfd:" in p)


def shm_entries() -> set[str]:
    """The names in ``/dev/shm`` (every process's: compare only through :meth:`Snapshot.leaks`)."""
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


# ---- names this process registers with multiprocessing's resource tracker ----

#: ``/dev/shm`` entries of the shared memory and semaphores this process registered
#: and has not unregistered (filled once :func:`record_mp_names` ran).
_registered: set[str] = set()


def _entry(name: str, rtype: str) -> str | None:
    name = name.lstrip("/")
    return {"shared_memory": name, "semaphore": "sem." + name}.get(rtype)


def record_mp_names() -> None:
    """Wrap ``multiprocessing.resource_tracker.register``/``unregister`` so that
    :data:`_registered` knows the segments this process created (idempotent)."""
    from multiprocessing import resource_tracker as rt
    if getattr(rt.register, "_leaks_recorder", False):
        return
    register, unregister = rt.register, rt.unregister

    def recording_register(name: str, rtype: str) -> Any:
        entry = _entry(name, rtype)
        if entry is not None and os.getpid() == _pid:
            _registered.add(entry)
        return register(name, rtype)

    def recording_unregister(name: str, rtype: str) -> Any:
        entry = _entry(name, rtype)
        if entry is not None and os.getpid() == _pid:
            _registered.discard(entry)
        return unregister(name, rtype)

    recording_register._leaks_recorder = True  # type: ignore[attr-defined]
    rt.register, rt.unregister = recording_register, recording_unregister


_pid = os.getpid()


class Snapshot:
    """What this process tree holds now (see the module docstring)."""

    def __init__(self) -> None:
        self.children = child_pids()
        self.fds = open_fds()
        self.maps = shared_mappings()
        self.shm = shm_entries()
        self.registered = set(_registered)

    def _ours(self, entry: str, before: Snapshot) -> bool:
        pids = {str(p) for p in before.children | self.children | {os.getpid()}}
        return (entry in self.registered
                or any(t in pids for t in _TOKEN.split(entry))
                or any(t.startswith(f"{SHM_DIR}/{entry}") for t, _ in self.fds.values())
                or any(p.startswith(f"{SHM_DIR}/{entry}") for p in self.maps.values()))

    def leaks(self, before: Snapshot) -> list[str]:
        """What is here now and was not in ``before``, one line per kind; [] if nothing."""
        problems = []
        new_children = self.children - before.children
        if new_children:
            desc = []
            for pid in sorted(new_children):
                try:
                    p = psutil.Process(pid)
                    status = p.status()
                    cmd = "" if status == psutil.STATUS_ZOMBIE else " ".join(p.cmdline())[:80]
                    desc.append(f"{pid} ({status}: {cmd})")
                except psutil.Error:
                    desc.append(str(pid))
            problems.append(f"child processes left behind: {', '.join(desc)}")
        new_fds = {fd: t for fd, (t, ino) in self.fds.items() if before.fds.get(fd) != (t, ino)}
        if new_fds:
            problems.append(f"file descriptors left open: {new_fds}")
        new_maps = sorted(p for key, p in self.maps.items() if key not in before.maps)
        if new_maps:
            problems.append(f"shared mappings left: {new_maps}")
        new_shm = sorted(e for e in self.shm - before.shm if self._ours(e, before))
        if new_shm:
            problems.append(f"/dev/shm entries left behind: {new_shm}")
        return problems


def check(before: Snapshot) -> list[str]:
    """``Snapshot().leaks(before)``; what looks leaked is looked at again after a
    collection of the young generations (~0.05 ms: the cycles a test leaves at its end,
    a traceback and its frames, are young, and what they kept goes with them), then,
    only if something is still there, after a full one (~110 ms with torch imported)."""
    problems = Snapshot().leaks(before)
    for generation in (1, 2):
        if not problems:
            break
        gc.collect(generation)
        problems = Snapshot().leaks(before)
    return problems


def assert_no_leaks(before: Snapshot) -> None:
    problems = check(before)
    assert not problems, "\n".join(problems)
