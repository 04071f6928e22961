"""PNG frames for the dashboard: a metric's curve and the memory bars, drawn with Agg.

Only matplotlib's object-oriented API (``Figure`` + ``FigureCanvasAgg``): pyplot's global
state would leak figures into the user's notebook and is not thread-safe. A full draw and
``savefig`` cost ~40-60 ms a frame (FACTS.md), so each plot keeps its figure and a copy
of the static parts (axes, ticks, labels): a frame restores that background, draws only
the data artists and encodes the pixels with Pillow at low compression. Axes are redrawn
only when the data leaves them (with headroom, so that is rare). Imported by the dashboard
on its UI thread, never at ``import nbaccel``; never imports torch.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib import font_manager
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from PIL import Image, ImageDraw, ImageFont

from nbaccel.ui.dashboard.model import MemoryReading
from nbaccel.ui.dashboard.text import size_text

MAX_DRAWN_POINTS = 2000  # a line with more points than pixels only costs time
_FONT = 8


def _png(canvas: Any) -> bytes:
    return _encode(_pixels(canvas))


def _pixels(canvas: Any) -> Image.Image:
    width, height = canvas.get_width_height()
    image = Image.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    return image.convert("RGB")


def _encode(image: Image.Image) -> bytes:
    out = io.BytesIO()
    # Level 1: ~3x faster than the default for a few % more bytes on flat plot images.
    image.save(out, format="PNG", compress_level=1)
    return out.getvalue()


def _figure(width_px: int, height_px: int, dpi: int) -> tuple[Figure, Any]:
    # The canvas is typed Any: Agg's blitting methods carry no annotations.
    figure = Figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi)
    return figure, FigureCanvasAgg(figure)


def _thin(steps: Sequence[float], values: Sequence[float]) -> tuple[list[float], list[float]]:
    stride = max(1, math.ceil(len(steps) / MAX_DRAWN_POINTS))
    xs, ys = list(steps[::stride]), list(values[::stride])
    if stride > 1 and xs[-1] != steps[-1]:  # always show the latest point
        xs.append(steps[-1])
        ys.append(values[-1])
    return xs, ys


Overlay = tuple[str, Sequence[float], Sequence[float]]  # (label, steps, values)
OVERLAY_COLOURS = ("tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink")


class CurvePlot:
    """One metric against step, blitted onto a cached background; earlier runs as overlays.

    The latest value is not drawn as text: laying out a text artist cost ~3 ms a frame,
    as much as the rest of the frame; the dashboard prints it beside the image instead.
    Overlays (earlier runs' series) do not change, so they are drawn into the background.

    The x axis ends where the run says it will (``total``: a ``total_steps`` metric or the
    tqdm bar's total); without one it grows with the steps (by half again, at least 8 steps,
    so full redraws stay rare); the final frame (``final=True``) fits the steps logged.

    >>> plot = CurvePlot()
    >>> png = plot.render("loss", [0, 1, 2], [2.0, 1.5, 1.2])
    >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n", plot.full_draws, plot.xlim
    (True, 1, (0.0, 10.0))
    >>> _ = plot.render("loss", [0, 1, 2, 3], [2.0, 1.5, 1.2, 1.1])
    >>> plot.full_draws  # the new point fits the axes: only the line was drawn
    1
    >>> _ = plot.render("loss", [0, 1, 2, 3], [2.0, 1.5, 1.2, 1.1], final=True)
    >>> plot.xlim
    (0.0, 3.0)
    """

    def __init__(self, width_px: int = 640, height_px: int = 240, dpi: int = 80) -> None:
        self._figure, self._canvas = _figure(width_px, height_px, dpi)
        self._axes = self._figure.add_subplot()
        self._figure.subplots_adjust(left=0.09, right=0.98, top=0.88, bottom=0.15)
        self._axes.tick_params(labelsize=_FONT)
        self._axes.grid(True, alpha=0.3)
        (self._line,) = self._axes.plot([], [], color="tab:blue", lw=1.2, animated=True)
        self._overlay_lines: list[Any] = []
        self._key: tuple[Any, ...] | None = None
        self._background: Any = None
        self.full_draws = 0

    @property
    def xlim(self) -> tuple[float, float]:
        """The x axis's limits now (tests, and the browser test's check of the axis)."""
        low, high = self._axes.get_xlim()
        return float(low), float(high)

    @property
    def ylim(self) -> tuple[float, float]:
        low, high = self._axes.get_ylim()
        return float(low), float(high)

    def render(
        self,
        name: str,
        steps: Sequence[float],
        values: Sequence[float],
        total: float | None = None,
        *,
        final: bool = False,
        overlays: Sequence[Overlay] = (),
    ) -> bytes:
        """A PNG of ``values`` against ``steps`` titled ``name``; ``total``: the last step
        if known; ``final``: the run ended (fit the axes to the data); ``overlays``: earlier
        runs' series of the same metric, drawn thinner in other colours."""
        finite = [v for v in values if math.isfinite(v)]
        for _, _, other in overlays:
            finite += [v for v in other if math.isfinite(v)]
        shape = (name, final, total, tuple((label, len(xs)) for label, xs, _ in overlays))
        if self._needs_axes(shape, steps, overlays, finite):
            self._set_axes(shape, steps, finite, total, overlays)
        self._canvas.restore_region(self._background)
        xs, ys = _thin(steps, values) if steps else ([], [])
        self._line.set_data(xs, ys)
        self._axes.draw_artist(self._line)
        return _png(self._canvas)

    def _needs_axes(
        self,
        shape: tuple[Any, ...],
        steps: Sequence[float],
        overlays: Sequence[Overlay],
        finite: list[float],
    ) -> bool:
        if self._key is None or self._key[0] != shape:
            return True
        x1, (y0, y1) = self._key[1][1], self._key[2]
        if not steps or not finite:
            return False
        # Only when the data leaves the axes: the limits have headroom, so that is rare.
        return bool(steps[-1] > x1 or min(finite) < y0 or max(finite) > y1)

    def _set_axes(
        self,
        shape: tuple[Any, ...],
        steps: Sequence[float],
        finite: list[float],
        total: float | None,
        overlays: Sequence[Overlay],
    ) -> None:
        name, final = shape[0], shape[1]
        starts = [float(steps[0])] if steps else []
        ends = [float(steps[-1])] if steps else []
        for _, xs, _ in overlays:
            starts += [float(xs[0])] if len(xs) else []
            ends += [float(xs[-1])] if len(xs) else []
        first = min(starts, default=0.0)
        last = max(ends, default=1.0)
        if final:
            end = last if last > first else first + 1.0
        elif total and total > last:
            end = float(total)
        else:
            end = last + max(last * 0.5, 8.0)
        xlim = (first, end)
        low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
        pad = (high - low) * (0.05 if final else 0.25) or abs(high) * 0.1 or 1.0
        ylim = (low - pad, high + pad)
        axes = self._axes
        for line in self._overlay_lines:
            line.remove()
        self._overlay_lines = []
        for index, (label, xs, ys) in enumerate(overlays):
            colour = OVERLAY_COLOURS[index % len(OVERLAY_COLOURS)]
            (line,) = axes.plot(*_thin(xs, ys), color=colour, lw=1.0, alpha=0.8, label=label)
            self._overlay_lines.append(line)
        axes.set_xlim(*xlim)
        axes.set_ylim(*ylim)
        axes.set_title(name, fontsize=_FONT + 1, loc="left")
        self._canvas.draw()  # the animated line is left out of the background
        self._background = self._canvas.copy_from_bbox(self._figure.bbox)
        self._key = (shape, xlim, ylim)
        self.full_draws += 1


