"""Dtypes: the ones a backend may declare, their names, and their wire codes (one table).

A code is a small integer that names a dtype on the wire: pg-core's messages carry it in
their tensor tables, and a backend may use the same codes in its own frames. The table
is append-only: a code never changes meaning.
"""

from __future__ import annotations

from typing import Final

import torch

__all__ = ["DTYPES", "NAMES", "dtype_code", "dtype_from_code", "dtype_name"]

#: Every dtype a backend may declare in its :class:`~pg_core.backend.Capabilities`.
DTYPES: Final[tuple[torch.dtype, ...]] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
)

#: Every dtype that has a wire code, in code order from 1 (append only). The first
#: twelve are :data:`DTYPES`; the rest travel inside messages (objects, tensor dicts).
_WIRE: Final[tuple[str, ...]] = (
    *(str(d).removeprefix("torch.") for d in DTYPES),
    "uint16",
    "uint32",
    "uint64",
    "complex32",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)

_CODE: Final[dict[torch.dtype, int]] = {
    getattr(torch, name): code
    for code, name in enumerate(_WIRE, start=1)
    if isinstance(getattr(torch, name, None), torch.dtype)  # an older torch may lack the newest ones
}
_BY_CODE: Final[dict[int, torch.dtype]] = {code: dtype for dtype, code in _CODE.items()}

#: The declarable dtypes by name (``"float32"``), as command lines and test specs spell them.
NAMES: Final[dict[str, torch.dtype]] = {str(d).removeprefix("torch."): d for d in DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_code(dtype: torch.dtype) -> int | None:
    """The wire code of ``dtype`` (1-based), or ``None`` if it has none."""
    return _CODE.get(dtype)


def dtype_from_code(code: int) -> torch.dtype | None:
    """The dtype a wire code names, or ``None`` for a code this torch does not know."""
    return _BY_CODE.get(code)
