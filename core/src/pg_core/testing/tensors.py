"""Deterministic tensors: every conformance tensor from a key, the same in every process.

A tensor's values derive from a *key*, a tuple that names where it is used
(:func:`tensor_key`: example seed, lane, step, rank, role); the controller and the rank
processes each make it from the key alone, bit-identical, and nothing is sent to agree on
it. :func:`random_tensor` draws from comfortable ranges (no reduction of up to 8 ranks
overflows), :func:`extreme_tensor` from a dtype's whole range with special values planted,
and :func:`laid_out` places values in a buffer of some memory layout, the rest of which is
junk that must survive the call.

This module needs torch only: it knows nothing of examples or calls.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

__all__ = [
    "BUCKET_MARGIN",
    "bucket_margins",
    "extreme_tensor",
    "generator_for",
    "laid_out",
    "moved",
    "random_tensor",
    "tensor_key",
]


def generator_for(*key: object) -> torch.Generator:
    """A torch generator seeded from ``key`` (its ``repr``, hashed): the same in every process."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return g


def tensor_key(ex_seed: int, lane: int, step: int, rank: int, role: object) -> tuple[object, ...]:
    """The key of the tensor that rank ``rank`` uses as ``role`` in step ``step`` of lane ``lane``
    of the example with seed ``ex_seed``."""
    return (ex_seed, lane, step, rank, role)


def _ranged(kind: str | None, dtype: torch.dtype) -> tuple[int, int]:
    """Integer value range for a reduce kind: sums and products of up to 8 ranks must not overflow."""
    info = torch.iinfo(dtype)
    if dtype == torch.int64:
        return -(2**62), 2**62  # randint's bounds are int64 themselves
    if kind in ("SUM", "AVG", "PREMUL_SUM"):
        return (0, 16) if info.min == 0 else (-8, 9)
    if kind == "PRODUCT":
        return (0, 2) if info.min == 0 else (-1, 2)
    return info.min, info.max + 1  # MIN/MAX/bitwise and copies: the full range


def random_tensor(key: tuple[object, ...], shape: Sequence[int], dtype: torch.dtype, kind: str | None) -> torch.Tensor:
    """Deterministic values for ``key``: floats in [-2, 2) (products stay in range),
    integers in a range where the reduce ``kind`` cannot overflow, random bools."""
    g = generator_for(*key)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.int64).bool()
    if dtype.is_complex:
        parts = torch.rand((*shape, 2), generator=g, dtype=torch.float64) * 4 - 2
        return torch.view_as_complex(parts).to(dtype)
    if dtype.is_floating_point:
        span = 4.0 if kind is not None else 2000.0  # copies: wider values, still exact in every float dtype
        values = torch.rand(shape, generator=g, dtype=torch.float64) * span - span / 2
        return values.to(dtype)
    lo, hi = _ranged(kind, dtype)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def _log_uniform(g: torch.Generator, shape: Sequence[int], lo: float, hi: float) -> torch.Tensor:
    """float64 values of random sign whose magnitudes are spread evenly over the binary
    exponents from ``lo`` to below ``hi``. Built from their bits with integer operations
    only, so every process makes exactly the same values (a vectorised ``exp2`` may differ
    in the last bit between a loop's body and its tail)."""
    shape = tuple(shape)
    first = max(1, math.frexp(lo)[1] + 1022)  # biased exponents (1: the smallest normal; 0: subnormals)
    last = math.frexp(hi)[1] + 1022 - 1
    biased = torch.randint(first - 1, max(first, last) + 1, shape, generator=g, dtype=torch.int64)
    mantissa = torch.randint(0, 2**52, shape, generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.int64) << 63
    return (sign | (biased << 52) | mantissa).view(torch.float64)


def _float_range(dtype: torch.dtype, kind: str | None, n: int) -> tuple[float, float]:
    """Magnitudes a float ``dtype`` can hold in a reduction ``kind`` of ``n`` ranks without
    overflowing in any order: from a subnormal up to a share of the largest finite value."""
    info = torch.finfo(dtype)
    tiny = info.smallest_normal * info.eps  # the smallest subnormal
    top = float(info.max) * 0.99
    if kind in ("SUM", "AVG", "PREMUL_SUM"):
        return tiny, top / (4 * n)  # |premul factor| <= 3
    if kind == "PRODUCT":
        root = top ** (1 / n) / 2  # no partial product overflows; none underflows below the normals
        return max(float(info.smallest_normal) ** (1 / n) * 2, 1 / root), root
    return tiny, top


