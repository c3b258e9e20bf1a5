"""pg-tcp: pg-core's reference backend, pure Python over TCP sockets.

Installing this distribution registers the ``tcp`` backend (entry point
``pg_core.backends``); users never import it. ``pg_tcp.backend.TCPBackend`` is the
class, ``pg_tcp.transport`` the progress engine it runs on, ``pg_tcp.wire`` the frame
format and ``pg_tcp.handshake`` how a connection is made and authenticated.
"""

from __future__ import annotations

__version__ = "0.1.0"
