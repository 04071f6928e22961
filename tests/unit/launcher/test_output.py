"""Splitting worker output into lines, with \\r progress bars as redraws of one line."""

from __future__ import annotations

from nbaccel.launcher.output import LineSplitter, render

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
