"""Inputs and expected outputs: what each rank's buffers hold before an op, the object the
object ops carry, and the checks of what every rank holds after it (tensors in chunks, so
checking 1 GiB needs no 8 GiB; objects with where they first differ)."""

from __future__ import annotations

import math
import pickle
from typing import Any, Final

import torch

from .catalog import BLOCKING_OF, ECHO_OPS, KNOWN_OPS, OBJECT_OPS, ROOT

__all__ = [
    "CHECK_CHUNK",
    "NOTHING",
    "POISON",
    "check_object",
    "check_output",
    "expected_output",
    "input_values",
    "object_size",
    "output_length",
    "output_shape",
    "request_object",
    "tensor_shape",
]

#: What an output is filled with before the last timed iteration: never an expected value
#: (every expected value is positive), so a stale output cannot pass.
POISON: Final[int] = -1
#: An object op's result before the op has left one.
NOTHING: Final[object] = object()
_RTOL: Final[dict[torch.dtype, float]] = {
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
    torch.float32: 1e-6,
    torch.float64: 1e-12,
}


def _pattern(index: torch.Tensor) -> torch.Tensor:
    return (index % 3 + 1).to(torch.float64)


def input_values(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: ``(rank + 1) * (1 + i % 3)`` at element ``i``."""
    period = (_pattern(torch.arange(3)) * (rank + 1)).to(dtype)
    return period.repeat(-(-count // 3))[:count].clone()


def output_length(op: str, world_size: int, count: int) -> int:
    """Elements of ``op``'s output on one rank (``count`` from :func:`~pg_core.bench.sizing.element_count`)."""
    return count // world_size if op == "reduce_scatter_tensor" else count


def tensor_shape(count: int) -> tuple[int, int]:
    """The shape ``send_tensor`` sends ``count`` elements in: rows of up to 64 elements,
    ``(count // w, w)`` with ``w = gcd(count, 64)`` (``(16, 64)`` for 4 KiB of float32)."""
    width = math.gcd(count, 64)
    return (count // width, width)


def output_shape(op: str, world_size: int, count: int) -> tuple[int, ...]:
    """The shape of ``op``'s output on one rank: :func:`tensor_shape` for ``send_tensor``,
    one dimension of :func:`output_length` elements for every other tensor op."""
    if op == "send_tensor":
        return tensor_shape(count)
    return (output_length(op, world_size, count),)


def request_object(payload_bytes: int) -> dict[str, Any]:
    """The object that ``send_object`` and ``broadcast_object`` carry: what a serving
    request looks like (ids, a model name, prompt token ids, sampling parameters, flags),
    plus ``payload``, a ``bytes`` of ``payload_bytes`` bytes so the size follows ``--sizes``.

    Plain bytes, not a tensor, on purpose: both pickle them the same way in-band,
    so neither side gains from how it treats tensors inside objects.
    """
    payload = bytes(i * 7 % 251 for i in range(min(payload_bytes, 251)))
    return {
        "request_id": "cmpl-7f3a9c2e4b1d4e8f",
        "model": "llama-3.1-8b-instruct",
        "prompt_token_ids": [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13, 128009],
        "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 256, "stop": ["</s>", "\n\n"]},
        "priority": 3,
        "stream": True,
        "payload": (payload * (payload_bytes // 251 + 1))[:payload_bytes],
    }


def object_size(payload_bytes: int) -> int:
    """Bytes of :func:`request_object` pickled (protocol 5): the ``size`` of an object op's row."""
    return len(pickle.dumps(request_object(payload_bytes), protocol=5))


def expected_output(
    op: str, rank: int, world_size: int, count: int, *, start: int = 0, stop: int | None = None
) -> torch.Tensor | None:
    """What ``rank``'s output must hold (float64) after ``op`` on inputs from :func:`input_values`,
    elements ``start:stop`` of it (default: all), or ``None`` where the op defines
    no output on that rank.

    ``count`` is :func:`~pg_core.bench.sizing.element_count`'s: the elements of the largest per-rank
    buffer. Roots (``broadcast`` source, ``reduce`` destination) are rank 0; for
    ``send_recv`` and ``send_tensor`` both rank 0 (after the echo) and rank 1 hold
    rank 0's input (``send_tensor``'s flattened: its shape is :func:`output_shape`'s).
    """
    if op in OBJECT_OPS:
        raise ValueError(f"{op} has no tensor output: its result is request_object(count)")
    if op not in KNOWN_OPS:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(KNOWN_OPS)}")
    op = BLOCKING_OF.get(op, op)  # an asynchronous form leaves what its blocking op leaves
    if (op == "reduce" and rank != ROOT) or (op in ECHO_OPS and rank > 1):
        return None
    n = world_size
    total = n * (n + 1) / 2  # sum of (r + 1) over ranks
    length = output_length(op, n, count)
    j = torch.arange(start, length if stop is None else min(stop, length))
    if op in ("all_reduce", "reduce"):
        return _pattern(j) * total
    if op in ("broadcast", "send_recv", "send_tensor"):  # the input of rank 0
        return _pattern(j)
    block = count // n
    if op == "reduce_scatter_tensor":  # block `rank` of everyone's input, summed
        return _pattern(rank * block + j) * total
    source, k = j // block, j % block  # output block `source` came from rank `source`
    if op == "all_gather_into_tensor":
        return _pattern(k) * (source + 1)
    return _pattern(rank * block + k) * (source + 1)  # all_to_all_single: block `rank` of its input


#: Elements compared at a time, so checking 1 GiB needs no 8 GiB.
CHECK_CHUNK: Final[int] = 1 << 22


def check_output(
    op: str, rank: int, world_size: int, count: int, output: torch.Tensor | None, *, dtype: torch.dtype | None = None
) -> str | None:
    """``None`` if ``output`` is what ``op`` must leave on ``rank`` (its shape, its
    values and, when ``dtype`` is given, its dtype), else what is wrong."""
    if expected_output(op, rank, world_size, count, stop=0) is None:
        return None
    if output is None:
        return f"{op}: rank {rank} has no output to check"
    length = output_length(op, world_size, count)
    shape = output_shape(op, world_size, count)
    if tuple(output.shape) != shape:
        return f"{op}: rank {rank} output has shape {tuple(output.shape)}, expected {shape}"
    if dtype is not None and output.dtype != dtype:
        return f"{op}: rank {rank} output has dtype {output.dtype}, expected {dtype}"
    flat = output.reshape(-1)
    rtol = _RTOL.get(output.dtype, 0.0)
    wrong, first, detail = 0, -1, ""
    for start in range(0, length, CHECK_CHUNK):
        expected = expected_output(op, rank, world_size, count, start=start, stop=start + CHECK_CHUNK)
        assert expected is not None
        got = flat[start : start + CHECK_CHUNK].detach().to("cpu", torch.float64)
        bad = ~torch.isclose(got, expected, rtol=rtol, atol=0.0)
        here = int(bad.sum())
        if here and first < 0:
            at = int(bad.nonzero()[0, 0])
            first = start + at
            detail = f"got {got[at].item():g}, expected {expected[at].item():g}"
        wrong += here
    if wrong == 0:
        return None
    return f"{op}: rank {rank}: {wrong} of {length} elements wrong; first at index {first}: {detail}"


def check_object(op: str, rank: int, world_size: int, count: int, output: object) -> str | None:
    """``None`` if ``output`` is what the object op ``op`` must leave on ``rank``
    (:func:`request_object` of ``count`` payload bytes: on every rank for
    ``broadcast_object``, on ranks 0 and 1 for ``send_object``), else what is wrong."""
    if op not in OBJECT_OPS:
        raise ValueError(f"{op!r} is not an object op; object ops: {', '.join(OBJECT_OPS)}")
    if op == "send_object" and rank > 1:
        return None
    expected = request_object(count)
    if output == expected:
        return None
    return f"{op}: rank {rank}: {_difference(output, expected)}"


def _difference(got: object, expected: object, where: str = "the object") -> str:
    """Where ``got`` first differs from ``expected``, in words."""
    if got is NOTHING:
        return "no object received"
    if type(got) is not type(expected):
        return f"{where} is a {type(got).__name__}, expected a {type(expected).__name__}"
    if isinstance(got, dict) and isinstance(expected, dict):
        if got.keys() != expected.keys():
            missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
            return f"{where} lacks keys {missing} and has extra keys {extra}"
        key = next(k for k in expected if got[k] != expected[k])
        return _difference(got[key], expected[key], f"{where}[{key!r}]")
    if isinstance(got, bytes | list | str) and isinstance(expected, bytes | list | str):
        if len(got) != len(expected):
            return f"{where} has length {len(got)}, expected {len(expected)}"
        at = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
        return f"{where} differs first at index {at}: got {got[at]!r}, expected {expected[at]!r}"
    return f"{where} is {got!r}, expected {expected!r}"
