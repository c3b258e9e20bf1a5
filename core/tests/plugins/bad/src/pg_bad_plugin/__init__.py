"""A plugin distribution whose entry points fail in two ways, for tests."""
