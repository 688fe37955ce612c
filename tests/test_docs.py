"""The docs against the tree: every section the code, tests, benchmarks and docs quote
exists, and every figure the reference docs quote from a constant is the constant's value.

The reference docs (docs/design.md, docs/bench.md, docs/faces.md) say what is true now;
the journals (docs/design-log.md, docs/bench-log.md) what was measured when (issue 21
s6).  A constant quoted in a reference doc or the README is pinned here: the doc's figure is read
from the doc's text and compared with the value imported from the code, so changing
either alone fails this test."""
from __future__ import annotations

import glob
import os
import re

import pytest

#: These tests read the checkout's sources, not the installed package (make test-matrix leaves them out).
pytestmark = pytest.mark.source_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("design.md", "design-log.md", "bench.md", "bench-log.md", "faces.md", "metrics.md")


def _read(rel: str) -> str:
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return f.read()


def _flat(text: str) -> str:
    """Whitespace (line breaks, comment markers of wrapped quotes) as single spaces."""
    text = re.sub(r"\n\s*(#|\*|//)?\s*", " ", text)
    return re.sub(r"\s+", " ", text)


def _headings(doc: str) -> list[str]:
    """The doc's headings and its paragraphs' bold labels (`* **Checkpoints** (...)`),
    without backticks."""
    text = _read(f"docs/{doc}")
    found = re.findall(r"^#{1,4} (.+)$", text, re.M)
    found += re.findall(r"^(?:\* )?\*\*([^*]+)\*\*", text, re.M)
    return [h.replace("`", "").strip().rstrip(".") for h in found]


def _sources() -> list[str]:
    pats = ["README.md", "docs/*.md", "mploader/*.py", "mploader/*.pyx", "mploader/*.pxd",
            "mploader/*.pxi", "mploader/integrations/*.py", "csrc/*.[ch]", "bench/*.py",
            "bench/mploader_bench/*.py", "tests/*.py", "tests/c/*.c", "tools/*.py"]
    out: list[str] = []
    for pat in pats:
        out.extend(sorted(glob.glob(os.path.join(REPO, pat))))
    return [p for p in out if not p.endswith("tests/test_docs.py")]


# docs/design.md, "Name"   docs/design.md ("Name", "Other")   `docs/design.md`, "Name"
_QUOTE = re.compile(r'docs/([a-z-]+\.md)`?,? \(?((?:"[^"]{2,80}"(?:, | and )?)+)')


def _quotes() -> list[tuple[str, str, str]]:
    found = []
    for path in _sources():
        text = _flat(_read(os.path.relpath(path, REPO)))
        for m in _QUOTE.finditer(text):
            for name in re.findall(r'"([^"]+)"', m.group(2)):
                found.append((os.path.relpath(path, REPO), m.group(1), name))
    return found


def test_the_quote_finder_finds_quotes():
    """The pattern below must see the quotes the tree is known to hold, or the next
    test would pass on nothing."""
    quotes = {(doc, name) for _, doc, name in _quotes()}
    assert ("design.md", "Slot protocol") in quotes          # csrc/ring.h, wrapped line
    assert ("design.md", "Pinned memory and asynchronous copies") in quotes  # wrapped
    assert ("bench.md", "The cache rule") in quotes
    assert len(quotes) >= 20


def test_every_quoted_section_exists():
    """A quote names a heading of the doc or a paragraph's bold label (a heading may go
    on after the quoted name: "Faults" is "Faults (issue 9): what the user sees, and
    the test")."""
    missing = []
    for where, doc, name in _quotes():
        if doc not in DOCS:
            missing.append(f"{where}: docs/{doc} does not exist")
            continue
        heads = _headings(doc)
        if not any(h == name or h.startswith(name + " ") or h.startswith(name + ":")
                   or h.startswith(name + ",") for h in heads):
            missing.append(f"{where}: docs/{doc} has no section {name!r}")
    assert not missing, "\n".join(sorted(set(missing)))


