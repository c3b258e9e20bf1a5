"""Where a launched process is: its rank, the job's size and the store, read from the
environment a launcher gave it. What :meth:`ProcessGroup.from_env` reads.

:func:`read_launch` only parses a mapping (``os.environ`` by default); nothing connects
until :meth:`LaunchEnv.connect`. The launchers it understands, first match wins:

1. **pgrun** (``pg_core.launch``): ``PG_RANK``, ``PG_WORLD_SIZE``, ``PG_LOCAL_RANK``,
   ``PG_STORE`` (``host:port``; pgrun hosts the store, every rank is a client).
2. **torchrun** (and torch's ``env://``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``MASTER_ADDR``, ``MASTER_PORT``. Under torchrun's agent
   (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent hosts the store and every rank is a
   client, in the namespace ``/worker/attempt_{TORCHELASTIC_RESTART_COUNT}`` so a
   restarted attempt never meets a failed attempt's keys; otherwise rank 0 hosts it, as
   torch's ``env://`` does.
3. **SLURM** (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the store on
   ``MASTER_ADDR`` or else the first host of ``SLURM_STEP_NODELIST`` (``SLURM_JOB_NODELIST``),
   at ``MASTER_PORT`` or else :func:`slurm_port`. On that first host, its first task
   (``SLURMD_NODENAME`` the host, ``SLURM_LOCALID`` 0) hosts the store, whichever rank it is;
   with ``MASTER_ADDR`` set, or without those two variables, rank 0 does.
4. **MPI** (``mpiexec``): Open MPI's ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
   ``OMPI_COMM_WORLD_LOCAL_RANK``, then MPICH's / PMI's ``PMI_RANK``, ``PMI_SIZE``,
   ``MPI_LOCALRANKID``; the store on ``MASTER_ADDR``/``MASTER_PORT``, rank 0 hosts it.

Whatever the launcher, ``PG_STORE`` (``host:port``), where set, names the store, and then
no rank hosts it: whoever set it does (``pgrun --mpi`` sets it and the ranks' rank comes
from the MPI launcher).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from itertools import product
from typing import Final

from .store import PrefixStore, Store, TCPStore

__all__ = ["SLURM_PORT_RANGE", "LaunchEnv", "expand_hostlist", "rank_and_size", "read_launch", "slurm_port"]

#: The ports :func:`slurm_port` derives a SLURM job's store port from (``MASTER_PORT`` overrides).
SLURM_PORT_RANGE: Final = range(20000, 30000)

#: (source, rank variable, size variable, local rank variable), in order of precedence.
_RANKS: Final[tuple[tuple[str, str, str, str], ...]] = (
    ("pgrun", "PG_RANK", "PG_WORLD_SIZE", "PG_LOCAL_RANK"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)

_WHO: Final = {
    "pgrun": "pgrun's",
    "torchrun": "torchrun's",
    "slurm": "SLURM's",
    "openmpi": "Open MPI's",
    "mpich": "MPICH/PMI's",
}


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a launched job, as its launcher's environment says.

    ``local_rank`` is ``None`` where the launcher does not say. ``host_store``: this process
    must host the store (``is_master``); ``prefix``: the namespace in the store every rank
    uses (``""``: none). ``source`` names the launcher: ``"pgrun"``, ``"torchrun"``,
    ``"slurm"``, ``"openmpi"`` or ``"mpich"``.
    """

    rank: int
    size: int
    local_rank: int | None
    host: str
    port: int
    prefix: str
    host_store: bool
    source: str

    def connect(self, timeout: float | timedelta = 300.0) -> Store:
        """The job's store: a ``TCPStore`` server on this process if :attr:`host_store`, else a
        client of ``host:port`` that waits up to ``timeout`` for the server; under
        :attr:`prefix` if there is one."""
        wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        store: Store = TCPStore(
            self.host,
            self.port,
            world_size=None,
            is_master=self.host_store,
            timeout=wait,
            wait_for_workers=False,
            multi_tenant=self.host_store,  # torch's env:// in this process may host on the same port
        )
        return PrefixStore(self.prefix, store) if self.prefix else store


