"""A working pg-core plugin, for tests."""
