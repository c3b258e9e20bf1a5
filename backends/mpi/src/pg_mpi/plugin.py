"""pg-mpi's entry point: what the registry reads without importing the backend or MPI.

The capabilities below are declared without initialising MPI (``pg-core backends`` must not),
and certified by the conformance suite under ``mpiexec`` (world sizes 1 to 4):

* every op and every dtype on ``cpu``; copies move bytes (``MPI_BYTE``), exact for every dtype;
* reductions are MPI's own on MPI's types (``MPI_FLOAT``, ``MPI_INT8_T``, ...,
  ``MPI_C_FLOAT_COMPLEX``; bool as ``MPI_UINT8_T``, whose ``MIN``/``MAX``/bitwise ops on 0 and
  1 are bool's); ``float16`` and ``bfloat16``, for which MPI has no type, reduce through a
  user-defined ``MPI_Op`` that applies torch's own elementwise op to the pieces MPI hands it;
  ``AVG`` is ``SUM`` then a division by the group size, ``PREMUL_SUM`` a local multiplication
  by the factor then ``SUM``: each correct by definition, with the same result on every rank;
  an integer ``SUM`` or ``PROD`` that the library does not wrap around as torch does (Open
  MPI's AVX sums of 8- and 16-bit integers saturate) is torch's too, found after ``MPI_Init``;
* tags up to ``32767``: the ``MPI_TAG_UB`` every MPI implementation guarantees at least
  (MPICH's is ``2**29 - 1``, but the real bound is known only after ``MPI_Init``, and
  declaring must not initialise MPI);
* ``eager_limit_bytes`` 4 KiB (:data:`EAGER_LIMIT`): a blocking send of at most that many
  bytes is MPI's buffered send (``MPI_Bsend`` on a communicator with MPI's automatic buffer,
  MPI 4.1; a copy of pg-mpi's own and ``MPI_Isend`` where the library predates it), which MPI
  completes without the receiver; a larger one is ``MPI_Isend`` from the tensor's own memory,
  waited for, so it may wait until the receiver has posted the matching receive (MPI's
  standard mode), as ``mpi4py``'s ``comm.Send`` does. The copy a buffered send makes costs
  nothing next to MPI's latency up to 4 KiB and 1.2 to 4.8 times MPI's time from 8 to 64 KiB
  (docs/decisions.md, "A send may wait for its receiver above an eager limit").

``launcher="mpiexec"``: the ranks of a job must be started together by one ``mpiexec``;
``is_available()`` says so in any other process.
"""

from __future__ import annotations

import importlib.util

import pluggy
from pg_core.backend import DTYPES, BackendSpec, Capabilities, default_reduce_ops
from pg_core.launchers import launched_rank
from pg_core.ops import OPS

__all__ = ["CAPABILITIES", "EAGER_LIMIT", "MAX_TAG", "is_available", "pg_core_backends"]

hookimpl = pluggy.HookimplMarker("pg_core")

#: The MPI standard's guaranteed minimum of ``MPI_TAG_UB``.
MAX_TAG = 32767

#: The size up to which a blocking send never waits for its receiver (MPI's buffered send).
EAGER_LIMIT = 4 << 10

#: cpu: every op and dtype, every reduce op that makes sense for each dtype, and receiving from
#: any source (``MPI_ANY_SOURCE``); sends above :data:`EAGER_LIMIT` may wait for their receivers.
CAPABILITIES = Capabilities(
    ops=frozenset(OPS) | {"recv_anysource"},
    dtypes=frozenset(DTYPES),
    reduce_ops={dtype: default_reduce_ops(dtype) for dtype in DTYPES},
    max_tag=MAX_TAG,
    eager_limit_bytes=EAGER_LIMIT,
)

HOW_TO_LAUNCH = "start every rank together with `mpiexec -n N python script.py` (mpiexec comes with pip install mpich)"


def is_available() -> str | None:
    """``None``, or why MPI cannot run in this process: mpi4py missing, not started by an MPI
    launcher (read from the environment: Hydra's ``PMI_RANK``, Open MPI's
    ``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK``), no MPI library that mpi4py can load, or MPI
    already initialised (by someone else) without ``MPI_THREAD_MULTIPLE``. Never initialises
    MPI; loads the library only in a process that an MPI launcher started."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install pg-mpi installs it)"
    if launched_rank() is None:
        return f"this process was not started by an MPI launcher (no PMI_RANK, OMPI_COMM_WORLD_RANK or PMIX_RANK): {HOW_TO_LAUNCH}"
    from ._mpi import load_mpi, thread_level_problem

    try:
        mpi = load_mpi()
    except (ImportError, OSError, RuntimeError) as exc:
        return f"mpi4py could not load an MPI library ({type(exc).__name__}: {exc}); pip install mpich, or set MPI4PY_LIBMPI"
    return thread_level_problem(mpi)


@hookimpl
def pg_core_backends() -> list[BackendSpec]:
    """The ``mpi`` backend: cpu tensors. Priority 3: pg-tcp (10) and pg-gloo (5) stay the
    defaults for ``backends=None``; name it (``backends="mpi"``) to use it."""
    return [
        BackendSpec(
            name="mpi",
            factory="pg_mpi.backend:MPIBackend",
            devices=("cpu",),
            capabilities=CAPABILITIES,
            priority=3,
            api_version="1.10",  # collectives launch (1.2), receives from any source (1.4), an eager limit (1.10)
            is_available=is_available,
            description="MPI through mpi4py: one communicator per group, MPI's own collectives",
            launcher="mpiexec",
        )
    ]
