"""A backend with one planted bug, for the tests of the conformance tooling: broadcast
takes its data from the wrong root. Loaded by path (``wrong_root.py:SPEC``)."""

from __future__ import annotations

import torch
from pg_core.backend import BackendSpec
from pg_tcp.backend import TCPBackend
from pg_tcp.plugin import CAPABILITIES


class WrongRoot(TCPBackend):
    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float) -> None:
        super().broadcast(tensor, (src + 1) % self.size, timeout=timeout)


SPEC = BackendSpec(name="wrong-root", factory=WrongRoot, devices=("cpu",), capabilities=CAPABILITIES)
