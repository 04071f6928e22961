"""Splitting worker output into lines, with \\r progress bars as redraws of one line."""

from __future__ import annotations

from nbaccel.launcher.output import (
    MAX_MARK_TEXT,
    LineSplitter,
    Mark,
    OutputReader,
    mark_line,
    render,
)

TQDM_LIKE = b"start\n\r  0%|   | 0/3\r 33%|#  | 1/3\r100%|###| 3/3\nend\n"


def split_all(data: bytes, chunk: int) -> list[tuple[str, bool, bool]]:
    splitter = LineSplitter()
    lines = []
    for i in range(0, len(data), chunk):
        lines += splitter.feed(data[i : i + chunk])
    return lines + splitter.close()


def test_progress_bar_redraws() -> None:
    assert split_all(TQDM_LIKE, len(TQDM_LIKE)) == [
        ("start", False, False),
        ("  0%|   | 0/3", False, True),
        (" 33%|#  | 1/3", True, True),
        ("100%|###| 3/3", True, False),
        ("end", False, False),
    ]


def test_any_chunking_gives_the_same_rendering() -> None:
    expected = "start\n100%|###| 3/3\nend\n"
    for chunk in range(1, len(TQDM_LIKE) + 1):
        lines = []
        for text, replace, _partial in split_all(TQDM_LIKE, chunk):
            if replace:
                lines[-1] = text
            else:
                lines.append(text)
        assert "".join(x + "\n" for x in lines) == expected, chunk


def test_crlf_is_one_line_break() -> None:
    assert split_all(b"a\r\nb\r\n", 100) == [("a", False, False), ("b", False, False)]
    assert render(b"a\r\nb\r\n") == "a\nb\n"


def test_utf8_split_across_reads() -> None:
    data = "héllo ✓\n".encode()
    assert split_all(data, 1) == [("héllo ✓", False, False)]


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    assert split_all(b"bad \xff byte\n", 3) == [("bad \ufffd byte", False, False)]


def test_unterminated_text_is_flushed_at_close() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"prompt> ") == []
    assert splitter.close() == [("prompt> ", False, False)]


def test_blank_lines_are_kept() -> None:
    assert render(b"a\n\nb\n") == "a\n\nb\n"


def test_huge_line_without_break_is_emitted() -> None:
    splitter = LineSplitter()
    lines = splitter.feed(b"x" * 70_000)
    assert lines and len(lines[0][0]) == 70_000


MARKED = (
    b"epoch 1\n 50%\r100%\n"
    + mark_line("done 1").encode()
    + b"tail without newline"
    + mark_line("done 2").encode()
    + b"\x1b[31mred\x1b[0m\n\x1b[nbaccel-mark "
    + b"x" * (MAX_MARK_TEXT + 1)  # too long to be a mark: the rank's own bytes
    + b"\nend\x1b[nbacc"  # a mark's first bytes, and then the output ends
)
UNMARKED = MARKED.replace(mark_line("done 1").encode(), b"").replace(
    mark_line("done 2").encode(), b""
)


def read_all(data: bytes, chunk: int) -> tuple[bytes, list[object]]:
    reader = OutputReader()
    kept, items = b"", []
    for i in range(0, len(data), chunk):
        more, found = reader.feed(data[i : i + chunk])
        kept, items = kept + more, items + found
    more, found = reader.close()
    return kept + more, items + found


def test_marks_come_out_of_the_output_in_order_at_any_chunking() -> None:
    expected_kept, expected_items = read_all(MARKED, len(MARKED))
    assert expected_kept == UNMARKED  # the log file keeps what the rank wrote, nothing else
    marks = [i for i, item in enumerate(expected_items) if isinstance(item, Mark)]
    assert [expected_items[i] for i in marks] == [Mark("done 1"), Mark("done 2")]
    # Each mark comes after the lines written before it, a line without its end included.
    assert expected_items[marks[0] - 1] == ("100%", True, False)
    assert expected_items[marks[1] - 1] == ("tail without newline", False, False)
    assert expected_items[-1] == ("end\x1b[nbacc", False, False)
    for chunk in range(1, len(MARKED)):
        assert read_all(MARKED, chunk) == (expected_kept, expected_items), chunk
