from pg_core import BackendSpec
from pg_core.registry import hookimpl


def _no_unicorn() -> str:
    return "no unicorn in this machine"


@hookimpl
def pg_core_backends() -> list[BackendSpec]:
    return [
        # a string factory: listing must not import pg_good_plugin.backend
        BackendSpec("good", "pg_good_plugin.backend:GoodBackend", devices=("cpu",), priority=7),
        BackendSpec("unicorn", "pg_good_plugin.backend:GoodBackend", devices=("cpu",), is_available=_no_unicorn),
    ]
