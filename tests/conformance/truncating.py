"""A backend written from scratch, as a first plugin author might, whose ``recv`` fits the message to the tensor.

Not a pg-tcp subclass: the whole backend is this file, point to point over the group's store (each
message one key, numbered per (sender, receiver, tag)), every collective inherited from pg-core's
defaults on ``send``/``recv``. It declares what it does: ``send``/``recv`` only, on four dtypes,
every tag, and (by not saying otherwise) that it checks message sizes. Its one mistake: a message
of another size than the receiving tensor is copied in as far as it goes, and a shorter one leaves
the rest of the tensor zeroed ("pad it, like a fixed-size record"), so a receive never fails and the
data is silently wrong. The contract asks for ``CollectiveMismatchError`` (:mod:`pg_core.backend`),
and the conformance test ``receives`` (check ``receive-mismatch``) catches it in the default run,
where pg-tcp under the same declaration passes (``tests/conformance/test_planted_bugs.py``). None of
the drawn tests sends a message of the wrong size, so before ``receives`` the suite passed it.
"""

from __future__ import annotations

import threading

import torch
from pg_core.backend import Backend, BackendContext, BackendSpec, Capabilities, tensor_bytes
from pg_core.store import wait_for

#: Point to point only, with uint8 for pg-core's emulation of messages (as planted.MESSAGE_CAPS).
CAPABILITIES = Capabilities(
    ops=frozenset({"send", "recv"}), dtypes=frozenset({torch.uint8, torch.float32, torch.int64, torch.complex128})
)


class StoreP2P(Backend):
    """Point to point through the store: ``send`` sets a key, ``recv`` waits for it, reads it and
    deletes it. A send never waits for its receiver (the store holds the message)."""

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._lock = threading.Lock()
        self._sent: dict[tuple[int, int], int] = {}
        self._received: dict[tuple[int, int], int] = {}

    def _next(self, counters: dict[tuple[int, int], int], peer: int, tag: int) -> int:
        with self._lock:
            n = counters.get((peer, tag), 0)
            counters[(peer, tag)] = n + 1
            return n

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        n = self._next(self._sent, dst, tag)
        # torch's stores take bytes as well as str (their stubs say str)
        self.ctx.store.set(f"p2p/{self.rank}>{dst}/{tag}/{n}", bytes(tensor_bytes(tensor)))  # type: ignore[arg-type]

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        n = self._next(self._received, src, tag)
        key = f"p2p/{src}>{self.rank}/{tag}/{n}"
        wait_for(self.ctx.store, [key], timeout, what=f"rank {self.rank}: recv from rank {src}")
        data = self.ctx.store.get(key)
        self.ctx.store.delete_key(key)
        out = tensor_bytes(tensor)
        fits = min(len(out), len(data))
        out[:fits] = data[:fits]  # the bug: a message of another size is cut or padded to fit
        out[fits:] = bytes(len(out) - fits)


SPEC = BackendSpec(name="truncating", factory=StoreP2P, devices=("cpu",), capabilities=CAPABILITIES)
