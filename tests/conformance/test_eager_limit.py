"""pg-core's own layers above a backend whose sends wait for their receivers above its eager limit.

``RENDEZVOUS_1K`` (planted.py) is pg-tcp whose blocking sends above 1 KiB wait until the receiver
has the message, declared so (``eager_limit_bytes=1024``), as MPI's and Gloo's sends of large
messages do. The object collectives and value messages, written once in the core on the backend's
``send_bytes``/``recv_bytes``, must complete on it at every world size, with objects above the
limit on every rank, or on some ranks only (a rank whose sends are eager and one whose sends wait,
in one call), instead of each rank sending to every other before it receives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

RENDEZVOUS_1K = f"{Path(__file__).resolve().with_name('planted.py')}:RENDEZVOUS_1K"


def _value(rank: int, big: bool) -> dict[str, Any]:
    """An object of a few KiB (``big``: above the 1 KiB limit) or a few bytes, different per rank."""
    return {"rank": rank, "payload": bytes([rank % 251]) * (5000 + 7 * rank if big else 3)}


def _object_collectives(ctx: Any, backend_ref: str, big_ranks: list[int]) -> dict[str, Any]:
    """Every object collective and value message pattern of the core, on the rendezvous backend."""
    from pg_core.backend_refs import resolve_backend_ref
    from pg_core.group import ProcessGroup

    spec = resolve_backend_ref(backend_ref, "cpu", factories=False)
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends={"cpu": spec}, name="eager-limit-objects", timeout=15)
    me, n = ctx.rank, ctx.size
    mine = _value(me, me in big_ranks)
    try:
        out: dict[str, Any] = {"all_gather_object": group.all_gather_object(mine)}
        out["broadcast_object"] = group.broadcast_object(mine if me == n - 1 else None, src=n - 1)
        out["gather_object"] = group.gather_object(mine, dst=0)
        out["scatter_object"] = group.scatter_object([_value(r, True) for r in range(n)] if me == 1 else None, src=1)
        tensors = {"w": torch.full((700 + me,), float(me)), "b": torch.arange(3) + me}
        got = group.broadcast_tensor_dict(tensors if me == 0 else None, src=0)
        out["broadcast_tensor_dict"] = {k: v.tolist() for k, v in got.items()}
        # a ring of value messages, each rank receiving first except rank 0 (a correct program above the limit)
        right, left = (me + 1) % n, (me - 1) % n
        if me == 0:
            group.send_object(mine, right)
            out["ring"] = group.recv_object(left)
        else:
            out["ring"] = group.recv_object(left)
            group.send_object(mine, right)
        return out
    finally:
        group.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("big", ["every rank", "some ranks"])
def test_object_collectives_do_not_rely_on_eager_sends(n: int, big: str, rank_pools) -> None:
    big_ranks = list(range(n)) if big == "every rank" else [r for r in range(n) if r % 2]
    results = rank_pools(n).run(_object_collectives, RENDEZVOUS_1K, big_ranks, timeout=90)
    values = [_value(r, r in big_ranks) for r in range(n)]
    for rank, out in enumerate(results):
        assert out["all_gather_object"] == values, f"rank {rank}"
        assert out["broadcast_object"] == values[n - 1], f"rank {rank}"
        assert out["gather_object"] == (values if rank == 0 else None), f"rank {rank}"
        assert out["scatter_object"] == _value(rank, True), f"rank {rank}"
        assert out["broadcast_tensor_dict"] == {"w": [0.0] * 700, "b": [0, 1, 2]}, f"rank {rank}"
        assert out["ring"] == values[(rank - 1) % n], f"rank {rank}"
