"""Turn a worker's raw output bytes into lines, treating ``\\r`` the way a terminal does.

A progress bar (tqdm) redraws its line with ``\\r``; each redraw becomes a line marked
``replace`` so consumers overwrite instead of appending. Stdlib only.
"""

from __future__ import annotations

import codecs
import re

_BREAKS = re.compile(r"\r\n|\r|\n")
MAX_PENDING_CHARS = 64 * 1024


class LineSplitter:
    """Incremental splitter: ``feed(bytes)`` returns ``(text, replace, partial)`` triples.

    ``replace``: the line overwrites the previous one. ``partial``: it ended with ``\\r`` and
    may itself be redrawn.

    >>> s = LineSplitter()
    >>> s.feed(b"epoch 1\\n 10%\\r 50%\\r100%\\ndone")
    [('epoch 1', False, False), (' 10%', False, True), (' 50%', True, True), ('100%', True, False)]
    >>> s.close()
    [('done', False, False)]
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._open = False  # the last emitted line ended with \r: the next one overwrites it

    def feed(self, data: bytes) -> list[tuple[str, bool, bool]]:
        return self._split(self._decoder.decode(data))

    def close(self) -> list[tuple[str, bool, bool]]:
        lines = self._split(self._decoder.decode(b"", final=True))
        if self._pending:
            lines.append((self._pending, self._open, False))
            self._pending, self._open = "", False
        return lines

    def _split(self, text: str) -> list[tuple[str, bool, bool]]:
        text = self._pending + text
        lines: list[tuple[str, bool, bool]] = []
        start = 0
        for match in _BREAKS.finditer(text):
            segment, brk = text[start : match.start()], match.group()
            start = match.end()
            if brk == "\r":
                if segment:  # "\r" alone (tqdm's leading one) only moves the cursor
                    lines.append((segment, self._open, True))
                    self._open = True
            elif segment or not self._open:
                lines.append((segment, self._open, False))
                self._open = False
            else:  # "\n" right after a "\r" redraw: that line is now final
                self._open = False
        self._pending = text[start:]
        if len(self._pending) > MAX_PENDING_CHARS:  # a huge line without a break: emit it
            lines.append((self._pending, self._open, False))
            self._pending, self._open = "", False
        return lines


def render(data: bytes) -> str:
    """The text a terminal would show for ``data``, each ``\\r`` redraw collapsed.

    >>> render(b"a\\n 1%\\r99%\\nb\\n")
    'a\\n99%\\nb\\n'
    """
    splitter = LineSplitter()
    lines: list[str] = []
    for text, replace, _partial in splitter.feed(data) + splitter.close():
        if replace and lines:
            lines[-1] = text
        else:
            lines.append(text)
    return "".join(line + "\n" for line in lines)
