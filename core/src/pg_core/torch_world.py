"""Our groups in torch's global tables, on request and for as long as asked: the one module of
pg-core that writes torch's process-wide state (``ProcessGroup.to_torch(register=True)``,
``torch_registered()``, ``as_torch_default()``, ``device_mesh()``).

What a registered group gets, and why:

* **Registration** puts the group's torch ``ProcessGroup`` (:func:`pg_core.interop.to_torch`)
  under its ``group_name`` in torch's C++ process-group registry (functional collectives,
  ``torch.compile`` and ``DeviceMesh`` resolve groups by that name) and in torch's Python
  tables (``_world.pg_map``, ``pg_names``, ``pg_group_ranks``, ``pg_backend_config``,
  ``pg_to_tag`` and ``tags_to_pg`` under the tag ``ptd:<name>`` only), so that
  ``dist.get_world_size(tg)``, ``dist.get_process_group_ranks(tg)``, the global ``src=``/
  ``dst=`` of ``dist.broadcast``, ``dist.send``/``dist.recv`` (and the sender ``recv``
  returns), ``dist.P2POp`` with ``dist.batch_isend_irecv``, FSDP2 and DTensor's collectives work.
  Nothing else is touched: no default group is created (``dist.is_initialized()`` stays False),
  the group is not put under torch's shared tag ``""`` (so ``(ranks, tag)`` lookups never pick
  a group of another job), and :func:`unregister` removes exactly the entries registration
  wrote, each only while it is still this group's.
* **Global ranks.** Torch speaks of global ranks. A group's global ranks are its ranks mapped
  through its parents' (``parent_ranks``) up to the top-level group it was made from, its
  *job* (:class:`Lineage`): a subgroup ``[1, 3]`` of a 4-rank job has global ranks 1 and 3.
  Two top-level groups (two jobs) in one process each have their own global ranks, which
  overlap; torch keeps one rank table per group, so both register and work side by side. What
  would mix them is torch's default group: ``dist.get_rank(group)`` reads *this process's*
  global rank from it. So while a pg-core group is the default (:func:`as_default`), only
  groups of its job may be registered, and it is refused while a group of another job is
  registered; next to a default group torch made itself (``init_process_group``), a group is
  registered only if its job has that group's size and this process's rank in it (taken to
  be the same job), else refused: a clear error rather than a wrong mapping.
* **What still needs a default group.** ``dist.get_rank(tg)`` and everything built on it
  read *this process's* global rank from torch's default group: ``DeviceMesh.get_rank()``,
  ``get_local_rank()``, slicing a multi-dimensional mesh (``mesh["tp"]``: torch builds the
  sub-mesh with ``get_rank()``), so HSDP (FSDP2 on a 2-D mesh, which slices it),
  ``DeviceMesh.from_group``, ``init_device_mesh``, DTensor's ``distribute_tensor`` (it
  scatters from a group rank it compares with ``get_rank(group)``; with
  ``src_data_rank=None``, each rank keeping its own shard, it needs none), tensor
  parallelism's ``parallelize_module`` (the same, and the same ``src_data_rank=None``) and DTensor's cpu
  shard-to-shard redistribution (``get_local_rank``). Those work inside ``with
  group.as_torch_default():`` (tested: slicing, ``get_local_rank``, HSDP, ``distribute_tensor``,
  ``parallelize_module``, 1-D ``init_device_mesh``, ``DeviceMesh.from_group``). FSDP2 on a 1-D
  mesh (``fully_shard(model, mesh=group.device_mesh("cpu"))``), DTensor over a 1-D or
  multi-dimensional mesh from :func:`device_mesh` (``DTensor.from_local``, ``redistribute`` to
  ``Replicate``/``Partial``, ``full_tensor()``) and functional collectives need none.
  ``init_device_mesh`` of several dimensions makes torch groups with torch's ``new_group``,
  which knows pg-core only through its plugin route (``pg_core.torch_plugin.register()``;
  without it: ``Unknown backend type pg_core``); those groups are torch's, made by torch's
  rules, and stay in torch's tables after the block, as anything torch makes does, until
  ``destroy_process_group``. Prefer :func:`device_mesh` of pg-core groups.
* **Meshes.** Torch tells meshes apart by their ranks, layout, device type, dimension names
  and ``_thread_id``, not by their groups, and its DTensor caches keep the meshes they saw:
  a mesh from :func:`device_mesh` carries an identity from its groups' names in
  ``_thread_id`` (:func:`_mesh_identity`), so a mesh of another job, or of a group shut down,
  over the same ranks is never taken for it (a sub-mesh torch slices from it, inside
  ``as_torch_default()``, is torch's own and does not carry it); and unregistering lets go of the meshes' hold on
  the group, so torch's caches do not keep a shut-down group's sockets open. A mesh outlives
  its groups only as a husk: using it after they shut down raises torch's ``Could not
  resolve the process group``. One hold remains that pg-core cannot undo: torch keeps the
  torch group behind the first DTensor a process makes for the life of the process (torch
  2.13; from no Python object), so if that group is pg-gloo's, its sockets stay open after
  shutdown.
* **Torch's ``destroy_process_group(tg)``** removes the entries itself, and calls the torch
  group's ``shutdown()``, which leaves the pg-core group working (tested on pg-tcp and
  pg-gloo; :mod:`pg_core.interop` decides what it does). pg-core then finds the entries gone: the next
  ``to_torch(register=True)``, ``device_mesh()`` or ``as_torch_default()`` raises
  ``RuntimeError`` saying so (once: after it, registering again registers anew), and shutdown
  removes nothing of anyone else's. ``destroy_process_group()`` with no argument (or of the
  default group) destroys every group in torch's tables, pg-core's included: torch's rule.

Torch internals this module relies on (private; checked on first use, and a missing one
raises ``RuntimeError`` naming it and the torch version; written against torch 2.13):
``torch.distributed.distributed_c10d._world`` and its ``pg_map``, ``pg_names``,
``pg_group_ranks``, ``pg_backend_config``, ``pg_to_tag``, ``tags_to_pg``,
``pg_coalesce_state`` and ``default_pg``; ``torch._C._distributed_c10d._register_process_group``,
``_unregister_process_group``, ``_resolve_process_group`` and ``_set_global_rank``;
``DeviceMesh.__init__``'s ``_init_backend`` and ``_rank`` arguments and its
``_dim_group_names`` and ``_pg_registry`` attributes (what ``DeviceMesh.from_group`` sets),
and ``_thread_id``, part of a mesh's identity (see :func:`_mesh_identity`).

The registrations live in torch's process-wide tables, so pg-core keeps one process-wide
record beside them (``_REGISTERED``: group name -> :class:`Registration`): which entries are
pg-core's, and the job each belongs to. It holds exactly the registered groups.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.distributed_c10d import GroupName

    from .group import ProcessGroup
    from .store import Store

__all__ = ["Lineage", "Registration", "as_default", "device_mesh", "register", "unregister"]

#: pg-core's name for its groups in torch's ``pg_map`` (what ``dist.get_backend(tg)`` says)
BACKEND_NAME = "pg_core"

_WORLD_TABLES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg")
_C10D_FUNCTIONS = (
    "_register_process_group",
    "_unregister_process_group",
    "_resolve_process_group",
    "_set_global_rank",
)

_LOCK = threading.RLock()
#: group name -> its registration, for exactly the pg-core groups in torch's tables
_REGISTERED: dict[str, Registration] = {}


@dataclass(frozen=True)
class Lineage:
    """Where a group's ranks sit in its job (the top-level group it was made from): ``job``
    is that group's uid, ``job_size`` its size, ``ranks[i]`` the job rank of this group's
    rank ``i`` (its *global* rank, in torch's words)."""

    job: str
    job_size: int
    ranks: tuple[int, ...]

    @classmethod
    def top(cls, uid: str, size: int) -> Lineage:
        """A top-level group's: its own job, its ranks its global ranks."""
        return cls(uid, size, tuple(range(size)))

    def child(self, parent_ranks: Sequence[int] | None) -> Lineage:
        """A subgroup's, whose rank ``i`` is rank ``parent_ranks[i]`` of the group with this lineage."""
        if parent_ranks is None:
            return self
        return Lineage(self.job, self.job_size, tuple(self.ranks[r] for r in parent_ranks))


@dataclass(frozen=True)
class Registration:
    """One group's entries in torch's tables: ``torch_group`` under ``name``, with global
    ranks ``lineage.ranks``; ``rank`` is this process's rank in the group."""

    torch_group: dist.ProcessGroup
    name: str
    lineage: Lineage
    rank: int
    described: str  # the pg-core group, for messages
    #: the meshes :func:`device_mesh` made over it, whose hold on it :func:`unregister` lets go
    meshes: weakref.WeakSet[DeviceMesh] = field(default_factory=weakref.WeakSet, compare=False)

    @property
    def job_rank(self) -> int:
        """This process's global rank (its rank in the group's job)."""
        return self.lineage.ranks[self.rank]


def _c10d() -> Any:
    """torch's C++ binding module, its registry functions checked (see the module docstring)."""
    module = torch._C._distributed_c10d
    for name in _C10D_FUNCTIONS:
        if not hasattr(module, name):
            _missing(f"torch._C._distributed_c10d.{name}")
    return module


def _world() -> Any:
    """torch's ``_world``, its tables checked (see the module docstring)."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    if world is None:
        _missing("torch.distributed.distributed_c10d._world")
    for table in _WORLD_TABLES:
        if not isinstance(getattr(world, table, None), dict):
            _missing(f"torch.distributed.distributed_c10d._world.{table}")
    return world


def _missing(name: str) -> NoReturn:
    raise RuntimeError(
        f"pg-core's registration with torch needs {name}, which torch {torch.__version__} does not have: it relies "
        "on torch's private process-group tables as torch 2.13 has them (see pg_core.torch_world); use to_torch() "
        "without register=True, or a torch version pg-core supports"
    )


def _registered_as(world: Any, c10d: Any, reg: Registration) -> bool:
    """Whether torch's tables still hold ``reg``'s group under its name."""
    tg = reg.torch_group
    if world.pg_names.get(tg) != reg.name or tg not in world.pg_group_ranks:
        return False
    try:
        return bool(c10d._resolve_process_group(reg.name) is tg or c10d._resolve_process_group(reg.name) == tg)
    except (RuntimeError, ValueError, LookupError):
        return False


def _lost(reg: Registration) -> RuntimeError:
    return RuntimeError(
        f"{reg.described} was registered with torch as {reg.name!r}, and torch no longer holds it: "
        "torch.distributed.destroy_process_group() removed it (and shut down what its torch ProcessGroup holds). "
        "pg-core has dropped its registration; to_torch(register=True) registers the group anew, if its backends "
        "still work, else make a new group"
    )


def _job_conflict(world: Any, lineage: Lineage, rank: int, described: str) -> str | None:
    """Why registering a group of ``lineage`` next to torch's current default group would give
    torch a wrong global rank, or ``None``."""
    default = world.default_pg
    if default is None:
        return None
    ours = next((r for r in _REGISTERED.values() if r.torch_group is default), None)
    if ours is not None:
        if ours.lineage.job == lineage.job:
            return None
        return (
            f"{ours.described} is torch's default group (as_torch_default), and {described} belongs to another job "
            f"({lineage.job!r}, not {ours.lineage.job!r}): torch would read its global ranks as ranks of the default "
            "group's job. Register it outside the as_torch_default() block"
        )
    job_rank = lineage.ranks[rank]
    if default.size() == lineage.job_size and default.rank() == job_rank:
        return None
    return (
        f"torch has a default group of its own (init_process_group: rank {default.rank()} of {default.size()}), and "
        f"{described}'s job has this process as rank {job_rank} of {lineage.job_size}: torch would translate its "
        "global ranks through the wrong group. Use to_torch() without register=True beside torch's default group, "
        "or make the pg-core group of the same ranks as torch's world"
    )


def register(
    torch_group: dist.ProcessGroup,
    *,
    lineage: Lineage,
    rank: int,
    store: Store,
    backends: Mapping[str, str],
    described: str,
    previous: Registration | None = None,
) -> Registration:
    """Put ``torch_group`` in torch's tables (see the module docstring) and return its
    :class:`Registration`; ``previous``, this group's registration so far, is returned as it
    is while torch still holds it (registration is idempotent). Raises ``RuntimeError`` where
    torch removed ``previous`` (once; the call after registers anew), where the name is
    taken by another group, or where torch's default group belongs to another job."""
    world, c10d = _world(), _c10d()
    with _LOCK:
        if previous is not None and _REGISTERED.get(previous.name) is previous:
            if _registered_as(world, c10d, previous):
                return previous
            _remove(world, c10d, previous)
            raise _lost(previous)
        try:
            name = torch_group.group_name
        except RuntimeError as exc:
            raise RuntimeError(f"{described}: its torch ProcessGroup has no group name to register ({exc})") from exc
        reason = _job_conflict(world, lineage, rank, described)
        if reason is not None:
            raise RuntimeError(f"cannot register {described} with torch: {reason}")
        if name in _REGISTERED or torch_group in world.pg_map:
            raise RuntimeError(f"cannot register {described} with torch as {name!r}: torch already has that group")
        with contextlib.suppress(RuntimeError, ValueError, LookupError):
            c10d._resolve_process_group(name)
            raise RuntimeError(
                f"cannot register {described} with torch as {name!r}: torch's registry holds another group by that name"
            )
        tag = f"ptd:{name}"
        world.pg_map[torch_group] = (BACKEND_NAME, store)
        world.pg_names[torch_group] = name
        world.pg_group_ranks[torch_group] = {global_rank: i for i, global_rank in enumerate(lineage.ranks)}
        world.pg_backend_config[torch_group] = ",".join(f"{d}:{b}" for d, b in backends.items())
        world.pg_to_tag[torch_group] = tag
        world.tags_to_pg.setdefault(tag, []).append(torch_group)
        c10d._register_process_group(name, torch_group)
        reg = Registration(torch_group, name, lineage, rank, described)
        _REGISTERED[name] = reg
        return reg


def unregister(reg: Registration) -> None:
    """Remove ``reg``'s entries from torch's tables: each only while it is still this group's,
    so what torch's ``destroy_process_group`` removed, or what another took since, is left
    alone. If the group is torch's default group (:func:`as_default`), torch has none after."""
    world, c10d = _world(), _c10d()
    with _LOCK:
        if _REGISTERED.get(reg.name) is reg:
            _remove(world, c10d, reg)


def _remove(world: Any, c10d: Any, reg: Registration) -> None:
    tg = reg.torch_group
    del _REGISTERED[reg.name]
    if world.default_pg is tg:
        _clear_default(world, c10d)
    with contextlib.suppress(RuntimeError, ValueError, LookupError):
        if c10d._resolve_process_group(reg.name) is tg:
            c10d._unregister_process_group(reg.name)
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag"):
        getattr(world, table).pop(tg, None)
    tag = f"ptd:{reg.name}"
    holders = world.tags_to_pg.get(tag)
    if holders is not None:
        holders[:] = [g for g in holders if g is not tg]
        if not holders:
            del world.tags_to_pg[tag]
    coalesce = getattr(world, "pg_coalesce_state", None)
    if isinstance(coalesce, dict):
        coalesce.pop(tg, None)
    for mesh in list(reg.meshes):  # torch's caches keep meshes (and what they hold) alive
        if mesh._pg_registry.get(reg.name) is tg:
            del mesh._pg_registry[reg.name]


def _clear_default(world: Any, c10d: Any) -> None:
    world.default_pg = None
    c10d._set_global_rank(-1)  # torch's own value with no default group


@contextlib.contextmanager
def as_default(reg: Registration) -> Iterator[None]:
    """``reg``'s group as torch's default group for the block (``dist.get_rank()``,
    ``init_device_mesh``, ``DeviceMesh.from_group`` then work); torch has none after it, as
    before. Inside a block of the same group, a block changes nothing. Refused
    (``RuntimeError``) where torch has another default group already, or a group of another job
    is registered (see the module docstring). The default is process-wide: every thread sees it
    for the block."""
    world, c10d = _world(), _c10d()
    with _LOCK:
        if _REGISTERED.get(reg.name) is not reg or not _registered_as(world, c10d, reg):
            raise _lost(reg)
        current = world.default_pg
        nested = current is reg.torch_group
        if current is not None and not nested:
            ours = next((r for r in _REGISTERED.values() if r.torch_group is current), None)
            holder = (
                f"{ours.described} is torch's default group already (as_torch_default)"
                if ours is not None
                else f"torch has a default group of its own (init_process_group, backend {world.pg_map[current][0]!r})"
            )
            raise RuntimeError(
                f"as_torch_default() of {reg.described}: {holder}; leave that block, or destroy torch's default "
                "group (torch.distributed.destroy_process_group()), first"
            )
        others = sorted(r.described for r in _REGISTERED.values() if r.lineage.job != reg.lineage.job)
        if others:
            raise RuntimeError(
                f"as_torch_default() of {reg.described}: groups of another job are registered with torch "
                f"({', '.join(others)}); with this group the default, torch would read their global ranks as "
                "ranks of this group's job. Shut them down or leave their torch_registered() blocks first"
            )
        if not nested:
            world.default_pg = reg.torch_group
            c10d._set_global_rank(reg.job_rank)
    try:
        yield
    finally:
        if not nested:
            with _LOCK:
                if world.default_pg is reg.torch_group:
                    _clear_default(world, c10d)


def _mesh_class() -> type[DeviceMesh]:
    """torch's ``DeviceMesh``, the private arguments this module builds it with checked."""
    from torch.distributed.device_mesh import DeviceMesh

    parameters = inspect.signature(DeviceMesh.__init__).parameters
    for name in ("_init_backend", "_rank"):
        if name not in parameters:
            _missing(f"the {name} argument of torch.distributed.device_mesh.DeviceMesh")
    return DeviceMesh


def device_mesh(
    device_type: str, groups: Sequence[ProcessGroup], mesh_dim_names: tuple[str, ...] | None = None
) -> DeviceMesh:
    """A ``DeviceMesh`` of ``device_type`` whose dimension ``d`` is the group ``groups[d]``,
    for FSDP2 (``fully_shard(model, mesh=...)``), DTensor and tensor parallelism, with no
    default group (see the module docstring for what still needs one). Each group is
    registered (``to_torch(register=True)``; collective the first time). Called by every
    member of every group. One group: a 1-D mesh of its global ranks. Several: the groups
    must form a grid of one job (a data-parallel and a tensor-parallel group made with
    ``new_group`` or ``split``, every process in one of each); the mesh is learnt from the
    groups (one ``all_gather_object`` on each) and checked the same on every member."""
    mesh_class = _mesh_class()
    if not isinstance(device_type, str) or not device_type or ":" in device_type:
        raise ValueError(
            f"device_mesh: device_type must be a device type such as 'cpu' or 'cuda' (no index), got {device_type!r}"
        )
    groups = list(groups)
    if not groups:
        raise ValueError("device_mesh: groups is empty; give one pg-core group per mesh dimension")
    if len({id(g) for g in groups}) != len(groups):
        raise ValueError(f"device_mesh: a group appears twice in {groups!r}; give one group per mesh dimension")
    if mesh_dim_names is not None:
        names = tuple(mesh_dim_names)
        if len(names) != len(groups) or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"device_mesh: mesh_dim_names must be {len(groups)} distinct strings, one per group, got "
                f"{mesh_dim_names!r}"
            )
        mesh_dim_names = names
    for group in groups:
        if device_type not in group.backends:
            have = ", ".join(f"{d}:{b}" for d, b in group.backends.items())
            raise ValueError(
                f"device_mesh: {group!r} has no backend for {device_type!r} (it has {have}); make the group with a "
                f"backend for {device_type!r}, or ask for a mesh of a device type it has"
            )
    regs = [_registration_of(group.to_torch(register=True)) for group in groups]
    jobs = {reg.lineage.job for reg in regs}
    if len(jobs) > 1:
        raise ValueError(
            f"device_mesh: the groups belong to {len(jobs)} jobs ({', '.join(r.described for r in regs)}); a mesh's "
            "groups must all be made from one top-level group"
        )
    mesh = _mesh_ranks(groups, regs)
    device_mesh = mesh_class(
        device_type, mesh, mesh_dim_names=mesh_dim_names, _init_backend=False, _rank=regs[0].job_rank
    )
    if not isinstance(getattr(device_mesh, "_pg_registry", None), dict):
        _missing("torch.distributed.device_mesh.DeviceMesh._pg_registry")
    group_names = [reg.name for reg in regs]
    device_mesh._dim_group_names = [cast("GroupName", name) for name in group_names]
    device_mesh._thread_id = _mesh_identity(group_names)
    for reg in regs:
        device_mesh._pg_registry[reg.name] = reg.torch_group
        reg.meshes.add(device_mesh)
    return device_mesh


