"""``NCCLBackend``: a group's cuda operations on one ``torch.distributed.ProcessGroupNCCL``.

Built from the group's own prefixed store (:meth:`pg_core.c10d.C10dBackend.rendezvous`, so
NCCL's rendezvous never blocks the client other groups share, and the store lives as long as
the backend: NCCL uses it at its first collective), with the group's rank and
size; no ``init_process_group``, nothing global. ``ProcessGroupNCCL`` makes one communicator
per device on first use, and runs every operation on NCCL's own streams.

Every collective is NCCL's (:class:`pg_core.c10d.C10dBackend`), with the call's timeout in
its options. A blocking call returns as torch's do: once the *current stream* waits for the
operation (``Work.wait()``), with no host synchronisation; outputs hold their values in
stream order. Point to point is NCCL's ``send``/``recv``, untagged (the core keeps order per
peer). NCCL cannot see a message's size: a receive of the wrong size is not detected before
the watchdog's timeout, as in torch. Timeouts are found by torch's NCCL watchdog, which (with
torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``) aborts the communicators; the next call
raises, translated to :class:`~pg_core.errors.CollectiveTimeout` or
:class:`~pg_core.errors.PeerFailureError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pg_core.backend import BackendContext
from pg_core.c10d import C10dBackend, first_line, timeout_delta
from pg_core.errors import CollectiveTimeout, PeerFailureError, PGError
from pg_core.ops import RedOpType, ReduceOp
from pg_core.work import Work
from torch.distributed import ProcessGroupNCCL  # type: ignore[attr-defined]  # absent from CPU builds

__all__ = ["NCCLBackend"]

_TIMED_OUT = ("timed out", "Timed out", "timeout", "Timeout")
_PEER_GONE = ("remote process exited", "ncclRemoteError", "Connection closed", "Connection reset", "aborted")


class NCCLBackend(C10dBackend):
    """One ``ProcessGroupNCCL`` per group formation (communicators per device inside it)."""

    #: NCCL has no 16-bit integer type; complex moves as its bytes (exact)
    as_bytes = frozenset({torch.int16, torch.complex64, torch.complex128})
    #: a work's wait() makes the caller's current stream wait for NCCL's, as torch's does
    host_completion = False

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        if ctx.device.type != "cuda":
            raise ValueError(f"backend 'nccl' serves cuda tensors, not {ctx.device}")
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout_delta(ctx.timeout)
        options.is_high_priority_stream = bool(ctx.options.get("high_priority_stream", False))
        self._pg = ProcessGroupNCCL(self.rendezvous("NCCL"), ctx.rank, ctx.size, options)

    def _error(self, exc: BaseException, what: str, timeout: float, peers: Sequence[int] = ()) -> BaseException:
        if isinstance(exc, PGError):  # pg-core's own (a RuntimeError too): already says it
            return exc
        text = first_line(exc)
        if any(words in text for words in _TIMED_OUT):
            return CollectiveTimeout(f"{what}: NCCL timed out after {timeout:g} s ({text})", op=what, peers=peers)
        if any(words in text for words in _PEER_GONE):
            return PeerFailureError(f"{what}: NCCL lost a peer ({text}); form a new group", peers=peers)
        return exc

    # -- PREMUL_SUM on one rank: computed here ------------------------------------------------
    # NCCL's one-rank path (NCCL 2.28.9 under torch 2.11, on an H100) leaves the last element of
    # a PREMUL_SUM unscaled or wrong (1 of 51129 float16 elements; the only element of a 1-element
    # tensor), which the conformance suite caught. On one rank the result is ``factor * x`` in
    # the dtype: one elementwise kernel on the current stream, stream-ordered as NCCL's would be.
    def _premul_alone(self, op: ReduceOp) -> bool:
        return self.size == 1 and op.type is RedOpType.PREMUL_SUM

    def _scaled(self, out: torch.Tensor, src: torch.Tensor, op: ReduceOp, what: str, async_op: bool) -> Work | None:
        factor = op.factor
        assert factor is not None  # a PREMUL_SUM carries its factor
        if out is not src:
            out.copy_(src)
        out.mul_(factor)
        return Work.completed(what) if async_op else None

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False) -> Work | None:
        if self._premul_alone(op):
            return self._scaled(tensor, tensor, op, "all_reduce", async_op)
        return super().all_reduce(tensor, op, timeout=timeout, async_op=async_op)

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        if self._premul_alone(op):
            return self._scaled(tensor, tensor, op, "reduce", async_op)
        return super().reduce(tensor, dst, op, timeout=timeout, async_op=async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        *,
        timeout: float,
        async_op: bool = False,
    ) -> Work | None:
        if self._premul_alone(op):
            return self._scaled(output, input_list[0], op, "reduce_scatter", async_op)
        return super().reduce_scatter(output, input_list, op, timeout=timeout, async_op=async_op)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float, async_op: bool = False
    ) -> Work | None:
        if self._premul_alone(op):
            return self._scaled(output, input.view(output.shape), op, "reduce_scatter_tensor", async_op)
        return super().reduce_scatter_tensor(output, input, op, timeout=timeout, async_op=async_op)

    # -- point to point: NCCL's, untagged ----------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        pg = self._ready("send", [dst])
        self._wait(lambda: pg.send([tensor], dst, 0), "send", timeout, [dst])

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        pg = self._ready("recv", [src])
        self._wait(lambda: pg.recv([tensor], src, 0), "recv", timeout, [src])
