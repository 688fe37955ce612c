"""The transport suite's output: the table and the JSON report (split from
:mod:`.transport` to keep modules under ~600 lines)."""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from .transport import REFERENCE, SUITE, _bound_by


class _Out:
    """Console output: rich if available, plain print otherwise."""

    def __init__(self, console: Any) -> None:
        if console is None:
            try:
                from rich.console import Console

                console = Console()
                if not console.is_terminal:  # piped: don't squeeze the table into 80 columns
                    console = Console(width=120)
            except ImportError:
                console = None
        self.console = console

    @property
    def rich(self) -> bool:
        return self.console is not None and type(self.console).__module__.startswith("rich")

    def line(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _fmt_cpu(parent: float | None, workers: float | None) -> str:
    def us(x: float) -> str:
        return f"{x * 1e6:,.0f}" if x * 1e6 >= 10 else f"{x * 1e6:.1f}"
    if parent is None:
        return "-"
    return us(parent) if workers is None else f"{us(parent)}+{us(workers)}"


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _print_report(report: dict, out: _Out) -> None:
    cfg = report["config"]
    # "ref": REFERENCE; "CPU us/batch": parent + all workers, CPU microseconds per batch
    # "share": batches/s over the collate limit of `limit_cores` cores (collate-limit x cores)
    # "bound by": mploader.diagnose's verdict on the transport's epochs (mploader's faces only)
    cores = report.get("limit_cores", cfg["workers"])
    header = ["size", "transport", "batches/s", "GB/s", "min-max batches/s", f"share of {cores}-core limit",
              "CPU us/batch", "ref batches/s", "mploader x", "bound by"]
    rows = []
    for size in cfg["sizes"]:
        meds = report["medians"].get(size, {})
        for name in cfg["transports"]:
            if name not in meds:
                err = report["errors"].get(size, {}).get(name)
                rows.append([size, name, "error" if err else "-"] + ["-"] * (len(header) - 3))
                continue
            m = meds[name]
            ref = REFERENCE.get(size, {}).get(name)
            ratio = report["ratios"].get(size, {}).get(name)
            rows.append([size, name, _fmt_rate(m["batches_per_s"]), f"{m['gb_per_s']:.3f}",
                         f"{_fmt_rate(m['min_batches_per_s'])}-{_fmt_rate(m['max_batches_per_s'])}",
                         "-" if m.get("share_of_limit") is None else f"{m['share_of_limit']:.2f}",
                         _fmt_cpu(m["parent_cpu_per_batch_s"], m["workers_cpu_per_batch_s"]),
                         _fmt_rate(ref) if ref else "", _fmt_ratio(ratio) if ratio else "",
                         _bound_by(m.get("verdict"))])
    title = (f"transport benchmark: medians of {cfg['repeats']} repetitions, "
             f"{cfg['workers']} workers")
    target_lines = []
    for t in report["targets"]:
        op = ">" if t["strict"] else ">="
        mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        target_lines.append(f"{t['size']}: mploader / {t['peer']} = {_fmt_ratio(t['ratio'])} "
                            f"(target {op} {t['minimum']:g}x): {mark}")
    if out.rich:
        from rich.table import Table

        table = Table(title=title)
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i < 2 else "right", no_wrap=True)
        last = None
        for r in rows:
            if last is not None and r[0] != last:
                table.add_section()
            last = r[0]
            table.add_row(*r)
        out.console.print(table)
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
                  for i, h in enumerate(header)]
        out.line(title)
        out.line("  ".join(h.ljust(w) if i < 2 else h.rjust(w)
                           for i, (h, w) in enumerate(zip(header, widths))))
        for r in rows:
            out.line("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))
    for line in target_lines:
        out.line(line)
    for t in report.get("share_targets", []):
        mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        share = "-" if t["share"] is None else f"{t['share']:.2f}"
        out.line(f"{t['size']}: {t['transport']} share of the {cores}-core collate limit = {share} "
                 f"(target >= {t['minimum']:g}): {mark}")
    for size, errs in report["errors"].items():
        for name, err in errs.items():
            out.line(f"error [{size}] {name}: {err}")


def _write_json(report: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{SUITE}-{stamp}.json"
    text = json.dumps(report, indent=2, sort_keys=False, default=str)
    path.write_text(text + "\n")
    (out_dir / f"{SUITE}-latest.json").write_text(text + "\n")
    return path