def _mesh_identity(names: Sequence[str]) -> int:
    """What tells a mesh over these groups from another over the same ranks. Torch compares
    and hashes meshes by their ranks, layout, device type, dimension names and ``_thread_id``
    (which tells apart the meshes of its threaded test groups, several ranks in one process),
    not by their groups; its DTensor caches would hand an operation on one group's mesh the
    mesh of another group over the same ranks (another job's, or one shut down). The same on
    every rank (from the group names), as torch.compile's guards and caches need."""
    digest = hashlib.blake2b("\n".join(names).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _registration_of(torch_group: dist.ProcessGroup) -> Registration:
    with _LOCK:
        for reg in _REGISTERED.values():
            if reg.torch_group is torch_group:
                return reg
    raise RuntimeError(f"{torch_group!r} is not registered with torch by pg-core")  # to_torch(register=True) did


def _mesh_ranks(groups: Sequence[ProcessGroup], regs: Sequence[Registration]) -> torch.Tensor:
    """The global ranks of the mesh whose dimension ``d`` is ``groups[d]``: built from the last
    dimension out (each member of ``groups[d]`` brings the block of dimensions after ``d``
    that it sits in), then checked: every member's groups are the lines through it, the
    ranks are distinct, and every member of every group has the same mesh."""
    if len(groups) == 1:
        return torch.tensor(regs[0].lineage.ranks, dtype=torch.int)
    block: Any = regs[-1].job_rank
    for group in reversed(groups):
        block = group.all_gather_object(block)
    mesh = torch.tensor(block, dtype=torch.int)
    flat = mesh.flatten().tolist()
    if len(set(flat)) != len(flat):
        raise ValueError(f"device_mesh: the groups {groups!r} do not form a grid: a process appears twice in {block}")
    coordinate = [reg.rank for reg in regs]
    for d, reg in enumerate(regs):
        index: list[Any] = list(coordinate)
        index[d] = slice(None)
        line = mesh[tuple(index)].tolist()
        if line != list(reg.lineage.ranks):
            raise ValueError(
                f"device_mesh: the groups {groups!r} do not form a grid: along dimension {d} this process's line of "
                f"the mesh {block} is {line}, but its group there has global ranks {list(reg.lineage.ranks)}"
            )
    for group in groups:
        if any(other != block for other in group.all_gather_object(block)):
            raise ValueError(
                f"device_mesh: the members of {group!r} learnt different meshes from the groups {groups!r}: they do "
                "not form one grid"
            )
    return mesh
