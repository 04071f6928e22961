"""Turn a worker's raw output bytes into lines, treating ``\\r`` the way a terminal does.

A progress bar (tqdm) redraws its line with ``\\r``; each redraw becomes a line marked
``replace`` so consumers overwrite instead of appending. ``OutputReader`` also takes
nbaccel's own marks out of the bytes before anything keeps or shows them. Stdlib only.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

_BREAKS = re.compile(r"\r\n|\r|\n")
MAX_PENDING_CHARS = 64 * 1024
# A mark: this, a short text, then "\n" (``mark_line``). ESC starts it, as a terminal's
# control sequences do: no program prints it by chance.
MARK = "\x1b[nbaccel-mark "
_MARK = MARK.encode()
MAX_MARK_TEXT = 200  # longer, and it is not a mark but the rank's own bytes
# The mark a keep_workers rank prints once its function returned, before its value goes:
# the kernel hands the ranks over to their Workers group once it has every rank's.
TRAINED_MARK = "trained"


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
        return self._split(self._decoder.decode(b"", final=True)) + self.flush()

    def flush(self) -> list[tuple[str, bool, bool]]:
        """The line begun and not ended yet, as a line of its own (its writer said that all
        it wrote is here: a cell that printed without a newline).

        >>> s = LineSplitter()
        >>> s.feed(b"no newline"), s.flush(), s.feed(b" then more\\n")
        ([], [('no newline', False, False)], [(' then more', False, False)])
        """
        if not self._pending:
            return []
        line = (self._pending, self._open, False)
        self._pending, self._open = "", False
        return [line]

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


def mark_line(text: str) -> str:
    """What a worker prints to put the mark ``text`` in its output (see ``OutputReader``)."""
    return f"{MARK}{text}\n"


@dataclass(frozen=True)
class Mark:
    """A mark a worker put in its output: everything it wrote before is before it."""

    text: str


class OutputReader:
    """One rank's output as the parent takes it: nbaccel's marks taken out, the rest split
    into lines.

    A worker prints a mark (``mark_line``) to say that all it wrote before has been written
    (an interactive worker does after each command). Marks travel in the output stream
    itself, so nothing on another channel overtakes them (on several machines too), but
    they are nbaccel's, not the rank's: the log file and the lines never hold them. A line
    not yet ended at a mark comes out whole before it. ``feed`` returns the bytes to keep
    (the log file's) and, in order, the lines (``LineSplitter``'s triples) and ``Mark``s.

    >>> reader = OutputReader()
    >>> reader.feed(b"loss 0.5\\n" + mark_line("done 1").encode()[:5])
    (b'loss 0.5\\n', [('loss 0.5', False, False)])
    >>> reader.feed(mark_line("done 1").encode()[5:] + b"next\\n")
    (b'next\\n', [Mark(text='done 1'), ('next', False, False)])
    """

    def __init__(self) -> None:
        self._splitter = LineSplitter()
        self._held = b""  # the start of what may be a mark, until the next read says

    def feed(self, data: bytes) -> tuple[bytes, list[tuple[str, bool, bool] | Mark]]:
        data, self._held = self._held + data, b""
        kept: list[bytes] = []
        items: list[tuple[str, bool, bool] | Mark] = []
        done = search = 0  # bytes taken; where the next mark is looked for
        while (at := data.find(_MARK, search)) != -1:
            text_at = at + len(_MARK)
            end = data.find(b"\n", text_at, text_at + MAX_MARK_TEXT + 1)
            if end == -1 and len(data) - text_at <= MAX_MARK_TEXT:
                self._held, data = data[at:], data[:at]  # its end comes with a later read
                break
            if end == -1:
                search = at + 1  # too long for a mark: the rank's own bytes
                continue
            kept.append(data[done:at])
            items += self._splitter.feed(data[done:at]) + self._splitter.flush()
            items.append(Mark(data[text_at:end].decode("utf-8", errors="replace")))
            done = search = end + 1
        rest = data[done:]
        if not self._held:  # hold a tail that may be a mark's first bytes
            escape = rest.rfind(b"\x1b", max(0, len(rest) - len(_MARK) + 1))
            if escape != -1 and _MARK.startswith(rest[escape:]):
                rest, self._held = rest[:escape], rest[escape:]
        kept.append(rest)
        items += self._splitter.feed(rest)
        return b"".join(kept), list(items)

    def close(self) -> tuple[bytes, list[tuple[str, bool, bool] | Mark]]:
        """The end of the output: what was held, and the last line."""
        held, self._held = self._held, b""
        return held, [*self._splitter.feed(held), *self._splitter.close()]
