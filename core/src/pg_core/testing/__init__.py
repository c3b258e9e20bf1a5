"""Testing tools shipped with pg-core: a persistent pool of rank processes
(:mod:`pg_core.testing.pool`) and, with the ``testing`` extra, the conformance
suite. Importing this package imports neither hypothesis nor pytest."""

from __future__ import annotations

__all__ = ["unavailable"]


def unavailable(backend: str) -> str | None:
    """Why the installed backend ``backend`` cannot run here, or ``None`` if it can: the
    reason a test that needs it skips with (``pytest.mark.skipif(unavailable("tcp") is not
    None, reason=...)``)."""
    from ..registry import default_registry

    for entry in default_registry().entries():
        if entry.name == backend:
            if entry.status == "available":
                return None
            return f"backend {backend!r} from {entry.distribution} is {entry.status}: {entry.reason}"
    return f"backend {backend!r} is not installed (pip install the distribution that provides it)"