def test_every_doc_the_docs_name_exists():
    names = set()
    for path in _sources():
        names.update(re.findall(r"docs/([A-Za-z0-9_-]+\.(?:md|png))", _read(os.path.relpath(path, REPO))))
    assert names, "no doc is named anywhere"
    missing = sorted(n for n in names if not os.path.exists(os.path.join(REPO, "docs", n)))
    assert not missing, f"named but absent: {missing}"


def test_reference_and_journal_are_apart():
    """The journals hold the dated runs; the reference docs hold none of the journal's
    session headings."""
    bench = _read("docs/bench.md")
    design = _read("docs/design.md")
    assert "# Journal" not in bench and "Per-batch cost (issue 13)" not in bench
    assert "Per-batch cost (issue 13)" in _read("docs/bench-log.md")
    for ref in (bench, design):
        assert not re.search(r"^#+ .*\b20\d\d-\d\d-\d\d\b", ref, re.M), "a dated heading in a reference doc"


def _test_functions() -> dict[str, set[str]]:
    """Every test function of tests/ and bench/tests/ by name -> the files defining it."""
    found: dict[str, set[str]] = {}
    paths = glob.glob(os.path.join(REPO, "tests", "*.py")) + glob.glob(os.path.join(REPO, "bench", "tests", "*.py"))
    for path in paths:
        for m in re.finditer(r"^\s*(?:async )?def (test_\w+)", _read(os.path.relpath(path, REPO)), re.M):
            found.setdefault(m.group(1), set()).add(os.path.basename(path))
    return found


def test_every_test_the_docs_name_exists():
    """`test_x.py::test_name`, `::test_name` (same file as the name before it) and a bare
    `test_name` in the docs and the README name a test that exists, in that file (the
    Faults table names the test of each case)."""
    defs = _test_functions()
    files = {f for names in defs.values() for f in names}
    token = re.compile(r"`((?:tests/)?test_\w+\.py)?(::)?(test_\w+)?")
    seen, stale = 0, []
    for doc in REFERENCE:
        last = None
        for m in token.finditer(_read(doc)):
            path, sep, name = m.groups()
            if not (path or name):
                continue
            seen += 1
            where = os.path.basename(path) if path else (last if sep else None)
            last = where if path else last
            if where is not None and where not in files:
                stale.append(f"{doc}: {where} does not exist")
            elif name and name not in defs:
                stale.append(f"{doc}: no test {name}")
            elif name and where is not None and where not in defs[name]:
                stale.append(f"{doc}: {name} is in {sorted(defs[name])}, not {where}")
    assert seen >= 100, f"only {seen} test names found: the pattern no longer matches the docs"
    assert not stale, "\n".join(stale)


REFERENCE = ("docs/design.md", "docs/faces.md", "docs/metrics.md", "docs/bench.md", "README.md")


def _module_source(module: str) -> str | None:
    for ext in (".py", ".pyx", ".pxi", ".pxd"):
        path = os.path.join(REPO, "mploader", module + ext)
        if os.path.exists(path):
            return _read(os.path.relpath(path, REPO))
    return None


def test_every_module_name_and_path_the_reference_names_exists():
    """`_module.name` (or `mploader._module.name`) in a reference doc names a module of
    mploader that has that name, and every path it gives (mploader/..., csrc/...,
    tests/c/..., bench/...) exists: a module split or a rename shows here, not in a
    reader's search.  The journals keep the names of their day."""
    stale, seen = [], 0
    for doc in REFERENCE:
        text = _read(doc)
        for m in re.finditer(r"`(?:mploader\.)?(_[a-z_]+)\.([A-Za-z_]\w*)", text):
            module, name = m.groups()
            if name in ("py", "pyx", "pxd", "pxi", "pyi", "c", "h"):
                continue
            seen += 1
            source = _module_source(module)
            if source is None:
                stale.append(f"{doc}: no module mploader.{module} (for {module}.{name})")
            elif not re.search(rf"\b{name}\b", source):
                stale.append(f"{doc}: mploader.{module} has no {name}")
        for m in re.finditer(r"((?:mploader|csrc|tests/c|bench)/[\w/]+\.(?:pyx|pyi|pxd|pxi|py|c|h))\b", text):
            seen += 1
            if not os.path.exists(os.path.join(REPO, m.group(1))):
                stale.append(f"{doc}: {m.group(1)} does not exist")
    assert seen >= 100, f"only {seen} references found: the patterns no longer match the docs"
    assert not stale, "\n".join(sorted(set(stale)))


