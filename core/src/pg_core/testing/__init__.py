"""Testing tools shipped with pg-core: a persistent pool of rank processes
(:mod:`pg_core.testing.pool`) and, with the ``testing`` extra, the conformance
suite. Importing this package imports neither hypothesis nor pytest."""
