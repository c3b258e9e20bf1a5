"""The baselines a rank measures beside pg-core, each through its own library's API: torch's
``ProcessGroupGloo`` (:class:`TorchGlooRunner`, labelled ``torch-gloo``) and raw mpi4py on
``MPI_COMM_WORLD`` (:class:`Mpi4pyRunner`). Both answer :class:`pg_core.bench.runners.Runner`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ..dtypes import dtype_code, dtype_from_code, dtype_name
from .catalog import BASELINE, CONTROL, MPI4PY, OBJECT_OPS, ROOT

__all__ = ["Mpi4pyRunner", "TorchGlooRunner"]


class TorchGlooRunner:
    """torch's ``ProcessGroupGloo``, created directly (no ``init_process_group``) and used
    through its own API; for the object ops, torch's ``send_object_list``,
    ``recv_object_list`` and ``broadcast_object_list`` on the default group.

    Those three need a group that torch.distributed's registry knows (``recv`` turns
    the source's group rank into a global rank through it), which only
    ``init_process_group`` or ``new_group`` (which needs the former) provide. So when
    an object op is measured, this runner calls ``init_process_group("gloo")`` on a
    store prefix of its own: acceptable here because the rank processes are the
    benchmark's own and nothing else in them uses torch's default group.

    ``send_tensor`` is what a torch user writes for a tensor whose shape the receiver
    does not know: three blocking send/recv pairs on the same ``ProcessGroupGloo``
    (int64 ``[ndim, dtype code]``, then the int64 shape, then the data).
    """

    is_baseline = True
    label = BASELINE

    def __init__(
        self, store: Any, rank: int, size: int, timeout: float, *, objects: bool = False, control: bool = False
    ) -> None:
        import torch.distributed as dist

        prefix = "bench-torch-gloo" + ("-control" if control else "")  # a control row: a Gloo object of its own
        self._options(dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout)))
        if control:
            self.label, self.is_baseline = BASELINE + CONTROL, False
        self._default_group = objects and not dist.is_initialized()
        if self._default_group:
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("bench-torch-gloo-objects", store),
                rank=rank,
                world_size=size,
                timeout=timedelta(seconds=timeout),
            )

    def _options(self, pg: Any) -> None:
        """Use ``pg`` (torch's API), with the options each call passes made once."""
        import torch.distributed as dist

        self._dist = dist
        self.pg: Any = pg
        sum_op: Any = dist.ReduceOp.SUM  # torch's stubs type it as RedOpType; the options want a ReduceOp
        self._bcast = dist.BroadcastOptions()
        self._bcast.rootRank = ROOT
        self._bcast.rootTensor = 0
        self._reduce = dist.ReduceOptions()
        self._reduce.rootRank = ROOT
        self._reduce.rootTensor = 0
        self._reduce.reduceOp = sum_op
        self._rs = dist.ReduceScatterOptions()
        self._rs.reduceOp = sum_op

    def why_not(self, op: str, dtype: torch.dtype) -> str | None:
        return None

    def barrier(self) -> bool:
        self.pg.barrier().wait()
        return True

    def all_reduce(self, t: torch.Tensor) -> None:
        self.pg.allreduce([t]).wait()

    def all_reduce_async(self, t: torch.Tensor) -> None:  # torch's calls return a Work either way
        self.pg.allreduce([t]).wait()

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        assert src == ROOT
        self.pg.broadcast([t], self._bcast).wait()

    def broadcast_async(self, t: torch.Tensor, src: int) -> None:
        assert src == ROOT
        self.pg.broadcast([t], self._bcast).wait()

    def reduce(self, t: torch.Tensor, dst: int) -> None:
        assert dst == ROOT
        self.pg.reduce([t], self._reduce).wait()

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.pg._allgather_base(out, inp).wait()

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.pg._reduce_scatter_base(out, inp, self._rs).wait()

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.pg.alltoall_base(out, inp, [], [], self._dist.AllToAllOptions()).wait()

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.pg.send([t], dst, 0).wait()

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.pg.recv([t], src, 0).wait()

    def isend_wait(self, t: torch.Tensor, dst: int) -> None:
        self.pg.send([t], dst, 0).wait()

    def irecv_wait(self, t: torch.Tensor, src: int) -> None:
        self.pg.recv([t], src, 0).wait()

    def send_tensor(self, t: torch.Tensor, dst: int) -> None:
        header = torch.tensor([t.dim(), dtype_code(t.dtype)], dtype=torch.int64)  # pg-core's wire codes
        self.pg.send([header], dst, 0).wait()
        self.pg.send([torch.tensor(t.shape, dtype=torch.int64)], dst, 0).wait()
        self.pg.send([t], dst, 0).wait()

    def recv_tensor(self, src: int) -> torch.Tensor:
        header = torch.empty(2, dtype=torch.int64)
        self.pg.recv([header], src, 0).wait()
        ndim, code = header.tolist()
        shape = torch.empty(ndim, dtype=torch.int64)
        self.pg.recv([shape], src, 0).wait()
        dtype = dtype_from_code(code)
        if dtype is None:
            raise ValueError(f"send_tensor: received unknown dtype code {code}")
        t = torch.empty(shape.tolist(), dtype=dtype)
        self.pg.recv([t], src, 0).wait()
        return t

    def send_object(self, obj: object, dst: int) -> None:
        self._dist.send_object_list([obj], dst=dst)

    def recv_object(self, src: int) -> object:
        got: list[object] = [None]
        self._dist.recv_object_list(got, src=src)
        return got[0]

    def broadcast_object(self, obj: object, src: int) -> object:
        box = [obj]
        self._dist.broadcast_object_list(box, src=src)
        return box[0]

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.pg = None
        if self._default_group:
            self._dist.destroy_process_group()


class Mpi4pyRunner:
    """Raw mpi4py on ``MPI_COMM_WORLD``, on numpy views of the tensors (``Tensor.numpy()``, no
    copy): the baseline with ``--baseline mpi4py``, whose ranks an MPI launcher started. Tensor
    collectives and ``send_recv``; the value ops are pg-core's business, not MPI's."""

    is_baseline = True
    label = MPI4PY

    def __init__(self, *, control: bool = False) -> None:
        from mpi4py import MPI  # initialises MPI (mpi4py's defaults: MPI_THREAD_MULTIPLE), unless it is already

        self._mpi = MPI
        self.comm: Any = MPI.COMM_WORLD  # a control row too: the very calls of the baseline's row
        if control:
            self.label, self.is_baseline = MPI4PY + CONTROL, False

    def why_not(self, op: str, dtype: torch.dtype) -> str | None:
        if op in ("send_tensor", *OBJECT_OPS):
            return "raw mpi4py has no such operation (it is what pg-core adds)"
        try:
            torch.empty(0, dtype=dtype).numpy()
        except TypeError:
            return f"numpy has no {dtype_name(dtype)}"
        return None

    def barrier(self) -> bool:
        self.comm.Barrier()
        return True

    def all_reduce(self, t: torch.Tensor) -> None:
        self.comm.Allreduce(self._mpi.IN_PLACE, t.numpy())

    def all_reduce_async(self, t: torch.Tensor) -> None:
        self.comm.Iallreduce(self._mpi.IN_PLACE, t.numpy()).Wait()

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self.comm.Bcast(t.numpy(), root=src)

    def broadcast_async(self, t: torch.Tensor, src: int) -> None:
        self.comm.Ibcast(t.numpy(), root=src).Wait()

    def reduce(self, t: torch.Tensor, dst: int) -> None:
        if self.comm.Get_rank() == dst:
            self.comm.Reduce(self._mpi.IN_PLACE, t.numpy(), root=dst)
        else:
            self.comm.Reduce(t.numpy(), None, root=dst)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.Allgather(inp.numpy(), out.numpy())

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.Reduce_scatter_block(inp.numpy(), out.numpy())

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.Alltoall(inp.numpy(), out.numpy())

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.comm.Send(t.numpy(), dst, 0)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.comm.Recv(t.numpy(), src, 0)

    def isend_wait(self, t: torch.Tensor, dst: int) -> None:
        self.comm.Isend(t.numpy(), dst, 0).Wait()

    def irecv_wait(self, t: torch.Tensor, src: int) -> None:
        self.comm.Irecv(t.numpy(), src, 0).Wait()

    def send_tensor(self, t: torch.Tensor, dst: int) -> None:
        raise NotImplementedError

    def recv_tensor(self, src: int) -> torch.Tensor:
        raise NotImplementedError

    def send_object(self, obj: object, dst: int) -> None:
        raise NotImplementedError

    def recv_object(self, src: int) -> object:
        raise NotImplementedError

    def broadcast_object(self, obj: object, src: int) -> object:
        raise NotImplementedError

    def close(self) -> None:
        self.comm = None  # MPI_COMM_WORLD is MPI's; mpi4py finalises MPI at exit
