"""pg-shm: pg-core groups whose ranks share a host, over shared memory.

Installing this distribution registers the ``shm`` backend (entry point
``pg_core.backends``); users never import it. ``pg_shm.backend.ShmBackend`` is the class.
"""

from __future__ import annotations

__version__ = "0.1.0"
