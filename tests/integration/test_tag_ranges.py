"""Backends with narrow tags or none: the core maps its own tags and the user's into what a
backend declares (``Capabilities.max_tag``), so object messages and the default collectives
work on a backend that carries 32-bit non-negative tags (as Gloo) or no tags (as NCCL).

The backends here are pg-tcp's transport behind a backend that declares the narrow range,
refuses any tag outside it, and overrides no collective (so the defaults of
``pg_core.algorithms`` run on the core's channel) and no ``isend``/``irecv`` (so the core's
helper threads and deferred receives carry them).
"""

from __future__ import annotations

import pytest
import torch
from pg_core import NotSupportedError, ProcessGroup, ReduceOp
from pg_core.backend import Backend, BackendContext, BackendSpec, Capabilities

pytestmark = pytest.mark.requires_backend("tcp")  # in-repo: missing or broken fails, never skips

GLOO_MAX_TAG = 2**31 - 1


class _Narrow(Backend):
    """pg-tcp's point to point, refusing every tag outside ``max_tag`` (``None``: only 0)."""

    max_tag: int | None = GLOO_MAX_TAG

    def __init__(self, ctx: BackendContext) -> None:  # no super().__init__: the core needs none
        from pg_tcp.backend import TCPBackend

        self.inner = TCPBackend(ctx)

    def _tag(self, tag: int) -> int:
        limit = 0 if self.max_tag is None else self.max_tag
        if not 0 <= tag <= limit:
            raise AssertionError(f"the core handed tag {tag} to a backend that carries 0..{limit}")
        return tag

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        self.inner.send(tensor, dst, self._tag(tag), timeout=timeout)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        self.inner.recv(tensor, src, self._tag(tag), timeout=timeout)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def abort(self) -> None:
        self.inner.abort()


class _NoTags(_Narrow):
    max_tag = None


NARROW = BackendSpec("narrow", _Narrow, ("cpu",), Capabilities(max_tag=GLOO_MAX_TAG))
NO_TAGS = BackendSpec("notags", _NoTags, ("cpu",), Capabilities(max_tag=None))


def everything(ctx, which: str) -> dict[str, object]:
    spec = NARROW if which == "narrow" else NO_TAGS
    r, n = ctx.rank, ctx.size
    out: dict[str, object] = {}
    with ProcessGroup(ctx.store, rank=r, size=n, backends=spec, timeout=ctx.timeout) as g:
        t = torch.full((5,), float(r + 1))
        g.all_reduce(t)  # the default algorithm on the core's collective tag
        out["all_reduce"] = t.tolist()
        big = torch.full((40_000,), float(r))  # past the direct path: the ring
        g.all_reduce(big, ReduceOp.MAX)
        out["ring_max"] = big[0].item()
        g.barrier()
        out["objects"] = g.all_gather_object({"rank": r})
        out["broadcast"] = g.broadcast_object(["hello", r], src=n - 1)
        right, left = (r + 1) % n, (r - 1) % n
        top = g._dispatch.instance(torch.device("cpu")).tags.limit - 1  # the largest user tag carried
        tag = top if which == "narrow" else 0
        # a user tensor, an object message and a collective interleaved on one pair
        work = g.isend(torch.full((3,), float(r)), right, tag=tag)
        g.send_object({"from": r}, right, tag=tag)
        got = torch.empty(3)
        g.recv(got, left, tag=tag)
        out["p2p"] = got.tolist()
        out["object_p2p"] = g.recv_object(left, tag=tag)
        work.wait()
        s = torch.ones(2)
        g.all_reduce(s)
        out["after"] = s.tolist()
        with pytest.raises(NotSupportedError):
            g.send(torch.zeros(1), right, tag=top + 1)
        g.barrier()
    return out


@pytest.mark.parametrize("which", ["narrow", "none"])
def test_messages_and_default_collectives_fit_the_declared_tags(rank_pools, which):
    n = 3
    results = rank_pools(n).run(everything, which)
    for r, out in enumerate(results):
        left = (r - 1) % n
        assert out["all_reduce"] == [float(n * (n + 1) // 2)] * 5
        assert out["ring_max"] == float(n - 1)
        assert out["objects"] == [{"rank": q} for q in range(n)]
        assert out["broadcast"] == ["hello", n - 1]
        assert out["p2p"] == [float(left)] * 3
        assert out["object_p2p"] == {"from": left}
        assert out["after"] == [float(n)] * 2
