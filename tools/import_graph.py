"""The import graph of mploader's own modules, and its cycles.

    python tools/import_graph.py [--engine] [--rev REV]

Every ``import``/``from ... import`` of an mploader module is an edge, wherever it
stands: at module level, under ``if TYPE_CHECKING:`` (marked ``type``) or inside a
function (marked ``local``) -- a circle closed by a type-only or a local import is
still a circle (docs/design.md, "The engine"; STYLE.md, "Imports in the engine form a
tree").  ``--engine`` prints only the engine's modules (:data:`ENGINE`) and the
edges between them; ``--rev`` reads the tree of a git revision instead of the
working tree.  The cycles are the strongly connected components of more than one
module (or a module importing itself).  tests/test_import_graph.py pins that no
cycle goes through an engine module.
"""
from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "mploader"

#: The engine: the scheduler, its executors, the worker loop and what only they use.
#: A module whose name starts with one of these prefixes belongs to it too (the
#: scheduler's parts).
ENGINE = ("_engine", "_executors", "_metrics", "_scheduler", "_worker", "_watchdog", "_channel", "_dispatch",
          "_receive", "_run", "_diagnose", "_zygote")


def is_engine(name: str) -> bool:
    return any(name == e or name.startswith(e + "_") for e in ENGINE)


def _sources(rev: str | None) -> dict[str, str]:
    """``{module name: source}`` of the package's ``.py`` and ``.pyx`` files (top
    level only; of a ``.pyx`` file only its Python-level ``import`` lines)."""
    if rev is None:
        return {p.stem: _python_part(p.name, p.read_text()) for p in sorted((ROOT / PACKAGE).iterdir())
                if p.suffix in (".py", ".pyx")}
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, f"{PACKAGE}/"],
                             check=True, capture_output=True, text=True).stdout.split()
    out = {}
    for path in listing:
        if path.endswith((".py", ".pyx")) and path.count("/") == 1:
            out[Path(path).stem] = _python_part(path, subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout)
    return out


def _python_part(name: str, src: str) -> str:
    """``src`` itself for a ``.py`` file; a Cython file's ``import``/``from ...
    import`` statements of Python modules (at any indentation: as module-level ones)."""
    if not name.endswith(".pyx"):
        return src
    keep = [line.strip() for line in src.splitlines()
            if re.match(r"\s*(import \w|from [\w.]+ import )", line) and " cimport " not in line]
    return "\n".join(line for line in keep if not line.endswith(("(", "\\")))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, modules: set[str]) -> list[str]:
    """The package's modules that ``node`` imports."""
    found = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == PACKAGE and len(parts) > 1 and parts[1] in modules:
                found.append(parts[1])
        return found
    if node.level == 1 or (node.level == 0 and node.module and node.module.split(".")[0] == PACKAGE):
        mod = (node.module or "") if node.level == 1 else ".".join((node.module or "").split(".")[1:])
        if mod:
            head = mod.split(".")[0]
            if head in modules:
                found.append(head)
        else:  # from . import a, b
            found += [a.name for a in node.names if a.name in modules]
    return found


def edges(rev: str | None = None) -> dict[str, dict[str, str]]:
    """``{importer: {imported: kind}}``, kind "top", "type" or "local" (the
    strongest seen: top > type > local)."""
    sources = _sources(rev)
    modules = set(sources)
    rank = {"top": 2, "type": 1, "local": 0}
    graph: dict[str, dict[str, str]] = {m: {} for m in modules}

    def visit(name: str, body: list[ast.stmt], kind: str) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, modules):
                    old = graph[name].get(target)
                    if old is None or rank[kind] > rank[old]:
                        graph[name][target] = kind
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(name, node.body, "type" if kind == "top" else kind)
                visit(name, node.orelse, kind)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(name, node.body, "local")  # type: ignore[arg-type]
            elif isinstance(node, ast.ClassDef):
                visit(name, node.body, kind)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list) and inner and isinstance(inner[0], (ast.stmt, ast.excepthandler)):
                        visit(name, inner, kind)

    for name, src in sources.items():
        visit(name, ast.parse(src).body, "top")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components that are cycles (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, {}):
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", action="store_true", help="only the engine's modules")
    ap.add_argument("--rev", default=None, help="a git revision (default: the working tree)")
    args = ap.parse_args(argv)
    graph = edges(args.rev)
    for name in sorted(graph):
        if args.engine and not is_engine(name):
            continue
        out = sorted((t, k) for t, k in graph[name].items() if not args.engine or is_engine(t))
        text = ", ".join(t if k == "top" else f"{t} ({k})" for t, k in out)
        print(f"{name} -> {text}" if text else f"{name}")
    found = [c for c in cycles(graph) if not args.engine or any(is_engine(m) for m in c)]
    print("cycles:" if found else "cycles: none")
    for c in found:
        print("  " + " <-> ".join(c))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
