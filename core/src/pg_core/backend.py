"""The plugin contract: everything a backend author implements and may call, in one file.

A backend is a class derived from :class:`Backend`, described by a
:class:`BackendSpec` that a plugin distribution returns from its
``pg_core_backends()`` hook (entry-point group ``pg_core.backends``). The core wraps
each instance in an object of its own (helper threads, tag mapping, order, cleanup):
a plugin needs no ``super().__init__`` and no private name of :class:`Backend` is
reserved.

**Instances.** One instance serves one device *type* of one group formation
(``ctx.device`` is the device of the first tensor of that type, ``cuda:1`` say), created
on the first operation on that type. The core hands it tensors of that type on any
device index; a backend bound to one device (a communicator per GPU) raises
``ValueError`` naming both devices for a tensor on another. Construction may talk to
the other members (Gloo's connects them all): the core never assumes it does not.

**What the core guarantees before it calls a backend method**

* Arguments are validated: ranks are in ``range(size)``, list lengths equal the
  group size, shapes and dtypes agree where the operation needs them to, every
  tensor of one call is on the same device.
* The (op, dtype, reduce op) combination is one the backend declared in its
  :class:`Capabilities`; anything else raised :class:`~pg_core.errors.NotSupportedError`
  in the core, and the backend never sees it. The core emulates nothing a backend does
  not declare: ``ReduceOp.AVG`` and ``PREMUL_SUM`` reach an overridden collective only
  if declared for the dtype, and then the override implements them (the inherited
  defaults implement every reduce op :func:`default_reduce_ops` lists).
* Tags are within what the backend declared (``Capabilities.max_tag``, see
  :mod:`pg_core.tags`): the user's, the core's messages' and the core's collectives' tags
  are mapped into ``0 .. max_tag``, each kind apart; a backend without tags
  (``max_tag=None``) always sees tag ``0``.
* Tensors are dense: contiguous, with the strides ``torch.empty`` would give them
  (the core stages any other layout, a strided 1-element view included, and copies results
  back), and detached from autograd. Lists are Python lists. ``timeout`` is a positive
  number of seconds already resolved from the call or the group default.
* Collectives come one at a time per instance, in the order the user called them; that
  every rank calls the same collectives in the same order is the *user's* obligation (the
  core numbers them, and a backend that can see ranks disagree says so).
  ``send``/``recv``/``isend``/``irecv`` and ``send_bytes``/``recv_bytes`` may come from
  any thread, also while a collective runs on another; calls on one (peer, tag) stream
  come in the user's order (the any-source receives of one tag are a stream of their own:
  see *Receiving from any source*).

**What a backend guarantees back**

* Blocking methods return only when the operation is complete *on this rank*:
  for ``send``, the tensor may be reused; for everything else, outputs hold their
  final values.
* A blocking ``send`` (and ``send_bytes``) of at most :attr:`Capabilities.eager_limit_bytes`
  bytes must not wait for the receiver to post its ``recv`` (buffer eagerly, or let a
  progress thread drain incoming data); a larger one may wait for the matching receive, as
  MPI's standard-mode send and torch's Gloo ``send`` do (API 1.10; the default limit,
  ``None``, is no limit: every send is eager, as before). ``isend``/``irecv``, where
  overridden, are truly asynchronous, because the inherited collectives post before they
  wait; an ``isend`` need not copy: the caller leaves the tensor untouched until its
  ``Work`` completes.
* ``send``/``recv`` match on (peer, tag), in order per (peer, tag) (per peer without
  tags). A ``recv`` whose tensor does not match the message's size (or its dtype, where
  the wire carries it) raises :class:`~pg_core.errors.CollectiveMismatchError` naming the
  peer, never a silent truncation; a backend that cannot see the size fails the receive
  at the timeout.
* ``send_bytes`` may be called from several threads at once (one thread per stream at a
  time); each call is one whole message.
* Errors are pg-core's: :class:`~pg_core.errors.CollectiveTimeout` when
  ``timeout`` passes (give ``peers=``, the ranks not heard from; the core fills
  in the collective's ``op`` and ``seq``), :class:`~pg_core.errors.PeerFailureError`
  when a peer is gone (promptly, not at the timeout, where the transport can
  tell; a backend that cannot detect deaths falls back to the timeout),
  :class:`~pg_core.errors.CollectiveMismatchError` when the backend can see that
  ranks disagree, :class:`~pg_core.errors.GroupClosedError` after ``abort``.
* All reduce results are bitwise identical on every rank.
* **Reduction values** are what some order and grouping of the dtype's own elementwise
  operations gives, rounded to the dtype as torch's CPU ops round (pg-core's default
  algorithms fold with them):

  - integers: ``SUM`` and ``PRODUCT`` wrap around in the dtype's width (two's complement),
    as torch's CPU ops on that dtype do; nothing saturates, nothing goes through a float;
  - floats: IEEE arithmetic in the dtype itself (or wider), so ``NaN`` in any operand of
    ``SUM``, ``AVG``, ``PREMUL_SUM`` or ``PRODUCT`` gives ``NaN``; ``inf`` plus ``-inf``
    gives ``NaN``, ``inf`` times ``0`` gives ``NaN``, and otherwise ``±inf`` propagates
    with its sign; a ``SUM`` of zeros is ``-0.0`` exactly when every operand is ``-0.0``
    (start the fold from an operand, not from ``+0.0``), and a zero ``PRODUCT`` has the
    product of the operands' signs. ``MIN``/``MAX`` treat ``±inf`` as ordinary values;
    with a ``NaN`` operand their result is undefined (torch propagates it, MPI and Gloo
    compare), and a tie of ``-0.0`` with ``0.0`` may give either;
  - copies (``broadcast``, the gathers, scatters and all-to-alls, point to point) are
    bit-exact, ``NaN`` payloads and ``-0.0`` included.
* ``shutdown`` releases every thread, socket and process the backend started;
  ``abort`` does so at once and makes operations blocked in other threads raise.
  The core drains pending operations before ``shutdown``, and stops its own helper
  threads whatever the backend's methods do.

``ctx.store`` may be shared with other groups forming on other threads at the
same moment. A ``TCPStore`` client serves one request at a time, and ``store.wait``
(or ``store.get`` of a key that is not set yet) holds it until the key appears,
stalling every other user of that client. Wait for keys with
:func:`pg_core.store.wait_for`, which polls ``check`` and raises
:class:`~pg_core.errors.CollectiveTimeout`; ``get`` only keys that are set.
Once the process hosting the store is gone, every call on ``ctx.store`` raises
:class:`~pg_core.errors.StoreUnavailableError` (the group's store is seen through
:class:`pg_core.store.GuardedStore`, a store defined in Python: torch's ``set``, ``get``,
``add``, ``check``, ``compare_set``, ``wait``, ``delete_key``, ``num_keys``, ``append``,
``multi_get`` and ``multi_set`` reach it; its queue operations, ``list_keys`` and ``clone``
do not). Let it propagate, or wrap it, but do not take it for a dead peer.
``ctx.group_uid`` is unique to the formation across jobs and hosts: name host-wide
resources (shared memory, sockets' paths) with it.

**Launching collectives (API 1.2).** A backend whose library runs collectives on its own
threads or streams (a torch C++ backend: Gloo, NCCL) sets the class attribute
``launches = True``. Its collectives then also take ``async_op``: with ``False`` they behave
as above; with ``True`` they only *launch* the operation and return a
:class:`~pg_core.work.Work` that completes with it (failing with pg-core's errors). The core
launches in the caller's thread, in the group's call order (no progress thread: a CUDA
backend sees the caller's current stream), hands the work to the user, and copies staged
outputs back and latches a failure when it completes. A collective launches only where its
method takes ``async_op``: the core reads each method's signature once, when the instance is
created, so a subclass may override one collective without ``async_op`` (written as a backend
that does not launch writes it) and the core runs that one on the group's progress thread.

**Coalescing (API 1.3).** The operations a user calls inside ``with group.coalescing():``
(collectives, ``isend``/``irecv``, ``batch_isend_irecv``) are issued together when the block
exits. A backend whose library can launch several operations as one (NCCL's group calls)
sets ``coalesces = True`` and implements :meth:`Backend.coalesced`, which receives the whole
batch in one call: a list of :class:`Call`, each naming one of this backend's methods (a
collective other than ``barrier``, ``send`` or ``recv``) with the positional arguments that
method would get on its own, and its ``timeout``. The core guarantees what it guarantees
for each method on its own (validated, capability-checked, dense, tags mapped), and in
addition: at least one call; every tensor on this backend's device type; the calls in the
user's order, collectives and point to point interleaved as called; a batch that holds a
collective comes in the group's collective order, as one entry (it takes as many sequence
numbers as it holds collectives); nothing of a batch was sent if the user's block failed.
The backend returns one :class:`~pg_core.work.Work` that completes when every call has
(failing with pg-core's errors); raising instead fails the whole batch. The core copies
staged outputs back and latches a failure when that work completes. A backend without the
hook gets the batch one call at a time, in the same order, as if the user had made the calls
after the block: still correct, without the saving. Point to point from other threads may
arrive while ``coalesced`` runs, as at any time: a library whose coalescing state belongs to
the object rather than the thread (torch's does) must keep them out of the batch.

**Receiving from any source (API 1.4, optional).** A backend that can take the next message
on a tag from whichever peer sent it implements ``recv_anysource`` (``irecv_anysource`` too,
where it can post a receive without a thread) and names ``"recv_anysource"`` in
``Capabilities.ops``. The default ``Capabilities()`` does not declare it (it is one of
:data:`~pg_core.ops.OPTIONAL_OPS`), so a backend written before 1.4 is never asked for it: the
group's ``recv(tensor, src=None)`` on a backend that does not declare it raises
:class:`~pg_core.errors.NotSupportedError` in the core, before anything is sent.

* The core guarantees what it does for ``recv`` (a dense tensor of a dtype declared for
  ``recv``, a positive ``timeout``), and: ``tag`` is the wire tag ``recv`` gets for the same
  user tag, so any-source receives and receives that name a peer compete for one tag's
  messages; the group has two ranks or more. The any-source receives of one tag are one
  stream, handed over in the user's order: from the caller's thread (blocking calls, and
  ``irecv_anysource`` where the backend overrides it), or else one at a time from the core's
  helper thread of that stream.
* The backend returns the sender's group rank (``irecv_anysource``: a
  :class:`~pg_core.work.Work` whose ``result()`` it is), and matches as MPI does: each
  peer's messages on a tag are taken in the order it sent them, whichever receives take
  them, so a message from peer ``p`` on tag ``t`` is never received (by an any-source
  receive, or by one naming ``p``) before an earlier message from ``p`` on ``t``; a message
  goes to the receive posted first among those pending that accept it (one naming its
  sender, or an any-source receive on its tag); messages of different peers have no order
  among them. A message of the wrong size (or dtype) raises
  :class:`~pg_core.errors.CollectiveMismatchError` naming its sender;
  :class:`~pg_core.errors.CollectiveTimeout` names every peer it waited for
  (``peers=``); :class:`~pg_core.errors.PeerFailureError` comes once no peer that could
  still send is left (every other rank gone), never while one is.

**A prepared all_reduce (API 1.5, optional).** ``prepared_all_reduce(dtype, op, timeout=)``
may return a callable ``run(tensor)`` that does exactly what ``all_reduce(tensor, op,
timeout=timeout)`` does for a blocking call on a tensor of ``dtype``, prepared once (the library's options object
built, the method looked up) so that each call costs the least Python. The core asks once
per (device, dtype, reduce op; never for ``PREMUL_SUM``, whose factor changes from call to
call) with the group's default timeout, after a plain ``all_reduce``
of that kind succeeded, and then calls ``run`` in its place for blocking calls of that kind:
with what it guarantees for ``all_reduce`` (validated, declared, dense, in order). ``None``
(the default) keeps every call on ``all_reduce``. A torch C++ backend gets it from
:class:`~pg_core.c10d.C10dBackend`; it is what keeps pg-gloo's 4-byte all_reduce within a few
percent of the raw ``ProcessGroupGloo`` call.

**A native split (API 1.6, optional).** A backend whose library splits a communicator itself
(``MPI_Comm_split``; NCCL's ``ncclCommSplit`` is the other example) overrides
``split(color, rank, timeout=)``; the core detects the override (``type(b).split is not
Backend.split``), as it detects ``isend``'s. ``ProcessGroup.split`` calls it on the parent
group's message-device backend (which has just carried the split's ``all_gather_object``, so
it exists on every member), on *every* member of the parent, members that join no subgroup
included, as one collective in the group's order (op ``"split"``, one sequence number), after
the colors are agreed, and only when every member's subgroup uses the parent's backend spec
for that device type (the members decide together; otherwise the subgroup forms the usual way,
and so does every ``new_group``). ``color`` is a dense index (the agreed distinct colors
sorted, numbered ``0 .. k-1``), ``None`` for a member that joins none; ``rank`` is the member's
rank in its subgroup (ranked by the user's key, then by parent rank: order by ``rank`` and the
backend's order is the core's), for a ``None`` member its rank in the parent. The backend
returns its library's handle of the new communicator (anything, ``None`` say, for ``color
None``); raising fails the split like any collective. The core then creates the subgroup's
backend of that device type at once, inside ``split()`` (every member of the subgroup is
there), with the handle as :attr:`BackendContext.split_from`: that backend owns it from the
moment its constructor is called (a constructor that raises releases it), and its
``shutdown``/``abort`` release it. A handle no subgroup takes goes back to the backend that
made it, through ``release_split(handle)`` (API 1.7, optional, detected as an override as
``split`` is): a handle returned for ``color None`` (anything but ``None``), and the handle of
a member whose subgroup then failed to form (its store exchange raised) before any backend
took it. A backend that splits natively but does not override ``release_split`` leaks such
handles. A library without a non-blocking split may wait
without ``timeout`` there: every member was just heard from in the ``all_gather_object``.

After a collective fails (timeout, peer failure, mismatch) the core refuses the
group's later collectives, so a backend never has to resynchronise ranks whose
messages may still be in flight; point to point keeps working.

**Launch.** A spec's ``launcher`` (:class:`BackendSpec`) is data the tools that start rank
processes read: with ``"mpiexec"``, the conformance suite starts its ranks through one
``mpiexec -n N`` and asks ``is_available()`` in a process started that way, not in its own.

Only ``send`` and ``recv`` are required: every collective has a default in
:mod:`pg_core.algorithms` written on them (inherited from :class:`Backend`, and
callable through ``super()``), so two methods make a complete, correct backend.
Override what your hardware does better.

Objects, tensors of unknown shape and tensor dicts (:mod:`pg_core.messages`) are the
core's, written on this contract. They need ``send`` and ``recv`` declared on the
group's message device (its cpu backend, else its first); then one ``send_bytes`` per
message where the backend implements ``send_bytes``/``recv_bytes`` (it receives the
message's parts as a list, API 1.1), otherwise at most two ``send`` calls of ``uint8``
tensors, for which ``uint8`` must be declared. Tensors on a device with a backend of its
own follow as that backend's ``send``/``broadcast``.
"""

