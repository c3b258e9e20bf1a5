"""A griffe extension for the API reference: pg-core's docstrings in Markdown.

The docstrings are prose with reStructuredText's inline roles (``:class:`~pg_core.errors.PGError```)
and ``::`` before a literal block. mkdocstrings renders docstrings as Markdown, where a role
would show as ``:class:`` beside a code span. This extension rewrites each role into an
optional cross-reference (a link where the target is on the site, plain code where it is not)
each ``::`` into ``:``, and a list nested two spaces deep into one nested four deep, as
Markdown nests; the source files are left as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj|const):`(?P<tilde>~?)(?P<target>[^`<>]+)`")
_LITERAL_BLOCK = re.compile(r"(?<=\S)::$", flags=re.MULTILINE)
# A list nested two spaces deep, as the docstrings write it; Markdown nests at four.
_NESTED_ITEM = re.compile(r"^  (?=[-*] )", flags=re.MULTILINE)


def _identifier(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as written in ``obj``'s docstring: absolute when it names
    ``pg_core`` or another package, else resolved in the object's scope."""
    head, _, rest = target.partition(".")
    if head in {"pg_core", "pg_tcp", "pg_gloo", "pg_nccl", "pg_mpi", "torch"}:
        return target
    try:
        resolved = obj.resolve(head)
    except (griffe.NameResolutionError, KeyError, ValueError):
        return target
    return f"{resolved}.{rest}" if rest else resolved


def markdown(obj: griffe.Object, text: str) -> str:
    """``text``, a docstring of ``obj``, with its roles as cross-references."""

    def reference(match: re.Match[str]) -> str:
        target = match["target"]
        title = target.rsplit(".", 1)[-1] if match["tilde"] else target
        return f'<autoref identifier="{_identifier(obj, target)}" optional><code>{title}</code></autoref>'

    return _NESTED_ITEM.sub("    ", _LITERAL_BLOCK.sub(":", _ROLE.sub(reference, text)))


class RolesAsReferences(griffe.Extension):
    """Rewrites every docstring of a loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        self._rewrite(pkg, set())

    def _rewrite(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj, obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                assert isinstance(member, griffe.Object)
                self._rewrite(member, seen)
