"""pg-gloo: pg-core groups on torch's own Gloo backend (``ProcessGroupGloo``).

Installing this distribution registers the ``gloo`` backend (entry point
``pg_core.backends``); users never import it. ``pg_gloo.backend.GlooBackend`` is the class.
"""

from __future__ import annotations

__version__ = "0.1.0"
