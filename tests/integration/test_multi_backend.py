"""One group, many backends, across real processes: cpu tensors on a real backend (pg-gloo
or pg-tcp), tensors of a second device type on another backend, each created on first use;
objects, control traffic and ``barrier`` on the cpu backend.

The second device type is ``meta`` (tensors without data, on every torch build), served by
a recording backend: it does what a device backend does with its tensors' *metadata* and
records every call, so the test sees what went where. On a GPU machine the same routing
puts cuda tensors on pg-nccl (``tests/integration/test_nccl.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.backend import Backend, BackendContext, Capabilities
from pg_core.testing.pool import RankContext, RankPool

Pools = Callable[[int], RankPool]


class MetaRecorder(Backend):
    """A backend for ``meta`` tensors that records each call (op, shapes, peer) and which
    rank's context built it; meta tensors carry no values, so there is nothing to move."""

    name = "meta-rec"
    capabilities = Capabilities(ops=frozenset({"all_reduce", "broadcast", "send", "recv"}))
    built: ClassVar[list[BackendContext]] = []

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.calls: list[tuple[Any, ...]] = []
        MetaRecorder.built.append(ctx)
        MetaRecorder.last = self

    last: ClassVar[MetaRecorder]

    def all_reduce(self, tensor: torch.Tensor, op: Any, *, timeout: float) -> None:
        self.calls.append(("all_reduce", tuple(tensor.shape), op.type.name))

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float) -> None:
        self.calls.append(("broadcast", tuple(tensor.shape), src))

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        self.calls.append(("send", tuple(tensor.shape), dst))

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        self.calls.append(("recv", tuple(tensor.shape), src))

    def barrier(self, *, timeout: float) -> None:
        self.calls.append(("barrier",))


def two_device_types(ctx: RankContext, cpu_backend: str, as_string: bool) -> dict[str, Any]:
    MetaRecorder.built = []
    backends: Any = {"cpu": cpu_backend, "meta": MetaRecorder}
    if as_string:  # the string form names registered backends only: register the recorder under a name
        from pg_core import register_backend
        from pg_core.backend import BackendSpec

        register_backend(BackendSpec("meta-rec", MetaRecorder, ("meta",), MetaRecorder.capabilities), override=True)
        backends = f" cpu : {cpu_backend} , meta:meta-rec "
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends=backends, timeout=ctx.timeout)
    try:
        out: dict[str, Any] = {"backends": group.backends}
        out["built_before_use"] = len(MetaRecorder.built)
        t = torch.full((3,), float(ctx.rank + 1))
        group.all_reduce(t)  # cpu: the real backend
        out["cpu_sum"] = t.tolist()
        out["built_after_cpu"] = len(MetaRecorder.built)
        group.all_reduce(torch.empty(2, 5, device="meta"))  # meta: the recorder, created now
        out["built_after_meta"] = len(MetaRecorder.built)
        group.broadcast(torch.empty(7, device="meta"), src=ctx.size - 1)
        # objects and barrier go over the cpu backend, never the meta one
        out["object"] = group.broadcast_object({"from": ctx.rank} if ctx.rank == 0 else None, src=0)
        group.barrier()
        # a tensor of unknown shape on meta: its metadata over cpu, its payload on the meta backend
        if ctx.rank == 0:
            group.send_tensor(torch.empty(4, 2, device="meta"), dst=1)
        elif ctx.rank == 1:
            got = group.recv_tensor(src=0, device="meta")
            out["received"] = (str(got.device), tuple(got.shape))
        async_work = group.all_reduce(torch.empty(1, device="meta"), async_op=True)
        assert async_work is not None
        async_work.wait()
        built = MetaRecorder.built
        out["meta_ctx"] = (built[0].rank, built[0].size, str(built[0].device), built[0].backend_name) if built else None
        out["meta_calls"] = list(MetaRecorder.last.calls) if built else []
        return out
    finally:
        group.shutdown()


