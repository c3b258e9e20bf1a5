raise ImportError("pg_bad_plugin needs libunicorn.so, which is not installed")
