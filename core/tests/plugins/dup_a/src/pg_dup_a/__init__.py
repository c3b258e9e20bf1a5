"""One of two distributions providing backend 'dup', for tests."""