from __future__ import annotations

import ctypes
import importlib
import mmap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import torch

from . import algorithms, tags
from .dtypes import DTYPES
from .errors import NotSupportedError
from .launchers import LAUNCHERS
from .ops import OPS, OPTIONAL_OPS, RedOpType, ReduceOp
from .work import Work

if TYPE_CHECKING:
    from torch.distributed import Store

    from .auth import AuthKey

__all__ = [
    "API_VERSION",
    "DTYPES",
    "MAX_TAG",
    "Backend",
    "BackendContext",
    "BackendSpec",
    "Call",
    "Capabilities",
    "default_reduce_ops",
    "parse_api_version",
    "tensor_bytes",
]

#: The version of this contract, ``"MAJOR.MINOR"``. A plugin declaring another
#: major version is refused with :class:`~pg_core.errors.PluginVersionError`. Minor versions
#: add, and never take away: 1.1, ``send_bytes`` takes a message's parts as a list; 1.2,
#: collectives that launch (:attr:`Backend.launches`); 1.3, coalescing (:meth:`Backend.coalesced`);
#: 1.4, receiving from any source (``recv_anysource``, an optional op a backend declares by name);
#: 1.5, a prepared all_reduce (:meth:`Backend.prepared_all_reduce`); 1.6, a native split
#: (:meth:`Backend.split`, with :attr:`BackendContext.split_from`); 1.7, releasing a split's handle
#: that no subgroup took (:meth:`Backend.release_split`); 1.8, the job's secret
#: (:attr:`BackendContext.auth_key`) for backends that authenticate their connections; 1.9,
#: :attr:`Capabilities.checks_message_size` (a backend that cannot see a message's size says so); 1.10,
#: :attr:`Capabilities.eager_limit_bytes` (a blocking send above it may wait for its receiver).
API_VERSION: Final[str] = "1.10"