@pytest.mark.parametrize(
    "cpu_backend",
    [
        pytest.param("gloo", marks=pytest.mark.requires_backend("gloo")),
        pytest.param("tcp", marks=pytest.mark.requires_backend("tcp")),
    ],
)
@pytest.mark.parametrize("as_string", [False, True], ids=["dict", "string"])
def test_cpu_on_a_real_backend_and_meta_on_another(rank_pools: Pools, cpu_backend: str, as_string: bool) -> None:
    n = 3
    results = rank_pools(n).run(two_device_types, cpu_backend, as_string, timeout=120)
    for rank, out in enumerate(results):
        assert out["backends"] == {"cpu": cpu_backend, "meta": "meta-rec"}
        assert out["cpu_sum"] == [6.0, 6.0, 6.0]
        # each backend is created on the first use of its device type, once
        assert (out["built_before_use"], out["built_after_cpu"], out["built_after_meta"]) == (0, 0, 1)
        assert out["meta_ctx"] == (rank, n, "meta", "meta-rec")
        assert out["object"] == {"from": 0}
        calls = out["meta_calls"]
        assert calls[:2] == [("all_reduce", (2, 5), "SUM"), ("broadcast", (7,), n - 1)]
        assert ("barrier",) not in calls  # barrier ran on the cpu backend
        if rank == 0:
            assert calls[2] == ("send", (4, 2), 1)
        if rank == 1:
            assert out["received"] == ("meta", (4, 2))
            assert calls[2] == ("recv", (4, 2), 0)
        assert calls[-1] == ("all_reduce", (1,), "SUM")
        assert len(calls) == (4 if rank in (0, 1) else 3)


def test_the_readme_capability_table_is_the_generated_one() -> None:
    """README's table is `pg-core backends --capabilities tcp shm gloo mpi nccl`, not written by hand."""
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    shown = readme.split("<!-- capabilities:begin -->\n", 1)[1].split("\n<!-- capabilities:end -->", 1)[0]
    generated = subprocess.run(
        [sys.executable, "-m", "pg_core", "backends", "--capabilities", "tcp", "shm", "gloo", "mpi", "nccl"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    assert shown == generated, f"README's table is stale; paste this in:\n{generated}"


def the_cards_line(ctx: RankContext, backends: Any) -> dict[str, Any]:
    """The README's headline line as a GPU cluster's script has it, run as it is."""
    from pg_core.errors import BackendUnavailableError
    from pg_nccl.plugin import is_available

    group = ProcessGroup(ctx.store, rank=ctx.rank, size=ctx.size, backends=backends, timeout=ctx.timeout)
    try:
        out: dict[str, Any] = {"backends": group.backends, "nccl_reason": is_available()}
        group.all_reduce(t := torch.full((4,), float(ctx.rank + 1)))
        out["cpu_sum"] = t.tolist()
        out["gathered"] = group.all_gather_object(ctx.rank)
        out["cuda_supported"] = group.supports("all_reduce", "cuda")
        torch.distributed.all_reduce(u := torch.ones(2), group=group.to_torch())  # torch's side: the cpu part too
        out["torch_sum"] = u.tolist()
        if out["nccl_reason"] is not None:
            # a CPU-only torch cannot even make a cuda tensor: the group's own refusal is what a
            # device-moving helper meets, e.g. a cuda tensor's backend created for to_torch()
            try:
                group.send_tensor(torch.ones(1), dst=(ctx.rank + 1) % ctx.size)  # cpu still fine
                group.recv_tensor(src=(ctx.rank - 1) % ctx.size, device="cuda")
            except BackendUnavailableError as exc:
                out["cuda_error"] = str(exc)
            group.barrier()
        return out
    finally:
        group.shutdown()


@pytest.mark.requires_backend("gloo")
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("backends", [{"cuda": "nccl", "cpu": "gloo"}, "cpu:gloo,cuda:nccl"], ids=["dict", "string"])
def test_the_cards_line_runs_its_cpu_part_wherever_it_runs(rank_pools: Pools, n: int, backends: Any) -> None:
    results = rank_pools(n).run(the_cards_line, backends, timeout=120)
    for out in results:
        assert out["backends"] == {"cuda": "nccl", "cpu": "gloo"}
        assert out["cpu_sum"] == [n * (n + 1) / 2] * 4
        assert out["gathered"] == list(range(n))
        assert out["cuda_supported"] == (out["nccl_reason"] is None)
        assert out["torch_sum"] == [float(n)] * 2
        if out["nccl_reason"] is not None:  # this machine: the reason and the fix, on the first cuda use
            assert "group 'world' cannot run cuda tensors here" in out["cuda_error"]
            assert out["nccl_reason"] in out["cuda_error"]
            assert "its other backends work: cpu: gloo" in out["cuda_error"]