def extreme_tensor(
    key: tuple[object, ...], shape: Sequence[int], dtype: torch.dtype, kind: str | None, *, rank: int, n: int
) -> torch.Tensor:
    """Values from ``dtype``'s whole range, for rank ``rank`` of ``n``, with special values at
    positions that every rank agrees on (the flat index ``i`` decides):

    * integers: uniform over the whole range (past 2**53 for int64, 128-255 for uint8), with
      the minimum and the maximum planted; SUM and PRODUCT results wrap around as torch's CPU
      ops on that dtype do. (AVG and PREMUL_SUM, declared for an integer dtype, keep the
      comfortable range: their integer result is not defined past it.)
    * floats: magnitudes spread over every exponent from the smallest subnormal up to what a
      reduction of ``n`` ranks cannot overflow (copies, MIN and MAX: up to the largest finite
      value, so bfloat16 holds values that float16 cannot); ``-0.0`` on every rank at ``i % 7
      == 3`` (a SUM of them is ``-0.0``); for copies, SUM, AVG, PREMUL_SUM and PRODUCT, NaN on
      one rank at ``i % 11 == 5``, ``inf`` on one rank at ``i % 13 == 6``, and ``inf`` on one
      rank with ``-inf`` (SUM kinds) or ``0`` (PRODUCT) on the next at ``i % 17 == 8``. MIN
      and MAX get ``inf`` and ``-inf`` but no NaN: the contract leaves NaN there undefined.
    * complex: each part as a float of the same width, the quadrant chosen by ``i % 4``;
      non-finite parts only in copies.
    """
    g = generator_for(*key, "extreme")
    shape = tuple(shape)
    count = math.prod(shape)
    index = torch.arange(count, dtype=torch.int64)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.int64).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        if kind in ("AVG", "PREMUL_SUM"):
            return random_tensor(key, shape, dtype, kind)
        info = torch.iinfo(dtype)
        flat = torch.randint(info.min, info.max, (count,), generator=g, dtype=torch.int64)
        flat[index % 5 == 0] = info.min
        flat[index % 5 == 1] = info.max
        if dtype == torch.int64:  # just past float64's exact integers
            flat[index % 5 == 2] = 2**53 + 1 + rank
        return flat.to(dtype).reshape(shape)
    real_dtype = dtype.to_real() if dtype.is_complex else dtype
    lo, hi = _float_range(real_dtype, kind, n)
    parts = 2 if dtype.is_complex else 1
    # finite values first, converted once; the special values are written in the dtype itself
    # (converting a NaN is not reproducible: torch's vectorised and scalar paths differ in its bits)
    flat = _log_uniform(g, (count, parts), lo, hi).to(real_dtype)
    specials = kind is None or (kind in ("SUM", "AVG", "PREMUL_SUM", "PRODUCT") and not dtype.is_complex)
    ordered = kind in ("MIN", "MAX")
    mine = index % n == rank
    nxt = index % n == (rank - 1) % n if n > 1 else torch.zeros_like(mine)
    for part in range(parts):
        values = flat[:, part]
        if dtype.is_complex:  # quadrant i % 4: (+,+), (-,+), (-,-), (+,-)
            negative = ((index % 4 == 1) | (index % 4 == 2)) if part == 0 else (index % 4 >= 2)
            values.copy_(torch.where(negative, -values.abs(), values.abs()))
        if not ordered:
            values[index % 7 == 3] = -0.0
        if specials or ordered:
            values[(index % 13 == 6) & mine] = math.inf if ordered or kind is not None else -math.inf
            if ordered:
                values[(index % 17 == 8) & mine] = -math.inf
        if specials:
            values[(index % 11 == 5) & mine] = math.nan
            pair = index % 17 == 8
            values[pair & mine] = math.inf
            values[pair & nxt] = 0.0 if kind == "PRODUCT" else -math.inf
    if dtype.is_complex:
        return torch.view_as_complex(flat.contiguous()).reshape(shape)
    return flat[:, 0].reshape(shape)


#: How many sentinel elements sit before and after a ``bucket`` view in its storage: at least
#: one on each side, so a write one element past the view, a read from the storage's start and
#: a write over the whole storage all meet a sentinel.
BUCKET_MARGIN = (1, 6)


def bucket_margins(key: tuple[object, ...], count: int) -> tuple[int, int]:
    """``(before, after)``: the sentinel elements around a ``bucket`` view of ``count`` elements
    made for ``key``. They depend on the buffer's role (the key's last part) and size, not on
    the rank: every rank's buffer of one role has the same shape, as fresh ones do."""
    g = generator_for(key[-1], count, "bucket")
    lo, hi = BUCKET_MARGIN
    before, after = torch.randint(lo, hi + 1, (2,), generator=g).tolist()
    return int(before), int(after)


def laid_out(values: torch.Tensor, layout: str, key: tuple[object, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, base)``: ``view`` holds ``values`` with ``layout``; ``base`` is the
    whole buffer behind it, its other elements filled with junk that must survive.

    ``bucket`` is how parameters and gradients live in a flat bucket: a contiguous view at a
    non-zero storage offset of a flat 1-d storage, with sentinel elements before and after it
    (:func:`bucket_margins`). It is dense, so pg-core hands it to the backend as it is: the
    backend must read and write exactly the view's bytes."""
    if layout == "bucket":
        count = values.numel()
        before, after = bucket_margins(key, count)
        base = random_tensor((*key, "sentinel"), (before + count + after,), values.dtype, None)
        view = base[before : before + count].view(values.shape)
        view.copy_(values)
        return view, base
    if layout == "strided" and values.dim() >= 1:
        wide = (*values.shape[:-1], values.shape[-1] * 2)
        base = random_tensor((*key, "gap"), wide, values.dtype, None)
        view = base[..., ::2]
        view.copy_(values)
        return view, base
    if layout == "transposed" and values.dim() >= 2:
        base = values.transpose(-1, -2).contiguous()
        view = base.transpose(-1, -2)
        return view, base
    base = values.clone()
    return base, base


def moved(view: torch.Tensor, base: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, base)`` on ``device``: ``base`` copied there whole, and the same view of the copy
    (shape, strides and offset into the buffer as ``view`` has in ``base``)."""
    new_base = base.to(device)
    offset = view.storage_offset() - base.storage_offset()
    return new_base.as_strided(view.shape, view.stride(), new_base.storage_offset() + offset), new_base