def _unit(largest: float) -> tuple[str, float]:
    return ("GiB", 2.0**30) if largest >= 2**30 else ("MiB", 2.0**20)


class MemoryBars:
    """One horizontal bar per device: current (filled), peak (dark tick), limit (grey).

    The background (axes, labels, limits) depends only on the devices, their limits and
    the scale; the bars and peak ticks are drawn over it each frame, so the run's end costs
    a blit, not a full draw (~30 ms). The texts over the bars ("n/a", and the peak once the
    run ended) are written by Pillow on the frame's pixels, in matplotlib's own font: a
    matplotlib text costs ~1 ms to lay out and draw, a third of the end's frame.

    >>> bars = MemoryBars()
    >>> png = bars.render([MemoryReading("cuda:0", 2**30, 2**31, 2**34),
    ...                    MemoryReading("rank 1 (xla)", None, None, None)])
    >>> _ = bars.render([MemoryReading("cuda:0", 2**30, 2**31, 2**34, last=2**30),
    ...                  MemoryReading("rank 1 (xla)", None, None, None)], ended=True)
    >>> png.startswith(b"\\x89PNG"), bars.full_draws, bars.texts
    (True, 1, ['peak 2.0 GiB', 'peak n/a'])
    """

    def __init__(self, width_px: int = 640, height_px: int = 140, dpi: int = 80) -> None:
        self._figure, self._canvas = _figure(width_px, height_px, dpi)
        self._axes = self._figure.add_subplot()
        self._axes.tick_params(labelsize=_FONT)
        self._key: tuple[Any, ...] | None = None
        self._background: Any = None
        self._bars: list[Any] = []
        # (x, y) in pixels from the top left, words, colour: written over each frame.
        self._texts: list[tuple[tuple[float, float], str, str]] = []
        self._font = ImageFont.truetype(font_manager.findfont(FontProperties()), _FONT * dpi / 72)
        (self._peaks,) = self._axes.plot([], [], color="black", lw=2.5, animated=True)
        self.full_draws = 0

    @property
    def texts(self) -> list[str]:
        """What the last frame wrote over its bars, top to bottom."""
        return [words for _, words, _ in self._texts]

    def render(self, readings: Sequence[MemoryReading], *, ended: bool = False) -> bytes:
        """A PNG of the readings (``current``/``peak`` None: drawn as "n/a"). Once the run
        ``ended`` its workers are gone, so each bar is the device's peak (what the run
        needed), its figure written over it."""
        xmax = self._scale(readings)
        key = (tuple(r.device for r in readings), tuple(r.limit for r in readings), xmax)
        if key != self._key:
            self._set_axes(readings, xmax)
            self._key = key
        self._canvas.restore_region(self._background)
        unit = _unit(xmax)[1]
        xs: list[float] = []
        ys: list[float] = []
        for index, (reading, bar) in enumerate(zip(readings, self._bars, strict=True)):
            shown = reading.peak if ended else reading.current
            bar.set_width((shown or 0) / unit)
            self._axes.draw_artist(bar)
            if reading.peak is not None:
                xs += [reading.peak / unit] * 2 + [math.nan]
                ys += [index - 0.4, index + 0.4, math.nan]
        self._peaks.set_data(xs, ys)
        self._axes.draw_artist(self._peaks)
        self._set_texts(readings, xmax, ended)
        image = _pixels(self._canvas)
        if self._texts:
            draw = ImageDraw.Draw(image)
            for at, words, colour in self._texts:
                draw.text(at, words, fill=colour, font=self._font, anchor="lm")
        return _encode(image)

    @staticmethod
    def _scale(readings: Sequence[MemoryReading]) -> float:
        seen = [r.peak or r.current or 0 for r in readings]
        largest = max(seen, default=0) or 2**30
        limits = [r.limit for r in readings if r.limit]
        # The limit sets the scale unless it would squash the bars (CPU: the machine's RAM).
        if limits and max(limits) <= 4 * largest:
            return float(max(limits))
        # Powers of two with 20 % headroom: a growing process rescales (a ~80 ms full
        # redraw, measured) about log2 times, not at every 30 % of growth.
        return float(2 ** math.ceil(math.log2(largest * 1.2)))

    def _set_texts(self, readings: Sequence[MemoryReading], xmax: float, ended: bool) -> None:
        """The texts over the bars and where they go (left of each bar, centred on it)."""
        if ended:
            # The number the bar shows; the last reading is in the text beside the image and
            # the summary.
            said = [f"peak {size_text(r.peak)}" for r in readings]
        else:
            said = ["n/a" if r.current is None else "" for r in readings]
        height = self._canvas.get_width_height()[1]
        to_pixels = self._axes.transData.transform
        self._texts = []
        for index, (reading, words) in enumerate(zip(readings, said, strict=True)):
            if not words:
                continue
            wide = ended and (reading.peak or 0) > 0.3 * xmax  # white on a long dark bar
            x, y = to_pixels((0.01 * xmax / _unit(xmax)[1], index))
            self._texts.append(((x, height - y), words, "white" if wide else "black"))

    def _set_axes(self, readings: Sequence[MemoryReading], xmax: float) -> None:
        unit_name, unit = _unit(xmax)
        axes = self._axes
        axes.clear()
        axes.set_xlim(0, xmax / unit)
        axes.set_xlabel(unit_name, fontsize=_FONT)
        axes.set_ylim(len(readings) - 0.5, -0.5)
        labels = []
        for index, reading in enumerate(readings):
            label = reading.device
            if reading.limit is not None and reading.limit > xmax:
                label += f" (of {size_text(reading.limit)})"
            labels.append(label)
            if reading.limit is not None:
                axes.barh(index, min(reading.limit, xmax) / unit, color="0.9", height=0.8)
        axes.set_yticks(range(len(readings)), labels, fontsize=_FONT)
        self._bars = list(axes.barh(range(len(readings)), 0, color="tab:green", height=0.6))
        for bar in self._bars:
            bar.set_animated(True)
        self._peaks.set_data([], [])
        axes.add_line(self._peaks)
        # Fixed margins: tight_layout cost ~50 ms a redraw; labels are short device names.
        self._figure.subplots_adjust(left=0.3, right=0.98, top=0.95, bottom=0.3)
        self._canvas.draw()
        self._background = self._canvas.copy_from_bbox(self._figure.bbox)
        self.full_draws += 1


