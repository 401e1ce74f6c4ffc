"""A line chart as a PNG, with nothing but the standard library (zlib, struct): bench/ttl.py's loss-against-seconds
plot, written the same on the GPU machine and in CI, with no plotting package to install.

The chart: one polyline per series (with a dot at each point), light grid lines at round tick values (1, 2 or 5 times a
power of ten), tick numbers, axis titles, a title, an optional dashed horizontal reference line, and a legend. Text is
drawn from a 5 x 7 pixel font (FONT: digits, lowercase letters, a little punctuation; capitals are drawn lowercase).
PNG: 8-bit RGB, one IDAT of zlib-compressed rows each with filter byte 0.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

Color = tuple[int, int, int]
COLORS: list[Color] = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]
GRID, AXIS, TEXT, WHITE = (225, 225, 225), (60, 60, 60), (20, 20, 20), (255, 255, 255)

# each glyph: 7 rows of 5 bits, most significant bit leftmost (the HD44780 character ROM's 5 x 7 shapes)
FONT = {
    "0": "0e 11 13 15 19 11 0e", "1": "04 0c 04 04 04 04 0e", "2": "0e 11 01 02 04 08 1f", "3": "1f 02 04 02 01 11 0e",
    "4": "02 06 0a 12 1f 02 02", "5": "1f 10 1e 01 01 11 0e", "6": "06 08 10 1e 11 11 0e", "7": "1f 01 02 04 08 08 08",
    "8": "0e 11 11 0e 11 11 0e", "9": "0e 11 11 0f 01 02 0c", "a": "00 00 0e 01 0f 11 0f", "b": "10 10 16 19 11 11 1e",
    "c": "00 00 0e 10 10 11 0e", "d": "01 01 0d 13 11 11 0f", "e": "00 00 0e 11 1f 10 0e", "f": "06 09 08 1c 08 08 08",
    "g": "00 00 0f 11 0f 01 0e", "h": "10 10 16 19 11 11 11", "i": "04 00 0c 04 04 04 0e", "j": "02 00 06 02 02 12 0c",
    "k": "10 10 12 14 18 14 12", "l": "0c 04 04 04 04 04 0e", "m": "00 00 1a 15 15 11 11", "n": "00 00 16 19 11 11 11",
    "o": "00 00 0e 11 11 11 0e", "p": "00 00 1e 11 1e 10 10", "q": "00 00 0d 13 0f 01 01", "r": "00 00 16 19 10 10 10",
    "s": "00 00 0e 10 0e 01 1e", "t": "08 08 1c 08 08 09 06", "u": "00 00 11 11 11 13 0d", "v": "00 00 11 11 11 0a 04",
    "w": "00 00 11 11 15 15 0a", "x": "00 00 11 0a 04 0a 11", "y": "00 00 11 11 0f 01 0e", "z": "00 00 1f 02 04 08 1f",
    ".": "00 00 00 00 00 0c 0c", ",": "00 00 00 00 0c 04 08", "-": "00 00 00 1f 00 00 00", ":": "00 0c 0c 00 0c 0c 00",
    "(": "02 04 08 08 08 04 02", ")": "08 04 02 02 02 04 08", "/": "00 01 02 04 08 10 00", "'": "0c 04 08 00 00 00 00",
    "%": "18 19 02 04 08 13 03", "=": "00 00 1f 00 1f 00 00", "+": "00 04 04 1f 04 04 00", "_": "00 00 00 00 00 00 1f",
    " ": "00 00 00 00 00 00 00", "?": "0e 11 01 02 04 00 04",
}  # fmt: skip
GLYPH_W, GLYPH_H, SCALE = 5, 7, 2  # pixels of a glyph, and each font pixel drawn as SCALE x SCALE


def glyph_rows(ch: str) -> list[int]:
    code = FONT.get(ch, FONT["?"]).replace(" ", "")
    return [int(code[i : i + 2], 16) for i in range(0, 14, 2)]


class Canvas:
    """An RGB image of w x h pixels, white, drawn on by pixel, line, rectangle and text."""

    def __init__(self, w: int, h: int) -> None:
        self.w, self.h = w, h
        self.px = bytearray(WHITE * (w * h))

    def pixel(self, x: int, y: int, c: Color) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i : i + 3] = bytes(c)

    def rect(self, x0: int, y0: int, x1: int, y1: int, c: Color) -> None:
        """Filled, corners inclusive."""
        for y in range(max(0, min(y0, y1)), min(self.h, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.w, max(x0, x1) + 1)):
                self.pixel(x, y, c)

    def line(self, x0: float, y0: float, x1: float, y1: float, c: Color, width: int = 1, dash: int = 0) -> None:
        """A straight line of `width` pixels (Bresenham's points, each stamped width x width); dash > 0: dashes and
        gaps of that many steps."""
        x0, y0, x1, y1 = (int(round(v)) for v in (x0, y0, x1, y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, n = dx + dy, 0
        while True:
            if not dash or (n // dash) % 2 == 0:
                self.rect(x0 - width // 2, y0 - width // 2, x0 + (width - 1) // 2, y0 + (width - 1) // 2, c)
            if x0 == x1 and y0 == y1:
                return
            e2, n = 2 * err, n + 1
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, c: Color = TEXT, anchor: str = "left") -> None:
        """s with its top at y, starting at x (anchor "left"), ending at x ("right") or centred on x ("center")."""
        w = text_width(s)
        x -= {"left": 0, "right": w, "center": w // 2}[anchor]
        for k, ch in enumerate(s.lower()):
            for r, bits in enumerate(glyph_rows(ch)):
                for col in range(GLYPH_W):
                    if bits >> (GLYPH_W - 1 - col) & 1:
                        gx, gy = x + k * (GLYPH_W + 1) * SCALE + col * SCALE, y + r * SCALE
                        self.rect(gx, gy, gx + SCALE - 1, gy + SCALE - 1, c)

    def png(self) -> bytes:
        rows = b"".join(b"\x00" + bytes(self.px[3 * self.w * y : 3 * self.w * (y + 1)]) for y in range(self.h))

        def chunk(kind: bytes, body: bytes) -> bytes:
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")
        )


def text_width(s: str) -> int:
    return max(0, len(s) * (GLYPH_W + 1) * SCALE - SCALE)


def ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten apart) from lo to hi, about n of them."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def label(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.2f}".rstrip("0").rstrip(".")


def line_chart(
    path: Path,
    series: dict[str, list[tuple[float, float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    hline: tuple[float, str] | None = None,
    size: tuple[int, int] = (960, 600),
) -> None:
    """Write the chart of series (label -> [(x, y)], in order) to path as a PNG; hline: (y, its label)."""
    w, h = size
    cv = Canvas(w, h)
    left, right, top, bottom = 90, w - 30, 64, h - 70
    points = [p for pts in series.values() for p in pts] + ([(0.0, hline[0])] if hline else [])
    xs, ys = [0.0] + [x for x, _ in points], [y for _, y in points] or [0.0, 1.0]
    x0, x1 = 0.0, max(xs) * 1.03 or 1.0
    pad = (max(ys) - min(ys)) * 0.05 or 0.5
    y0, y1 = min(ys) - pad, max(ys) + pad

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

    for v in ticks(x0, x1):
        X, _ = at(v, y0)
        cv.line(X, top, X, bottom, GRID)
        cv.text(int(X), bottom + 8, label(v), anchor="center")
    for v in ticks(y0, y1):
        _, Y = at(x0, v)
        cv.line(left, Y, right, Y, GRID)
        cv.text(left - 8, int(Y) - GLYPH_H * SCALE // 2, label(v), anchor="right")
    cv.line(left, bottom, right, bottom, AXIS, 2)
    cv.line(left, top, left, bottom, AXIS, 2)
    if hline:
        _, Y = at(x0, hline[0])
        cv.line(left, Y, right, Y, AXIS, 1, dash=6)
        cv.text(right - 4, int(Y) - GLYPH_H * SCALE - 4, hline[1], AXIS, anchor="right")
    for k, (name, pts) in enumerate(series.items()):
        c = COLORS[k % len(COLORS)]
        for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
            cv.line(*at(xa, ya), *at(xb, yb), c, 2)
        for x, y in pts:
            X, Y = at(x, y)
            cv.rect(int(X) - 2, int(Y) - 2, int(X) + 2, int(Y) + 2, c)
    cv.text(w // 2, 10, title, anchor="center")
    cv.text((left + right) // 2, h - 30, xlabel, anchor="center")
    cv.text(8, top - 26, ylabel)
    legend(cv, right - 12, top + 12, list(series), AXIS)
    Path(path).write_bytes(cv.png())


def legend(cv: Canvas, x1: int, y0: int, names: list[str], border: Color) -> None:
    """The series' colours and names in a framed white box whose top right corner is (x1, y0)."""
    x0, row = x1 - max(map(text_width, names)) - 60, GLYPH_H * SCALE + 10
    y1 = y0 + row * len(names) + 10
    cv.rect(x0, y0, x1, y1, border)
    cv.rect(x0 + 1, y0 + 1, x1 - 1, y1 - 1, WHITE)
    for k, name in enumerate(names):
        y = y0 + 10 + k * row
        cv.line(x0 + 10, y + GLYPH_H * SCALE // 2, x0 + 40, y + GLYPH_H * SCALE // 2, COLORS[k % len(COLORS)], 3)
        cv.text(x0 + 50, y, name)
