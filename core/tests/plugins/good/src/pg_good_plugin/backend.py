from pg_core import Backend


class GoodBackend(Backend):
    """Inherits send/recv that raise: enough to prove the factory string resolves."""
