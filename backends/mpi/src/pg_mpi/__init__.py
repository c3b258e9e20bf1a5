"""pg-mpi: pg-core groups on MPI, through mpi4py.

Installing this distribution registers the ``mpi`` backend (entry point
``pg_core.backends``); users never import it. Start the ranks with ``mpiexec -n N python
script.py``. ``pg_mpi.backend.MPIBackend`` is the class.
"""

from __future__ import annotations

__version__ = "0.1.0"
