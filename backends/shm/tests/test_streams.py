"""pg-shm's messages larger than the ring stream through it a piece at a time
(``STREAM_CHUNK``): the sender copies a piece in while the receiver copies the last one
out. Every byte lands where it belongs, whatever the ring's offset when the message starts
(wrapping) and whichever receive takes it (blocking, or posted first and completed by its
waiter or by a later receive).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.store import wait_for
from pg_core.testing.pool import RankContext, RankPool
from pg_shm import rings

pytestmark = pytest.mark.requires_backend("shm")

Pools = Callable[[int], RankPool]

#: int32 elements: a few chunks and a ring and more, none of them a whole number of chunks
SIZES = [
    rings.EAGER_LIMIT // 4 + 1,
    (rings.STREAM_CHUNK * 5) // 4 + 3,
    (rings.RING_BYTES * 3) // 4 + 17,
    (9 << 20) // 4 + 5,
]


def _pattern(n: int, seed: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))


def streams(ctx: RankContext) -> list[str]:
    """Rank 0 sends, for each size, a small message that moves the ring's head to an odd
    place and then the large one; rank 1 takes the large ones by blocking receive and by
    irecvs posted before the send (waited for at once, or after the next message's receive)."""
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends="shm", timeout=60)
    wrong: list[str] = []
    try:
        for i, n in enumerate(SIZES):
            for how in ("recv", "irecv", "irecv-later"):
                seed = 100 * i + len(how)
                if ctx.rank == 0:
                    wait_for(ctx.store, [f"posted/{i}/{how}"], 60)
                    group.send(torch.arange(i % 7 + 1, dtype=torch.int32), 1)
                    group.send(_pattern(n, seed), 1)
                    group.send(torch.full((3,), i, dtype=torch.int32), 1)
                    continue
                small, big, after = (
                    torch.zeros(i % 7 + 1, dtype=torch.int32),
                    torch.zeros(n, dtype=torch.int32),
                    torch.zeros(3, dtype=torch.int32),
                )
                works = []
                if how != "recv":
                    works = [group.irecv(small, 0), group.irecv(big, 0)]
                ctx.store.set(f"posted/{i}/{how}", "1")
                if how == "recv":
                    group.recv(small, 0)
                    group.recv(big, 0)
                    group.recv(after, 0)
                elif how == "irecv":
                    for w in works:
                        w.wait()
                    group.recv(after, 0)
                else:
                    group.recv(after, 0)  # behind the posted ones: it completes them first
                    for w in works:
                        w.wait()
                if not torch.equal(small, torch.arange(i % 7 + 1, dtype=torch.int32)):
                    wrong.append(f"{how} {n}: the small message before")
                want = _pattern(n, seed)
                if not torch.equal(big, want):
                    at = int((big != want).nonzero()[0])
                    wrong.append(f"{how} {n} elements: first wrong element {at} (byte {4 * at})")
                if not torch.equal(after, torch.full((3,), i, dtype=torch.int32)):
                    wrong.append(f"{how} {n}: the message after")
        group.barrier()
    finally:
        group.shutdown()
    return wrong


def test_messages_larger_than_the_ring_arrive_whole_at_every_offset(rank_pools: Pools) -> None:
    results = rank_pools(2).run(streams, timeout=180)
    assert results == [[], []], results
