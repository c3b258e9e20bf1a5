from pg_core import BackendSpec
from pg_core.registry import hookimpl


@hookimpl
def pg_core_backends() -> list[BackendSpec]:
    return [BackendSpec("dup", "pg_dup_b.plugin:DupB", devices=("cpu",), description="from pg-dup-b")]