def test_metrics_md_documents_every_key_stats_returns():
    """docs/metrics.md's tables name every key of a loader's ``stats()``, and no key
    that ``stats()`` lacks (the Gluon face, one forked worker, after an epoch)."""
    import numpy as np

    import mploader

    documented = set()
    for row in re.findall(r"^\| (`[^|]+) \|", _read("docs/metrics.md"), re.M):
        documented.update(re.findall(r"`(\w+)`", row))
    with mploader.DataLoader(np.arange(8), batch_size=2, num_workers=1) as loader:
        assert sum(len(b) for b in loader) == 8
        keys = set(loader.stats())
    assert not keys - documented, f"stats() keys missing from docs/metrics.md: {sorted(keys - documented)}"
    assert not documented - keys, f"docs/metrics.md keys stats() lacks: {sorted(documented - keys)}"


def test_every_class_attribute_the_reference_names_exists():
    """`Class.attribute` in a reference doc, for a class mploader defines, names an
    attribute of that class or of a base class mploader defines (the scheduler is
    ``Scheduler(Dispatch(Receive))``: `Receive._check_wait` and `Scheduler._check_wait`
    are the same method)."""
    classes: dict[str, tuple[list[str], str]] = {}   # name -> (bases, source of its module)
    for path in glob.glob(os.path.join(REPO, "mploader", "*.py*")):
        if not path.endswith((".py", ".pyx", ".pxi")):
            continue
        source = _read(os.path.relpath(path, REPO))
        for m in re.finditer(r"^(?:cdef )?class (\w+)(?:\(([^)]*)\))?", source, re.M):
            bases = [b.strip().split(".")[-1] for b in (m.group(2) or "").split(",") if b.strip()]
            classes[m.group(1)] = (bases, source)

    def has(name: str, attr: str, depth: int = 0) -> bool:
        bases, source = classes[name]
        if re.search(rf"\b{attr}\b", source):
            return True
        return depth < 8 and any(has(b, attr, depth + 1) for b in bases if b in classes)

    stale, seen = [], 0
    for doc in REFERENCE:
        for m in re.finditer(r"`(?:[\w.]*\.)?([A-Z]\w+)\.(_?[a-z]\w*)", _read(doc)):
            name, attr = m.groups()
            if name in classes:
                seen += 1
                if not has(name, attr):
                    stale.append(f"{doc}: {name} has no {attr}")
    assert seen >= 30, f"only {seen} class attributes found: the pattern no longer matches the docs"
    assert not stale, "\n".join(sorted(set(stale)))


# ---- figures the reference quotes from constants ----

def _figure(doc: str, pattern: str) -> str:
    text = _flat(_read(f"docs/{doc}"))
    m = re.search(pattern, text)
    assert m, f"docs/{doc} no longer states {pattern!r}: update the doc and this test together"
    return m.group(1)


def _mib(text: str) -> int:
    num, unit = text.split()
    return int(num) * {"KiB": 1 << 10, "MiB": 1 << 20}[unit]


def _constant(name: str) -> list[tuple[str, object]]:
    """``name``'s value in every module of mploader that assigns it at top level (a
    constant may move between modules; the doc's figure must match wherever it is)."""
    import importlib

    found = []
    for path in sorted(glob.glob(os.path.join(REPO, "mploader", "*.py*"))):
        if not path.endswith((".py", ".pyx")):
            continue
        if re.search(rf"^{name}\s*(:[^=]+)?=", _read(os.path.relpath(path, REPO)), re.M):
            mod = "mploader." + os.path.basename(path).rsplit(".", 1)[0]
            found.append((mod, getattr(importlib.import_module(mod), name)))
    assert found, f"no module of mploader defines {name}"
    return found


