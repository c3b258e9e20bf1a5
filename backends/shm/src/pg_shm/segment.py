"""Shared memory and the kernel's help to wait on it: what the rest of pg-shm builds on.

* :class:`Segment`: a file in ``/dev/shm`` mapped with ``mmap``, its pages reserved at
  creation (``posix_fallocate``: a full ``/dev/shm`` is an error here, never a ``SIGBUS``
  later), with the address of its first byte for word access through ``ctypes``.
* :class:`Word`: one 32- or 64-bit word of a segment. Every word has exactly one writing
  process (see :mod:`pg_shm.backend`), so nothing in shared memory is ever locked and a
  process that dies holds nothing. x86-64 keeps stores in order (TSO), so a reader that
  sees a counter move also sees the bytes written before it: pg-shm runs on x86-64 only.
* :func:`futex_wait` / :func:`futex_wake`: the Linux futex on a shared word, through
  ``ctypes``. A wait always has a timeout (a slice): a wake-up that is lost costs one slice,
  never a hang, and each slice is where a waiter checks its peers are alive.
* :func:`host_identity`: what makes two processes "on one host" for pg-shm: the host name
  and the kernel's boot id.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import socket
from pathlib import Path
from typing import Final

__all__ = [
    "HOST_ID_ENV",
    "SHM_DIR",
    "Segment",
    "Word",
    "futex_wait",
    "futex_wake",
    "host_identity",
    "why_unsupported",
]

#: Where segments live: tmpfs, so a segment is memory and never touches a disk.
SHM_DIR: Final = Path("/dev/shm")

#: For tests (and containers that share ``/dev/shm`` but not a host name): when set, this
#: process's host identity is this value instead of ``hostname boot-id``.
HOST_ID_ENV: Final = "PG_SHM_HOST_ID"

_SYS_FUTEX: Final = 202  # x86-64
_FUTEX_WAIT: Final = 0  # shared (not FUTEX_PRIVATE_FLAG): the word is in memory other processes map
_FUTEX_WAKE: Final = 1
_EVERYONE: Final = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def why_unsupported() -> str | None:
    """``None`` where pg-shm can run in this process, else why not."""
    if platform.system() != "Linux":
        return f"pg-shm needs Linux (shared futexes, /dev/shm); this is {platform.system()}"
    if platform.machine() not in ("x86_64", "AMD64"):
        return (
            f"pg-shm runs on x86-64 only (its ordering of shared-memory stores relies on x86's); "
            f"this machine is {platform.machine()}: use tcp or gloo"
        )
    if not SHM_DIR.is_dir() or not os.access(SHM_DIR, os.W_OK | os.X_OK):
        return f"{SHM_DIR} is missing or not writable by this process: use tcp or gloo"
    return None


def host_identity() -> str:
    """``hostname boot-id`` (or :data:`HOST_ID_ENV` where set): equal for two processes exactly
    when they run on the same booted kernel under the same name."""
    override = os.environ.get(HOST_ID_ENV)
    if override:
        return override
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()} {boot}"


def futex_wait(address: int, expected: int, seconds: float) -> None:
    """Sleep while the 32-bit word at ``address`` holds ``expected``, at most ``seconds``.
    Returns at once if it holds something else; may return early (a wake-up, a signal)."""
    whole = int(seconds)
    spec = _Timespec(whole, int((seconds - whole) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected & 0xFFFFFFFF),
             ctypes.byref(spec), None, 0)  # fmt: skip


def futex_wake(address: int) -> None:
    """Wake every process and thread sleeping in :func:`futex_wait` on ``address``."""
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _EVERYONE, None, None, 0)


class Word:
    """A 32- or 64-bit unsigned word at ``address`` (which must stay mapped while in use).
    ``cell`` is its ``ctypes`` integer: hot loops read ``cell.value`` (an ``int``) directly,
    which saves the property's call per poll."""

    __slots__ = ("address", "cell")

    def __init__(self, address: int, bits: int = 64) -> None:
        self.address = address
        self.cell = (ctypes.c_uint64 if bits == 64 else ctypes.c_uint32).from_address(address)

    @property
    def value(self) -> int:
        return int(self.cell.value)

    @value.setter
    def value(self, new: int) -> None:
        self.cell.value = new


class Segment:
    """A mapped file of ``/dev/shm``: :meth:`create` it (this process owns and unlinks it) or
    :meth:`open` one another process created. ``address`` is its first byte, ``view`` a
    byte ``memoryview`` of it; :meth:`close` unmaps it (no view may be used afterwards)."""

    def __init__(self, path: Path, mapping: mmap.mmap, owned: bool) -> None:
        self.path = path
        self.size = len(mapping)
        self.owned = owned
        self._mapping: mmap.mmap | None = mapping
        anchor = ctypes.c_char.from_buffer(mapping)
        self.address = ctypes.addressof(anchor)
        del anchor  # releases its export; the address stays valid while the mapping does
        self.view: memoryview = memoryview(mapping)

    @classmethod
    def create(cls, prefix: str, size: int) -> Segment:
        """A new segment of ``size`` bytes, named ``prefix`` plus a random token, its pages
        reserved. ``OSError`` (``ENOSPC``: ``/dev/shm`` is full) leaves nothing behind."""
        path = SHM_DIR / f"{prefix}-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise
        os.close(fd)
        return cls(path, mapping, owned=True)

    @classmethod
    def open(cls, path: Path, size: int) -> Segment:
        """Map the segment another member created; ``OSError`` where it cannot be opened
        (another host, another ``/dev/shm``) or is not ``size`` bytes."""
        fd = os.open(path, os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise OSError(f"{path} is {actual} bytes, expected {size}")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mapping, owned=False)

    def word(self, offset: int, bits: int = 64) -> Word:
        return Word(self.address + offset, bits)

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid): nothing is left in ``/dev/shm``."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close(self) -> None:
        """Unmap (idempotent). The caller guarantees no thread reads or writes it any more."""
        if self._mapping is None:
            return
        self.view.release()
        self._mapping.close()
        self._mapping = None
