"""Flight-recorder dumps: written in torch's format, read back safely, merged into one report.

A rank's dump (``PG_CORE_TRACE_DIR``, written by :class:`~pg_core.recorder.Tracer` when an
operation fails) is ``<dir>/<group>-<uid>-rank<r>``: a pickle in torch's flight-recorder
format (version :data:`TORCH_FORMAT_VERSION`), which torch's analyser reads
(``python -m torch.distributed.flight_recorder.fr_trace DIR -p <group>-<uid>-rank``), with
pg-core's own account under the key ``"pg_core"``. ``pg-core trace DIR`` merges a job's dumps
(:func:`merge`, :func:`merged_text`); it reads them with an unpickler that loads no class at
all (:func:`load_dump`), so a file planted in the folder cannot run code.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from .recorder import COMPLETED, FAILED, SCHEDULED, head_of, where

__all__ = ["TORCH_FORMAT_VERSION", "dump_name", "load_dump", "merge", "merged_text", "torch_dump", "write_dump"]

#: the version of torch's flight-recorder dump format the dumps follow (torch 2.13 writes it)
TORCH_FORMAT_VERSION: Final = "2.10"


def dump_name(group: str, uid: str, rank: int) -> str:
    """The file a rank's dump of a group goes to: ``<group>-<uid>-rank<r>``, the group's name
    kept to letters, digits, ``_`` and ``-``, ``uid`` shortened to the formation's token. No
    extension: torch's analyser reads the rank from the digits the name ends with."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", group)
    token = uid.rsplit("-", 1)[-1][:8]
    return f"{safe}-{token}-rank{rank}"


# -- dumps: torch's format -------------------------------------------------------------------------
_TORCH_DTYPE: Final[dict[str, str]] = {
    "float16": "Half",
    "bfloat16": "BFloat16",
    "float32": "Float",
    "float64": "Double",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
    "bool": "Bool",
    "uint8": "Byte",
    "int8": "Char",
    "int16": "Short",
    "int32": "Int",
    "int64": "Long",
}

#: torch's analyser knows these communication libraries before the colon of an entry's name
_TORCH_LIBS: Final = frozenset({"nccl", "gloo"})


def _torch_lib(backend: str | None, device: str) -> str:
    """The library name an entry gives torch's analyser, which accepts only its own
    (``nccl``, ``gloo``, ...): the backend's name where torch knows it, else by device
    (``nccl`` for cuda, ``gloo`` for the rest); the real backend is in ``pg_core``."""
    if backend in _TORCH_LIBS:
        return backend
    return "nccl" if device == "cuda" else "gloo"


def torch_dump(state: Mapping[str, Any]) -> dict[str, Any]:
    """A group's :meth:`Tracer.state` in torch's flight-recorder dump format (a dict of plain
    values, as torch pickles it), with ``state`` itself under ``"pg_core"``."""
    group, desc = str(state["uid"]), str(state["group"])
    backends: Mapping[str, str] = state.get("backends", {})
    timeout_ms = int(float(state.get("timeout", 0)) * 1000)
    entries = []
    for e in state["entries"]:
        p2p = e["p2p_seq"] is not None
        name = e["op"]
        if p2p:
            me, peer = state["rank"], e.get("peer")
            name = f"{name} {me}->{peer}" if e["op"] == "send" else f"{name} {me}<-{peer}"
        done = e["state"] in (COMPLETED, FAILED)
        entries.append(
            {
                "record_id": e["record_id"],
                "pg_id": 0,
                "process_group": (group, desc),
                "collective_seq_id": e["seq"] or 0,
                "p2p_seq_id": e["p2p_seq"] or 0,
                "op_id": e["record_id"] + 1,
                "profiling_name": f"{_torch_lib(backends.get(e['device']), e['device'])}:{name}",
                "time_created_ns": e["start_ns"],
                "input_sizes": e["input_sizes"],
                "input_dtypes": [_TORCH_DTYPE.get(d, d) for d in e["input_dtypes"]],
                "output_sizes": e["output_sizes"],
                "output_dtypes": [_TORCH_DTYPE.get(d, d) for d in e["output_dtypes"]],
                "state": e["state"],
                "time_discovered_started_ns": e["start_ns"] if e["state"] != SCHEDULED else None,
                "time_discovered_completed_ns": e["end_ns"] if done else None,
                "retired": done,
                "timeout_ms": timeout_ms,
                "is_p2p": p2p,
                "thread_name": "",
                "thread_id": "",
                "frames": [],
            }
        )
        if e["duration_us"] is not None:
            entries[-1]["duration_ms"] = e["duration_us"] / 1e3
    completed = [e["seq"] for e in state["entries"] if e["seq"] and e["state"] == COMPLETED]
    started = [e["seq"] for e in state["entries"] if e["seq"]]
    return {
        "version": TORCH_FORMAT_VERSION,
        "comm_lib_version": "",
        "pg_config": {group: {"name": group, "desc": desc, "ranks": str(list(range(int(state["size"]))))}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": max(started, default=-1),
                "last_started_collective": max(started, default=-1),
                "last_completed_collective": max(completed, default=-1),
            }
        },
        "entries": entries,
        "pg_core": dict(state),
    }


