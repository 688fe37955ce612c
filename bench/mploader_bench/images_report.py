"""The images suite's output: the JSON report, the tables and the PNG chart (split
from :mod:`.images` to keep modules under ~600 lines)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .images import SUITE


def write_json(report: dict, out_dir: Path, stamp: str) -> Path:
    """Write ``images-<stamp>.json`` and ``images-latest.json`` in `out_dir`; returns the first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2, default=str) + "\n"
    path = out_dir / f"{SUITE}-{stamp}.json"
    path.write_text(text)
    (out_dir / f"{SUITE}-latest.json").write_text(text)
    return path


def _console() -> Any:
    try:
        from rich.console import Console
    except ImportError:  # pragma: no cover
        return None
    c = Console()
    return c if c.is_terminal else Console(width=132)


def _print(console: Any, text: str) -> None:
    if console is None:
        print(text, flush=True)
    else:
        console.print(text, markup=False, highlight=False)


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def print_tables(report: dict, console: Any) -> None:
    """Print one table per format (rich if available) and the targets."""
    cfg = report["config"]
    rows_by_fmt = {}
    for fmt, fr in report["formats"].items():
        rows = []
        for name, rec in fr["transports"].items():
            m = rec["median"]
            rows.append([name, _fmt(m["images_per_s"], ",.0f"), _fmt(m["mb_per_s"], ",.0f"),
                         _fmt(m["wait_pct"], ".1f"), _fmt(m["wait_ms_per_batch"], ",.1f"),
                         _fmt(m["cpu_s_per_1k_images"], ".2f"),
                         _fmt(m["peak_pss_mb"], ",.0f"), _fmt(rec["x_pickle"], ".2f", "x"),
                         _fmt(rec["x_torch"], ".2f", "x"),
                         _fmt(None if rec["scaling_efficiency"] is None
                              else 100 * rec["scaling_efficiency"], ".0f", "%"),
                         (m.get("verdict") or "-").replace("-bound", "")])
        rows_by_fmt[fmt] = rows
    # "bound by": mploader.diagnose's verdict on the transport's epochs (mploader's faces only)
    header = ["transport", "images/s", "MB/s", "wait %", "wait ms/batch", "CPU s/1k img",
              "peak PSS MB", "x pickle", "x torch", "scaling", "bound by"]
    for fmt, rows in rows_by_fmt.items():
        fr = report["formats"][fmt]
        title = (f"images · {fmt} · {cfg['workers']} workers · batch {cfg['batch_size']} · "
                 f"{fr['batches_per_run']} batches/run (inline {fr['batches_per_run_inline']}) · "
                 f"median of {cfg['repeats']}")
        ok = fr["verification"]["ok"]
        caption = (f"checksums: {fr['verification']['batches_checked']} batches identical across "
                   f"transports and repetitions" if ok else "checksums: MISMATCH")
        other = fr.get("other_cpu_pct_max")
        if other is not None and other > 10:
            caption += (f"\nwarning: other processes took up to {other:.0f}% of the machine's CPU "
                        f"during a run: rates are depressed and scattered")
        table_cls: Any
        try:
            from rich.table import Table as table_cls
        except ImportError:
            table_cls = None
        if table_cls is not None and console is not None and hasattr(console, "print"):
            table = table_cls(title=title, caption=caption)
            for i, h in enumerate(header):
                table.add_column(h, justify="left" if i == 0 else "right")
            for row in rows:
                style = "bold" if row[0] == "mploader" else None
                table.add_row(*row, style=style)
            console.print(table)
        else:
            _print(console, title)
            _print(console, "  ".join(f"{h:>12}" for h in header))
            for row in rows:
                _print(console, "  ".join(f"{c:>12}" for c in row))
            _print(console, caption)
    for t in report.get("targets", []):
        name = t.get("transport", "mploader")
        if t["metric"] == "images/s ratio":
            what = (f"{name} {_fmt(t['measured'], '.2f', 'x')} {t['peer']} images/s "
                    f"(target >= {t['target']:g}x)")
        else:
            what = (f"{name} {t['metric'].replace(' lower', '')} {_fmt(t['measured'], '.2f')} "
                    f"vs {t['peer']} {_fmt(t['target'], '.2f')} (target: lower)")
        _print(console, f"target {t['format']}: {what}: {'met' if t['met'] else 'MISSED'}")


def plot_png(report: dict, out_dir: Path, stamp: str) -> Path | None:
    """Bar chart of median images/s per transport, one panel per format.

    Error bars span the repetitions' minimum to maximum; each bar is labelled
    with its rate and ratio to pickle.  Writes ``images-<stamp>.png`` and
    ``images-latest.png``; returns the first, or None without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fmts = list(report["formats"])
    if not fmts:
        return None
    cfg = report["config"]
    colors = {"mploader": "#1f77b4", "pickle": "#d62728", "torch": "#ff7f0e",
              "inline": "#7f7f7f", "queue": "#2ca02c"}
    fig, axes = plt.subplots(1, len(fmts), figsize=(5.2 * len(fmts), 4.2), squeeze=False)
    for ax, fmt in zip(axes[0], fmts):
        ts = report["formats"][fmt]["transports"]
        names = list(ts)
        med = [ts[n]["median"]["images_per_s"] or 0.0 for n in names]
        lo = [med[i] - min((r["images_per_s"] for r in ts[n]["runs"]), default=med[i])
              for i, n in enumerate(names)]
        hi = [max((r["images_per_s"] for r in ts[n]["runs"]), default=med[i]) - med[i]
              for i, n in enumerate(names)]
        bars = ax.bar(names, med, yerr=[lo, hi], capsize=4,
                      color=[colors.get(n, "#9467bd") for n in names])
        for b, n, v, up in zip(bars, names, med, hi):
            xp = ts[n]["x_pickle"]
            label = f"{v:,.0f}" + (f"\n{xp:.2f}x pickle" if xp and n != "pickle" else "")
            ax.annotate(label, (b.get_x() + b.get_width() / 2, v + up),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 3),
                        textcoords="offset points")
        ax.set_title(f"{fmt}" + (" (JPEG decode + crop + flip)" if fmt == "jpeg"
                                 else " (pre-decoded 256², crop + flip)"), fontsize=10)
        ax.set_ylabel("images / s (higher is better)")
        ax.set_ylim(0, max([m + h for m, h in zip(med, hi)] + [1.0]) * 1.25)
        ax.grid(axis="y", alpha=0.3)
    m = report["machine"]
    fig.suptitle(f"mploader bench images: {cfg['workers']} workers, batch {cfg['batch_size']}, "
                 f"224x224x3 uint8 — {m.get('cpu_model', '?')}, {m.get('usable_cores', '?')} cores",
                 fontsize=10)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{SUITE}-{stamp}.png"
    fig.savefig(path, dpi=110)
    fig.savefig(out_dir / f"{SUITE}-latest.png", dpi=110)
    plt.close(fig)
    return path