@pytest.mark.parametrize("doc, name, pattern, parse", [
    ("design.md", "MAX_PLANS", r"`MAX_PLANS` \((\d+)\)", int),
    ("design.md", "MAX_UNUSED_PLANS", r"`MAX_UNUSED_PLANS` \((\d+)\)", int),
    ("design.md", "SMALL_BATCHES_BYTES", r"`SMALL_BATCHES_BYTES // batch_bytes` \((\d+ [KM]iB)\)", _mib),
    ("design.md", "AUTO_PREFETCH_PER_WORKER",
     r"`AUTO_PREFETCH_PER_WORKER \* num_workers`\] \((\d+) per worker\)", int),
    ("design.md", "STREAM_MIN_BYTES", r"`_?\w*\.?STREAM_MIN_BYTES` \((\d+ [KM]iB)\)", _mib),
    ("design.md", "SMALL_LEAF_BYTES", r"`mploader.torch.SMALL_LEAF_BYTES` \((\d+ [KM]iB)", _mib),
    ("design.md", "POLL_S", r"`POLL_S` = (\d+) ms", lambda ms: int(ms) / 1000),
    ("design.md", "FLOOR_S", r"`?FLOOR_S = (\d+) s", float),
    ("design.md", "P99_FACTOR", r"P99_FACTOR = (\d+) x p99", float),
    ("design.md", "WARMUP_BATCHES", r"`WARMUP_BATCHES = (\d+)`", int),
    ("design.md", "WARMUP_FLOOR_S", r"`WARMUP_FLOOR_S = (\d+) s`", float),
    ("design.md", "KIND_REPORT", r"`KIND_REPORT = (\d+)`", int),
    ("design.md", "MAX_SUBSTITUTES", r"`MAX_SUBSTITUTES = (\d+)`", int),
    ("design.md", "FRACTION_MIN_BAD", r"`FRACTION_MIN_BAD = (\d+)`", int),
    ("../README.md", "AUTO_PREFETCH_PER_WORKER", r"while batches are small up to (\d+) per worker", int),
    ("../README.md", "SMALL_BATCHES_BYTES", r"as long as they take at most (\d+ [KM]iB) together", _mib),
    ("../README.md", "FLOOR_S", r"`max\((\d+) s, \d+ x the p99 batch time\)`", float),
    ("../README.md", "P99_FACTOR", r"`max\(\d+ s, (\d+) x the p99 batch time\)`", float),
    ("../README.md", "WARMUP_FLOOR_S", r"(\d+) s until \d+ batches were timed", float),
    ("../README.md", "WARMUP_BATCHES", r"\d+ s until (\d+) batches were timed", int),
])
def test_quoted_figures_are_the_codes(doc, name, pattern, parse):
    if name == "SMALL_LEAF_BYTES":
        pytest.importorskip("torch")
    figure = parse(_figure(doc, pattern))
    for module, value in _constant(name):
        assert figure == value, f"docs/{doc} says {name} is {figure}, {module} has {value}"


def test_faces_md_counts_the_faces():
    """faces.md's title counts the faces that the design's table lists."""
    words = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6}
    count = words[_figure("faces.md", r"^# The (\w+) faces")]
    table = re.search(r"\| face \| tasks from \|.*?\n\n", _read("docs/design.md"), re.S)
    assert table, "docs/design.md lost its table of faces"
    rows = [r for r in table.group(0).splitlines()[2:] if r.startswith("|")]
    own = re.search(r"\| \| plans tasks from \|.*?\n\n", _read("docs/faces.md"), re.S)
    assert own, "docs/faces.md lost its table of faces"
    own_rows = [r for r in own.group(0).splitlines()[2:] if r.startswith("|")]
    assert count == len(rows) == len(own_rows) == 4


def test_readme_names_every_dependency():
    """The README's install paragraph names each runtime dependency of pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    text = _flat(_read("README.md"))
    m = re.search(r"Installing the library alone \(.*?\) needs only (.*?);", text)
    assert m, "README lost its 'Installing the library alone' sentence"
    for dep in deps:
        name = re.split(r"[<>=!~ \[]", dep, maxsplit=1)[0]
        assert name.lower() in m.group(1).lower(), f"README's install sentence does not name {name}"