def stack_frames(frames: Sequence[bytes]) -> bytes:
    """PNG frames one above the other, as one PNG: the summary of a run whose dashboard
    showed all there was (one metric at most), made from its final frames (~3 ms) rather
    than drawn again; one frame is its own picture.

    >>> one = MemoryBars().render([MemoryReading("rank 0 (cpu)", 2**20, 2**21, 2**30)])
    >>> Image.open(io.BytesIO(stack_frames([one, one]))).size, stack_frames([one]) is one
    ((640, 280), True)
    """
    if len(frames) == 1:
        return frames[0]
    images = [Image.open(io.BytesIO(frame)).convert("RGB") for frame in frames]
    width = max(image.width for image in images)
    stacked = Image.new("RGB", (width, sum(image.height for image in images)), "white")
    top = 0
    for image in images:
        stacked.paste(image, (0, top))
        top += image.height
    return _encode(stacked)


def render_summary(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    memory: Sequence[MemoryReading],
    title: str,
) -> bytes:
    """The static picture left in the cell: every metric's curve, and memory at its peak.

    >>> render_summary({"loss": ([0, 1], [1.0, 0.5])}, [], "run r1").startswith(b"\\x89PNG")
    True
    """
    names = [name for name, (steps, _) in series.items() if steps][:6]
    panels = len(names) + (1 if memory else 0)
    columns = min(3, max(1, panels))
    rows = max(1, math.ceil(panels / columns))
    figure, canvas = _figure(300 * columns, 220 * rows + 30, 80)
    figure.suptitle(title, fontsize=_FONT + 1)
    for index, name in enumerate(names):
        axes = figure.add_subplot(rows, columns, index + 1)
        axes.plot(*_thin(*series[name]), lw=1.2)
        axes.set_title(name, fontsize=_FONT + 1, loc="left")
        axes.set_xlabel("step", fontsize=_FONT)
        axes.tick_params(labelsize=_FONT)
        axes.grid(True, alpha=0.3)
    if memory:
        axes = figure.add_subplot(rows, columns, panels)
        largest = max([r.peak or r.current or r.limit or 0 for r in memory], default=0) or 2**30
        unit_name, unit = _unit(largest)
        peaks = [(r.peak or r.current or 0) / unit for r in memory]
        axes.barh(range(len(memory)), peaks, color="tab:green", height=0.6)
        axes.set_yticks(range(len(memory)), [r.device for r in memory], fontsize=_FONT)
        axes.invert_yaxis()
        axes.set_title(f"peak memory ({unit_name})", fontsize=_FONT + 1, loc="left")
        axes.tick_params(labelsize=_FONT)
    if not panels:
        figure.text(0.5, 0.5, "no metrics were logged", ha="center", fontsize=_FONT + 2)
    # Fixed margins in pixels (room for device names, tick labels and titles):
    # tight_layout measured every text first and tripled the picture's cost (~60 ms).
    width, height = canvas.get_width_height()
    figure.subplots_adjust(
        left=90 / width, right=1 - 12 / width, top=1 - 48 / height, bottom=36 / height,
        wspace=0.45, hspace=0.55,
    )  # fmt: skip
    canvas.draw()
    return _png(canvas)
