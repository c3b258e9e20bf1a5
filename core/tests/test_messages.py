"""pg_core.messages without processes: every value survives encode -> bytes -> parse -> value,
tensors are never copied into the pickle stream, and received CPU tensors are views of the
one buffer the message arrived in."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from pg_core import messages
from pg_core.backend import DTYPES
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout
from pg_core.timeouts import Deadline


def _wire(out: messages.Outgoing, **stamp: int) -> bytearray:
    return bytearray().join(out.parts(**stamp))


def _roundtrip(kind: int, value: object) -> object:
    out = messages.encode(kind, value)
    return messages.parse(_wire(out), src=0).value({}, None)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 0, 2), (4, 5), (2, 3, 4)])
def test_a_tensor_of_any_dtype_and_shape_round_trips(dtype, shape):
    t = (torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 1.5 - 3).to(dtype)
    got = _roundtrip(messages.TENSOR, t)
    assert isinstance(got, torch.Tensor)
    assert _same(got, t)


def test_layouts_are_sent_as_their_values():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    z = torch.randn(5, dtype=torch.complex64)
    for t in (base.t(), base[:, ::2], base[1:3], base[0, 0:1], z.conj(), torch.neg(z.conj()), base.expand(2, 4, 6)):
        got = _roundtrip(messages.TENSOR, t)
        assert _same(got, t.resolve_conj().resolve_neg().contiguous()), t
        assert got.is_contiguous()


def test_objects_of_any_structure_round_trip():
    t = torch.arange(6.0).reshape(2, 3)
    value = {
        "ints": [0, -1, 2**70],
        "floats": (0.5, float("inf"), -0.0),
        "text": "kv-cache ✓",
        "raw": b"\x00\xff",
        "none": None,
        ("tuple", "key"): {"deep": [t, {"t0": torch.tensor(3, dtype=torch.int8)}]},
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "strided": t.t(),
    }
    got = _roundtrip(messages.OBJECT, value)
    assert got.keys() == value.keys()
    assert got["ints"] == value["ints"] and got["text"] == value["text"] and got["raw"] == value["raw"]
    assert got["floats"][1] == math.inf and math.copysign(1, got["floats"][2]) == -1
    assert _same(got[("tuple", "key")]["deep"][0], t)
    assert _same(got[("tuple", "key")]["deep"][1]["t0"], torch.tensor(3, dtype=torch.int8))
    assert _same(got["empty"], value["empty"])
    assert _same(got["strided"], t.t().contiguous())


def test_no_tensor_byte_is_in_the_pickle_stream_and_parts_point_into_the_tensors():
    t = torch.full((1024,), 7.25)
    out = messages.encode(messages.OBJECT, {"t": t, "again": t})
    assert len(out.body) < 300  # a tensor of 4 KiB is referenced, not pickled
    assert t.numpy().tobytes() not in out.body
    assert len(out.entries) == 1  # the same tensor twice is sent once
    views = [p for p in out.parts() if isinstance(p, memoryview) and p.nbytes == t.numel() * 4]
    assert len(views) == 1
    import ctypes

    assert ctypes.addressof(ctypes.c_char.from_buffer(views[0])) == t.data_ptr()  # zero copy on the way out
    got = messages.parse(_wire(out), src=0).value({}, None)
    assert got["t"] is got["again"]  # and one tensor on the way in


def test_received_tensors_are_aligned_views_of_the_message():
    tensors = {f"t{i}": torch.randn(i * 3 + 1, dtype=torch.float64) for i in range(5)}
    data = _wire(messages.encode(messages.TENSOR_DICT, tensors))
    got = messages.parse(data, src=0).value({}, None)
    import ctypes

    start = ctypes.addressof(ctypes.c_char.from_buffer(data))
    for name, t in tensors.items():
        assert _same(got[name], t)
        offset = got[name].data_ptr() - start
        assert 0 <= offset < len(data)  # a view into the received buffer, not a copy
        assert offset % 64 == 0
    got["t0"].add_(1)  # writable: the buffer is the receiver's own


def test_numpy_arrays_travel_out_of_band():
    import numpy as np  # installed by make install: a missing numpy fails, never skips

    a = np.arange(4096, dtype=np.float32)
    out = messages.encode(messages.OBJECT, {"a": a})
    assert len(out.buffers) == 1 and len(out.body) < 400
    got = messages.parse(_wire(out), src=0).value({}, None)
    assert (got["a"] == a).all() and got["a"].dtype == a.dtype


def test_autograd_flags_and_parameters_survive():
    p = torch.nn.Parameter(torch.ones(3))
    leaf = torch.zeros(2, requires_grad=True)
    nonleaf = leaf * 2
    got = _roundtrip(messages.OBJECT, [p, leaf, nonleaf, torch.ones(1)])
    assert isinstance(got[0], torch.nn.Parameter) and got[0].requires_grad
    assert got[1].requires_grad and got[2].requires_grad and got[2].is_leaf
    assert not got[3].requires_grad


def test_tensors_of_other_devices_are_separate_only_where_the_group_has_a_backend():
    t = torch.arange(4.0)
    out = messages.encode(messages.TENSOR_DICT, {"t": t, "u": torch.ones(2)}, separate_devices=frozenset({"cpu"}))
    assert len(out.separate) == 2
    incoming = messages.parse(_wire(out), src=0)
    specs = incoming.separate_specs()
    assert [(s.shape, s.dtype) for _, s in specs] == [((4,), torch.float32), ((2,), torch.float32)]
    got = incoming.value({i: out.separate[k].clone() for k, (i, _) in enumerate(specs)}, None)
    assert _same(got["t"], t)


def test_a_message_says_its_kind_and_collective():
    out = messages.encode(messages.TENSOR_DICT, {"a": 1})
    incoming = messages.parse(_wire(out, op=3, seq=42), src=1)
    assert (incoming.kind, incoming.op, incoming.seq) == (messages.TENSOR_DICT, 3, 42)
    messages.check_collective(incoming, op=3, seq=42, src=1, what="gather_object", names={})
    with pytest.raises(CollectiveMismatchError, match="rank 1 sent a message of scatter_object"):
        messages.check_collective(incoming, op=2, seq=42, src=1, what="all_gather_object", names={3: "scatter_object"})


def test_garbage_is_not_a_message():
    with pytest.raises(ValueError, match="not a pg-core message"):
        messages.parse(bytearray(b"hello world, this is not it....."), src=3)
    data = _wire(messages.encode(messages.TENSOR, torch.ones(100)))
    with pytest.raises(ValueError, match="truncated"):
        messages.parse(data[:-8], src=3)


def test_unpicklable_values_fail_at_encoding():
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        messages.encode(messages.OBJECT, {"f": lambda: 1})


def test_a_deadline_bounds_every_step():
    d = Deadline("recv_object", 0.001)
    while True:
        try:
            d.left()
        except CollectiveTimeout as exc:
            assert exc.op == "recv_object"
            break
