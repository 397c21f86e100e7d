"""A sweep's rows as a table (text, markdown, CSV), their Pareto front, and its plots.

The front is hit rate against cost: a row is on it when no other row has a
RAM hit at least as high and a Δ NLL at least as low, one of them strictly.
The terminal plot is plotext's; the file plot is an SVG drawn here (axes,
ticks, every row as a dot, the front as a line with its rows labelled).
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass
from html import escape
from pathlib import Path

from tierlab.engine.errors import TierlabError

#: (key, title, kind): kind "pct" = fraction shown in percent, "nll"/"num" = plain numbers
COLUMNS = (
    ("row", "row", "str"), ("cache", "cache", "int"), ("ram_hit", "RAM hit", "pct"),
    ("oracle_hit", "Belady", "pct"), ("miss_reduction", "miss −", "pct"), ("swap", "swap", "pct"),
    ("route_agree", "route agree", "pct"), ("tf_nll", "TF-NLL", "num4"), ("dnll", "ΔNLL", "nll"),
    ("dnll_lo", "ΔNLL lo", "nll"), ("dnll_hi", "ΔNLL hi", "nll"), ("dppl_pct", "Δppl %", "num2"),
    ("agree", "top-1 agree", "pct"), ("kl_mean", "KL mean", "num3"), ("kl_p99", "KL p99", "num3"),
    ("flips", "flips", "pct"), ("gate", "gate", "str"),
)


def show(value, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "nll":
        return f"{value:+.4f}" if value != 0 else "0.0000"
    if kind == "num2":
        return f"{value:+.2f}" if value != 0 else "0.00"
    if kind == "num4":
        return f"{value:.4f}"
    if kind == "num3":
        return f"{value:.3f}"
    return str(value)


def pareto_front(rows: list[dict]) -> list[dict]:
    """Rows no other row beats on both RAM hit (higher) and Δ NLL (lower), by rising hit rate."""
    pts = [r for r in rows if r.get("ram_hit") is not None and r.get("dnll") is not None]
    front = []
    for r in pts:
        beaten = any(o["ram_hit"] >= r["ram_hit"] and o["dnll"] <= r["dnll"]
                     and (o["ram_hit"] > r["ram_hit"] or o["dnll"] < r["dnll"]) for o in pts)
        if not beaten:
            front.append(r)
    return sorted(front, key=lambda r: (r["ram_hit"], r["dnll"]))


def shown_columns(rows: list[dict]) -> tuple:
    """The columns, the gate verdict only where the rows were judged (`tierlab sweep` judges them)."""
    return tuple(c for c in COLUMNS if c[0] != "gate" or any("gate" in r for r in rows))


def render_table(rows: list[dict], markdown: bool = False) -> str:
    front = {id(r) for r in pareto_front(rows)}
    columns = shown_columns(rows)
    head = [t for _, t, _ in columns] + ["front"]
    body = [[show(r.get(k), kind) for k, _, kind in columns] + ["*" if id(r) in front else ""] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), *(fmt(c) for c in body)])


def render_csv(rows: list[dict]) -> str:
    keys = [k for k, _, _ in shown_columns(rows)] + ["dnll_lo", "kl_p50", "flip_count", "ppl", "shadow_hit", "route_kl",
                                          "tokens", "baseline"]
    keys = list(dict.fromkeys(keys))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(keys)
    for r in rows:
        writer.writerow(["" if r.get(k) is None else r.get(k) for k in keys])
    return buf.getvalue()


def terminal_plot(rows: list[dict], width: int = 78, height: int = 20) -> str:
    """plotext: every row, the front as a line; no colour codes."""
    import plotext as plt

    pts = [r for r in rows if r.get("ram_hit") is not None and r.get("dnll") is not None]
    front = pareto_front(rows)
    plt.clear_figure()
    plt.plot_size(width, height)
    plt.theme("clear")
    plt.scatter([100 * r["ram_hit"] for r in pts], [r["dnll"] for r in pts], marker="x", label="rows")
    if front:
        plt.plot([100 * r["ram_hit"] for r in front], [r["dnll"] for r in front], marker="o", label="front")
    plt.title("Pareto front: RAM hit % vs ΔNLL (nats/token vs baseline)")
    plt.xlabel("RAM hit %")
    text = plt.build()
    plt.clear_figure()
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1e-6
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


@dataclass(frozen=True)
class PlotLayout:
    """Where the front's plot puts things: canvas, margins, data ranges (hit % and ΔNLL), ticks."""

    x0: float
    x1: float
    y0: float
    y1: float
    width: int = 720
    height: int = 440
    left: int = 80
    right: int = 30
    top: int = 40
    bottom: int = 60

    @classmethod
    def around(cls, pts: list[tuple[float, float]]) -> "PlotLayout":
        xs = [x for x, _ in pts] or [0.0, 100.0]
        ys = [y for _, y in pts] or [0.0, 1.0]
        padx = (max(xs) - min(xs)) * 0.05 or 1.0
        pady = (max(ys) - min(ys)) * 0.08 or 0.01
        return cls(min(xs) - padx, max(xs) + padx, min(ys) - pady, max(ys) + pady)

    def sx(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * (self.width - self.left - self.right)

    def sy(self, y: float) -> float:
        return self.height - self.bottom - (y - self.y0) / (self.y1 - self.y0) * (self.height - self.top - self.bottom)

    @property
    def x_ticks(self) -> list[float]:
        return _ticks(self.x0, self.x1)

    @property
    def y_ticks(self) -> list[float]:
        return _ticks(self.y0, self.y1)


def _points(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    pts = [r for r in rows if r.get("ram_hit") is not None and r.get("dnll") is not None]
    return pts, pareto_front(rows)


def svg_plot(rows: list[dict], title: str = "Pareto front: RAM hit vs ΔNLL") -> str:
    """The front as a standalone SVG document."""
    pts, front = _points(rows)
    lay = PlotLayout.around([(100 * r["ram_hit"], r["dnll"]) for r in pts])
    W, H, L, R, T, B = lay.width, lay.height, lay.left, lay.right, lay.top, lay.bottom
    sx, sy = lay.sx, lay.sy
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="black"/>']
    for t in lay.x_ticks:
        out.append(f'<line x1="{sx(t):.1f}" y1="{H - B}" x2="{sx(t):.1f}" y2="{T}" stroke="#ddd"/>')
        out.append(f'<text x="{sx(t):.1f}" y="{H - B + 16}" text-anchor="middle">{t:g}%</text>')
    for t in lay.y_ticks:
        out.append(f'<line x1="{L}" y1="{sy(t):.1f}" x2="{W - R}" y2="{sy(t):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:.3g}</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 18}" text-anchor="middle">RAM hit</text>')
    out.append(f'<text x="18" y="{(T + H - B) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 18 {(T + H - B) / 2})">ΔNLL (nats/token vs baseline)</text>')
    if len(front) > 1:
        path = " ".join(f"{sx(100 * r['ram_hit']):.1f},{sy(r['dnll']):.1f}" for r in front)
        out.append(f'<polyline points="{path}" fill="none" stroke="#c0392b" stroke-width="2"/>')
    for r in pts:
        out.append(f'<circle cx="{sx(100 * r["ram_hit"]):.1f}" cy="{sy(r["dnll"]):.1f}" r="3.5" fill="#2c7fb8">'
                   f'<title>{escape(r["row"])} (CACHE={r.get("cache")})</title></circle>')
    for r in front:
        out.append(f'<circle cx="{sx(100 * r["ram_hit"]):.1f}" cy="{sy(r["dnll"]):.1f}" r="5" fill="none" '
                   'stroke="#c0392b" stroke-width="2"/>')
        out.append(f'<text x="{sx(100 * r["ram_hit"]) + 7:.1f}" y="{sy(r["dnll"]) - 7:.1f}" font-size="10">'
                   f'{escape(r["row"])} c{r.get("cache")}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def png_plot(rows: list[dict]) -> bytes:
    """The front as a PNG image (app/lab/front_png.py rasterises it)."""
    from tierlab.app.lab.front_png import png_plot as rasterise

    pts, front = _points(rows)
    xy = lambda rs: [(100 * r["ram_hit"], r["dnll"]) for r in rs]  # noqa: E731
    return rasterise(PlotLayout.around(xy(pts)), xy(pts), xy(front))


PLOT_KINDS = (".svg", ".png")


def write_plot(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    if path.suffix.lower() not in PLOT_KINDS:
        raise TierlabError(f"--plot {path}: write a .svg or .png file")
    try:
        if path.suffix.lower() == ".png":
            path.write_bytes(png_plot(rows))
        else:
            path.write_text(svg_plot(rows), encoding="utf-8")
    except OSError as exc:
        raise TierlabError(f"--plot {path}: cannot write: {exc.strerror}") from None
