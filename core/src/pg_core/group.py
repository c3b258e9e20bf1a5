"""``ProcessGroup``, the front door: every method validates, picks its device's backend, and submits.

There is no default group and no global rank: a ``ProcessGroup`` is an ordinary object, a
process may hold any number of them, and every rank it speaks of is a rank *in that group*.
Bad input raises here, before any byte is sent. What happens next belongs to other modules:
the order of collectives to :mod:`pg_core.executor`, coalesced batches to
:mod:`pg_core.coalescing`, backends to :mod:`pg_core.dispatch`
and :mod:`pg_core.instance`, objects and unknown shapes to :mod:`pg_core.objects`, and the
group's formation (subgroups and rendezvous included) to :mod:`pg_core.membership`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch

from . import environment, messages
from .auth import AuthKey, resolve_key
from .check import Checker, check_mode
from .coalescing import Batch, OpenBlocks, Recorder
from .dispatch import (
    BackendsArg,
    Dispatcher,
    context_factory,
    fallbacks,
    message_device,
    resolve_backends,
    unavailable,
)
from .errors import CollectiveTimeout, NotSupportedError, PeerFailureError, warn_user
from .executor import Executor
from .instance import Lane
from .interop import to_torch
from .membership import ROOT_NAMESPACE, Formation, Subgroups, await_leaving, check_name, form, leave, never_joined
from .messages import ObjectsArg
from .objects import Objects
from .ops import RedOpType, ReduceOp, as_reduce_op
from .recorder import FlightRecorder, Tracer, buffer_size, shape_of, trace_dir
from .sparse import SPARSE_LAYOUTS, all_reduce_sparse
from .store import PrefixStore, Store, auth_key_of, authenticated, hosts_store, store_address, wait_for
from .tags import check_tag
from .timeouts import DEFAULT_TIMEOUT, seconds
from .torch_world import Lineage, Registration, as_default, unregister
from .torch_world import device_mesh as mesh_of_groups
from .torch_world import register as register_with_torch
from .validation import (
    Staging,
    Supported,
    check_dict,
    check_members,
    check_peer,
    check_rank,
    check_tensor,
    check_tensor_list,
    dense,
    device_arg,
    same_numel,
    split_sizes,
)
from .work import Work, mapped, then

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .backend import Backend, BackendSpec
    from .instance import Instance
    from .registry import Registry

__all__ = ["DEFAULT_TIMEOUT", "P2POp", "ProcessGroup", "rendezvous"]

_Tensor = torch.Tensor  # a module global: the hot path's type check reads one name, not two


class _Unread:
    """The mark of a value not read yet (``None`` is a value: outside a launcher, no local rank)."""


_UNREAD = _Unread()


#: an argument not given (``None`` is a value: torch's form refuses ``object_list=None``)
_MISSING: Any = _Unread()


@dataclass(frozen=True)
class P2POp:
    """One send or receive for :meth:`ProcessGroup.batch_isend_irecv`.

    ``op`` is ``group.isend`` / ``group.irecv`` (or the strings ``"isend"`` /
    ``"irecv"``); ``peer`` is a rank of the group the batch runs on, or for ``irecv``
    ``None``: a receive from any source, as ``group.irecv(tensor, None, tag)``.
    """

    op: Callable[..., Any] | str
    tensor: torch.Tensor
    peer: int | None
    tag: int = 0

    @property
    def kind(self) -> str:
        name = self.op if isinstance(self.op, str) else getattr(self.op, "__name__", "")
        if name in ("isend", "send"):
            return "isend"
        if name in ("irecv", "recv"):
            return "irecv"
        raise ValueError(f"P2POp.op must be isend or irecv, got {self.op!r}")


class ProcessGroup:
    """A group of ``size`` processes, this one being ``rank``.

    ``store`` is any torch c10d store every member can reach; the group keeps to
    its own namespace in it (``pg-core/<name>/<generation>/``), so groups with
    different names never collide, and forming a name again (say, survivors
    re-forming ``"world"`` after a failure, or a second group of that name while the
    first is alive) is a new formation, a generation of its own.

    ``backends``: a dict ``{"cpu": "gloo", "cuda": "nccl"}``, the same as a string
    ``"cpu:gloo,cuda:nccl"``, one backend name for every device it declares,
    ``None`` for the highest-priority available backend per device type, or a
    ``Backend`` subclass / factory. Every member must resolve the same backends
    (checked as it joins). ``timeout`` (seconds) bounds every operation unless the
    call gives its own. ``options`` maps a backend name to the options its
    ``BackendContext`` carries.

    ``check=True`` (default: ``PG_CORE_CHECK`` of the environment, read here; off when unset)
    is check mode: before each tensor collective reaches its backend, the ranks compare a
    fingerprint of it (op, sequence number, device, dtype, the shape they must agree on,
    root, reduce op, all-to-all split sizes) over the message backend, and a difference
    raises :class:`~pg_core.errors.CollectiveMismatchError` on every rank, naming each side,
    instead of the backend's crash, hang or wrong result. It costs one small all_gather per
    collective (see :mod:`pg_core.check`); every rank of a group must have it alike.
    Subgroups inherit it.

    ``auth_key`` (str or bytes; default: ``PG_CORE_AUTH_KEY`` of the environment, read here;
    ``pgrun`` sets one per job) is the job's secret: every store value the group writes
    carries a MAC and is verified when read back, and backends that authenticate their
    connections (pg-tcp) admit only peers that prove they hold it (see ``docs/security.md``).
    Every member must have the same one. Subgroups inherit it. ``objects="restricted"`` (or a
    list of classes to allow besides) loads received objects through an allow-list instead
    of plain pickle (see :mod:`pg_core.messages`); subgroups inherit it.
    """

    def __init__(
        self,
        store: Store,
        rank: int | None = None,
        size: int | None = None,
        *,
        backends: BackendsArg = None,
        name: str = "world",
        timeout: float | timedelta | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        registry: Registry | None = None,
        check: bool | None = None,
        auth_key: str | bytes | AuthKey | None = None,
        objects: ObjectsArg = None,
    ) -> None:
        rank, size = _rank_and_size(rank, size)
        check_name(name)
        self._attach(
            *_form_top_level(
                store,
                name,
                rank,
                size,
                backends=backends,
                timeout=timeout,
                options=options,
                registry=registry,
                check=check,
                auth_key=auth_key,
                objects=objects,
            )
        )

    @classmethod
    def from_env(
        cls,
        backends: BackendsArg = None,
        name: str = "world",
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | timedelta | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        registry: Registry | None = None,
        check: bool | None = None,
        auth_key: str | bytes | AuthKey | None = None,
        objects: ObjectsArg = None,
    ) -> ProcessGroup:
        """The group of every process a launcher started: pgrun, torchrun, SLURM's ``srun`` or
        ``mpiexec``, read from ``env`` (default ``os.environ``) as :mod:`pg_core.environment`
        says, in that order of precedence. Connects to (or, where the launcher leaves it to
        rank 0, hosts) the job's store, then forms the group as the constructor does.
        ``backends=None`` takes ``PG_BACKENDS`` (``pgrun --backends``) where it is set;
        ``auth_key=None`` takes ``PG_CORE_AUTH_KEY`` (``pgrun`` sets one per job), and
        ``objects=None`` ``PG_CORE_OBJECTS``, of ``env``.
        Raises ``ValueError`` naming the variables it looked for, before connecting."""
        env = os.environ if env is None else env
        launch = environment.read_launch(env)
        if backends is None and env.get("PG_BACKENDS"):
            backends = env["PG_BACKENDS"]
        checked = check_mode(check, env)  # PG_CORE_CHECK of the launcher's environment, where not given
        key = resolve_key(auth_key, env)  # PG_CORE_AUTH_KEY likewise
        loader = messages.loader(objects, env)
        store = launch.connect(seconds(timeout, DEFAULT_TIMEOUT))
        group = cls(
            store,
            launch.rank,
            launch.size,
            backends=backends,
            name=name,
            timeout=timeout,
            options=options,
            registry=registry,
            check=checked,
            auth_key=key,
            objects=loader,
        )
        group._local_rank = launch.local_rank
        return group

    @classmethod
    def _of(cls, formation: Formation, check: bool, loader: messages.Loader | None = None) -> ProcessGroup:
        """The group of a formation made elsewhere (:func:`rendezvous`, subgroups)."""
        group = cls.__new__(cls)
        group._attach(formation, check, loader or messages.PICKLE)
        return group

    def _attach(self, f: Formation, check: bool, loader: messages.Loader) -> None:
        """Everything a group holds, from its formation: nothing here talks to a peer."""
        m = f.membership
        self._formation = f
        self._rank, self._size, self._name, self._timeout = m.rank, m.size, f.name, f.timeout
        self._store = PrefixStore(m.prefix, f.store)
        self._specs = dict(f.specs)
        missing = unavailable(self._specs, f.registry, f.name)
        self._supported = Supported(self._specs, f.name, missing)
        #: the flight recorder (None: PG_CORE_TRACE_BUFFER=0) and what the group does with it on a failure
        capacity = buffer_size(os.environ)
        self._recorder = FlightRecorder(capacity) if capacity else None
        self._tracer = Tracer(
            store=self._store,
            rank=m.rank,
            size=m.size,
            name=f.name,
            uid=f.uid,
            timeout=f.timeout,
            recorder=self._recorder,
            joined=never_joined(self._store, m.size, f.name),
            folder=trace_dir(os.environ),
            describe=self._described,
        )
        self._executor = Executor(f.name, self._tracer.explain, self._recorder)
        self._dispatch = Dispatcher(
            self._specs,
            context_factory(
                self._store,
                rank=m.rank,
                size=m.size,
                timeout=f.timeout,
                group_name=f.name,
                group_uid=f.uid,
                options=f.options,
                split_from=f.split_from,
                auth_key=auth_key_of(f.store),
            ),
            missing,
            fallbacks(f.specs),
            self._chose,
        )
        # where barrier (an op without tensors) and messages go: the cpu backend, else the first configured one
        self._barrier_device = message_device(self._specs)
        #: the open coalescing blocks on this group, by thread (false but while one is open)
        self._coalescing = OpenBlocks(f.name)
        #: blocking all_reduce's fast path: the backend's prepared call as an executor lane (or None) per
        #: (device, dtype, reduce op type)
        self._lanes: dict[tuple[torch.device, torch.dtype, RedOpType], Callable[[torch.Tensor], None] | None] = {}
        #: asynchronous all_reduce's fast path, where the backend launches it: a launch through the
        #: executor per (device, dtype, reduce op type)
        self._async_lanes: dict[tuple[torch.device, torch.dtype, RedOpType], Callable[[torch.Tensor], Work]] = {}
        #: blocking send/recv's fast path: the lane per (op, device, dtype) whose checks passed once
        #: (the ones that hold for every later call of that kind; see _p2p_lane). Not per tag: a program
        #: may use a new tag per message, and this must not grow with them.
        self._p2p_lanes: dict[tuple[str, torch.device, torch.dtype], Lane] = {}
        #: the cpu ones among them by dtype, per op: the common case's lookup is one hash of the dtype
        self._cpu_lanes: dict[str, dict[torch.dtype, Lane]] = {"send": {}, "recv": {}}
        self._objects = Objects(
            rank=m.rank,
            size=m.size,
            device=self._barrier_device,
            separate=frozenset(d for d in self._specs if d != "cpu"),
            dispatcher=self._dispatch,
            supported=self._supported,
            executor=self._executor,
            coalescing=self._coalescing,
            name=f.name,
            loader=loader,
        )
        self._subgroups = Subgroups(f)
        #: check mode's fingerprint exchange, or ``None`` (off: nothing on any path reads more than this)
        self._checker = _checker(
            self._dispatch, self._supported, self._barrier_device, rank=m.rank, size=m.size, name=f.name, check=check
        )
        self._local_rank: int | _Unread | None = _UNREAD  # read from the environment on first use
        self._torch_group: torch.distributed.ProcessGroup | None = None  # to_torch(), made on first call
        self._lineage = Lineage.top(f.uid, m.size)  # where its ranks sit in its job (a subgroup's: set by its parent)
        self._registration: Registration | None = None  # in torch's tables (to_torch(register=True)), or not
        self._monitored = 0  # monitored_barrier() rounds so far (their store keys)

    def _chose(self, device_type: str, spec: BackendSpec) -> None:
        """The dispatcher fell back to ``spec`` for ``device_type`` (the default refused every
        member): :attr:`backends` and the capability checks (which read this dict) follow it, and
        what passed the checks against the refused one is checked again."""
        self._specs[device_type] = spec
        self._supported.forget()

    # -- properties -------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def local_rank(self) -> int | None:
        """This process's rank on its node, as its launcher says (pgrun's ``PG_LOCAL_RANK``,
        torchrun's ``LOCAL_RANK``, SLURM's ``SLURM_LOCALID``, MPI launchers' local rank; the
        environment :meth:`from_env` read, for a group made by it): which GPU to take,
        ``torch.device("cuda", group.local_rank)``. ``None`` outside a launcher. A property of
        the process, not the group: every group of the process gives the same."""
        if isinstance(self._local_rank, _Unread):
            self._local_rank = environment.local_rank(os.environ)
        return self._local_rank

    def get_rank(self) -> int:
        """:attr:`rank`, under torch's name (``torch.distributed.get_rank(group)``)."""
        return self._rank

    def get_world_size(self) -> int:
        """:attr:`size`, under torch's name (``torch.distributed.get_world_size(group)``)."""
        return self._size

    @property
    def name(self) -> str:
        return self._name

    @property
    def uid(self) -> str:
        """Unique to this formation of the group, across jobs and hosts (``BackendContext.group_uid``)."""
        return self._formation.uid

    @property
    def parent_ranks(self) -> tuple[int, ...] | None:
        """For a subgroup (``new_group``, ``split``): ``parent_ranks[i]`` is the rank in the
        parent group of this group's rank ``i``. ``None`` for a group formed on its own."""
        return self._formation.parent_ranks

    @property
    def timeout(self) -> float:
        """Default per-operation timeout in seconds."""
        return self._timeout

    @property
    def check(self) -> bool:
        """Whether check mode is on: each collective's fingerprint is compared across the
        ranks before its backend runs it (``check=`` or ``PG_CORE_CHECK``; see the class)."""
        return self._checker is not None

    @property
    def authenticated(self) -> bool:
        """Whether this group belongs to an authenticated job (``auth_key=`` or
        ``PG_CORE_AUTH_KEY``; the secret itself is never shown)."""
        return auth_key_of(self._formation.store) is not None

    @property
    def objects(self) -> str:
        """How received objects are loaded: ``"pickle"`` or ``"restricted"`` (see the class)."""
        return self._objects.loader.mode

    @property
    def backends(self) -> dict[str, str]:
        """Device type -> backend name."""
        return {device: spec.name for device, spec in self._specs.items()}

    def debug_state(self) -> dict[str, Any]:
        """What this rank's flight recorder knows of the group, as a JSON-serialisable dict:
        ``group``, ``uid``, ``rank``, ``size``, ``backends``, ``timeout``, ``state`` (``open``,
        ``failed``, ``shutting down``, ``shut down``, ``aborted``), ``seq`` (the last collective's
        sequence number), ``recorder`` (its capacity: ``PG_CORE_TRACE_BUFFER``, ``0`` when off),
        ``entries`` (the operations kept, oldest first: sequence number or point to point
        number, op, input and output sizes and dtypes, root or peer, device, state, error
        class, start and end times in wall-clock nanoseconds) and ``report`` (the last desync
        report: who was where when a collective failed; ``None`` if none failed). See
        docs/debugging.md."""
        return self._tracer.state()

    def _described(self) -> dict[str, Any]:
        executor = self._executor
        state = executor.state or ("failed" if executor.failed else "open")
        return {
            "group": self._name,
            "uid": self._formation.uid,
            "rank": self._rank,
            "size": self._size,
            "backends": self.backends,
            "timeout": self._timeout,
            "state": state,
            "seq": executor.seq,
        }

    def supports_device(self, device: str | torch.device) -> bool:
        """Whether this group has a backend for ``device``'s type that can run here (False for
        one installed but unavailable on this machine, such as nccl without a GPU)."""
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        return self._dispatch.available(device_type)

    def form_backend(self, device: str | torch.device, op: str = "form_backend") -> Backend:
        """Collective where the backend's construction is (Gloo's is): create this group's
        backend for ``device``'s type now, on every member, and return it (the one already
        made, if it exists; nothing is exchanged then). Every member must call it for the same
        device type, before anything that leaves some of them out (point to point, a torch
        wrapper) uses it. ``device`` is a device type (``"cuda"``: the current device of that
        type, or the one the backend already uses) or a device (``cuda:1``); ``op`` names the
        operation a timeout while forming it is reported against. Raises :class:`ValueError`
        for a device type the group has no backend for and
        :class:`~pg_core.errors.BackendUnavailableError` for one that cannot run here."""
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        if device_type not in self._specs:
            raise ValueError(
                f"group {self._name!r} has no backend for device type {device_type!r} (it has "
                f"{', '.join(sorted(self._specs)) or 'none'}); pass one of those, or form the group with "
                f"backends= naming one for {device_type!r}"
            )
        where = device if isinstance(device, torch.device) else self._dispatch.device(device_type)
        return self._dispatch.instance(where, op).backend

    def supports(
        self,
        op: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        reduce_op: ReduceOp | RedOpType | None = None,
    ) -> bool:
        """Whether ``op`` (e.g. ``"all_reduce"``, ``"isend"``, ``"recv_anysource"``: ``recv`` with
        ``src=None``) is declared for that device/dtype/reduce op by a backend that can run here
        (False for a device type whose backend is installed but unavailable on this machine)."""
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        op = {"isend": "send", "irecv": "recv"}.get(op, op)
        spec = self._specs.get(device_type)
        if spec is None or not self.supports_device(device_type):
            return False
        caps = spec.capabilities_for(device_type)
        return caps.supports(op, dtype, as_reduce_op(reduce_op) if reduce_op is not None else None)

    def __repr__(self) -> str:
        backends = ", ".join(
            f"{d}: {n}{'' if self._dispatch.available(d) else ' (unavailable here)'}" for d, n in self.backends.items()
        )
        state = self._executor.state
        shown = (
            f"{' authenticated' if self.authenticated else ''}{' check' if self._checker is not None else ''}"
            f"{' restricted-objects' if self._objects.loader.mode != 'pickle' else ''}{f' {state}' if state else ''}"
        )
        return f"<ProcessGroup {self._name!r} rank {self._rank}/{self._size} backends={{{backends}}}{shown}>"

    # -- execution --------------------------------------------------------------
    def _collective(
        self,
        op: str,
        staging: Staging | None,
        args: tuple[Any, ...],
        *,
        reduce_op: ReduceOp | None,
        async_op: bool,
        timeout: float | timedelta | None,
    ) -> Any:
        """Check that the backend for the staged tensors' device (``barrier``: none staged)
        declares ``op``, then call its method ``op`` with ``args`` and the timeout in the
        executor's order (inside this thread's coalescing block: record it in the batch).
        Blocking: returns what the method returned; ``async_op``: a ``Work`` whose ``result()``
        it is."""
        # (a closed group raises in the executor, before anything is sent)
        if staging is None or staging.device is None:
            device, dtype = self._barrier_device, None
        else:
            device, dtype = staging.device, staging.dtype
        self._supported.check(op, device, dtype, reduce_op)
        if self._coalescing:  # (empty unless some thread is inside a coalescing block of this group)
            batch = self._coalescing.current()
            if batch is not None:
                return batch.collective(op, device, staging, args, timeout=timeout, async_op=async_op)
        budget = self._timeout if timeout is None else seconds(timeout, self._timeout)
        dispatch = self._dispatch

        checker = self._checker
        # (in check mode, not launched here: the check waits for every rank, which an asynchronous call must not)
        if async_op and checker is None and dispatch.launches(device, op):
            return self._launch(op, device, staging, args, budget)

        def run(seq: int) -> Any:
            if checker is not None:  # every rank's fingerprint first: a mismatch raises here, on every rank
                checker.verify(op, seq, device.type, args, budget)
            result = getattr(dispatch.instance(device).backend, op)(*args, timeout=budget)
            if staging is not None and staging.back:
                staging.finish()
            return result

        return self._executor.run(op, run, async_op=async_op, args=args, device=device.type)

    def _launch(
        self, op: str, device: torch.device, staging: Staging | None, args: tuple[Any, ...], budget: float
    ) -> Work:
        """An asynchronous collective on a backend that launches (API 1.2): launched here, in
        the executor's order (:meth:`Executor.launch`: no thread), returning the backend's work;
        staged outputs are copied back and a failure latched when it completes."""
        method = getattr(self._dispatch.instance(device, op).backend, op)

        def launch(seq: int) -> Work:
            work: Work = method(*args, timeout=budget, async_op=True)
            return work

        inner = self._executor.launch(op, launch, args, device.type)
        return then(inner, staging.finish) if staging is not None and staging.back else inner

    @property
    def open_batch(self) -> Batch | None:
        """The batch of this thread's open ``with group.coalescing()`` block on this group, or
        ``None`` outside one (other threads' blocks are theirs)."""
        return self._coalescing.current()

    def coalescing(self, *, async_op: bool = False, timeout: float | timedelta | None = None) -> Batch:
        """``with group.coalescing() as batch:``: the tensor collectives and ``isend``/``irecv``
        (and ``batch_isend_irecv``) this thread calls on this group inside the block are
        issued together when it exits, as torch's ``_coalescing_manager`` does: as one launch
        where the device's backend coalesces (pg-nccl: one NCCL group call), otherwise one
        after another in call order (correct, without the saving).

        Each call is validated as it is made (bad input raises there) and returns at once: a
        blocking collective returns ``None``, a call with ``async_op=True`` a ``Work`` that
        completes with the batch. Nothing is sent before the exit; a block that raises sends
        nothing and re-raises. ``async_op=False``: the exit waits for the whole batch, and
        outputs hold their values after the block; ``async_op=True``: ``batch.work`` /
        ``batch.wait()`` complete when every operation has. ``timeout`` (seconds) is what each
        call of the block gets when it gives none (default: the group's).

        Inside a block: one device type (the first call's); no ``barrier``,
        ``monitored_barrier``, blocking ``send``/``recv``, nor object or message operations
        (``RuntimeError``); no nested block. Other groups' calls, and other threads' calls
        on this group, are not captured: each group (and thread) coalesces its own. A batch
        holding a collective is one entry in the group's collective order, taking the
        sequence numbers its collectives would have taken one by one; a batch of point to
        point only goes straight to the backend.
        """
        self._coalescing.refuse_nested()
        self._executor.check_open()
        return Batch(
            name=self._name,
            executor=self._executor,
            dispatch=self._dispatch,
            blocks=self._coalescing,
            async_op=async_op,
            timeout=self._seconds(timeout),
            default_timeout=self._timeout,
            check=self._checker,
        )

    # -- collectives ------------------------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | RedOpType = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Reduce ``tensor`` across the group, in place, on every rank. A sparse COO tensor is
        summed as torch's Gloo sums one (:mod:`pg_core.sparse`), on every backend."""
        # The hot paths (the group's timeout, a dense plain tensor, no coalescing block, a kind
        # that went through the full path once): blocking, the backend's prepared all_reduce, in
        # order; asynchronous, the backend's launch through the executor's (no staging, no checks
        # again). (No lane is made for PREMUL_SUM, whose factor changes per call: it never finds one.)
        plain = type(tensor) is _Tensor and type(op) is ReduceOp and timeout is None and not self._coalescing
        if plain:
            key = (tensor.device, tensor.dtype, op.type)  # type: ignore[union-attr]
            lane = self._async_lanes.get(key) if async_op else self._lanes.get(key)
            if lane is not None and not tensor.requires_grad and dense(tensor):
                return lane(tensor)  # type: ignore[no-any-return]
        plain = plain and op.type is not RedOpType.PREMUL_SUM  # type: ignore[union-attr]
        rop = as_reduce_op(op)
        if getattr(tensor, "layout", None) in SPARSE_LAYOUTS:  # summed from gathers of its parts (as Gloo does)
            self._coalescing.refuse_inside("all_reduce of a sparse tensor")
            return all_reduce_sparse(self, tensor, rop, async_op=async_op, timeout=timeout)
        st = Staging("all_reduce")
        t = st.stage(tensor, written=True)
        result = self._collective("all_reduce", st, (t, rop), reduce_op=rop, async_op=async_op, timeout=timeout)
        if plain and self._checker is None:  # it ran: the backend exists, and declares this kind (not in a batch)
            key = (tensor.device, tensor.dtype, rop.type)
            if async_op:
                if key not in self._async_lanes and self._dispatch.launches(tensor.device, "all_reduce"):
                    self._async_lanes[key] = self._async_lane(tensor.device, rop)
            elif key not in self._lanes:  # the backend's prepared call, run in order by the executor
                prepared = self._dispatch.prepared_all_reduce(tensor.device, tensor.dtype, rop, self._timeout)
                self._lanes[key] = (
                    None if prepared is None else self._executor.lane("all_reduce", prepared, tensor.device.type)
                )
        return result

    def _async_lane(self, device: torch.device, rop: ReduceOp) -> Callable[[torch.Tensor], Work]:
        """``all_reduce(t, rop, async_op=True)`` with the group's timeout on ``device``'s backend,
        which launches it: what the general path (:meth:`_collective`, :meth:`_launch`) does once
        its checks passed, a dense tensor needing no staging. The executor numbers it, keeps its
        order, notes it in the recorder and latches its failure (:meth:`Executor.launch`)."""
        backend: Any = self._dispatch.instance(device, "all_reduce").backend  # (its all_reduce takes async_op)
        method: Callable[..., Work] = backend.all_reduce
        budget = self._timeout

        def start(tensor: torch.Tensor) -> Work:
            return method(tensor, rop, timeout=budget, async_op=True)

        return self._executor.launch_lane("all_reduce", start, device.type)

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, async_op: bool = False, timeout: float | timedelta | None = None
    ) -> Work | None:
        """Copy ``tensor`` of group rank ``src`` into ``tensor`` on every rank."""
        check_rank(src, self._size, "src")
        st = Staging("broadcast")
        t = st.stage(tensor, written=True) if self._rank != src else st.stage(tensor)
        return self._collective(
            "broadcast",
            st,
            (t, src),
            reduce_op=None,
            async_op=async_op,
            timeout=timeout,
        )

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int,
        op: ReduceOp | RedOpType = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Reduce ``tensor`` across the group into ``tensor`` on ``dst``; others' tensors are unchanged."""
        check_rank(dst, self._size, "dst")
        rop = as_reduce_op(op)
        st = Staging("reduce")
        t = st.stage(tensor, written=True) if self._rank == dst else st.stage(tensor)
        return self._collective(
            "reduce",
            st,
            (t, dst, rop),
            reduce_op=rop,
            async_op=async_op,
            timeout=timeout,
        )

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``tensor_list[i]`` receives rank ``i``'s ``tensor``."""
        tensor = check_tensor(tensor)
        outs = check_tensor_list(tensor_list, "tensor_list", self._size)
        same_numel(outs, tensor.numel(), "all_gather", "tensor_list")
        st = Staging("all_gather")
        staged = [st.stage(o, written=True) for o in outs]
        t = st.stage(tensor)
        return self._collective(
            "all_gather",
            st,
            (staged, t),
            reduce_op=None,
            async_op=async_op,
            timeout=timeout,
        )

    def all_gather_into_tensor(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``output_tensor`` (``size`` times ``input_tensor``'s elements) receives every rank's input in rank order."""
        st = Staging("all_gather_into_tensor")
        o, i = st.stage(output_tensor, "output_tensor", written=True), st.stage(input_tensor, "input_tensor")
        if o.numel() != i.numel() * self._size:
            raise ValueError(
                f"all_gather_into_tensor: output_tensor has {o.numel()} elements, expected "
                f"{self._size} x {i.numel()} = {self._size * i.numel()}"
            )
        return self._collective(
            "all_gather_into_tensor",
            st,
            (o, i),
            reduce_op=None,
            async_op=async_op,
            timeout=timeout,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp | RedOpType = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``output`` on rank ``i`` receives the reduction of every rank's ``input_list[i]``."""
        out = check_tensor(output, "output")
        ins = check_tensor_list(input_list, "input_list", self._size)
        same_numel(ins, out.numel(), "reduce_scatter", "input_list")
        rop = as_reduce_op(op)
        st = Staging("reduce_scatter")
        o = st.stage(out, written=True)
        staged = [st.stage(t) for t in ins]
        return self._collective(
            "reduce_scatter",
            st,
            (o, staged, rop),
            reduce_op=rop,
            async_op=async_op,
            timeout=timeout,
        )

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp | RedOpType = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``output`` on rank ``i`` receives the reduction of block ``i`` of every rank's ``input``."""
        st = Staging("reduce_scatter_tensor")
        o, i = st.stage(output, "output", written=True), st.stage(input, "input")
        if i.numel() != o.numel() * self._size:
            raise ValueError(
                f"reduce_scatter_tensor: input has {i.numel()} elements, expected "
                f"{self._size} x {o.numel()} = {self._size * o.numel()}"
            )
        rop = as_reduce_op(op)
        return self._collective(
            "reduce_scatter_tensor",
            st,
            (o, i, rop),
            reduce_op=rop,
            async_op=async_op,
            timeout=timeout,
        )

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``output_tensor_list[i]`` receives rank ``i``'s ``input_tensor_list[rank]``; sizes may differ per peer."""
        outs = check_tensor_list(output_tensor_list, "output_tensor_list", self._size)
        ins = check_tensor_list(input_tensor_list, "input_tensor_list", self._size)
        if outs[self._rank].numel() != ins[self._rank].numel():
            raise ValueError(
                f"all_to_all: output_tensor_list[{self._rank}] has {outs[self._rank].numel()} elements but "
                f"input_tensor_list[{self._rank}] (what this rank sends itself) has {ins[self._rank].numel()}"
            )
        st = Staging("all_to_all")
        o = [st.stage(t, written=True) for t in outs]
        i = [st.stage(t) for t in ins]
        return self._collective(
            "all_to_all",
            st,
            (o, i),
            reduce_op=None,
            async_op=async_op,
            timeout=timeout,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``), send piece ``i`` to rank ``i``,
        and concatenate what arrives into ``output`` (by ``output_split_sizes``)."""
        out = check_tensor(output, "output")
        inp = check_tensor(input, "input")
        if out.dim() == 0 or inp.dim() == 0:
            raise ValueError("all_to_all_single: input and output need at least one dimension (splits are along dim 0)")
        if out.shape[1:] != inp.shape[1:]:
            raise ValueError(
                f"all_to_all_single: output shape {tuple(out.shape)} and input shape {tuple(inp.shape)} "
                "must agree beyond dim 0"
            )
        in_splits = split_sizes(input_split_sizes, inp.shape[0], self._size, "input")
        out_splits = split_sizes(output_split_sizes, out.shape[0], self._size, "output")
        if in_splits[self._rank] != out_splits[self._rank]:
            raise ValueError(
                f"all_to_all_single: this rank sends itself {in_splits[self._rank]} rows but expects "
                f"{out_splits[self._rank]}"
            )
        st = Staging("all_to_all_single")
        o, i = st.stage(out, written=True), st.stage(inp)
        return self._collective(
            "all_to_all_single",
            st,
            (o, i, out_splits, in_splits),
            reduce_op=None,
            async_op=async_op,
            timeout=timeout,
        )

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None = None,
        dst: int = 0,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``gather_list[i]`` on ``dst`` receives rank ``i``'s ``tensor``; other ranks pass no list."""
        st = Staging("gather")
        tensor, staged = self._rooted("gather", tensor, gather_list, dst, st)
        t = st.stage(tensor)
        return self._collective(
            "gather",
            st,
            (t, staged, dst),
            reduce_op=None,
            async_op=async_op,
            timeout=timeout,
        )

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list[torch.Tensor] | None = None,
        src: int = 0,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """``tensor`` on rank ``i`` receives ``scatter_list[i]`` of ``src``; other ranks pass no list."""
        st = Staging("scatter")
        tensor, staged = self._rooted("scatter", tensor, scatter_list, src, st)
        t = st.stage(tensor, written=True)
        return self._collective(
            "scatter",
            st,
            (t, staged, src),
            reduce_op=None,
            async_op=async_op,
            timeout=timeout,
        )

    def _rooted(
        self, op: str, tensor: object, lst: list[torch.Tensor] | None, root: int, st: Staging
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Validate gather/scatter: the list exists on the root only, one tensor per rank,
        each with ``tensor``'s element count; stage it (outputs for gather, inputs for scatter)."""
        tensor = check_tensor(tensor)
        role, what = ("destination", "dst") if op == "gather" else ("source", "src")
        check_rank(root, self._size, what)
        name = f"{op}_list"
        if self._rank != root:
            if lst:
                raise ValueError(f"{op}: {name} is only passed on the {role} rank ({root})")
            return tensor, None
        if lst is None:
            raise ValueError(f"{op}: the {role} rank {root} must pass {name}")
        items = check_tensor_list(lst, name, self._size)
        same_numel(items, tensor.numel(), op, name)
        staged = [st.stage(i, written=True) if op == "gather" else st.stage(i) for i in items]
        return tensor, staged

    def barrier(self, *, async_op: bool = False, timeout: float | timedelta | None = None) -> Work | None:
        """Return once every rank has entered the barrier (on the cpu backend if the group has one)."""
        return self._collective("barrier", None, (), reduce_op=None, async_op=async_op, timeout=timeout)

    def monitored_barrier(self, *, timeout: float | timedelta | None = None, wait_all_ranks: bool = True) -> None:
        """A barrier that names the ranks that did not arrive, as ``torch.distributed.monitored_barrier``.

        Every rank reports to rank 0 through the group's store; rank 0 waits at most ``timeout``
        for them, then every rank returns, or raises :class:`~pg_core.errors.CollectiveTimeout`
        whose ``peers`` (and message) are the ranks that did not arrive (if rank 0 itself does
        not answer, the others name it). It uses the store, not a backend, so it works whatever
        the backends are doing, also after a collective failed: a debugging tool for hangs.
        Every missing rank is named whatever ``wait_all_ranks`` says (kept for torch's spelling).
        """
        self._executor.check_open()
        self._coalescing.refuse_inside("monitored_barrier")
        budget = self._timeout if timeout is None else seconds(timeout, self._timeout)
        self._monitored += 1
        key = f"monitored_barrier/{self._monitored}"
        self._store.set(f"{key}/{self._rank}", "1")
        if self._rank == 0:
            arrivals = [f"{key}/{r}" for r in range(self._size)]
            try:
                wait_for(self._store, arrivals, budget, what="monitored_barrier")
                missing: list[int] = []
            except CollectiveTimeout:
                missing = [r for r, k in enumerate(arrivals) if not self._store.check([k])]
            self._store.set(f"{key}/verdict", ",".join(map(str, missing)))
        else:
            try:  # rank 0 decides within its budget; the slack covers its store round trips
                wait_for(self._store, [f"{key}/verdict"], budget + 5.0, what="monitored_barrier")
            except CollectiveTimeout:
                raise CollectiveTimeout(
                    f"monitored_barrier of group {self._name!r}: rank 0, which runs it, did not answer within "
                    f"{budget + 5.0:g} s",
                    op="monitored_barrier",
                    peers=[0],
                ) from None
            verdict = self._store.get(f"{key}/verdict").decode()
            missing = [int(r) for r in verdict.split(",")] if verdict else []
        if missing:
            raise CollectiveTimeout(  # torch's words first ("Rank 0 timed out in monitoredBarrier")
                f"Rank {self._rank} timed out in monitoredBarrier of group {self._name!r}: rank(s) "
                f"{', '.join(map(str, missing))} did not arrive within {budget:g} s",
                op="monitored_barrier",
                peers=missing,
            )

    # -- point to point -----------------------------------------------------------
    def _p2p_lane(
        self, kind: str, tensor: torch.Tensor, peer: int, tag: int, timeout: float | timedelta | None
    ) -> Lane | None:
        """The lane of a ``send``/``recv`` (``kind``; ``isend``/``irecv`` too, where the backend
        has its own: :attr:`Lane.starts`) that may skip :meth:`_p2p`'s checks: with the group's
        timeout, outside any coalescing block, of a dense plain tensor to or from a rank other
        than this one, with a tag in the backend's range, where one of its (device, dtype)
        already passed them. ``None``: take :meth:`_p2p`.

        The checks run cheapest first (one type test, one hash), and what is rarely true last:
        whatever a call could change since its lane was made (the group closed, the tensor's
        layout, ``requires_grad``) is checked on every call."""
        if type(tensor) is not _Tensor or timeout is not None or self._coalescing:
            return None
        if tensor.is_cpu:
            lane = self._cpu_lanes[kind].get(tensor.dtype)
        else:
            lane = self._p2p_lanes.get((kind, tensor.device, tensor.dtype))
        if (
            lane is None
            or type(peer) is not int
            or type(tag) is not int  # (a bool or a list: the full path's TypeError)
            or not 0 <= tag < lane.limit
            or not 0 <= peer < self._size
            or peer == self._rank
            or self._executor.state is not None
            or tensor.requires_grad
            or tensor.is_neg()
            or (not lane.plain and tensor.is_conj())
        ):
            return None
        try:
            strides = tensor.stride()
        except RuntimeError:  # sparse, nested, mkldnn: no strides (the full path says so)
            return None
        if strides == (1,) or dense(tensor):  # the common case first: 1-D with unit stride
            return lane
        return None

    def _p2p(
        self, kind: str, tensor: torch.Tensor, peer: int | None, tag: int, timeout: float | timedelta | None
    ) -> tuple[Instance | Recorder, torch.Tensor, Staging, float]:
        """Validate one send or receive (``peer=None``: a receive from any source) and stage its
        tensor; inside this thread's coalescing block, the recorder of its batch stands in for
        the instance."""
        self._executor.check_open()
        tensor = check_tensor(tensor)
        if peer is not None or kind == "send":
            check_peer(peer, self._size, self._rank, "dst" if kind == "send" else "src", kind)
        check_tag(tag)
        self._supported.check(kind, tensor.device, tensor.dtype)
        if peer is None:
            self._supported.check_any_source(tensor.device, self._size, self._formation.registry)
        inst = self._dispatch.instance(tensor.device, kind)
        inst.tags.check(tag)
        st = Staging(kind)
        staged = st.stage(tensor) if kind == "send" else st.stage(tensor, written=True)
        if self._coalescing:  # inside this thread's coalescing block: recorded in its batch instead
            batch = self._coalescing.current()
            if batch is not None:
                if peer is None:
                    raise RuntimeError(
                        f"{kind} with src=None cannot join a coalescing block of group {self._name!r}: a batch "
                        "names every peer (as NCCL's group calls do); receive from any source outside the block"
                    )
                return batch.capture(inst, timeout), staged, st, self._seconds(timeout)
        if timeout is None and peer is not None:  # what passed holds for later calls of this kind
            self._p2p_lane_for(kind, inst, tensor.device, tensor.dtype)
        return inst, staged, st, self._timeout if timeout is None else seconds(timeout, self._timeout)

    def _p2p_lane_for(self, kind: str, inst: Instance, device: torch.device, dtype: torch.dtype) -> None:
        """Keep the lane of ``kind`` on ``inst`` for tensors on ``device`` (the tensor's own, as
        :meth:`_p2p_lane` looks it up: ``cuda:1`` is not ``cuda``) of ``dtype``, whose call passed
        :meth:`_p2p`'s checks."""
        key = (kind, device, dtype)
        if key not in self._p2p_lanes:
            lane = self._p2p_lanes[key] = Lane(
                inst,
                kind,
                dtype,
                timeout=self._timeout,
                recorder=self._recorder,
                failed=self._tracer.point_to_point_failed,
            )
            if device.type == "cpu":
                self._cpu_lanes[kind][dtype] = lane

    def _p2p_any_source(
        self, tensor: torch.Tensor, tag: int, timeout: float | timedelta | None
    ) -> tuple[Instance, torch.Tensor, Staging, float]:
        """:meth:`_p2p` for a receive from any source, which never joins a coalescing batch."""
        inst, t, st, budget = self._p2p("recv", tensor, None, tag, timeout)
        return cast("Instance", inst), t, st, budget

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, timeout: float | timedelta | None = None) -> None:
        """Send ``tensor`` to group rank ``dst``; returns once ``tensor`` may be reused."""
        lane = self._p2p_lane("send", tensor, dst, tag, timeout)
        if lane is not None:
            lane.run(tensor, dst, tag)
        else:
            self._full_p2p("send", tensor, dst, tag, timeout=timeout)

    def recv(
        self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, *, timeout: float | timedelta | None = None
    ) -> int:
        """Receive the next message with ``tag`` from group rank ``src`` into ``tensor``; returns
        the sender's rank (``src``), as ``torch.distributed.recv`` does.

        ``src=None`` receives the next message with ``tag`` from whichever rank sent it, where
        the backend declares ``"recv_anysource"`` (:meth:`supports`; else
        :class:`~pg_core.errors.NotSupportedError` before anything is received). Each sender's
        messages arrive in the order it sent them, however receives naming it and any-source
        receives interleave (see docs/decisions.md)."""
        if src is None:  # (not recorded: its peer is known only once it is received)
            return self._recv(tensor, None, tag, timeout=timeout)
        lane = self._p2p_lane("recv", tensor, src, tag, timeout)
        if lane is not None:
            lane.run(tensor, src, tag)
        else:
            self._full_p2p("recv", tensor, src, tag, timeout=timeout)
        return src

    def _full_p2p(
        self, kind: str, tensor: torch.Tensor, peer: int, tag: int, *, timeout: float | timedelta | None
    ) -> None:
        """A blocking ``send``/``recv`` (``kind``) that its lane may not take: :meth:`_send` or
        :meth:`_recv`, their checks included, recorded as the lane records its calls (a coalescing
        block's calls are its batch's, recorded with it)."""
        call = self._send if kind == "send" else self._recv
        recorder = self._recorder
        if recorder is None or type(tensor) is not _Tensor or self._coalescing:
            call(tensor, peer, tag, timeout=timeout)
            return
        try:
            recorder.point_to_point(
                kind, shape_of(tensor), tensor.dtype, tensor.device, peer, call, tensor, tag, timeout
            )
        except BaseException as exc:
            self._tracer.point_to_point_failed(exc)
            raise

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float | timedelta | None) -> None:
        """A blocking send by the full path (:meth:`_p2p`): what :meth:`send` does where no lane may take it."""
        inst, t, _, budget = self._p2p("send", tensor, dst, tag, timeout)
        inst.p2p("send", t, dst, tag, budget, async_op=False)

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int, *, timeout: float | timedelta | None) -> int:
        """A blocking receive by the full path (:meth:`_p2p`): what :meth:`recv` does where no lane may take it."""
        if src is None:
            inst, t, st, budget = self._p2p_any_source(tensor, tag, timeout)
            sender = inst.recv_any(t, tag, budget)
        else:
            via, t, st, budget = self._p2p("recv", tensor, src, tag, timeout)
            via.p2p("recv", t, src, tag, budget, async_op=False)
            sender = src
        if st.back:
            st.finish()
        return sender

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, timeout: float | timedelta | None = None) -> Work:
        """Start sending ``tensor`` to ``dst``; do not modify it until the ``Work`` completes."""
        lane = self._p2p_lane("send", tensor, dst, tag, timeout)
        if lane is not None and lane.starts:  # the backend's own isend, past the checks that can change
            return lane.start(tensor, dst, tag)
        inst, t, _, budget = self._p2p("send", tensor, dst, tag, timeout)
        return inst.p2p("send", t, dst, tag, budget, async_op=True)  # type: ignore[no-any-return]

    def irecv(
        self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, *, timeout: float | timedelta | None = None
    ) -> Work:
        """Start receiving from ``src`` into ``tensor``; read it after the ``Work`` completes.
        ``src=None`` receives from any source, as :meth:`recv`, and the ``Work``'s ``result()``
        is then the sender's rank."""
        if src is None:
            inst, t, st, budget = self._p2p_any_source(tensor, tag, timeout)
            inner = inst.irecv_any(t, tag, budget)  # (its result: the sender, checked)
            return then(inner, st.finish) if st.back else inner
        lane = self._p2p_lane("recv", tensor, src, tag, timeout)
        if lane is not None and lane.starts:
            return lane.start(tensor, src, tag)
        via, t, st, budget = self._p2p("recv", tensor, src, tag, timeout)
        inner = via.p2p("recv", t, src, tag, budget, async_op=True)
        return then(inner, st.finish) if st.back else inner

    def batch_isend_irecv(self, p2p_op_list: Sequence[P2POp]) -> list[Work]:
        """Start every send and receive of the list as one coalesced batch (see
        :meth:`coalescing`); returns one ``Work`` per op, in order, each complete when the
        whole batch is. Nothing starts if any op is invalid. Inside a coalescing block, the
        ops join that block's batch. An ``irecv`` with ``peer=None`` receives from any source
        (its ``result()`` is the sender); such a list is not coalesced (a batch names every
        peer, as NCCL's group calls do): its ops start one by one, after all are validated."""
        if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
            raise ValueError("batch_isend_irecv takes a non-empty list of P2POp")
        for p in p2p_op_list:
            if not isinstance(p, P2POp):
                raise TypeError(f"batch_isend_irecv takes P2POp items, got {type(p).__name__}")
            bound = getattr(p.op, "__self__", self)
            if bound is not self:
                raise ValueError("a P2POp's op belongs to another group; build it from this group's isend/irecv")
        if any(p.peer is None for p in p2p_op_list):
            for p in p2p_op_list:  # validate everything before starting anything
                self._p2p("send" if p.kind == "isend" else "recv", p.tensor, p.peer, p.tag, None)
            return [(self.isend if p.kind == "isend" else self.irecv)(p.tensor, p.peer, p.tag) for p in p2p_op_list]  # type: ignore[arg-type]
        if not self._coalescing.inside():
            with self.coalescing(async_op=True):
                return self.batch_isend_irecv(p2p_op_list)
        return [(self.isend if p.kind == "isend" else self.irecv)(p.tensor, p.peer, p.tag) for p in p2p_op_list]  # type: ignore[arg-type]

    # -- objects and tensors the receiver knows nothing about ------------------------------
    #
    # A layer over the backend contract (pg_core.objects over pg_core.messages): one message
    # per value where the backend carries variable-size messages, the eager emulation
    # otherwise; tensors ride in the message without a copy.

    def send_object(
        self, obj: Any, dst: int, *, tag: int = 0, async_op: bool = False, timeout: float | timedelta | None = None
    ) -> Work | None:
        """Send a picklable ``obj`` to group rank ``dst`` (pickle protocol 5; tensors and
        buffers inside it travel out of band, not copied into the pickle stream).

        Trusted peers only: the receiver unpickles what arrives. Object messages have their
        own tags, apart from tensor ``send``/``recv``. With ``async_op`` the object is encoded
        now; its tensors are read as the message goes, so leave them alone until the ``Work``
        completes.
        """
        return self._objects.send(
            "send_object", messages.OBJECT, obj, dst=dst, tag=tag, async_op=async_op, timeout=self._seconds(timeout)
        )

    def recv_object(
        self, src: int, *, tag: int = 0, async_op: bool = False, timeout: float | timedelta | None = None
    ) -> Any:
        """Receive the next object (or tensor, or tensor dict) that ``src`` sent with ``tag``."""
        return self._recv_value("recv_object", None, src=src, tag=tag, device=None, async_op=async_op, timeout=timeout)

    def send_tensor(
        self,
        tensor: torch.Tensor,
        dst: int,
        *,
        tag: int = 0,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Send ``tensor`` to a receiver that does not know its shape or dtype
        (:meth:`recv_tensor`). Shape, dtype and data travel in one message where the
        backend can carry one; see :mod:`pg_core.messages`."""
        tensor = check_tensor(tensor)
        return self._objects.send(
            "send_tensor", messages.TENSOR, tensor, dst=dst, tag=tag, async_op=async_op, timeout=self._seconds(timeout)
        )

    def recv_tensor(
        self,
        src: int,
        device: str | torch.device | None = None,
        *,
        tag: int = 0,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """Receive a tensor sent with :meth:`send_tensor`, with the sender's shape and dtype,
        on ``device`` (default: the sender's device type; a CPU tensor is a view into the
        received message, not a copy)."""
        return self._recv_value(
            "recv_tensor", messages.TENSOR, src=src, tag=tag, device=device, async_op=async_op, timeout=timeout
        )

    def send_tensor_dict(
        self,
        tensor_dict: Mapping[Any, Any],
        dst: int,
        *,
        tag: int = 0,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Send a dict of tensors and plain values, nested as deep as needed (a kv-cache
        transfer's metadata and blocks), in one message; tensors on a device with a backend
        of their own (``cuda``) follow on that backend, described by the message."""
        check_dict(tensor_dict, "send_tensor_dict")
        return self._objects.send(
            "send_tensor_dict",
            messages.TENSOR_DICT,
            tensor_dict,
            dst=dst,
            tag=tag,
            async_op=async_op,
            timeout=self._seconds(timeout),
        )

    def recv_tensor_dict(
        self,
        src: int,
        device: str | torch.device | None = None,
        *,
        tag: int = 0,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """Receive a dict sent with :meth:`send_tensor_dict`; its tensors on ``device``
        (default: each tensor's sender device type)."""
        return self._recv_value(
            "recv_tensor_dict",
            messages.TENSOR_DICT,
            src=src,
            tag=tag,
            device=device,
            async_op=async_op,
            timeout=timeout,
        )

    def broadcast_object(
        self, obj: Any, src: int = 0, *, async_op: bool = False, timeout: float | timedelta | None = None
    ) -> Any:
        """Every rank returns ``src``'s ``obj`` (other ranks pass anything, usually ``None``).
        ``src`` gets its own object back; the others a copy, decoded from one message that
        travelled down a binomial tree."""
        return self._objects.broadcast(
            "broadcast_object",
            obj,
            messages.OBJECT,
            src=src,
            device=None,
            timeout=self._seconds(timeout),
            async_op=async_op,
        )

    def broadcast_tensor_dict(
        self,
        tensor_dict: Mapping[Any, Any] | None = None,
        src: int = 0,
        *,
        device: str | torch.device | None = None,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """Every rank returns ``src``'s dict of tensors and plain values; other ranks pass
        ``None``. Where the message backend carries variable-size messages, CPU tensors ride
        in the one message; tensors on another device follow as that device backend's
        ``broadcast``."""
        check_rank(src, self._size, "src")
        if self._rank == src:
            check_dict(tensor_dict, "broadcast_tensor_dict")
        elif tensor_dict is not None:
            raise ValueError(f"broadcast_tensor_dict: tensor_dict is only passed on the source rank ({src})")
        return self._objects.broadcast(
            "broadcast_tensor_dict",
            tensor_dict,
            messages.TENSOR_DICT,
            src=src,
            device=self._supported.target(device_arg(device)),
            timeout=self._seconds(timeout),
            async_op=async_op,
        )

    def all_gather_object(
        self,
        *args: Any,
        object_list: Any = _MISSING,
        obj: Any = _MISSING,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """A list of every rank's ``obj``, in rank order (copies, this rank's included):
        ``objs = group.all_gather_object(obj)``.

        Torch's form works too: ``group.all_gather_object(object_list, obj)`` (either may be
        given by keyword, as in torch) fills ``object_list``, a list with one entry per rank,
        in place and returns ``None`` (with ``async_op=True``, a :class:`Work` that fills it on
        completion)."""
        object_list, obj = _torch_form("all_gather_object", args, object_list, obj)
        if object_list is not _MISSING:
            _check_object_list(object_list, self._size, "all_gather_object")
        result = self._objects.all_gather(obj, timeout=self._seconds(timeout), async_op=async_op)
        if object_list is _MISSING:
            return result

        def fill(values: list[Any]) -> None:
            object_list[:] = values

        return _filled(result, fill, async_op)

    def broadcast_object_list(
        self,
        object_list: list[Any],
        src: int = 0,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Work | None:
        """Torch's ``broadcast_object_list``: every rank's ``object_list`` becomes a copy of
        ``src``'s, in place (the lists are the same length on every rank, as torch requires;
        another length raises ``ValueError`` once the objects arrive). :meth:`broadcast_object`
        is pg-core's own form: one object, returned."""
        if not isinstance(object_list, list):
            raise TypeError(f"broadcast_object_list: object_list must be a list, got {type(object_list).__name__}")
        result = self.broadcast_object(
            list(object_list) if self._rank == src else None, src, async_op=async_op, timeout=timeout
        )

        def fill(values: list[Any]) -> None:
            if len(values) != len(object_list):
                raise ValueError(
                    f"broadcast_object_list: rank {src} sent {len(values)} objects into a list of "
                    f"{len(object_list)} on rank {self._rank}; pass lists of one length on every rank"
                )
            object_list[:] = values

        return _filled(result, fill, async_op)

    def gather_object(
        self, obj: Any, dst: int = 0, *, async_op: bool = False, timeout: float | timedelta | None = None
    ) -> Any:
        """On ``dst``: a list of every rank's ``obj`` in rank order (copies); elsewhere ``None``."""
        return self._objects.gather(obj, dst=dst, timeout=self._seconds(timeout), async_op=async_op)

    def scatter_object(
        self,
        objs: Sequence[Any] | None,
        src: int = 0,
        *,
        async_op: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """Rank ``i`` returns ``objs[i]`` of ``src`` (a copy); ``objs`` is a list of one
        object per rank on ``src`` and ``None`` elsewhere."""
        return self._objects.scatter(objs, src=src, timeout=self._seconds(timeout), async_op=async_op)

    def _recv_value(
        self,
        op: str,
        kind: int | None,
        *,
        src: int,
        tag: int,
        device: str | torch.device | None,
        async_op: bool,
        timeout: float | timedelta | None,
    ) -> Any:
        try:
            return self._objects.recv(
                op,
                kind,
                src=src,
                tag=tag,
                device=self._supported.target(device_arg(device)),
                async_op=async_op,
                timeout=self._seconds(timeout),
            )
        except (CollectiveTimeout, PeerFailureError) as exc:
            self._tracer.point_to_point_failed(exc)
            raise

    def _seconds(self, timeout: float | timedelta | None) -> float:
        return self._timeout if timeout is None else seconds(timeout, self._timeout)

    # -- subgroups ------------------------------------------------------------------------------
    def to_torch(self, register: bool = False) -> torch.distributed.ProcessGroup:
        """This group as a ``torch.distributed.ProcessGroup``, for ``DistributedDataParallel(model,
        process_group=group.to_torch())`` and the ``torch.distributed`` calls that take ``group=``
        (with ``group_src=``/``group_dst=``); nothing global is initialised. Torch C++ backends
        (Gloo, NCCL) are registered on it as they are; other backends go through this group.
        Collective the first time (it creates the group's backends on every rank); the same
        object afterwards. See :mod:`pg_core.interop` for what needs torch's global registry.

        ``register=True`` also puts it in torch's process-group registry and rank tables under
        its ``group_name`` (functional collectives, ``torch.compile``, FSDP2, DTensor, global
        ``src=``/``dst=``), with this group's ranks mapped to its job's as its global ranks,
        until this group shuts down or aborts; once, however often asked. No default group is
        made. See :mod:`pg_core.torch_world`."""
        torch_group = self._torch_group
        if torch_group is None:
            self._executor.check_open()
            torch_group = self._torch_group = to_torch(self)
        if register:
            self._executor.check_open()
            self._registration = register_with_torch(
                torch_group,
                lineage=self._lineage,
                rank=self._rank,
                store=self._store,
                backends=self.backends,
                described=f"pg-core group {self._name!r} (rank {self._rank} of {self._size})",
                previous=self._registration,
            )
        return torch_group

    @contextlib.contextmanager
    def torch_registered(self) -> Iterator[torch.distributed.ProcessGroup]:
        """``with group.torch_registered() as tg:``: :meth:`to_torch` registered with torch for the
        block; a group registered before the block stays registered after it."""
        registered_before = self._registration is not None
        torch_group = self.to_torch(register=True)
        try:
            yield torch_group
        finally:
            if not registered_before:
                self._unregister_from_torch()

    @contextlib.contextmanager
    def as_torch_default(self) -> Iterator[torch.distributed.ProcessGroup]:
        """``with group.as_torch_default() as tg:``: this group, registered, is torch's default group
        for the block (``dist.get_rank()``, ``init_device_mesh``, ``DeviceMesh.from_group``,
        DTensor's ``distribute_tensor`` work), and torch has none after it (a block inside a block
        of the same group changes nothing). Refused with ``RuntimeError`` where torch has another
        default group already (``init_process_group``'s, or another pg-core group's) or a group of
        another job is registered."""
        with self.torch_registered() as torch_group, as_default(self._registration_now()):
            yield torch_group

    def device_mesh(self, device_type: str, mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
        """A 1-D ``DeviceMesh`` of ``device_type`` over this group (registered), for FSDP2's
        ``fully_shard(model, mesh=...)`` and DTensor, with no default group. Several groups:
        :func:`pg_core.device_mesh`."""
        return mesh_of_groups(device_type, [self], mesh_dim_names)

    def _registration_now(self) -> Registration:
        registration = self._registration
        if registration is None:
            raise RuntimeError(f"pg-core group {self._name!r} is not registered with torch")
        return registration

    def _unregister_from_torch(self) -> None:
        """Undo :meth:`to_torch`'s registration, if any (its own entries only)."""
        registration, self._registration = self._registration, None
        if registration is not None:
            unregister(registration)

    def new_group(
        self,
        ranks: Sequence[int],
        name: str | None = None,
        backends: BackendsArg = None,
        *,
        timeout: float | timedelta | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        check: bool | None = None,
    ) -> ProcessGroup:
        """A group of the ranks ``ranks`` of this group; called by those members only
        (the others never call it). This rank's rank in it is its index in ``ranks``.

        ``backends``, ``timeout``, ``options`` and ``check`` default to this group's. The subgroup
        lives in this group's store namespace: the same ``ranks`` (or ``name``) formed
        again, while the first is alive or after it shut down, is a new formation.
        Members must call ``new_group`` for the same ``ranks`` in the same order.
        """
        self._executor.check_open()
        members = check_members(ranks, self._size)
        if self._rank not in members:
            raise ValueError(f"new_group: rank {self._rank} is not in ranks {members}; only the members call new_group")
        if name is not None:
            check_name(name, "new_group name")
        specs, budget, opts = self._inherited(backends, timeout, options)
        checked = self._inherited_check(check)
        formation = self._subgroups.new_group(members, name, specs=specs, timeout=budget, options=opts, check=checked)
        group = ProcessGroup._of(formation, checked, self._objects.loader)
        group._local_rank = self._local_rank  # the process's, as its parent read it
        group._lineage = self._lineage.child(formation.parent_ranks)
        return group

    def split(
        self,
        color: int | None,
        key: int = 0,
        *,
        name: str | None = None,
        backends: BackendsArg = None,
        timeout: float | timedelta | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        check: bool | None = None,
    ) -> ProcessGroup | None:
        """Collective over this group, with ``MPI_Comm_split`` semantics: ranks passing the
        same ``color`` (an int ``>= 0``) form one subgroup, ranked by ``key`` and then by
        their rank here; ``color=None`` joins none and returns ``None``. ``backends``,
        ``timeout``, ``options`` and ``check`` default to this group's.

        The colors and keys travel in one ``all_gather_object``. Where this group's message
        backend splits natively (``Backend.split``, backend API 1.6: pg-mpi's
        ``MPI_Comm_split``) and every subgroup keeps that backend, it then splits, as one more
        collective of this group, and each subgroup's backend is created at once, here, on the
        communicator it made; otherwise the subgroups' backends form as ``new_group``'s do."""
        self._executor.check_open()
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ValueError(f"split: color must be an int >= 0 or None, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"split: key must be an int, got {key!r}")
        if name is not None:
            check_name(name, "split name")
        specs, budget, opts = self._inherited(backends, timeout, options)
        checked = self._inherited_check(check)

        def native(index: int | None, rank: int) -> dict[str, Any]:
            """The message backend's native split, in collective order, where it has one."""
            inst = self._dispatch.instance(self._barrier_device, "split")  # made by the all_gather_object
            if not inst.native_split:
                return {}
            backend = inst.backend
            handle = self._executor.run(
                "split", lambda _seq: backend.split(index, rank, timeout=budget), async_op=False
            )
            return {inst.device.type: handle}

        def release(handles: Mapping[str, Any]) -> None:
            """Hand the split's handles that no subgroup took back to the backend that made them."""
            inst = self._dispatch.instance(self._barrier_device, "split")
            for handle in handles.values():
                if handle is not None and inst.native_release:
                    inst.backend.release_split(handle)

        formation = self._subgroups.split(
            color,
            key,
            name,
            lambda mine: self.all_gather_object(mine, timeout=timeout),
            native=native,
            release=release,
            specs=specs,
            timeout=budget,
            options=opts,
            check=checked,
        )
        if formation is None:
            return None
        group = ProcessGroup._of(formation, checked, self._objects.loader)
        group._local_rank = self._local_rank
        group._lineage = self._lineage.child(formation.parent_ranks)
        try:
            for device_type in formation.split_from:  # created now, while every member is here
                group.form_backend(self._dispatch.device(device_type), "split")
        except BaseException:
            group.abort()
            raise
        return group

    def shrink(self, exclude: Iterable[int] = (), *, timeout: float | timedelta | None = None) -> ProcessGroup:
        """The group of this group's survivors, after peers died: called by every survivor, it
        agrees through the store alone (not the backends, which may be broken) on who goes on,
        and forms them into a new group of the same name, backends, options and check mode.
        Ranks keep their order: the new rank is the index among the survivors, and
        ``parent_ranks`` of the new group maps it back to this group's ranks.

        Gone are the ranks in ``exclude``, those a collective's :class:`PeerFailureError` named
        on any survivor, those that shut down or aborted; every rank that reaches ``shrink``
        before the survivors decide goes on. The survivors decide as soon as every rank has
        arrived or is gone, else at ``timeout`` (default: the group's), whoever has not arrived
        by then being gone. A rank that arrives after a decision that left it out raises
        :class:`PeerFailureError`. This group is left as it is (``abort()`` it); it works in any
        state, aborted included. Every survivor must call ``shrink`` as many times as the others.
        """
        lost = [check_rank(r, self._size, "exclude") for r in exclude]
        lost += self._executor.lost
        specs, budget, opts = self._inherited(None, timeout, None)
        checked = self._checker is not None
        formation = self._subgroups.shrink(lost, specs=specs, timeout=budget, options=opts, check=checked)
        group = ProcessGroup._of(formation, checked, self._objects.loader)
        group._local_rank = self._local_rank
        group._lineage = self._lineage.child(formation.parent_ranks)
        return group

    def _inherited(
        self,
        backends: BackendsArg,
        timeout: float | timedelta | None,
        options: Mapping[str, Mapping[str, Any]] | None,
    ) -> tuple[Mapping[str, BackendSpec], float, Mapping[str, Mapping[str, Any]]]:
        """A subgroup's configuration: this group's, where the call does not give its own."""
        # the formation's own choice, fallbacks included: each subgroup decides for its own members
        specs = self._formation.specs if backends is None else resolve_backends(backends, self._formation.registry)
        return specs, self._seconds(timeout), self._formation.options if options is None else options

    def _inherited_check(self, check: bool | None) -> bool:
        """A subgroup's check mode: this group's unless the call says (the environment is not read again)."""
        return check_mode(check, {}) if check is not None else self._checker is not None

    # -- life ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish queued operations (bounded by the group timeout), then release every
        backend, thread and socket. Further use raises :class:`GroupClosedError`.

        Then this member leaves the group. In the process that hosts the store's server (the
        rank that made its ``TCPStore`` with ``is_master=True``, or one holding a
        :class:`~pg_core.StoreServer`), shutdown then waits until every member of this group
        in another process has left it (by ``shutdown()``, ``abort()`` or a ``with`` block's
        end), so the store outlives the ranks still using it; at most the group's timeout,
        past which it warns (``RuntimeWarning``) naming the ranks that did not leave, and
        returns. A backend that failed to close is raised after that wait."""
        self._unregister_from_torch()
        if not self._executor.drain(self._timeout):
            return
        with self._executor.running:
            errors = [e for inst in self._dispatch.close() if (e := inst.close("shutdown")) is not None]
        if self._executor.failed or errors:
            # Only a group that failed marks its generation closed. After a clean shutdown,
            # members still joining (slower than this one, which needed nothing from them)
            # must find the generation, not skip it and wait alone in the next one.
            self._mark_generation_closed()
        self._leave(wait=True)
        if errors:
            raise errors[0]

    def abort(self) -> None:
        """Stop now: operations blocked in other threads raise, queued ones fail, every
        backend releases its resources. Further use raises :class:`GroupClosedError`.
        This member leaves the group; unlike :meth:`shutdown`, abort never waits for the
        others, even in the process that hosts the store."""
        self._unregister_from_torch()

        def release() -> None:
            for inst in self._dispatch.close():
                inst.close("abort")

        if self._executor.abort(release):
            self._mark_generation_closed()
            self._leave(wait=False)

    def _leave(self, *, wait: bool) -> None:
        """Leave the group in the store; with ``wait``, in the process hosting the store, wait
        (at most the group's timeout) until every member in another process has left."""
        try:
            leave(self._store, self._rank)
        except Exception:  # the store is gone or failing: then nobody waits for this mark
            return
        if not wait or not hosts_store(self._formation.store):
            return
        what = f"group {self._name!r} rank {self._rank}: shutdown, waiting for the members to leave"
        missing = await_leaving(self._store, self._size, self._timeout, what)
        if missing:
            address = store_address(self._formation.store)
            warn_user(
                f"group {self._name!r}: rank {self._rank} hosts the store{f' at {address}' if address else ''}, and "
                f"its shutdown waited {self._timeout:g} s (the group's timeout) for every member to leave the group; "
                f"rank(s) {', '.join(map(str, missing))} did not (no shutdown() or abort() yet, or the process died). "
                "The store ends with this process: if they still use it, they fail with StoreUnavailableError"
            )

    def _mark_generation_closed(self) -> None:
        # Best effort: lets a later formation of this name skip a generation that never filled up.
        with contextlib.suppress(Exception):
            self._store.set("closed", "1")

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.shutdown()
        else:
            self.abort()

    def __del__(self) -> None:
        # A group dropped without shutdown() must not keep sockets and threads alive.
        with contextlib.suppress(Exception):
            if self._executor.state is None:
                self.abort()


def _torch_form(op: str, args: tuple[Any, ...], object_list: Any, obj: Any) -> tuple[Any, Any]:
    """``(object_list, obj)`` of a call in torch's form ``op(object_list, obj)`` (positional or
    keyword), or ``(_MISSING, obj)`` of one in pg-core's ``op(obj)``."""
    given = list(args)
    if object_list is _MISSING and len(given) == 2 - (obj is not _MISSING):
        object_list = given.pop(0)  # torch's order: the list first
    if obj is _MISSING and len(given) == 1:
        obj = given.pop()
    if given or obj is _MISSING:
        raise TypeError(
            f"{op}() takes obj (pg-core's form: it returns the list) or object_list and obj (torch's: it fills "
            f"the list); got {len(args)} positional argument(s)"
            f"{'' if object_list is _MISSING else ' and object_list'}{'' if obj is _MISSING else ' and obj'}"
        )
    return object_list, obj


def _filled(result: Any, fill: Callable[[Any], None], async_op: bool) -> Work | None:
    """Torch's in-place forms: ``fill`` the caller's list with ``result`` (or, for an
    asynchronous call, once its work completes) and return what torch returns."""
    if async_op:
        return mapped(result, fill)
    fill(result)
    return None


def _check_object_list(object_list: object, size: int, op: str) -> None:
    if not isinstance(object_list, list):
        raise TypeError(f"{op}: object_list must be a list, got {type(object_list).__name__}")
    if len(object_list) != size:
        raise ValueError(
            f"{op}: object_list has {len(object_list)} entries, but the group has size {size}: torch's form fills "
            f"one entry per rank ([None] * group.size)"
        )


def _rank_and_size(rank: int | None, size: int | None) -> tuple[int, int]:
    if rank is None or size is None:
        found = environment.rank_and_size(os.environ)
        if found is None:
            raise ValueError(
                "rank and size are required outside a launcher (pgrun, torchrun, srun and mpiexec set them: see "
                "ProcessGroup.from_env)"
            )
        rank = found[0] if rank is None else rank
        size = found[1] if size is None else size
    for value, what in ((rank, "rank"), (size, "size")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be an int, got {value!r}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} is out of range for size={size}")
    return rank, size


def rendezvous(
    store: Store,
    name: str,
    size: int,
    *,
    backends: BackendsArg = None,
    timeout: float | timedelta | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    registry: Registry | None = None,
    check: bool | None = None,
    auth_key: str | bytes | AuthKey | None = None,
    objects: ObjectsArg = None,
) -> ProcessGroup:
    """Form group ``name`` of ``size`` processes that know nothing of each other but the
    store; ranks are given in arrival order. ``check``, ``auth_key`` and ``objects``: as
    :class:`ProcessGroup`'s. Returns once all ``size`` have arrived, so any
    operation (point to point included) may come first.

    The processes need no common parent group: a decode worker started later joins by
    calling this with the name its peers use. A process that arrives after the group is
    full waits for the *next* formation of the name (its next ``size`` arrivals) and, if
    nobody comes, fails at ``timeout`` with :class:`~pg_core.errors.CollectiveTimeout` saying
    so; a rendezvous that times out closes its generation, so the others waiting in it
    fail at once with :class:`~pg_core.errors.PeerFailureError` instead of at their own
    timeouts. Do not mix ``rendezvous`` and ``ProcessGroup(store, rank, size, name=...)``
    on one name.
    """
    check_name(name)
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"size must be an int, got {size!r}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    group = ProcessGroup._of(
        *_form_top_level(
            store,
            name,
            None,
            size,
            backends=backends,
            timeout=timeout,
            options=options,
            registry=registry,
            check=check,
            auth_key=auth_key,
            objects=objects,
        )
    )
    try:
        group.form_backend(group._barrier_device, "rendezvous")  # the message backend, while every member is here
    except BaseException:
        group.abort()
        raise
    return group


def _checker(
    dispatch: Dispatcher, supported: Supported, device: torch.device, *, rank: int, size: int, name: str, check: bool
) -> Checker | None:
    """Check mode's exchange for a group (``None`` when off), over the message backend on
    ``device``, which must declare int64 ``all_reduce`` (SUM) and ``all_gather_into_tensor``
    (checked on first use). Made of the group's parts, not the group: no cycle keeps a dropped
    group alive."""
    if not check:
        return None
    checked: list[bool] = []

    def endpoint() -> Instance:
        if not checked:
            try:
                supported.check("all_reduce", device, torch.int64, ReduceOp.SUM)
                supported.check("all_gather_into_tensor", device, torch.int64, None)
            except NotSupportedError as exc:
                raise NotSupportedError(
                    f"group {name!r}: check mode compares each collective's fingerprint as an int64 all_reduce "
                    f"(and all_gather_into_tensor) over the group's {device.type} backend, which does not declare it "
                    f"({exc}); turn check mode off for this group (check=False)"
                ) from exc
            checked.append(True)
        return dispatch.instance(device, "check")

    return Checker(rank=rank, size=size, name=name, endpoint=endpoint)


def _form_top_level(
    store: Store,
    name: str,
    rank: int | None,
    size: int,
    *,
    backends: BackendsArg,
    timeout: float | timedelta | None,
    options: Mapping[str, Mapping[str, Any]] | None,
    registry: Registry | None,
    check: bool | None,
    auth_key: str | bytes | AuthKey | None,
    objects: ObjectsArg,
) -> tuple[Formation, bool, messages.Loader]:
    """A group formed in the store's root namespace: at ``rank``, or (``None``) in arrival
    order once all ``size`` have arrived, as :func:`rendezvous` does; with its check mode and
    object loader (``check``, ``auth_key`` and ``objects`` default to this process's
    environment). Everything local is settled before this rank takes a place (the backends
    resolved, the variables read): a wrong name fails here, not in the others' wait."""
    checked = check_mode(check, os.environ)
    loader = messages.loader(objects, os.environ)
    key = resolve_key(auth_key, os.environ)
    specs = resolve_backends(backends, registry)
    formation = form(
        authenticated(store, key),
        ROOT_NAMESPACE,
        name,
        rank,
        size,
        name=name,
        specs=specs,
        timeout=seconds(timeout, DEFAULT_TIMEOUT),
        options=options or {},
        registry=registry,
        wait=rank is None,
        check=checked,
    )
    return formation, checked, loader
