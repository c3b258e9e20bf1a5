"""pg-nccl on any machine: listed with the reason it cannot run, refused with that reason,
and its capabilities what NCCL has. Its certification on a GPU is in
``tests/conformance/test_backends.py`` (it skips, naming the reason, where none is visible).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from pg_core import ProcessGroup
from pg_core.errors import BackendUnavailableError
from pg_core.ops import RedOpType
from pg_core.registry import default_registry
from pg_core.store import HashStore
from pg_nccl.plugin import CAPABILITIES, is_available

REASON = is_available()


def test_the_backend_is_registered_whatever_the_machine() -> None:
    (entry,) = [e for e in default_registry().entries() if e.name == "nccl"]
    assert entry.distribution == "pg-nccl"
    if REASON is None:
        assert entry.status == "available"
    else:
        assert entry.status == "unavailable" and entry.reason == REASON


def test_pg_core_backends_prints_why_it_cannot_run_here() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pg_core", "backends", "--json"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    (entry,) = [e for e in json.loads(out) if e["name"] == "nccl"]
    assert entry["status"] == ("available" if REASON is None else "unavailable")
    if REASON is not None:
        assert REASON in json.dumps(entry)


def test_a_group_with_nccl_for_cuda_forms_everywhere_and_says_why_cuda_cannot_run_here() -> None:
    # the card's line: on a machine without a usable GPU its cpu part runs unchanged
    for backends in ({"cpu": "gloo", "cuda": "nccl"}, "cpu:gloo,cuda:nccl"):
        with ProcessGroup(HashStore(), 0, 1, backends=backends) as group:
            assert group.backends == {"cpu": "gloo", "cuda": "nccl"}
            assert group.supports("all_reduce", "cuda") == (REASON is None)
            group.all_reduce(t := torch.ones(2))
            assert t.tolist() == [1.0, 1.0]
            if REASON is not None:
                with pytest.raises(BackendUnavailableError) as err:
                    group.recv_tensor(src=0, device="cuda")  # a cuda use that needs no cuda tensor
                assert REASON in str(err.value) and "group 'world' cannot run cuda tensors here" in str(err.value)


def test_a_group_of_nccl_alone_is_refused_with_the_reason_where_it_cannot_run() -> None:
    if REASON is None:  # a GPU machine: the group forms (NCCL itself starts on first use)
        with ProcessGroup(HashStore(), 0, 1, backends="nccl") as group:
            assert group.backends == {"cuda": "nccl"}
        return
    with pytest.raises(BackendUnavailableError) as err:  # its messages and barrier would need it
        ProcessGroup(HashStore(), 0, 1, backends="nccl")
    assert REASON in str(err.value)


def test_the_reason_names_exactly_what_is_missing() -> None:
    if torch.version.cuda is None:
        assert REASON is not None and "without CUDA" in REASON and torch.__version__ in REASON
    elif not torch.distributed.is_nccl_available():
        assert REASON is not None and "without NCCL" in REASON
    elif torch.cuda.device_count() == 0:
        assert REASON is not None and "no GPU is visible" in REASON
    else:
        assert REASON is None


def test_the_declared_capabilities_are_what_nccl_has() -> None:
    assert CAPABILITIES.max_tag is None  # NCCL's point to point is untagged
    for dtype in CAPABILITIES.dtypes:
        ops = CAPABILITIES.reduce_ops_for(dtype)
        assert not ops & {RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR}, dtype  # NCCL has no bitwise reductions
    assert CAPABILITIES.reduce_ops_for(torch.int16) == frozenset()
    assert RedOpType.PREMUL_SUM in CAPABILITIES.reduce_ops_for(torch.bfloat16)
    assert "recv_anysource" not in CAPABILITIES.ops  # every ncclRecv names its peer: no receive from any source


# -- on a GPU: a coalescing block is one NCCL group call -----------------------------------------


class _Spy:
    """The ProcessGroupNCCL, recording the calls pg-nccl makes on it."""

    def __init__(self, pg: object) -> None:
        self._pg = pg
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._pg, name)
        if not callable(attr):
            return attr

        def call(*args: object) -> object:
            self.calls.append(name)
            return attr(*args)

        return call


@pytest.mark.skipif(REASON is not None, reason=f"pg-nccl cannot run here: {REASON}")
@pytest.mark.parametrize("async_block", [False, True], ids=["blocking", "async"])
def test_a_coalescing_block_is_one_nccl_group_call(async_block: bool) -> None:
    torch.cuda.set_device(0)
    with ProcessGroup(HashStore(), 0, 1, backends={"cpu": "gloo", "cuda": "nccl"}, timeout=60) as group:
        group.all_reduce(torch.ones(1, device="cuda"))  # the backend and its communicator exist
        backend = group._dispatch.instance(torch.device("cuda")).backend
        assert backend.coalesces is True  # ProcessGroupNCCL's supports_coalescing
        spy = backend._pg = _Spy(backend._pg)
        tensors = [
            torch.full((5,), 1.5, device="cuda"),
            torch.full((3, 2), 2.0, device="cuda", dtype=torch.float64),
            torch.arange(4, device="cuda", dtype=torch.int32),
            torch.full((6, 4), 3.0, device="cuda").t(),  # staged, copied back after the batch
        ]
        root = torch.full((7,), 4.0, device="cuda")
        with group.coalescing(async_op=async_block) as batch:
            works = [group.all_reduce(t, async_op=True) for t in tensors]
            group.broadcast(root, src=0)
        if async_block:
            batch.wait(timeout=60)
        torch.cuda.synchronize()
        assert spy.calls == ["_start_coalescing", *["allreduce"] * 4, "broadcast", "_end_coalescing"]
        assert all(w is not None and w.is_completed() for w in works)
        assert tensors[0].tolist() == [1.5] * 5 and tensors[2].tolist() == [0, 1, 2, 3]
        assert tensors[3].tolist() == [[3.0] * 6] * 4 and root.tolist() == [4.0] * 7
