"""pg-nccl: pg-core groups on torch's own NCCL backend (``ProcessGroupNCCL``).

Installing this distribution registers the ``nccl`` backend (entry point
``pg_core.backends``) on any machine; where torch has no CUDA or NCCL, or no GPU is
visible, ``pg-core backends`` lists it as unavailable with that reason.
``pg_nccl.backend.NCCLBackend`` is the class (importing it needs a torch with NCCL).
"""

from __future__ import annotations

__version__ = "0.1.0"
