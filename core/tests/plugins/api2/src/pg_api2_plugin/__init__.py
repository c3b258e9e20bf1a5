"""A plugin written for a future major version of the backend API, for tests."""
