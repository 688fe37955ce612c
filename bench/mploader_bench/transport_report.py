"""The transport suite's output: the table and the JSON report (split from
:mod:`.transport` to keep modules under ~600 lines)."""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from .transport import SUITE, _bound_by


class _Out:
    """Console output: rich if available, plain print otherwise."""

    def __init__(self, console: Any) -> None:
        if console is None:
            try:
                from rich.console import Console

                console = Console()
                if not console.is_terminal:  # piped: don't squeeze the table into 80 columns
                    console = Console(width=200)
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


def _fmt_spread(x: dict | None, fmt: Any = _fmt_rate, suffix: str = "") -> str:
    """``median (min-max)`` of a :func:`mploader_bench.transport._spread` dict."""
    if x is None:
        return "-"
    return f"{fmt(x['median'])}{suffix} ({fmt(x['min'])}-{fmt(x['max'])})"


def _fmt_share(x: float) -> str:
    return f"{x:.2f}"


def _below_text(below: list | None) -> str:
    """The repetitions an every-repetition target missed (:func:`.transport._below`):
    ``" (repetition 3: 0.81, 2 of 4 blocks steady, copy-limit beside them 544-947
    batches/s)"``; a repetition with no steady block says so."""
    if not below:
        return ""
    parts = []
    for b in below:
        text = f"repetition {b['repeat'] + 1}: " + ("no steady block" if b["value"] is None else f"{b['value']:.2f}")
        if b.get("steady_blocks") is not None:
            if b["value"] is not None:
                text += f", {b['steady_blocks']} of {b['blocks']} blocks steady"
            span = b.get("copy_limit_range")
            if span:
                text += f", copy-limit beside them {_fmt_rate(span[0])}-{_fmt_rate(span[1])} batches/s"
        parts.append(text)
    return " (" + "; ".join(parts) + ")"


def _case_line(case: str, info: dict, meds: dict) -> str:
    """What data a case ran on, and copy-limit's methods."""
    pool = info.get("pool")
    if info["cache"] == "resident":
        data = (f"resident: {info['distinct_samples']} distinct samples "
                f"({info['pool_bytes'] / 1e3:,.1f} kB, in the cache)")
    else:
        data = (f"cold: {info['distinct_samples']:,} distinct samples, {info['pool_bytes'] / 1e6:,.1f} MB of "
                f"arrays" + ("" if pool is None else
                             f" + {info['distinct_samples'] * pool['header_bytes'] / 1e6:,.1f} MB of headers = "
                             f"{pool['cache_multiple']:.1f} x the {pool['llc_bytes'] / 2**20:g} MiB LLC"
                             + (f" (CAPPED at {pool['cap_bytes'] / 2**20:,.0f} MiB)" if pool["capped"] else "")))
    methods = meds.get("copy-limit", {}).get("methods")
    if methods:
        data += "; copy-limit by method: " + ", ".join(
            f"{k} {_fmt_spread(v)}" for k, v in methods.items())
    return f"{case}: {data}"


def _print_report(report: dict, out: _Out) -> None:
    cfg = report["config"]
    # "share of copy-limit": batches/s over copy-limit's in the same repetition, median (min-max)
    # "share of N-core collate": batches/s over collate-limit's median x N cores
    # "CPU us/batch": parent + all workers, CPU microseconds per batch
    # "x torch": batches/s over torch's DataLoader's in the same repetition, median (min-max)
    # "bound by": mploader.diagnose's verdict on the transport's epochs (mploader's faces only)
    cores = report.get("limit_cores", cfg["workers"])
    header = ["size", "transport", "batches/s (min-max)", "GB/s", "share of copy-limit",
              f"of {cores}-core collate", "CPU us/batch", "x torch (min-max)", "bound by"]
    rows = []
    for case in report["sizes"]:
        meds = report["medians"].get(case, {})
        for name in cfg["transports"]:
            if name not in meds:
                err = report["errors"].get(case, {}).get(name)
                rows.append([case, name, "error" if err else "-"] + ["-"] * (len(header) - 3))
                continue
            m = meds[name]
            rate = dict(median=m["batches_per_s"], min=m["min_batches_per_s"], max=m["max_batches_per_s"])
            rows.append([case, name, _fmt_spread(rate), f"{m['gb_per_s']:.3f}",
                         _fmt_spread(m.get("share_of_copy_limit"), _fmt_share),
                         "-" if m.get("share_of_limit") is None else f"{m['share_of_limit']:.2f}",
                         _fmt_cpu(m["parent_cpu_per_batch_s"], m["workers_cpu_per_batch_s"]),
                         _fmt_spread(m.get("x_torch"), lambda x: f"{x:.2f}", "x"),
                         _bound_by(m.get("verdict"))])
    title = (f"transport benchmark: medians (min-max) of {cfg['repeats']} repetitions, "
             f"{cfg['workers']} workers, data: {', '.join(cfg.get('cache', ['cold']))}")
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
    for case, info in report["sizes"].items():
        meds = report["medians"].get(case, {})
        out.line(_case_line(case, info, meds))
        others = [f"{name} {_fmt_spread(m['others_cores'], lambda x: f'{x:.2f}')}"
                  for name, m in meds.items() if m.get("others_cores")]
        if others:
            out.line(f"{case}: other work on the machine during the runs, cores (median (min-max) over "
                     "repetitions): " + ", ".join(others))
    mach = report.get("machine", {})
    if mach.get("load_avg_start") or mach.get("load_avg_end"):
        def la(x: list | None) -> str:
            return "-" if not x else " ".join(f"{v:.2f}" for v in x)
        out.line(f"load average (1, 5, 15 min): start {la(mach.get('load_avg_start'))}, "
                 f"end {la(mach.get('load_avg_end'))}")
    for t in report["targets"]:
        op = ">" if t["strict"] else ">="
        mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        out.line(f"{t['size']}: mploader / {t['peer']} = {_fmt_ratio(t['ratio'])} "
                 f"(target {op} {t['minimum']:g}x): {mark}")
    for t in report.get("share_targets", []):
        mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        share = "-" if t["share"] is None else f"{t['share']:.2f}"
        out.line(f"{t['size']}: {t['transport']} share of the {cores}-core collate limit = {share} "
                 f"(target >= {t['minimum']:g}): {mark}")
    for t in report.get("every_run_targets", []):
        mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        what = "share of copy-limit" if t["what"] == "copy-limit" else f"x {t['what']}"
        out.line(f"{t['size']}: {t['transport']} {what} = {_fmt_spread(t['value'], _fmt_share)} "
                 f"(target >= {t['minimum']:g} in every repetition): {mark}" + _below_text(t.get("below")))
    for case, errs in report["errors"].items():
        for name, err in errs.items():
            out.line(f"error [{case}] {name}: {err}")
    for mm in report.get("mismatches", []):
        out.line(f"WRONG BATCH [{mm['size']}] {mm['transport']}: {mm['error']}")


def _write_json(report: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{SUITE}-{stamp}.json"
    text = json.dumps(report, indent=2, sort_keys=False, default=str)
    path.write_text(text + "\n")
    (out_dir / f"{SUITE}-latest.json").write_text(text + "\n")
    return path
