"""Rendering a benchmark result: the terminal table, the JSON file, the PNG bar chart."""

from __future__ import annotations

import json
import os
from typing import Any

from fastload.benchmark.loaders import LABELS
from fastload.formats.units import plural

__all__ = ["format_table", "write_json", "write_plot"]

MB = 1e6


def _num(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def _rng(stat: dict[str, Any], scale: float = 1.0) -> str:
    return f"[{stat['min'] / scale:,.0f}-{stat['max'] / scale:,.0f}]"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _grid(header: list[str], rows: list[list[str]], *, left: int = 1) -> list[str]:
    """Columns aligned; the first `left` columns left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        cells = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  " + "  ".join(cells).rstrip()

    return [line(header), *(line(r) for r in rows)]


def _limits(res: dict[str, Any]) -> list[str]:
    lim = res["limits"]
    rows = []
    cold = lim.get("read_cold")
    if cold:
        resident = cold.get("resident_after_evict")
        how = "fadvise DONTNEED" + ("" if resident is None else f", {100 * resident:.0f}% resident after")
        if cold.get("warning"):
            how += "; " + cold["warning"]
        rows.append([f"sequential read, cold ({how})", _num(cold["bytes_per_s"]["median"] / MB), "MB/s",
                     _rng(cold["bytes_per_s"], MB)])
    if lim.get("download"):
        d = lim["download"]["bytes_per_s"]
        rows.append(["download (fsspec, sequential)", _num(d["median"] / MB), "MB/s", _rng(d, MB)])
    for key, label in (("read_warm", "sequential read, warm (page cache)"), ("memcpy", "memcpy (1 thread)")):
        if lim.get(key):
            s = lim[key]["bytes_per_s"]
            rows.append([label, _num(s["median"] / MB), "MB/s", _rng(s, MB)])
    for cache in ("cold", "warm"):
        g = lim.get(f"gather_{cache}")
        if g:
            label = f"random gather of the samples' bytes, {cache} (1 thread)"
            rows.append([label, _num(g["bytes_per_s"]["median"] / MB), "MB/s", _rng(g["bytes_per_s"], MB)])
            rows.append(["  same, samples", _num(g["samples_per_s"]["median"]), "samples/s", _rng(g["samples_per_s"])])
    jd = lim.get("jpeg_decode")
    if jd:
        s = jd["images_per_s_per_core"]
        rows.append([f"JPEG decode ({jd['decoder']}, {jd['mean_jpeg_bytes'] / 1e3:.0f} kB), 1 core",
                     _num(s["median"]), "img/s", _rng(s)])
        rows.append([f"JPEG decode ceiling, x {jd['cores']} cores", _num(jd["images_per_s"]), "img/s", ""])
    return ["RAW LIMITS (median [min-max] over repeats)", *_grid(["what", "value", "unit", "range"], rows)]


def _backends(res: dict[str, Any]) -> list[str]:
    rows = []
    for b in res["backends"]:
        s, m = b["samples_per_s"], b["bytes_per_s"]
        note = ""
        if b.get("resident_after_evict") is not None and b["resident_after_evict"] > 0.1:
            note = f"eviction incomplete ({100 * b['resident_after_evict']:.0f}% resident)"
        rows.append([b["backend"], b["cache"], _num(s["median"]), _rng(s), _num(m["median"] / MB),
                     _pct(b["pct_of_limit"]), b["limit"], _pct(b.get("vs_gather")), note])
    cfg = res["config"]
    head = (f"BACKENDS (1 thread, open + shuffled get_batch of {cfg['batch_size']}; % of the same-cache read limit; "
            "% gather = samples/s / the same-cache random gather's)")
    header = ["backend", "cache", "samples/s", "range", "MB/s", "% limit", "limit", "% gather", "note"]
    return [head, *_grid(header, rows, left=2)]


def _loaders(res: dict[str, Any]) -> list[str]:
    rows = []
    for r in res["loaders"]:
        s = r["samples_per_s"]
        rows.append([
            ("* " if r["best"] else "  ") + LABELS.get(r["loader"], r["loader"]), str(r["num_workers"]),
            _num(s["median"]), _rng(s),
            _num(r["bytes_per_s"]["median"] / MB), _pct(r["pct_of_limit"]), _ratio(r["vs_torch"]),
            _num(r["first_batch_ms"]["median"], 1), _num(r["p50_ms"]["median"], 1), _num(r["p99_ms"]["median"], 1),
            _num(r["cpu_percent"]["median"]), _num(r["peak_rss_bytes"] / 2**20),
        ])
    header = ["loader", "workers", "samples/s", "range", "MB/s", "% raw", "vs torch", "1st batch ms",
              "p50 ms", "p99 ms", "CPU %", "RSS MiB"]
    head = ("LOADERS (shuffled epochs; * = best workers per loader; % raw = MB/s / warm read limit; "
            "vs torch = samples/s / the best torch row's)")
    return [head, *_grid(header, rows)]


def _step(res: dict[str, Any]) -> list[str]:
    st = res["step"]
    rows = []
    for r in st["rows"]:
        rows.append([("* " if r["best"] else "  ") + LABELS.get(r["loader"], r["loader"]), str(r["num_workers"]),
                     _num(r["step_wall_ms"]["median"], 1),
                     _pct(r["data_stall"]["median"]), "yes" if r["input_bound"] else "no", r["bottleneck"] or "-"])
    head = (f"TRAINING STEP ({st['step_ms']:g} ms {st['kind']} on {st['device']} per batch; data stall = "
            f"time waiting for input / wall; * = lowest stall per loader)")
    header = ["loader", "workers", "ms/step", "data stall", "input-bound", "bottleneck"]
    return [head, *_grid(header, rows)]


def format_table(res: dict[str, Any]) -> str:
    """The human-readable report."""
    ds, cfg, m = res["dataset"], res["config"], res["machine"]
    lines = [
        f"fastload bench: {ds['description']}",
        f"  {ds['samples']:,} samples, {ds['bytes'] / 2**20:,.0f} MiB in {ds['files']} files "
        f"({ds['mean_sample_bytes'] / 1e3:.1f} kB/sample) | {m['cores']} cores | torch {m['torch']} | "
        f"device {cfg['device']} | batch {cfg['batch_size']} | {cfg['repeats']} repeats x <= {cfg['seconds']:g} s",
        "",
        *_limits(res),
        "",
        *_backends(res),
        "",
        *_loaders(res),
    ]
    if res.get("step"):
        lines += ["", *_step(res)]
    lines += ["", "SUMMARY", *("  " + s for s in res["summary"]["lines"])]
    lines.append(f"  (total wall time {res['wall_s']:.0f} s)")
    return "\n".join(lines)


def write_json(res: dict[str, Any], path: str) -> None:
    """Write the results `res` to `path` as indented JSON (keys in insertion order), creating its
    directory if needed."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(res, fh, indent=2, sort_keys=False)
        fh.write("\n")


_COLORS = {"fastload": "#4c72b0", "fastload-views": "#3a5a8c", "torch": "#dd8452", "torch-batched": "#c9a26b"}


def _bar_note(row: dict[str, Any]) -> str:
    """The text beside a bar: samples/s, and for loaders the ratio to the best torch row."""
    note = f"{row['samples_per_s']['median']:,.0f} samples/s"
    if row.get("vs_torch") is not None:
        note += f"  ({row['vs_torch']:.2f}x torch)"
    return note


def write_plot(res: dict[str, Any], path: str) -> None:
    """Horizontal bars of MB/s (median, min-max whiskers), each labelled with its samples/s (and
    for loaders its ratio to the best torch row), with the raw read limits drawn as lines (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install 'fastload[plot]'") from exc
    groups = [
        ("storage backends alone (1 thread, shuffled batches)",
         [(f"{b['backend']} {b['cache']}", b, b["backend"]) for b in res["backends"]]),
        ("loaders (shuffled epochs; what a training loop sees)",
         [(f"{LABELS.get(r['loader'], r['loader'])}, {plural(r['num_workers'], 'worker')}", r, r["loader"])
          for r in res["loaders"]]),
    ]
    groups = [g for g in groups if g[1]]
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 1.4 + 0.45 * sum(len(g[1]) for g in groups) + len(groups)),
                             squeeze=False)
    limits = res["limits"]
    top = max([b[1]["bytes_per_s"]["max"] / MB for g in groups for b in g[1]]
              + [limits[k]["bytes_per_s"]["median"] / MB for k in ("read_warm", "read_cold") if limits.get(k)])
    for ax, (title, bars) in zip(axes[:, 0], groups):
        labels = [b[0] for b in bars]
        stats = [b[1]["bytes_per_s"] for b in bars]
        med = [st["median"] / MB for st in stats]
        err = [[m - st["min"] / MB for m, st in zip(med, stats)], [st["max"] / MB - m for m, st in zip(med, stats)]]
        colors = [_COLORS.get(b[2], "#55a868") for b in bars]
        ax.barh(labels, med, xerr=err, color=colors, capsize=3)
        for y, (st, b) in enumerate(zip(stats, bars)):  # beside the whisker's end
            ax.text(st["max"] / MB + top * 0.01, y, _bar_note(b[1]), va="center", ha="left", fontsize=8)
        ax.invert_yaxis()
        for key, style in (("read_warm", "--"), ("read_cold", ":")):
            if limits.get(key):
                value = limits[key]["bytes_per_s"]["median"] / MB
                ax.axvline(value, color="#c44e52", ls=style, label=f"raw read limit, {key[5:]}: {value:,.0f} MB/s")
        ax.set_xlim(0, top * 1.05)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("MB/s of payload (bar: median; whiskers: min-max over repeats)")
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"fastload bench: {res['dataset']['description']}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
