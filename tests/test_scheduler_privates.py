"""No module outside the scheduler touches a scheduler's or a channel's privates,
and none but the scheduler writes the list of workers (issue 21 s1).

STYLE.md: "One owner per piece of state.  If two modules write the same field, or
one reaches into another's privates, the next fix commit lands at that seam."  The
scheduler is :data:`SCHEDULER` (``Scheduler(Dispatch(Receive))``, its runs and its
channels); the watchdog, the engine, the metrics and the faces call its public
methods.  Both checks read the source (``ast``), so a path that no test runs is
checked too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

#: These tests read the checkout's sources, not the installed package (make test-matrix leaves them out).
pytestmark = pytest.mark.source_tree

PACKAGE = Path(__file__).resolve().parent.parent / "mploader"

#: The scheduler's modules: its three parts, its runs and the workers' channels.
SCHEDULER = ("_scheduler", "_dispatch", "_receive", "_run", "_channel")
#: The engine's modules outside the scheduler (tools/import_graph.py's ENGINE).
ENGINE_OTHERS = ("_engine", "_executors", "_metrics", "_worker", "_watchdog", "_diagnose", "_zygote")
#: What changes a list in place.
MUTATORS = frozenset({"append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse"})


def _trees(names=None) -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))
            if names is None or p.stem in names}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_names(trees: dict[str, ast.Module]) -> set[str]:
    """The private names the classes of ``trees`` define: methods, ``self._x``
    attributes and ``__slots__`` entries."""
    out: set[str] = set()
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                    out.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self" and _private(node.attr):
                    out.add(node.attr)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Tuple, ast.List)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                        out.update(e.value for e in node.value.elts
                                   if isinstance(e, ast.Constant) and isinstance(e.value, str) and _private(e.value))
    return out


def reaches_in(trees: dict[str, ast.Module], names: set[str]) -> list[str]:
    """``module:line: expr`` for each ``x._name`` in ``trees`` with ``_name`` in ``names``
    and ``x`` not ``self``/``cls`` (an object's own private is its own business)."""
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in names and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def scheduler_privates() -> tuple[set[str], set[str]]:
    """(the private names only the scheduler's classes define, those another class
    of the package defines too -- ambiguous: ``_engine`` is a Run's and a face's)."""
    trees = _trees()
    mine = private_names({m: t for m, t in trees.items() if m in SCHEDULER})
    others = private_names({m: t for m, t in trees.items() if m not in SCHEDULER})
    return mine - others, mine & others


def test_no_module_outside_the_scheduler_touches_its_privates():
    names, _ = scheduler_privates()
    # the scan sees the scheduler's privates (else it would pass for nothing)
    assert {"_pump", "_pick_worker", "_send_pending", "_resend", "_fill", "_await"} <= names
    outside = _trees()
    for m in SCHEDULER:
        outside.pop(m)
    assert reaches_in(outside, names) == []


def test_no_scheduler_private_that_another_class_shares_is_reached_through_a_scheduler():
    """A private name another class defines too (``_dispatch``: a face's) is checked
    where the object is named as a scheduler (``sched._dispatch``, ``engine._scheduler._load``)."""
    _, shared = scheduler_privates()
    assert "_dispatch" in shared
    outside = _trees()
    for m in SCHEDULER:
        outside.pop(m)
    assert [f for f in reaches_in(outside, shared) if "sched" in f.split(": ", 1)[1].rsplit(".", 1)[0]] == []


def test_the_scheduler_and_the_watchdog_reach_no_private_of_the_engine():
    """The engine hands the scheduler what it needs (``Scheduler(engine, res, lock)``)
    and the scheduler calls the engine's public methods (``closing``,
    ``start_worker``); the engine hands each run its scheduler (``Run(engine,
    scheduler, ...)``) and the run asks for its batches through the engine's public
    ``next_batch``."""
    trees = _trees()
    engine_names = private_names({"_engine": trees["_engine"]})
    assert {"_res", "_lock", "_scheduler"} <= engine_names
    found = reaches_in({m: trees[m] for m in (*SCHEDULER, "_watchdog")}, engine_names)
    assert [f for f in found if "engine" in f.split(": ", 1)[1].rsplit(".", 1)[0]] == []


def test_the_engine_scan_finds_the_runs_old_reaches():
    """What ``Run`` did until issue 21 s1 -- ``engine._scheduler`` and
    ``engine._next_batch`` (then the engine's, now ``Engine.next_batch``) -- is found
    (else the check above would pass for nothing)."""
    engine_names = private_names({"_engine": _trees(("_engine",))["_engine"]}) | {"_next_batch"}
    tree = ast.parse("class Run:\n"
                     "    def __init__(self, engine):\n"
                     "        self._engine = engine\n"
                     "        scheduler = engine._scheduler\n"
                     "    def __next__(self):\n"
                     "        self._engine._next_batch(self)\n"
                     "        self._engine._scheduler.abandon(self)\n")
    assert reaches_in({"_run": tree}, engine_names) == [
        "_run:4: engine._scheduler", "_run:6: self._engine._next_batch", "_run:7: self._engine._scheduler"]


def test_the_scan_finds_the_watchdogs_old_calls():
    """The calls the watchdog made until issue 21 s1 (``sched._pump(w, 0)``,
    ``sched._pick_worker(...)``, ``sched._send_pending()``) are found; a module's own
    privates (``self._x``) are not."""
    names, _ = scheduler_privates()
    tree = ast.parse("def replace(sched, w, src):\n"
                     "    sched._pump(w, 0)\n"
                     "    target = sched._pick_worker(src[3] if len(src) > 3 else None)\n"
                     "    sched._send_pending()\n"
                     "    self._pump(w, 0)\n")
    assert reaches_in({"old_watchdog": tree}, names) == [
        "old_watchdog:2: sched._pump", "old_watchdog:3: sched._pick_worker", "old_watchdog:4: sched._send_pending"]


def workers_writes(trees: dict[str, ast.Module]) -> list[str]:
    """``module:line: expr`` for each write of an attribute ``workers`` (``x.workers =
    ...``, ``x.workers += ...``, ``x.workers.append(...)`` and the other in-place
    changes of a list) outside an ``__init__`` (where the list is made)."""
    found = []
    for module, tree in trees.items():
        inits = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__init__"
                 for n in ast.walk(f)}
        for node in ast.walk(tree):
            if id(node) in inits:
                continue
            if isinstance(node, ast.Attribute) and node.attr == "workers" and isinstance(node.ctx, ast.Store):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)} =")   # (x.workers += ... too)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "workers":
                found.append(f"{module}:{node.lineno}: {ast.unparse(node.func)}()")
    return sorted(found)


def test_only_the_scheduler_writes_the_list_of_workers():
    """The engine makes the list (``_Resources``) and its teardown asks the scheduler
    (``Receive.teardown``, ``Receive.drop_in_child``); the scheduler is its one writer."""
    assert workers_writes(_trees(ENGINE_OTHERS)) == []
    # the scan sees the scheduler's writes (else it would pass for nothing)
    assert len(workers_writes(_trees(SCHEDULER))) >= 4


def test_the_workers_scan_finds_each_kind_of_write():
    tree = ast.parse("class R:\n"
                     "    def __init__(self):\n"
                     "        self.workers = []\n"
                     "    def release(self):\n"
                     "        workers, self.workers = self.workers, []\n"
                     "        self.workers.append(1)\n"
                     "        res.workers += [2]\n"
                     "        print(len(self.workers))\n")
    assert workers_writes({"m": tree}) == ["m:5: self.workers =", "m:6: self.workers.append()",
                                           "m:7: res.workers ="]
