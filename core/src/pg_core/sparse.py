"""``all_reduce`` of a sparse COO tensor, as torch's Gloo reduces one, over any backend.

Backends move dense strided tensors only, so the sum is built from collectives every backend
has. Each rank coalesces its tensor. The ranks then gather their numbers of entries
(``nnz``), and their indices and values, each padded to the largest ``nnz``. Every rank sums
the union by coalescing it, and writes the result into its tensor in place. The result is
coalesced and alike on every rank.

The rules are torch's Gloo's:
- sparse COO only (another sparse layout is refused with what to call instead);
- ``SUM`` only;
- every rank's tensor has the same shape and dtype (the gathers check the dtype; the shape
  is checked here, from every rank's header).

It costs three gathers: every rank's header (its ``nnz`` and shape), then the indices and the
values. The call runs them to
the end before it returns, so the :class:`~pg_core.work.Work` that ``async_op=True`` returns
is already complete.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from .errors import NotSupportedError
from .ops import RedOpType, ReduceOp
from .work import Work

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["SPARSE_LAYOUTS", "all_reduce_sparse"]

#: torch's sparse layouts: a tensor in one has no strides to hand a backend
SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})
#: a header's length: nnz, sparse dims, dense dims, then the shape (torch allows 64 dims), -1 after it
_HEADER = 3 + 64


def all_reduce_sparse(
    group: ProcessGroup,
    tensor: torch.Tensor,
    op: ReduceOp,
    *,
    async_op: bool,
    timeout: float | timedelta | None,
) -> Work | None:
    """Sum the sparse COO ``tensor`` across ``group``, in place (see the module docstring)."""
    if tensor.layout is not torch.sparse_coo:
        raise NotSupportedError(
            f"all_reduce: a sparse tensor of layout {tensor.layout} is reduced only as sparse COO (as torch's Gloo "
            "does): call t.to_sparse_coo() first, or t.to_dense()"
        )
    if op.type is not RedOpType.SUM:
        raise NotSupportedError(
            f"all_reduce: a sparse tensor is reduced with ReduceOp.SUM only (as torch's Gloo does), got {op}: "
            "call t.to_dense() for another reduction"
        )
    local = tensor.detach().coalesce()
    indices, values = local.indices(), local.values()
    nnz, n = indices.shape[1], group.size
    # one gather of every rank's header: its nnz, its sparse and dense dims, its shape
    mine = torch.full((_HEADER,), -1, dtype=torch.int64)
    mine[:3] = torch.tensor([nnz, local.sparse_dim(), local.dense_dim()])
    mine[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    headers = torch.empty((n, _HEADER), dtype=torch.int64, device=tensor.device)
    group.all_gather_into_tensor(headers, mine.to(tensor.device), timeout=timeout)
    headers = headers.cpu()
    differ = [r for r in range(n) if not bool((headers[r, 1:] == mine[1:]).all())]
    if differ:
        theirs = headers[differ[0], 3:]
        raise ValueError(
            f"all_reduce: the sparse tensor has shape {tuple(tensor.shape)} ({local.sparse_dim()} sparse dims) on "
            f"rank {group.rank} but {tuple(theirs[theirs >= 0].tolist())} ({int(headers[differ[0], 1])} sparse dims) "
            f"on rank {differ[0]}: every rank must pass the same shape"
        )
    counts = headers[:, 0]
    most = int(counts.max())
    summed = torch.sparse_coo_tensor(
        indices.new_zeros((indices.shape[0], 0)), values.new_zeros((0, *values.shape[1:])), tensor.shape
    )
    if most:
        mine_i = indices.new_zeros((indices.shape[0], most))
        mine_i[:, :nnz] = indices
        mine_v = values.new_zeros((most, *values.shape[1:]))
        mine_v[:nnz] = values
        all_i = indices.new_empty((n, *mine_i.shape))
        all_v = values.new_empty((n, *mine_v.shape))
        group.all_gather_into_tensor(all_i, mine_i, timeout=timeout)
        group.all_gather_into_tensor(all_v, mine_v, timeout=timeout)
        kept = [int(c) for c in counts.tolist()]
        summed = torch.sparse_coo_tensor(
            torch.cat([all_i[r, :, : kept[r]] for r in range(n)], dim=1),
            torch.cat([all_v[r, : kept[r]] for r in range(n)]),
            tensor.shape,
        )
    with torch.no_grad():
        tensor.copy_(summed.coalesce())
    return Work.completed("all_reduce") if async_op else None
