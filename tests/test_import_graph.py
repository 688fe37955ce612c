"""The engine's imports form a tree: no cycle goes through an engine module.

STYLE.md: "Imports in the engine form a tree: data flows one way, from the faces
through the scheduler to the executors and the worker loop.  A circle of imports is
a design to fix, not to hide with a local import."  tools/import_graph.py reads
every import of the package (module level, under ``if TYPE_CHECKING:``, inside a
function) and finds the cycles; before issue 21 s1 the engine had one through seven
modules (``_engine``, ``_executors``, ``_metrics``, ``_scheduler``, ``_watchdog``,
``_worker``, ``_zygote``: ``_metrics`` and ``_scheduler`` named ``_engine`` for their
types, ``_watchdog`` named ``_scheduler``).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

#: These tests read the checkout's sources, not the installed package (make test-matrix leaves them out).
pytestmark = pytest.mark.source_tree

TOOL = Path(__file__).resolve().parent.parent / "tools" / "import_graph.py"


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", mod)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycle_goes_through_the_engine():
    tool = _tool()
    graph = tool.edges()
    engine_cycles = [c for c in tool.cycles(graph) if any(tool.is_engine(m) for m in c)]
    assert engine_cycles == [], f"import cycles through the engine: {engine_cycles}"


def test_the_cycle_finder_finds_type_only_and_local_imports():
    """The finder itself: a circle closed by a type-only import, or by one inside a
    function, is a circle (so the test above can fail)."""
    tool = _tool()
    graph = {"_engine": {"_scheduler": "top"}, "_scheduler": {"_engine": "type"}, "_a": {"_b": "top"},
             "_b": {"_c": "top"}, "_c": {"_a": "local"}, "_d": {"_a": "top"}}
    assert tool.cycles(graph) == [["_a", "_b", "_c"], ["_engine", "_scheduler"]]


def test_the_parser_sees_every_kind_of_import(tmp_path, monkeypatch):
    """Module-level, ``from . import``, ``import mploader.x``, TYPE_CHECKING and local
    imports each become an edge of the right kind."""
    tool = _tool()
    sources = {
        "_a": "from . import _b\nimport mploader._c as c\nfrom typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from ._d import D\n"
              "def f():\n    from ._e import E\n",
        "_b": "", "_c": "", "_d": "", "_e": "x = 1\n",
    }
    monkeypatch.setattr(tool, "_sources", lambda rev: sources)
    assert tool.edges() == {"_a": {"_b": "top", "_c": "top", "_d": "type", "_e": "local"},
                            "_b": {}, "_c": {}, "_d": {}, "_e": {}}
