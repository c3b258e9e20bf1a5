def pg_core_backends() -> int:
    return 42
