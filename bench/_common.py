"""Shared helpers for the benchmarks: timing, markdown tables, JSON output, plots."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch


def median_time(fn: Callable[[], Any], reps: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() over reps runs, after warmup runs."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def machine() -> dict[str, Any]:
    return {"python": sys.version.split()[0], "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cuda": torch.cuda.is_available()}


def markdown_table(rows: Sequence[dict], cols: Sequence[str], fmt: dict[str, str] | None = None) -> str:
    fmt = fmt or {}
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(format(v, fmt[c]) if c in fmt and isinstance(v, (int, float)) else str(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_outputs(path: str | None, payload: dict, table: str) -> None:
    """Print the table; write JSON to `path` and the table beside it (`.md`)."""
    print(table)
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(table + "\n")
    print(f"wrote {path} and {os.path.splitext(path)[0]}.md")


def plot(path: str | None, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, title: str,
         logx: bool = False, logy: bool = False) -> None:
    """Line plot of {label: (xs, ys)} to `path` (PNG). Silently does nothing only when path is None."""
    if not path:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def bench_parser(doc: str, *, model: bool = True, seed: int | None = None, plot: bool = False, records: bool = False,
                 model_help: str = "default: the embedded SmolLM2-135M-Instruct") -> "argparse.ArgumentParser":
    """The argument prologue every benchmark shares: --threads (default 2, the project machine's cores), --json
    (the results file; its .md table is written beside it), and where the benchmark has them --model, --seed and
    --plot (a PNG path); records=True adds --records (a JSONL a rerun resumes from) and --report (only summarize
    these records). The benchmark adds its own arguments, then calls `parse_bench_args`."""


    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if model:
        ap.add_argument("--model", default=None, help=model_help)
    if seed is not None:
        ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--json", default=None, help="write the results here (and the markdown table beside it)")
    if plot:
        ap.add_argument("--plot", default=None, help="PNG path")
    if records:
        ap.add_argument("--records", default=None, help="JSONL of per-item records; a rerun resumes from it")
        ap.add_argument("--report", nargs="+", default=None, help="only summarize these records files")
    return ap


def parse_bench_args(ap: "argparse.ArgumentParser", argv: Sequence[str] | None = None) -> "argparse.Namespace":
    """Parse, then apply what the prologue controls (torch's thread count)."""
    a = ap.parse_args(argv)
    if a.threads < 1:
        ap.error(f"--threads: expected an int >= 1, got {a.threads}")
    torch.set_num_threads(a.threads)
    return a
