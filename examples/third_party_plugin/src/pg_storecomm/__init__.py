"""pg-storecomm: a pg-core backend that sends messages through the group's key-value store.

An example of a third-party plugin written from pg-core's README and the contract in
``pg_core.backend`` alone. Slow by design (every message is a store round trip); it exists
to show how little a complete backend needs.
"""

from __future__ import annotations

from .backend import StoreBackend

__all__ = ["StoreBackend", "__version__"]

__version__ = "0.1.0"
