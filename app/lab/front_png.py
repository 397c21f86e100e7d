"""The Pareto front as a PNG image, rasterised here with numpy and zlib (no imaging library).

The same picture as `sweep_report.svg_plot` without its words: frame, grid,
tick numbers (a 3x5 pixel digit font, drawn at twice its size), every row
as a blue dot, the front as a red line through red rings.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

#: 3x5 glyphs, rows top to bottom, "1" = ink
FONT = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    ".": ("000", "000", "000", "000", "010"), "-": ("000", "000", "111", "000", "000"),
    "+": ("000", "010", "111", "010", "000"), "%": ("101", "001", "010", "100", "101"),
    "e": ("000", "111", "111", "100", "111"),
}
BLUE, RED, GREY, BLACK = (44, 127, 184), (192, 57, 43), (221, 221, 221), (0, 0, 0)


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.px = np.full((height, width, 3), 255, dtype=np.uint8)

    def dot(self, x: float, y: float, r: float, colour, ring: bool = False) -> None:
        h, w, _ = self.px.shape
        yy, xx = np.ogrid[:h, :w]
        d2 = (xx - x) ** 2 + (yy - y) ** 2
        mask = (d2 <= r * r) & ((d2 >= (r - 2) ** 2) if ring else True)
        self.px[mask] = colour

    def line(self, x0: float, y0: float, x1: float, y1: float, colour, width: int = 1) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        h, w, _ = self.px.shape
        for t in np.linspace(0.0, 1.0, n):
            x, y = int(round(x0 + t * (x1 - x0))), int(round(y0 + t * (y1 - y0)))
            self.px[max(0, y - width // 2): min(h, y + width - width // 2),
                    max(0, x - width // 2): min(w, x + width - width // 2)] = colour

    def text(self, x: int, y: int, s: str, anchor: str = "middle", scale: int = 2) -> None:
        glyphs = [FONT[c] for c in s if c in FONT]
        width = len(glyphs) * 4 * scale
        x = x - width // 2 if anchor == "middle" else x - width if anchor == "end" else x
        for i, glyph in enumerate(glyphs):
            for row, bits in enumerate(glyph):
                for col, bit in enumerate(bits):
                    if bit == "1":
                        gx, gy = x + (4 * i + col) * scale, y + row * scale
                        self.px[gy: gy + scale, gx: gx + scale] = BLACK

    def png(self) -> bytes:
        h, w, _ = self.px.shape
        raw = b"".join(b"\x00" + self.px[row].tobytes() for row in range(h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")


def png_plot(layout, pts: list[tuple[float, float]], front: list[tuple[float, float]]) -> bytes:
    """`layout` is sweep_report.PlotLayout; points are (hit %, ΔNLL)."""
    c = Canvas(layout.width, layout.height)
    L, R, T, B = layout.left, layout.width - layout.right, layout.top, layout.height - layout.bottom
    for t in layout.x_ticks:
        c.line(layout.sx(t), T, layout.sx(t), B, GREY)
        c.text(int(layout.sx(t)), B + 8, f"{t:g}%")
    for t in layout.y_ticks:
        c.line(L, layout.sy(t), R, layout.sy(t), GREY)
        c.text(L - 6, int(layout.sy(t)) - 5, f"{t:.3g}", anchor="end")
    for x0, y0, x1, y1 in ((L, T, R, T), (L, B, R, B), (L, T, L, B), (R, T, R, B)):
        c.line(x0, y0, x1, y1, BLACK)
    for (xa, ya), (xb, yb) in zip(front, front[1:]):
        c.line(layout.sx(xa), layout.sy(ya), layout.sx(xb), layout.sy(yb), RED, width=2)
    for x, y in pts:
        c.dot(layout.sx(x), layout.sy(y), 3.5, BLUE)
    for x, y in front:
        c.dot(layout.sx(x), layout.sy(y), 5.5, RED, ring=True)
    return c.png()
