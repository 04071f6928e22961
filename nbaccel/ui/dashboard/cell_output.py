"""The dashboard's place in the cell: its widgets, then two outputs reserved for the static
summary (a text and a PNG) that a saved notebook keeps. Split from ``dashboard``.

The widgets' place can be reserved too (``show(later=True)``), and filled once they are
built (``_show_widgets``): a blocking call's short run never builds them (dashboard_after)."""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from typing import Any


class CellOutput:
    """``show()`` and ``_publish_summary()`` of ``Dashboard`` (which sets ``widget``,
    ``summary_text``, ``summary_png`` and ``_write_text``)."""

    widget: Any
    summary_text: str
    summary_png: bytes | None
    _summary_outputs: tuple[Any, Any] | None = None
    _widgets_output: Any = None  # the widgets' reserved place (``show(later=True)``)
    _shown_later = False
    _end_seen: bool  # the run's end has reached the dashboard
    _write_text: Callable[[], None]

    def show(self, *, later: bool = False) -> None:
        """Display the widgets in the current cell (``later``: reserve their place, filled by
        ``_show_widgets`` once built), and reserve two outputs for the summary."""
        from IPython import display as ipython_display

        display: Any = ipython_display.display  # untyped in IPython
        self._shown_later = later
        if later and self._end_seen:
            pass  # its run has ended (a short interactive call): no widgets will come
        elif later:
            self._widgets_output = display({"text/plain": ""}, raw=True, display_id=True)
        else:
            self._write_text()  # the header at once; the UI thread goes on when the run starts
            display(self._widgets_bundle(), raw=True)
        # Outputs with a display_id, filled at the end with update_display_data: they stay
        # in this cell (and in the saved notebook) wherever the kernel is by then.
        self._summary_outputs = (
            display({"text/plain": ""}, raw=True, display_id=True),
            display({"text/plain": ""}, raw=True, display_id=True),
        )

    def _show_widgets(self) -> None:
        """Fill the widgets' reserved place (from the UI thread: an update of this cell's
        output by its display_id, wherever the kernel is)."""
        if self._widgets_output is not None:
            self._widgets_output.update(self._widgets_bundle(), raw=True)

    def _widgets_bundle(self) -> dict[str, Any]:
        bundle = dict(self.widget._repr_mimebundle_())
        # What a notebook viewer without the widget state shows instead of a VBox repr.
        bundle["text/plain"] = "nbaccel live dashboard (its final summary follows)"
        return bundle

    def _publish_summary(self) -> bool:
        """Write the summary into its reserved outputs; whether it has a picture there."""
        if self._summary_outputs is None:
            return False
        text_output, image_output = self._summary_outputs
        text = self.summary_text
        text_output.update(
            {"text/plain": text, "text/html": f"<pre>{html.escape(text)}</pre>"}, raw=True
        )
        if self.summary_png is not None:
            image = base64.b64encode(self.summary_png).decode("ascii")
            image_output.update({"image/png": image, "text/plain": text.split("\n")[0]}, raw=True)
        return self.summary_png is not None