def write_dump(folder: Path, state: Mapping[str, Any]) -> Path:
    """Write ``state`` (:meth:`Tracer.state`) as torch's format to ``folder``/:func:`dump_name`,
    whole or not at all (a temporary file renamed); returns the path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / dump_name(str(state["group"]), str(state["uid"]), int(state["rank"]))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".pg-core-dump-")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(torch_dump(state), f, protocol=4)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


class _PlainUnpickler(pickle.Unpickler):
    """Loads dicts, lists, tuples, strings and numbers only: no class, no function."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a flight-recorder dump holds plain values only")


def load_dump(path: Path) -> dict[str, Any]:
    """A dump written by :func:`write_dump` (or torch's recorder), read without loading any
    class; ``ValueError`` naming the file when it is not one."""
    try:
        with open(path, "rb") as f:
            dump = _PlainUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"{path} is not a flight-recorder dump: {exc}") from None
    if not isinstance(dump, dict) or ("entries" not in dump and "pg_config" not in dump):
        raise ValueError(f"{path} is not a flight-recorder dump (no 'entries' or 'pg_config')")
    return dump


# -- merging a job's dumps -------------------------------------------------------------------------
def _calls(state: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """A rank's collectives by sequence number."""
    return {e["seq"]: e for e in state.get("entries", ()) if e.get("seq")}


def _call_text(e: Mapping[str, Any]) -> str:
    sizes = ", ".join(f"{d}{list(s)}" for s, d in zip(e["input_sizes"], e["input_dtypes"], strict=False))
    state = e["state"] if not e.get("error") else f"{e['state']}: {e['error']}"
    return f"{e['op']} #{e['seq']}{f' {sizes}' if sizes else ''} ({state})"


def _signature(e: Mapping[str, Any]) -> tuple[Any, ...]:
    return (e["op"], e.get("root"), str(e["input_sizes"]), str(e["input_dtypes"]), str(e["output_sizes"]))


def merge(states: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Merge ranks' dumped states (the ``"pg_core"`` part of each dump) into one report per
    group formation: the ranks dumped and not, where each stands (its head), and the first
    sequence number at which the ranks' recorded collectives differ (a rank without it, or
    another op, root, shape or dtype), looked for where every dumped rank's ring still
    reaches."""
    by_group: dict[str, dict[int, Mapping[str, Any]]] = {}
    for state in states:
        by_group.setdefault(str(state["uid"]), {})[int(state["rank"])] = state
    out = []
    for uid, ranks in sorted(by_group.items()):
        first = next(iter(ranks.values()))
        size = int(first["size"])
        calls = {r: _calls(s) for r, s in ranks.items()}
        oldest = max((min(c, default=1) for c in calls.values()), default=1)
        newest = max((max(c, default=0) for c in calls.values()), default=0)
        divergence: dict[str, Any] | None = None
        for seq in range(oldest, newest + 1):
            found = {r: c.get(seq) for r, c in calls.items()}
            kinds = {None if e is None else _signature(e) for e in found.values()}
            if len(kinds) > 1:
                divergence = {
                    "seq": seq,
                    "ranks": {str(r): None if e is None else _call_text(e) for r, e in sorted(found.items())},
                }
                break
        heads = {}
        for r, s in sorted(ranks.items()):
            heads[str(r)] = head_of(s.get("entries", []))
        report_seq: int = divergence["seq"] if divergence else newest
        text_heads = {r: heads.get(str(r)) for r in range(size)}
        out.append(
            {
                "group": first["group"],
                "uid": uid,
                "size": size,
                "backends": first.get("backends", {}),
                "dumped": sorted(ranks),
                "not_heard": [r for r in range(size) if r not in ranks],
                "heads": heads,
                "where": where(report_seq, text_heads) if report_seq else "",
                "where_seq": report_seq,
                "divergence": divergence,
                "reports": {str(r): s["report"]["text"] for r, s in sorted(ranks.items()) if s.get("report")},
                "torch_prefix": dump_name(str(first["group"]), uid, 0)[: -len("0")],
            }
        )
    return out


def merged_text(groups: Sequence[Mapping[str, Any]], folder: str) -> str:
    """:func:`merge`'s report as a person reads it."""
    lines: list[str] = []
    for g in groups:
        backends = ", ".join(f"{d}: {n}" for d, n in g["backends"].items())
        lines.append(
            f"group {g['group']!r} ({g['uid']}), size {g['size']}{f', backends {backends}' if backends else ''}"
        )
        lines.append(f"  dumps from rank(s) {', '.join(map(str, g['dumped']))}")
        if g["not_heard"]:
            lines.append(
                f"  not heard from: rank(s) {', '.join(map(str, g['not_heard']))} (no dump: dead, stuck outside "
                "pg-core, or their operations did not fail)"
            )
        d = g["divergence"]
        if d is None:
            lines.append("  the recorded collectives agree on every rank")
        else:
            lines.append(f"  first divergence at collective #{d['seq']}:")
            missing = f"no collective #{d['seq']} recorded"
            for r, text in d["ranks"].items():
                lines.append(f"    rank {r}: {text if text is not None else missing}")
        if g["where"]:
            lines.append(f"  who is where at #{g['where_seq']}: {g['where']}")
        for r, text in g["reports"].items():
            lines.append(f"  rank {r} reported: {text}")
        lines.append(
            "  torch's analyser: python -m torch.distributed.flight_recorder.fr_trace "
            f"{folder} -p {g['torch_prefix']} --allow-incomplete-ranks"
        )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