def rank_and_size(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``(rank, size)`` from the first launcher of the precedence whose rank variable is set,
    ``None`` if none is. Raises ``ValueError`` if its size is missing or a value is not a
    number, or the rank is out of range."""
    found = _find_rank(env)
    return None if found is None else found[1:3]


def local_rank(env: Mapping[str, str]) -> int | None:
    """This process's rank on its node, from the first launcher of the precedence whose rank
    variable is set (``PG_LOCAL_RANK``, ``LOCAL_RANK``, ``SLURM_LOCALID``, ...); ``None`` outside
    a launcher or where the launcher does not say."""
    found = _find_rank(env)
    return None if found is None else found[3]


def read_launch(env: Mapping[str, str]) -> LaunchEnv:
    """Parse ``env``; nothing connects. Raises ``ValueError`` naming the variables it looked
    for and did not find, or the one whose value it cannot read."""
    found = _find_rank(env)
    if found is None:
        looked = "; ".join(f"{_WHO[src]} {rank_var} and {size_var}" for src, rank_var, size_var, _ in _RANKS)
        raise ValueError(
            f"no launcher found in the environment: looked for {looked}, and found none of them. Start the "
            "processes with pgrun -n N, torchrun, srun or mpiexec, or give ProcessGroup a store, rank and size"
        )
    source, rank, size, local_rank = found
    host_store = rank == 0
    prefix = ""
    if env.get("PG_STORE"):
        host, port = _host_port(env["PG_STORE"], "PG_STORE")
        host_store = False
    elif source == "pgrun":
        raise ValueError(_no_store("pgrun's PG_RANK and PG_WORLD_SIZE", "PG_STORE (host:port, which pgrun sets)"))
    elif source == "slurm":
        host = env.get("MASTER_ADDR") or _slurm_host(env)
        port = _port(env["MASTER_PORT"], "MASTER_PORT") if env.get("MASTER_PORT") else slurm_port(env)
        if not env.get("MASTER_ADDR") and env.get("SLURMD_NODENAME") and env.get("SLURM_LOCALID"):
            # the store is on the step's first node: its first task hosts it, which is task 0
            # only where tasks are laid out in blocks (not with --distribution=arbitrary or plane)
            host_store = env["SLURMD_NODENAME"] == host and _int(env["SLURM_LOCALID"], "SLURM_LOCALID") == 0
    else:
        missing = [var for var in ("MASTER_ADDR", "MASTER_PORT") if not env.get(var)]
        if missing:
            _, rank_var, size_var, _ = next(r for r in _RANKS if r[0] == source)
            raise ValueError(
                _no_store(
                    f"{_WHO[source]} {rank_var} and {size_var}", "PG_STORE (host:port) or MASTER_ADDR and MASTER_PORT"
                )
                + f" ({' and '.join(missing)} not set)"
            )
        host, port = env["MASTER_ADDR"], _port(env["MASTER_PORT"], "MASTER_PORT")
        if source == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            host_store = False  # torchrun's agent hosts it
            prefix = (
                f"/worker/attempt_{_int(env.get('TORCHELASTIC_RESTART_COUNT') or '0', 'TORCHELASTIC_RESTART_COUNT')}"
            )
    return LaunchEnv(rank, size, local_rank, host, port, prefix, host_store, source)


def _no_store(what: str, need: str) -> str:
    return f"{what} are set, but not where the store is: set {need}"


def _find_rank(env: Mapping[str, str]) -> tuple[str, int, int, int | None] | None:
    for source, rank_var, size_var, local_var in _RANKS:
        if not env.get(rank_var):
            continue
        if not env.get(size_var):
            raise ValueError(f"{_WHO[source]} {rank_var} is set ({env[rank_var]!r}) but {size_var} is not")
        rank, size = _int(env[rank_var], rank_var), _int(env[size_var], size_var)
        if size < 1:
            raise ValueError(f"{size_var}={env[size_var]!r} must be at least 1")
        if rank >= size:
            raise ValueError(f"{rank_var}={rank} is out of range for {size_var}={size}")
        local = _int(env[local_var], local_var) if env.get(local_var) else None
        return source, rank, size, local
    return None


def _int(value: str, var: str) -> int:
    text = value.strip()
    if not text.isdigit():
        raise ValueError(f"{var}={value!r} is not a non-negative integer")
    return int(text)


def _port(value: str, var: str) -> int:
    port = _int(value, var)
    if not 0 < port < 2**16:
        raise ValueError(f"{var}={value!r} is not a port (1 to 65535)")
    return port


def _host_port(value: str, var: str) -> tuple[str, int]:
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"{var}={value!r} is not host:port")
    return host.strip("[]"), _port(port, var)  # [::1]:29500 names an IPv6 host


# -- SLURM ----------------------------------------------------------------------------------


def slurm_port(env: Mapping[str, str]) -> int:
    """The store port of a SLURM job step without ``MASTER_PORT``: ``20000 + (SLURM_JOB_ID %
    1000) * 10 + SLURM_STEP_ID % 10``, in :data:`SLURM_PORT_RANGE`, so every task of a step
    derives the same port and ten steps of one job running at once get different ones."""
    if not env.get("SLURM_JOB_ID"):
        raise ValueError("SLURM's SLURM_PROCID is set, but neither MASTER_PORT nor SLURM_JOB_ID is: set MASTER_PORT")
    job = _int(env["SLURM_JOB_ID"], "SLURM_JOB_ID")
    step_text = env.get("SLURM_STEP_ID", "0").strip()
    step = int(step_text) if step_text.isdigit() else 0
    return SLURM_PORT_RANGE.start + (job % 1000) * 10 + step % 10


def _slurm_host(env: Mapping[str, str]) -> str:
    for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(var):
            return expand_hostlist(env[var])[0]
    raise ValueError(
        "SLURM's SLURM_PROCID and SLURM_NTASKS are set, but not where the store is: set MASTER_ADDR, or run "
        "under srun, which sets SLURM_STEP_NODELIST (none of MASTER_ADDR, SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, "
        "SLURM_NODELIST is set)"
    )


_ITEM = re.compile(r"([^\[\],]*)(\[[^\[\]]*\])?")


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a SLURM hostlist, in order, as ``scontrol show hostnames`` gives them:
    ``"node[01-03,07],gpu-a[1-2]-ib"`` is ``node01 node02 node03 node07 gpu-a1-ib gpu-a2-ib``.
    A range keeps its lower bound's zero padding (``[08-10]``: ``08 09 10``); a name may have
    several bracket groups (their product, left to right). Raises ``ValueError`` on a malformed
    list."""
    hosts: list[str] = []
    for item in _split_items(hostlist):
        parts: list[list[str]] = []
        pos = 0
        while pos < len(item):
            match = _ITEM.match(item, pos)
            if match is None or match.end() == pos:
                raise ValueError(f"malformed hostlist {hostlist!r} at {item[pos:]!r}")
            if match.group(1):
                parts.append([match.group(1)])
            if match.group(2):
                parts.append(_expand_ranges(match.group(2)[1:-1], hostlist))
            pos = match.end()
        hosts.extend("".join(combo) for combo in product(*parts))
    if not hosts:
        raise ValueError(f"hostlist {hostlist!r} names no host")
    return hosts


def _split_items(hostlist: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"malformed hostlist {hostlist!r}: nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"malformed hostlist {hostlist!r}: ']' without '['")
        elif char == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"malformed hostlist {hostlist!r}: '[' without ']'")
    items.append(hostlist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for part in ranges.split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"malformed hostlist {hostlist!r}: {part!r} is not a number or a range a-b")
        if not sep:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"malformed hostlist {hostlist!r}: range {part!r} runs backwards")
        width = len(low)
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out
