"""The README and docs/ point at things that exist, and only at things a reader has.

Every relative link (and image) names a file or folder of the repository, every ``#anchor``
a heading of the file it points into (GitHub's anchors); no page sends the reader to the
project's own issues, commits or files outside the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
# What only the people who built nbaccel had: their issue numbers, commits, notes.
PRIVATE = re.compile(
    r"\bissues? \d+\b|FACTS\.md|DESIGN\.md|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
    r"|other engineers|unfinished edits|other sessions"
)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.

    >>> anchor("One cell per machine (Accelerate's form)")
    'one-cell-per-machine-accelerates-form'
    >>> anchor("`save_state` and the `Run`")
    'save_state-and-the-run'
    """
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE):
        base = anchor(heading)
        name, n = base, 0
        while name in found:  # GitHub numbers repeated headings: name, name-1, name-2
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_and_anchor_exists(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.name}")
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_page_refers_to_what_only_the_developers_had(page: Path) -> None:
    found = [m.group(0) for m in PRIVATE.finditer(page.read_text())]
    assert not found, f"{page.name}: {found}"


def test_the_checks_catch_a_broken_link_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## The `x` part\n\n[b](b.md) [x](#the-x-part)\n")
    (tmp_path / "b.md").write_text("[a](a.md#nothing) [a](a.md#title)\n```\n# not a heading\n```\n")
    assert anchors(tmp_path / "a.md") == {"title", "the-x-part"}
    assert anchors(tmp_path / "b.md") == set()
    assert links(tmp_path / "b.md") == ["a.md#nothing", "a.md#title"]
    assert PRIVATE.search("fixed in issue 16") and PRIVATE.search("at 848729c")
    assert not PRIVATE.search("run 20261125-182359-ef65d8, 0.141 s")


def test_the_reference_names_every_config_field() -> None:
    """docs/reference.md's list of fields keeps up with the schema."""
    import dataclasses

    from nbaccel.config.schema import Config

    text = (REPO / "docs" / "reference.md").read_text()
    missing = [f.name for f in dataclasses.fields(Config) if f"`{f.name}" not in text]
    assert not missing, f"docs/reference.md does not name the config fields {missing}"


def test_the_readme_stays_short_and_names_what_each_notebook_needs() -> None:
    """The README is the page a new user reads whole: at most 160 lines. It names every
    example notebook and what each needs beyond ``nbaccel[notebook]`` (a new user's notebook
    08 failed for want of transformers, which nothing had said)."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 160, len(readme.splitlines())
    notebooks = sorted((REPO / "notebooks").glob("*.ipynb"))
    section = readme[readme.index("Notebooks (") :].split("\n\n")[0]
    for path in notebooks:
        assert path.name[:2] in section, f"the README's notebook list misses {path.name}"
    for need in ("+ `accelerate`", "+ `transformers`", "a TPU runtime", "binder/requirements.txt"):
        assert need in section, need
