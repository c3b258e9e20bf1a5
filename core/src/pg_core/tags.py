"""Tags: the whole tag namespace (the user's and the core's own), mapped into what a backend carries.

Three kinds of traffic share a backend's ``send``/``recv`` (and ``send_bytes``/``recv_bytes``):

* the user's ``send``/``recv``/``isend``/``irecv``, with user tags ``t >= 0`` (a receive from
  any source, ``src=None``, gets the same wire tag as a receive naming its sender: they
  compete for the same messages);
* point-to-point *messages* (``send_object``, ``send_tensor``, ``send_tensor_dict``), whose
  user tags are a namespace of their own: ``send_object(x, tag=3)`` never meets ``recv(t, tag=3)``;
* the core's own: the default collectives of :mod:`pg_core.algorithms` and the object
  collectives, which run one at a time per group.

A backend declares the tags it carries in :attr:`pg_core.backend.Capabilities.max_tag`, and
the core maps every kind into ``0 .. max_tag`` (:class:`TagMap`), so a backend never sees a
tag it did not declare:

========================  ==========================================
wire tag                  carries
========================  ==========================================
``0``                     the default collectives
``1``                     the object collectives
``2 + 2 t``               user tag ``t`` of ``send``/``recv``
``3 + 2 t``               user tag ``t`` of messages
========================  ==========================================

User tags range over ``0 .. (max_tag - 1) // 2 - 1``: ``2**62 - 2`` for a backend with
signed 64-bit tags, ``2**30 - 2`` for one with 32-bit non-negative tags (Gloo). The
constants hold for every declared range, so a backend's inherited default collectives use
:data:`COLLECTIVE` without knowing its group's range.

A backend without tags (``max_tag=None``, as NCCL's point to point) matches messages between
two ranks in the order they were sent. Every kind then travels as tag ``0``, the only user
tag accepted is ``0``, and the core keeps the call order per peer (not per (peer, tag)):
correct programs are those whose receives come in the order of the sends, which object
messages and collectives (called in the same order on every rank) keep.
"""

from __future__ import annotations

from typing import Final

from .errors import NotSupportedError

__all__ = ["COLLECTIVE", "OBJECT_COLLECTIVE", "TagMap", "check_tag"]

#: The wire tag of the default collectives' traffic.
COLLECTIVE: Final = 0
#: The wire tag of the object collectives' messages.
OBJECT_COLLECTIVE: Final = 1


def check_tag(tag: object) -> int:
    """A user tag's type and sign (``TypeError``/``ValueError``); the range is the backend's
    (:meth:`TagMap.user`)."""
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"tag must be an int, got {tag!r}")
    if tag < 0:
        raise ValueError(f"tag must be >= 0, got {tag}")
    return tag


class TagMap:
    """Wire tags for one backend, from its declared ``max_tag`` (``None``: no tags)."""

    __slots__ = ("backend", "limit", "ordered_per_peer", "user_first", "user_step")

    def __init__(self, max_tag: int | None, backend: str) -> None:
        self.backend = backend
        #: user tags are ``0 .. limit - 1``
        self.limit = 1 if max_tag is None else (max_tag - 1) // 2
        #: no tags: the call order per peer is the only order there is
        self.ordered_per_peer = max_tag is None
        #: the wire tag of user tag ``t`` for ``send``/``recv`` is ``user_first + user_step * t``
        #: (for a caller that checked ``t`` against :attr:`limit` itself: the hot path's lane)
        self.user_first, self.user_step = (0, 0) if self.ordered_per_peer else (2, 2)

    def _checked(self, tag: int, what: str) -> int:
        if tag >= self.limit:
            if self.ordered_per_peer:
                raise NotSupportedError(
                    f"{what} tag {tag}: backend {self.backend!r} carries no tags (messages between two ranks "
                    "match in the order they are sent); pass tag=0"
                )
            raise NotSupportedError(f"{what} tag {tag}: backend {self.backend!r} carries user tags below {self.limit}")
        return tag

    def user(self, tag: int) -> int:
        """The wire tag of user ``tag`` for ``send``/``recv`` (``NotSupportedError`` past the range)."""
        return self.user_first + self.user_step * self._checked(tag, "send/recv")

    def message(self, tag: int) -> int:
        """The wire tag of user ``tag`` for object and tensor messages."""
        tag = self._checked(tag, "message")
        return 0 if self.ordered_per_peer else 3 + 2 * tag

    def check(self, tag: int) -> None:
        """Raise ``NotSupportedError`` unless user ``tag`` is within the backend's range."""
        self._checked(tag, "user")

    @property
    def collective(self) -> int:
        return COLLECTIVE

    @property
    def object_collective(self) -> int:
        return 0 if self.ordered_per_peer else OBJECT_COLLECTIVE