#: The largest tag a backend can declare (``Capabilities.max_tag``): signed 64-bit.
MAX_TAG: Final[int] = 2**63 - 1

_FLOAT_OPS = frozenset(
    {RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX, RedOpType.AVG, RedOpType.PREMUL_SUM}
)
_COMPLEX_OPS = frozenset({RedOpType.SUM, RedOpType.PRODUCT, RedOpType.AVG, RedOpType.PREMUL_SUM})
_INT_OPS = frozenset(
    {RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX, RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR}
)
_BOOL_OPS = frozenset({RedOpType.MIN, RedOpType.MAX, RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR})


def parse_api_version(version: object) -> tuple[int, int] | None:
    """``"MAJOR.MINOR"`` (surrounding spaces allowed) as two ints; ``None`` if it is not that."""
    if not isinstance(version, str):
        return None
    major, dot, minor = version.strip().partition(".")
    if not dot or not (major + minor).isascii() or not major.isdigit() or not minor.isdigit():
        return None
    return int(major), int(minor)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a dense CPU tensor's memory, without a copy: what a
    backend hands to ``socket.sendmsg``/``recv_into`` (the core guarantees dense tensors).

    The view does not keep the tensor alive: whoever holds the view holds the tensor.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def default_reduce_ops(dtype: torch.dtype) -> frozenset[RedOpType]:
    """The reduce ops that make sense for ``dtype``, as the default algorithms implement them.

    Floating point: SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM. Complex: SUM,
    PRODUCT, AVG, PREMUL_SUM (no ordering). Integers: SUM, PRODUCT, MIN, MAX and
    the bitwise ops (no AVG: it would not be an integer). Bool: MIN, MAX and the
    bitwise ops (use BOR for "any", BAND for "all").
    """
    if dtype == torch.bool:
        return _BOOL_OPS
    if dtype.is_complex:
        return _COMPLEX_OPS
    if dtype.is_floating_point:
        return _FLOAT_OPS
    return _INT_OPS


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports on one device type: data that the dispatcher
    enforces and the conformance suite reads.

    ``ops`` defaults to :data:`~pg_core.ops.OPS`, every collective and ``send``/``recv``;
    an optional op (:data:`~pg_core.ops.OPTIONAL_OPS`: ``"recv_anysource"``) is declared only
    by naming it, as ``Capabilities(ops=frozenset(OPS) | {"recv_anysource"})``.

    ``reduce_ops`` maps a dtype to the reduce ops allowed for it; dtypes missing
    from it get :func:`default_reduce_ops`.

    ``max_tag``: the backend carries tags ``0 .. max_tag`` on ``send``/``recv`` (and
    ``send_bytes``/``recv_bytes``); the default is every non-negative signed 64-bit tag.
    Gloo, say, declares ``2**31 - 1``. ``None``: the backend has no tags, and messages
    between two ranks match in the order they were sent (as NCCL's do). The core maps its
    own tags and the user's into what is declared (:mod:`pg_core.tags`); a backend never
    sees a tag outside it.

    ``checks_message_size`` (API 1.9): ``True`` (the default), a ``recv`` (``irecv``, a receive
    from any source) meeting a message of another size raises
    :class:`~pg_core.errors.CollectiveMismatchError` and leaves its tensor as it was. ``False``:
    the transport carries no size (NCCL's), so such a receive fails at its timeout with
    :class:`~pg_core.errors.CollectiveTimeout` instead, its tensor still as it was. Neither may
    return with the tensor truncated, zero-padded or partly written.

    ``eager_limit_bytes`` (API 1.10): a blocking ``send`` or ``send_bytes`` of at most this
    many bytes returns without waiting for its receiver to post the matching receive; a
    larger one may wait until it has (MPI's standard-mode send, torch's Gloo ``send``), so a
    correct program posts its receive first or uses ``isend``/``irecv`` above it. ``None``
    (the default): no limit, every send is eager. The core's own collectives, object and
    message layers never rely on an eager send above it.
    """

    ops: frozenset[str] = frozenset(OPS)
    dtypes: frozenset[torch.dtype] = frozenset(DTYPES)
    reduce_ops: Mapping[torch.dtype, frozenset[RedOpType]] = field(default_factory=dict)
    max_tag: int | None = MAX_TAG
    checks_message_size: bool = True
    eager_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        unknown = set(self.ops) - set(OPS) - set(OPTIONAL_OPS)
        if unknown:
            raise ValueError(
                f"Capabilities name unknown ops {sorted(unknown)}; known ops: {', '.join(OPS + OPTIONAL_OPS)}"
            )
        object.__setattr__(self, "ops", frozenset(self.ops))
        object.__setattr__(self, "dtypes", frozenset(self.dtypes))
        object.__setattr__(self, "reduce_ops", {d: frozenset(r) for d, r in self.reduce_ops.items()})
        if self.max_tag is not None and (
            isinstance(self.max_tag, bool) or not isinstance(self.max_tag, int) or not 3 <= self.max_tag <= MAX_TAG
        ):
            raise ValueError(
                f"Capabilities.max_tag must be None (no tags) or an int in [3, 2**63 - 1], got {self.max_tag!r}"
            )
        limit = self.eager_limit_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"Capabilities.eager_limit_bytes must be None (no limit) or an int >= 0, got {limit!r}")

    def reduce_ops_for(self, dtype: torch.dtype) -> frozenset[RedOpType]:
        """The reduce ops declared for ``dtype`` (empty if the dtype is not declared)."""
        if dtype not in self.dtypes:
            return frozenset()
        return self.reduce_ops.get(dtype, default_reduce_ops(dtype))

    def why_not(
        self, op: str, dtype: torch.dtype | None = None, reduce_op: ReduceOp | RedOpType | None = None
    ) -> str | None:
        """``None`` if the combination is declared, else the reason it is not."""
        if op not in self.ops:
            return f"op {op!r} is not supported"
        if dtype is not None and dtype not in self.dtypes:
            return f"dtype {dtype} is not supported (declared: {', '.join(sorted(map(str, self.dtypes)))})"
        if reduce_op is not None:
            kind = reduce_op.type if isinstance(reduce_op, ReduceOp) else reduce_op
            if dtype is not None and kind not in self.reduce_ops_for(dtype):
                allowed = ", ".join(sorted(t.name for t in self.reduce_ops_for(dtype)))
                return f"reduce op {kind.name} is not supported for {dtype} (supported: {allowed or 'none'})"
        return None

    def supports(
        self, op: str, dtype: torch.dtype | None = None, reduce_op: ReduceOp | RedOpType | None = None
    ) -> bool:
        return self.why_not(op, dtype, reduce_op) is None


Factory = Callable[["BackendContext"], "Backend"]


def _always_available() -> str | None:
    return None


@dataclass(frozen=True)
class BackendSpec:
    """How the registry knows a backend without importing it.

    ``factory`` is a ``Backend`` subclass, any callable taking a
    :class:`BackendContext`, or a ``"module:attr"`` string imported on first use
    (so listing backends never imports CUDA or MPI). ``capabilities`` is one
    :class:`Capabilities` for every device or a mapping from device type to one.
    ``is_available()`` returns ``None`` or the reason the backend cannot run
    here. Higher ``priority`` wins when the user does not name a backend.
    ``distribution`` and ``version`` are filled in by the registry.

    ``launcher`` says how the backend's rank processes must be started: ``None`` (any way
    at all), or one of :data:`pg_core.launchers.LAUNCHERS`: ``"mpiexec"``, the ``N`` ranks
    of a job started together by one ``mpiexec -n N`` command, each reading its rank from
    the launcher's environment. Tools that start ranks (the conformance suite's pools) read
    it and start them that way, and ask ``is_available()`` in a process started that way:
    such a backend is unavailable, and says so, in any other process.
    """

    name: str
    factory: str | Factory
    devices: tuple[str, ...]
    capabilities: Capabilities | Mapping[str, Capabilities] = field(default_factory=Capabilities)
    priority: int = 0
    api_version: str = API_VERSION
    is_available: Callable[[], str | None] = _always_available
    description: str = ""
    distribution: str | None = None
    version: str | None = None
    launcher: str | None = None

    def __post_init__(self) -> None:
        if self.launcher is not None and self.launcher not in LAUNCHERS:
            raise ValueError(
                f"backend {self.name!r}: unknown launcher {self.launcher!r} (known: {', '.join(LAUNCHERS)})"
            )
        if not self.name or not isinstance(self.name, str) or any(c in self.name for c in ",:@ \t"):
            raise ValueError(f"backend name must be a non-empty string without ',:@' or spaces, got {self.name!r}")
        devices = (self.devices,) if isinstance(self.devices, str) else tuple(self.devices)
        if not devices:
            raise ValueError(f"backend {self.name!r} declares no devices")
        object.__setattr__(self, "devices", devices)
        caps = self.capabilities
        if isinstance(caps, Capabilities):
            caps = {d: caps for d in devices}
        missing = [d for d in devices if d not in caps]
        if missing:
            raise ValueError(f"backend {self.name!r} declares no capabilities for devices {missing}")
        object.__setattr__(self, "capabilities", dict(caps))

    def capabilities_for(self, device: str) -> Capabilities:
        caps = self.capabilities
        assert not isinstance(caps, Capabilities)  # normalised in __post_init__
        try:
            return caps[device]
        except KeyError:
            raise NotSupportedError(
                f"backend {self.name!r} does not support device {device!r} (it declares {', '.join(self.devices)})"
            ) from None

    def load_factory(self) -> Factory:
        """The factory, importing a ``"module:attr"`` string now."""
        if not isinstance(self.factory, str):
            return self.factory
        module_name, _, attr = self.factory.partition(":")
        if not attr:
            raise ValueError(f"backend {self.name!r}: factory {self.factory!r} is not 'module:attr'")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj  # type: ignore[no-any-return]

    def why_unavailable(self) -> str | None:
        """``is_available()``, with an exception turned into its reason."""
        try:
            return self.is_available()
        except Exception as exc:  # a plugin's probe must not take the caller down
            return f"is_available() raised {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class BackendContext:
    """Everything a backend instance gets from the core.

    ``store`` is already prefixed for this group formation, device and backend:
    keys a backend writes never collide with another group's or backend's.
    ``rank``/``size`` are group ranks. ``device`` is the first tensor's device.
    ``timeout`` is the group's default per-operation timeout in seconds.
    ``group_uid`` is unique per formation of the group (a re-formed group with the
    same name gets a new one). ``options`` are the user's ``options=`` for this
    backend. ``split_from`` (API 1.6) is ``None`` but for the backend of a subgroup that
    ``ProcessGroup.split`` formed through the parent's :meth:`Backend.split`: then it is
    the handle that hook returned on this member (an ``mpi4py`` communicator, say), of
    ``size`` members with this one at ``rank``, for the backend to take over (no store
    exchange needed) and to release in its ``shutdown``/``abort``.

    ``auth_key`` (API 1.8) is ``None``, or the job's secret (:class:`~pg_core.auth.AuthKey`)
    in an authenticated job. Then ``store`` already writes and verifies a MAC with every
    value, and a backend that opens connections of its own must admit only peers that prove
    they hold the key (``auth_key.mac(...)``, ``auth_key.verify(...)``: pg-tcp's handshake
    is the model) and read nothing else from a connection first. A backend that cannot
    should say so in its documentation: its connections are then as open as without a key.
    """

    store: Store
    rank: int
    size: int
    device: torch.device
    timeout: float
    group_name: str
    group_uid: str
    backend_name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    split_from: Any = None
    auth_key: AuthKey | None = None

    @property
    def store_timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout)

    def byte_option(self, name: str, default: int, *, minimum: int = 1) -> int:
        """(API 1.8) The backend option ``name`` (a budget or limit in bytes; ``default`` where not
        given), checked: an int of at least ``minimum``, else ``ValueError`` naming the backend, the
        group, the option and its value, before anything is sent."""
        value = self.options.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(
                f"backend {self.backend_name!r} of group {self.group_name!r}: option {name}={value!r} is not a "
                f"number of bytes: pass an int >= {minimum} (the default is {default}), the same on every rank"
            )
        return value


@dataclass(frozen=True, slots=True)
class Call:
    """One operation of a coalesced batch (:meth:`Backend.coalesced`, API 1.3): the backend
    method ``op`` (a collective's name, ``"send"`` or ``"recv"``) with the positional ``args``
    the core would pass it on its own (``send``/``recv``: ``(tensor, peer, tag)``, the tag
    already mapped) and the ``timeout`` (seconds) it would get. ``getattr(backend,
    call.op)(*call.args, timeout=call.timeout)`` is that call."""

    op: str
    args: tuple[Any, ...]
    timeout: float


class Backend:
    """Base class of every backend. See the module docstring for the contract.

    Subclasses implement ``send`` and ``recv`` (required) and may override any
    collective, ``isend``/``irecv``, ``send_bytes``/``recv_bytes``,
    ``recv_anysource``/``irecv_anysource`` (declared as ``"recv_anysource"``),
    ``prepared_all_reduce``, ``split`` and ``release_split`` (a native split), ``shutdown``
    and ``abort``. Every method receives ``timeout`` in seconds.

    The constructor takes the :class:`BackendContext`. Calling ``super().__init__(ctx)``
    is optional: the core sets ``ctx``, ``rank`` and ``size`` on an instance that has
    none of its own after construction, and reserves no other attribute.
    """

    ctx: BackendContext
    rank: int
    size: int
    #: collectives take ``async_op`` and, with ``True``, launch and return a Work (API 1.2; see the module docstring)
    launches: bool = False
    #: :meth:`coalesced` launches a batch as one (API 1.3; see the module docstring)
    coalesces: bool = False

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.rank = ctx.rank
        self.size = ctx.size

    # -- required --------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        """Send ``tensor`` to group rank ``dst``; return once ``tensor`` may be reused."""
        raise NotImplementedError(f"{type(self).__name__} must implement send()")

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        """Receive the next message from ``src`` with ``tag`` into ``tensor``."""
        raise NotImplementedError(f"{type(self).__name__} must implement recv()")

    # -- optional: asynchronous point to point ---------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Work:
        """Start a send and return its :class:`~pg_core.work.Work`. Optional.

        Not overridden, the core runs ``send`` on a helper thread of its own per
        (peer, tag) for the group's ``isend``, and the default collectives send at once,
        which needs a ``send`` that never waits for its receiver: a backend declaring
        ``eager_limit_bytes`` whose declared collectives include a default one must override
        it (the core refuses it otherwise, with :class:`~pg_core.errors.PluginError`). This
        body, for an override's ``super().isend``, sends at once too and returns a completed
        work.
        """
        self.send(tensor, dst, tag, timeout=timeout)
        return Work.completed("isend")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> Work:
        """Start a receive and return its :class:`~pg_core.work.Work`. Optional.

        Not overridden, the core runs ``recv`` on a helper thread of its own per
        (peer, tag) for the group's ``irecv`` (a pending receive from one peer or tag
        never holds up another), and the default collectives receive when they wait.
        This body, for an override's ``super().irecv``, returns a work that receives
        when it is waited for.
        """

        def receive(work: Work, budget: float) -> None:
            if budget <= 0:  # is_completed(): never block
                return
            try:
                self.recv(tensor, src, tag, timeout=timeout)
            except BaseException as exc:
                work.set_exception(exc)
            else:
                work.set_result(None)

        return Work("irecv", driver=receive)

    # -- optional: receiving from any source (API 1.4) -------------------------
    def recv_anysource(self, tensor: torch.Tensor, tag: int, *, timeout: float) -> int:
        """Receive the next message with ``tag`` from whichever peer sent it into ``tensor``,
        and return that peer's group rank. Optional: called only where ``"recv_anysource"``
        is declared (see *Receiving from any source* in the module docstring)."""
        raise NotSupportedError(f"{type(self).__name__} does not receive from any source")

    def irecv_anysource(self, tensor: torch.Tensor, tag: int, *, timeout: float) -> Work:
        """Start an any-source receive and return its :class:`~pg_core.work.Work`, whose
        ``result()`` is the sender's group rank. Optional.

        Not overridden, the core runs ``recv_anysource`` on a helper thread of its own per tag
        for the group's ``irecv(tensor, src=None)``. This body, for an override's
        ``super().irecv_anysource``, returns a work that receives when it is waited for.
        """

        def receive(work: Work, budget: float) -> None:
            if budget <= 0:  # is_completed(): never block
                return
            try:
                source = self.recv_anysource(tensor, tag, timeout=timeout)
            except BaseException as exc:
                work.set_exception(exc)
            else:
                work.set_result(source)

        return Work("irecv", driver=receive)

    # -- optional: variable-size messages --------------------------------------
    def send_bytes(
        self,
        data: bytes | bytearray | memoryview | mmap.mmap | Sequence[bytes | bytearray | memoryview | mmap.mmap],
        dst: int,
        tag: int,
        *,
        timeout: float,
    ) -> None:
        """Send one message whose size the receiver does not know. Optional.

        ``data`` is a list of buffers that form the message back to back (API 1.1: the
        core hands over a message's parts, views of the user's tensors among them, without
        joining them; a backend that can write them with one gather call copies nothing).
        A backend whose spec declares ``api_version`` ``"1.0"`` receives one ``bytes``
        object instead. Like ``send``, it must not wait for the receiver. It may be called
        from several threads at once (for different (peer, tag) streams, and for one
        stream from one thread at a time): each call is one whole message.
        """
        raise NotSupportedError(f"{type(self).__name__} does not carry variable-size messages")

    def recv_bytes(self, src: int, tag: int, *, timeout: float) -> bytearray | mmap.mmap:
        """Receive the next message sent with ``send_bytes`` from ``src`` with ``tag``, as a
        writable buffer of exactly its size that the caller then owns: a ``bytearray``, or
        for large messages an anonymous ``mmap`` (the core builds tensors as views into it).
        Optional."""
        raise NotSupportedError(f"{type(self).__name__} does not carry variable-size messages")

    # -- optional: coalescing (API 1.3) ----------------------------------------
    def coalesced(self, calls: Sequence[Call]) -> Work:
        """Launch ``calls`` as one operation and return one :class:`~pg_core.work.Work` that
        completes when all of them have. Called only where ``coalesces`` is ``True``; see
        "Coalescing" in the module docstring for what the core guarantees."""
        raise NotSupportedError(f"{type(self).__name__} does not coalesce (it sets no coalesces = True)")

    # -- optional: a prepared all_reduce (API 1.5) -----------------------------
    def prepared_all_reduce(
        self, dtype: torch.dtype, op: ReduceOp, *, timeout: float
    ) -> Callable[[torch.Tensor], None] | None:
        """A callable doing what ``all_reduce(tensor, op, timeout=timeout)`` does for a
        blocking call on a tensor of ``dtype``, or ``None`` (the default: the core calls :meth:`all_reduce`). See
        "A prepared all_reduce" in the module docstring."""
        return None

    # -- optional: a native split (API 1.6) ------------------------------------
    def split(self, color: int | None, rank: int, *, timeout: float) -> Any:
        """Split this backend's communicator, collectively over every member of the group:
        ``color`` is the dense index of this member's subgroup (``None``: it joins none) and
        ``rank`` its rank there. Return the library's handle of the new communicator (for
        ``color=None``, anything). Optional: the core calls it only where a subclass
        overrides it; see "A native split" in the module docstring."""
        raise NotImplementedError(
            f"{type(self).__name__} does not split natively (it does not override Backend.split); "
            "the core forms its subgroups through the store"
        )

    def release_split(self, handle: Any) -> None:
        """Release ``handle``, which :meth:`split` returned on this member and no subgroup's
        backend took (``color`` was ``None``, or the subgroup failed to form before its backend
        was created). Optional (API 1.7): the core calls it only where a subclass overrides it
        (``handle`` is never ``None``); see "A native split" in the module docstring."""
        raise NotImplementedError(
            f"{type(self).__name__} does not release split handles (it does not override Backend.release_split)"
        )

    # -- collectives: defaults from pg_core.algorithms --------------------------
    # (they return None: done; a backend with ``launches = True`` returns a Work for async_op=True)
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> Work | None:
        algorithms.all_reduce(_channel(self, timeout), tensor, op)
        return None

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float) -> Work | None:
        algorithms.broadcast(_channel(self, timeout), tensor, src)
        return None

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, timeout: float) -> Work | None:
        algorithms.reduce(_channel(self, timeout), tensor, dst, op)
        return None

    def all_gather(self, output_list: list[torch.Tensor], tensor: torch.Tensor, *, timeout: float) -> Work | None:
        algorithms.all_gather(_channel(self, timeout), output_list, tensor)
        return None

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, timeout: float) -> Work | None:
        algorithms.all_gather_into_tensor(_channel(self, timeout), output, input)
        return None

    def reduce_scatter(
        self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp, *, timeout: float
    ) -> Work | None:
        algorithms.reduce_scatter(_channel(self, timeout), output, input_list, op)
        return None

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, timeout: float
    ) -> Work | None:
        algorithms.reduce_scatter_tensor(_channel(self, timeout), output, input, op)
        return None

    def all_to_all(
        self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], *, timeout: float
    ) -> Work | None:
        algorithms.all_to_all(_channel(self, timeout), output_list, input_list)
        return None

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        *,
        timeout: float,
    ) -> Work | None:
        """``*_split_sizes`` are always explicit lists of dim-0 sizes (the core fills them in)."""
        algorithms.all_to_all_single(_channel(self, timeout), output, input, output_split_sizes, input_split_sizes)
        return None

    def gather(
        self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int, *, timeout: float
    ) -> Work | None:
        """``gather_list`` is a list on ``dst`` and ``None`` elsewhere."""
        algorithms.gather(_channel(self, timeout), tensor, gather_list, dst)
        return None

    def scatter(
        self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int, *, timeout: float
    ) -> Work | None:
        """``scatter_list`` is a list on ``src`` and ``None`` elsewhere."""
        algorithms.scatter(_channel(self, timeout), tensor, scatter_list, src)
        return None

    def barrier(self, *, timeout: float) -> Work | None:
        algorithms.barrier(_channel(self, timeout))
        return None

    # -- life --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release everything this backend holds. Optional: the core drained pending work first."""

    def abort(self) -> None:
        """Release everything now; operations blocked in other threads must raise. Optional."""


def _channel(backend: Backend, timeout: float) -> algorithms.P2PChannel:
    """The channel the inherited collectives run on: the backend's point to point with the
    core's collective tag (:data:`pg_core.tags.COLLECTIVE`), its own ``isend``/``irecv``
    where it overrides them."""
    cls = type(backend)
    return algorithms.P2PChannel(
        backend,
        backend.rank,
        backend.size,
        timeout,
        tags.COLLECTIVE,
        native_isend=cls.isend is not Backend.isend,
        native_irecv=cls.irecv is not Backend.irecv,
    )
