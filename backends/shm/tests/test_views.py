"""pg-shm's common-case copies go through byte views of the tensors they copy from and into
(:class:`pg_shm.rings.TensorViews`), keyed by address and size: every message still carries
the bytes its tensor holds at the call, and lands in the tensor the receive names, whatever
tensor held that memory when the view was made.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.testing.pool import RankContext, RankPool
from pg_shm.rings import VIEWS_KEPT, TensorViews

pytestmark = pytest.mark.requires_backend("shm")

Pools = Callable[[int], RankPool]


def test_a_view_is_made_the_second_time_an_address_is_copied_and_sees_that_memory() -> None:
    t = torch.arange(4, dtype=torch.int32)
    views = TensorViews()
    key = (t.data_ptr(), t.nbytes)
    views.note(*key)
    assert key in views and views[key] is None  # the first copy only notes it
    views.note(*key)
    view = views[key]
    assert view is not None and view.nbytes == 16 and view.format == "B"
    assert bytes(view) == t.numpy().tobytes()
    t += 10  # the view is the tensor's memory, not a copy of it
    assert bytes(view) == t.numpy().tobytes()
    view[:] = torch.full((4,), 7, dtype=torch.int32).numpy().tobytes()
    assert t.tolist() == [7, 7, 7, 7]


def test_views_are_forgotten_past_the_bound() -> None:
    buf = torch.zeros(VIEWS_KEPT + 1, dtype=torch.uint8)
    views = TensorViews()
    for i in range(VIEWS_KEPT):
        views.note(buf.data_ptr() + i, 1)
    assert len(views) == VIEWS_KEPT
    views.note(buf.data_ptr() + VIEWS_KEPT, 1)
    assert list(views) == [(buf.data_ptr() + VIEWS_KEPT, 1)]


def _sent(i: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32) + 100 * i


def copies(ctx: RankContext) -> list[str]:
    """Rank 0 sends eight float32s at a time: from one tensor changed in place between sends,
    from fresh tensors, and from an int32 view of the first tensor's memory (another tensor at
    a remembered address and size); rank 1 receives them into one tensor, into fresh ones, and
    into an int32 view of its first tensor. Each message must be exactly what was sent."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    wrong: list[str] = []
    try:
        if ctx.rank == 0:
            one = torch.zeros(8)
            for i in range(6):  # the same tensor, changed in place: a view from the third send on
                one.copy_(_sent(i))
                group.send(one, 1)
            for i in range(6, 10):
                group.send(_sent(i), 1)
            same_memory = one.view(torch.int32)  # same address and bytes, another dtype and values
            same_memory.copy_(torch.arange(8, dtype=torch.int32) - 50)
            group.send(same_memory, 1)
            group.send(one, 1)  # and the float tensor again, its bits now those integers'
        else:
            into = torch.zeros(8)
            for i in range(6):
                group.recv(into, 0)
                if not torch.equal(into, _sent(i)):
                    wrong.append(f"message {i} into one tensor: {into.tolist()}")
            for i in range(6, 10):
                fresh = torch.full((8,), -1.0)
                group.recv(fresh, 0)
                if not torch.equal(fresh, _sent(i)):
                    wrong.append(f"message {i} into a fresh tensor: {fresh.tolist()}")
            as_int = into.view(torch.int32)  # the address and bytes of `into`, whose view was made
            group.recv(as_int, 0)
            if as_int.tolist() != list(range(-50, -42)):
                wrong.append(f"the int32 message into a view of that memory: {as_int.tolist()}")
            again = torch.zeros(8)
            group.recv(again, 0)
            if again.view(torch.int32).tolist() != list(range(-50, -42)):
                wrong.append(f"the float message of those bits: {again.view(torch.int32).tolist()}")
        group.barrier()
    finally:
        group.shutdown()
    return wrong


def test_every_copy_carries_the_bytes_its_tensor_holds_at_the_call(rank_pools: Pools) -> None:
    assert rank_pools(2).run(copies, timeout=120) == [[], []]
