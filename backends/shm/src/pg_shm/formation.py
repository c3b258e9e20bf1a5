"""Forming a pg-shm group: one host, one segment per member, every name gone from /dev/shm.

The steps, each a round through the group's (prefixed) store:

1. every member publishes its host identity (:func:`pg_shm.segment.host_identity`); members
   on more than one host make every member refuse with
   :class:`~pg_core.errors.BackendUnavailableError` naming who is where (each sees the same
   identities, so all decide alike);
2. every member creates its segment (named from the group's uid, its rank and a random
   token) and publishes its path and pid;
3. every member maps every other's segment, opens a pidfd on its pid (how a wait later sees
   it die) and says whether it could: one that could not makes every member refuse alike
   (``BackendUnavailableError``: they do not share /dev/shm);
4. once every member has mapped every segment, each unlinks its own: from then on nothing
   of the group is in /dev/shm, whatever happens to its processes (the mappings stay valid
   until the last process unmaps or dies).

A formation that fails part-way (a timeout, a segment that does not open) unlinks its own
segment and those of members whose process is gone. Only a member killed between steps 2
and 4 while its peers also die leaves its file behind: ``/dev/shm/pg-shm-*``, removable with
``rm`` once the job is gone (the README says so).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import defaultdict
from pathlib import Path

from pg_core.backend import BackendContext
from pg_core.errors import BackendUnavailableError
from pg_core.store import wait_for

from .layout import PID, STATE, Layout
from .segment import Segment, host_identity

__all__ = ["Members", "form"]


class Members:
    """What a formed member holds: its own segment, every other's (``None`` at its own
    rank: ``segments[rank]`` is its own), and a pidfd per peer."""

    def __init__(self, rank: int, segments: list[Segment], pids: list[int], pidfds: list[int | None]) -> None:
        self.rank = rank
        self.segments = segments
        self.pids = pids
        self.pidfds = pidfds

    def close(self) -> None:
        for fd in self.pidfds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.pidfds = [None] * len(self.pidfds)
        for segment in self.segments:
            segment.close()


def group_prefix(group_uid: str) -> str:
    """How the names of the segments of the group ``group_uid`` begin (each member's name goes
    on with its rank and a random part)."""
    return f"pg-shm-{hashlib.sha256(group_uid.encode()).hexdigest()[:12]}-"


def _prefix(ctx: BackendContext) -> str:
    return f"{group_prefix(ctx.group_uid)}{ctx.rank}"


def _check_one_host(ctx: BackendContext) -> None:
    ctx.store.set(f"host/{ctx.rank}", host_identity())
    what = f"group {ctx.group_name!r} rank {ctx.rank}: pg-shm formation (host identities)"
    wait_for(ctx.store, [f"host/{r}" for r in range(ctx.size)], ctx.timeout, what=what)
    hosts: dict[str, list[int]] = defaultdict(list)
    for r in range(ctx.size):
        hosts[ctx.store.get(f"host/{r}").decode()].append(r)
    if len(hosts) > 1:
        where = "; ".join(f"ranks {ranks} on {host!r}" for host, ranks in hosts.items())
        raise BackendUnavailableError(
            f"backend 'shm' serves the ranks of one host only, and group {ctx.group_name!r} spans "
            f"{len(hosts)}: {where}. Use backends='tcp' or 'gloo' for this group (or pg-shm for a "
            "subgroup of one host's ranks)"
        )


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def form(ctx: BackendContext, layout: Layout) -> Members:
    """Steps 1-4 of the module docstring. Raises :class:`BackendUnavailableError` for members
    on several hosts or a segment that does not open, ``CollectiveTimeout`` for members that
    do not come, ``OSError`` for a full /dev/shm; nothing it made is left behind then."""
    _check_one_host(ctx)
    rank, size, store = ctx.rank, ctx.size, ctx.store
    try:
        own = Segment.create(_prefix(ctx), layout.total)
    except OSError as exc:
        reason = (
            f"rank {rank} could not create its {layout.total}-byte segment in /dev/shm ({exc}); "
            f"/dev/shm has {_free()} bytes free. Pass a smaller options={{'shm': {{'slot_bytes': N}}}} (two slots "
            "per member; the default is 16 MiB) or give /dev/shm more room (docker run --shm-size)"
        )
        store.set(f"seg/{rank}", f"-1 {reason}")  # the others refuse with this reason instead of timing out
        raise BackendUnavailableError(f"backend 'shm', group {ctx.group_name!r}: {reason}") from exc
    segments: list[Segment] = []
    pidfds: list[int | None] = []
    published: dict[int, tuple[Path, int]] = {}
    try:
        own.word(PID).value = os.getpid()
        own.word(STATE, 32).value = 0
        store.set(f"seg/{rank}", f"{os.getpid()} {own.path}")
        what = f"group {ctx.group_name!r} rank {rank}: pg-shm formation (segments)"
        wait_for(store, [f"seg/{r}" for r in range(size)], ctx.timeout, what=what)
        for r in range(size):
            pid_text, _, path_text = store.get(f"seg/{r}").decode().partition(" ")
            if pid_text == "-1":
                raise BackendUnavailableError(f"backend 'shm', group {ctx.group_name!r}: {path_text}")
            published[r] = (Path(path_text), int(pid_text))
        for r in range(size):
            if r == rank:
                segments.append(own)
                pidfds.append(None)
                continue
            path, pid = published[r]
            try:
                segments.append(Segment.open(path, layout.total))
            except OSError as exc:
                failed = f"rank {rank} cannot map rank {r}'s segment {path} ({exc})"
                break
            pidfds.append(_pidfd(pid))
        else:
            failed = ""
        # every member says whether it mapped them all, so that all refuse alike or none does
        store.set(f"mapped/{rank}", failed or "ok")
        what = f"group {ctx.group_name!r} rank {rank}: pg-shm formation (mappings)"
        wait_for(store, [f"mapped/{r}" for r in range(size)], ctx.timeout, what=what)
        refusals = [text for r in range(size) if (text := store.get(f"mapped/{r}").decode()) != "ok"]
        if refusals:
            raise BackendUnavailableError(
                f"backend 'shm', group {ctx.group_name!r}: {'; '.join(refusals)}: the members do not share "
                "/dev/shm (separate containers or hosts). Use backends='tcp' or 'gloo' for this group"
            )
    except BaseException:
        own.unlink()
        for r, (path, pid) in published.items():
            if r != rank and _dead(pid):
                with contextlib.suppress(OSError):
                    path.unlink()
        Members(rank, [s for s in segments if s is not own] + [own], [], pidfds).close()
        raise
    own.unlink()
    return Members(rank, segments, [published[r][1] for r in range(size)], pidfds)


def _free() -> int:
    stats = os.statvfs("/dev/shm")
    return stats.f_bavail * stats.f_frsize


def _pidfd(pid: int) -> int | None:
    """A pidfd on ``pid`` (readable once it exits), or ``None`` where the kernel has none:
    the waits then ask ``os.kill(pid, 0)``."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
