"""The README is the front door: every relative link in it leads to a file of the repository.

The documentation site's own pages are checked by ``make docs`` (``mkdocs build --strict``
fails on a broken link or anchor); the README lies outside the site, so its links are
checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def relative_links(markdown: str) -> list[str]:
    """The link targets of ``markdown`` that point into the repository (no scheme, no bare anchor)."""
    targets = [m["target"] for m in _LINK.finditer(markdown)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_relative_links_are_found_in_markdown() -> None:
    text = "see [a](docs/a.md), [b](https://x.org/b), [c](#here), [d](backends/gloo/README.md#install)"
    assert relative_links(text) == ["docs/a.md", "backends/gloo/README.md#install"]


def test_every_relative_link_of_the_readme_resolves() -> None:
    links = relative_links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert links, "the README links to no file: the pattern no longer matches its links"
    missing = [link for link in links if not (ROOT / link.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_stays_a_front_door() -> None:
    """What it is, install, the card's line, launching, the backends, links: history and
    measurements live in docs/ (issue 29 set the bound)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
