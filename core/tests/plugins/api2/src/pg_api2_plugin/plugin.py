from pg_core import BackendSpec
from pg_core.registry import hookimpl


@hookimpl
def pg_core_backends() -> list[BackendSpec]:
    return [BackendSpec("api2", "pg_api2_plugin.plugin:Api2", devices=("cpu",), api_version="2.0")]
