"""The conformance controller: runs examples on persistent rank pools and judges them.

A :class:`Conformance` holds one :class:`~pg_core.testing.pool.RankPool` per world
size (started on first use, respawned after a hang or a death), sends each
example to the ranks, computes the expected result of every call itself
(:func:`~pg_core.testing.reference.expected`), and raises :class:`ConformanceFailure`
naming the *check* that failed. Hypothesis runs here, in the controller
(:meth:`Conformance.check`); the ranks only execute.

Checks, by the name a failure carries:

``declared-must-pass``
    a declared call raised, or a lane's group could not be formed.
``reference``
    an output differs from the controller's reference (exact, or beyond the
    tolerance of :func:`~pg_core.testing.reference.tolerance_note`), or a byte
    outside the output view (a strided buffer's gaps) changed; for values
    (objects, tensors of unknown shape, tensor dicts), a received value is not
    structurally equal to the one sent (see :mod:`~pg_core.testing.values`); for
    receives from any source, a receive names a sender that had nothing more to
    send on its tag, or holds another message than that sender's next one.
``ranks-agree``
    ``all_reduce`` results are not bitwise identical on every rank.
``inputs-unchanged``
    an input buffer was modified (or a value, once sent).
``early-completion``
    an async ``Work`` was complete before a rank it depends on had called.
``membership``
    a subgroup from ``split`` or ``new_group`` has the wrong rank, size or
    ``parent_ranks`` on some member (or ``split`` with color ``None`` returned a group).
``supports``
    ``ProcessGroup.supports`` disagrees with the declared capabilities.
``undeclared-must-raise``
    an undeclared combination did not raise ``NotSupportedError`` locally.
``bad-input``
    bad input was not rejected with ``ValueError``/``TypeError`` locally.
``timeout``
    an operation that cannot finish did not raise ``CollectiveTimeout`` naming it.
``receive-mismatch``
    a receive meeting a message of another size (or dtype) did not raise
    ``CollectiveMismatchError`` (``CollectiveTimeout`` where the backend declares it cannot
    see sizes), returned with its buffer truncated or padded, or left the stream out of step
    (:mod:`~pg_core.testing.receives`).
``byte-messages``
    a byte message arrived with another length or other bytes than were sent.
``eager-limit``
    a blocking send of at most the declared ``eager_limit_bytes`` (any size, where none is
    declared) waited for its receiver to post the receive (:mod:`~pg_core.testing.eager`).
``dead-peer``
    a peer's death gave neither ``PeerFailureError`` nor ``CollectiveTimeout``.
``liveness``
    an operation blocked on another thread did not raise ``GroupClosedError`` soon
    after ``abort()``, or ``abort()`` did not return (see :mod:`~pg_core.testing.liveness`).
``deadline``
    the example did not finish in time (the failure carries every rank's stacks).
``rank-died`` / ``leak`` / ``rank-error``
    a rank process died, left threads, sockets, child processes or shared memory
    behind after ``shutdown()`` (or after ``abort()``, see ``liveness``), or failed
    outside any call.
"""

from __future__ import annotations

import collections
import math
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backend import Backend, BackendSpec, Capabilities
from ..backend_refs import absolute_backend_ref, resolve_backend_ref
from ..dtypes import dtype_name
from ..ops import COLLECTIVE_OPS, RedOpType
from .buffers import collective_input, input_bases, message_value, prepare
from .cases import VALUE_OPS, Call, Example, dtype_of
from .pool import RankPool, RanksFailed
from .rank import run_dead_peer, run_example, run_warm_up
from .reference import Expected, collective_result, expected, fill
from .values import difference, observe

__all__ = ["PROFILES", "TESTS", "Conformance", "ConformanceFailure", "Profile"]

#: Every conformance test, in the order the suite runs them.
TESTS: tuple[str, ...] = (
    "supports",
    "coverage",
    *COLLECTIVE_OPS,
    "p2p",
    "any_source",
    "receives",
    "eager_limit",
    "objects",
    "unknown_shape",
    "subgroups",
    "sequences",
    "coalescing",
    "concurrent_groups",
    "undeclared",
    "bad_input",
    "timeouts",
    "dead_peer",
    "liveness",
)


@dataclass(frozen=True)
class Profile:
    """How hard the suite tries. ``max_examples`` is per test; ``derandomize``
    makes a run repeat exactly (what CI wants); ``op_timeout`` bounds each call
    and ``deadline`` each example (plus ``op_timeout`` per call)."""

    name: str
    max_examples: int
    derandomize: bool
    op_timeout: float = 10.0
    deadline: float = 30.0
    max_hangs: int = 2
    per_test: dict[str, float] = field(default_factory=dict)  # multipliers of max_examples


PROFILES: dict[str, Profile] = {
    "ci": Profile(
        "ci",
        max_examples=16,
        derandomize=True,
        per_test={
            "sequences": 2.0,
            "concurrent_groups": 1.0,
            "p2p": 1.5,
            "timeouts": 0.5,
            "undeclared": 0.75,
            "bad_input": 1.5,
        },
    ),
    "thorough": Profile("thorough", max_examples=200, derandomize=False, per_test={"sequences": 2.0, "timeouts": 0.25}),
}


class ConformanceFailure(AssertionError):
    """A backend broke the contract. ``check`` names the check (see the module
    docstring); the message carries the example and a one-line reproduction."""

    def __init__(self, check: str, detail: str, example: Example | None = None, replay: str | None = None) -> None:
        self.check, self.detail, self.example, self.replay = check, detail, example, replay
        text = f"[{check}] {detail}"
        if example is not None:
            text += f"\n\nexample:\n{example.describe()}"
        if replay:
            text += f"\n\nreplay exactly this example:\n  {replay}"
        super().__init__(text)


class Conformance:
    """The suite against one backend.

    ``backend`` is a reference as :func:`~pg_core.backend_refs.resolve_backend_ref` reads it
    (``factories=False``): a registered name (``"name@distribution"`` pins one),
    ``"package.module:ATTR"`` or ``"path/to/file.py:ATTR"`` naming a
    :class:`~pg_core.backend.BackendSpec`; a relative file path is relative to the
    current directory when the suite is made. The controller and every rank resolve
    it with that one function (the ranks get :attr:`rank_ref`, whose file path is
    absolute). ``pools`` lets a caller share rank pools (a callable from world size to
    :class:`RankPool`); by default the suite owns its pools and :meth:`close` stops them.
    """

    def __init__(
        self,
        backend: str,
        *,
        world_sizes: Sequence[int] = (1, 2, 3, 4),
        profile: str | Profile = "ci",
        max_examples: int | None = None,
        devices: Sequence[str] | None = None,
        pools: Callable[[int], RankPool] | None = None,
        shrink: bool = True,
    ) -> None:
        self.backend_ref = backend
        self.profile = PROFILES[profile] if isinstance(profile, str) else profile
        self.max_examples = max_examples
        self.shrink = shrink
        self.world_sizes = tuple(sorted(set(world_sizes)))
        if not self.world_sizes or min(self.world_sizes) < 1:
            raise ValueError(f"world sizes must be >= 1, got {list(world_sizes)}")
        self.spec = resolve_backend_ref(backend, factories=False, here=False)
        #: ``backend`` as the ranks resolve it, whatever their working directory.
        self.rank_ref = absolute_backend_ref(backend)
        usable, self.skipped_devices = _usable_devices(self.spec, devices)
        if not usable:
            reasons = "; ".join(f"{d}: {why}" for d, why in self.skipped_devices.items())
            raise RuntimeError(f"backend {self.spec.name!r} has no device usable here ({reasons})")
        self.devices = tuple(usable)
        self.caps: dict[str, Capabilities] = {d: self.spec.capabilities_for(d) for d in self.devices}
        self.carries_bytes = _carries_bytes(self.spec)
        self._own_pools: dict[int, RankPool] = {}
        self._pools = pools
        self._hangs: dict[str, list[ConformanceFailure]] = {}
        #: test -> number of examples run; test -> op -> calls run; test -> world size -> examples
        self.examples: collections.Counter[str] = collections.Counter()
        self.calls: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.sizes: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.notes: dict[str, str] = {}
        #: test -> what its passed examples exercised (:class:`~pg_core.testing.coverage.Exercised`)
        self.exercised: dict[str, Any] = {}
        #: op -> (device, dtype, reduce op) -> the (world size, async) pairs it passed with values
        self.covered: dict[str, dict[tuple[str, str, str | None], set[tuple[int, bool]]]] = collections.defaultdict(
            lambda: collections.defaultdict(set)
        )

    # -- pools ---------------------------------------------------------------------
    def pool(self, world_size: int) -> RankPool:
        if self._pools is not None:
            return self._pools(world_size)
        if world_size not in self._own_pools:
            accelerators = [d for d in self.devices if d != "cpu"]
            # what a library starts once per process (a device's context; MPI_Init's shared memory
            # and sockets, for a launched backend) is started before the first call's leak check
            warm = list(self.devices) if self.spec.launcher is not None else accelerators
            self._own_pools[world_size] = RankPool(
                world_size,
                op_timeout=self.profile.op_timeout,
                devices=accelerators,
                prelude=(run_warm_up, (self.rank_ref, warm, self.profile.op_timeout)) if warm else None,
                launcher=self.spec.launcher,
            )
        return self._own_pools[world_size]

    def close(self) -> None:
        for pool in self._own_pools.values():
            pool.close()
        self._own_pools.clear()

    def __enter__(self) -> Conformance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reproduction --------------------------------------------------------------
    def replay_command(self, test: str, example: Example) -> str:
        return f"pg-core conformance {shlex.quote(self.backend_ref)} --replay {test} {shlex.quote(example.to_json())}"

    def fail(self, test: str, check: str, detail: str, example: Example) -> ConformanceFailure:
        return ConformanceFailure(check, detail, example, self.replay_command(test, example))

    # -- running -------------------------------------------------------------------
    def target(self) -> Any:
        from .strategies import Target

        return Target(self.world_sizes, self.devices, self.caps, carries_bytes=self.carries_bytes)

    def check(self, test: str) -> None:
        """Run conformance test ``test`` (one of :data:`TESTS`) with Hypothesis; raise on the first failure."""
        if test == "supports":
            self.check_supports()
            return
        if test == "dead_peer":
            self.check_dead_peer()
            return
        if test == "coverage":
            self.check_coverage()
            return
        if test == "liveness":
            from .liveness import check_liveness

            check_liveness(self)
            return
        if test == "receives":
            from .receives import check_receives

            check_receives(self)
            return
        if test == "eager_limit":
            from .eager import check_eager_limit

            check_eager_limit(self)
            return
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis.errors import FlakyFailure

        from .strategies import examples_for

        target = self.target()
        why = self.not_applicable(test, target)
        if why is not None:
            raise NotApplicable(why)
        count = self.max_examples or max(1, round(self.profile.max_examples * self.profile.per_test.get(test, 1.0)))
        phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
        if self.shrink:
            phases.append(Phase.shrink)
        config = settings(
            max_examples=count,
            derandomize=self.profile.derandomize,
            database=None if self.profile.derandomize else settings().database,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            phases=phases,
            print_blob=False,
            report_multiple_bugs=False,
            verbosity=Verbosity.quiet,
        )

        @config
        @given(examples_for(test, target))
        def conformance(example: Example) -> None:
            self.execute(test, example)

        try:
            conformance()
        except FlakyFailure as exc:  # it failed once, then passed when Hypothesis ran it again
            first = next((e for e in exc.exceptions if isinstance(e, ConformanceFailure)), None)
            if first is None:
                raise
            raise ConformanceFailure(
                first.check,
                f"{first.detail}\n(intermittent: the same example passed when run again; a race in the backend, "
                "or a machine too loaded for the profile's timeouts)",
                first.example,
                first.replay,
            ) from None

    def not_applicable(self, test: str, target: Any) -> str | None:
        """Why ``test`` has nothing to draw for this backend, or ``None``."""
        multi = any(n >= 2 for n in self.world_sizes)
        p2p = any(target.p2p_dtypes(d) for d in self.devices)
        ops = any(target.ops(d) for d in self.devices)
        if test in COLLECTIVE_OPS:
            if not any(target.declared(test, d) for d in self.devices):
                return f"{test} is not declared (the undeclared test proves it raises NotSupportedError)"
        elif test == "p2p":
            if not p2p:
                return "send/recv are not declared"
            if not multi:
                return "point to point needs a world size >= 2"
        elif test == "any_source":
            if not any(target.any_source(d) for d in self.devices):
                return "recv_anysource is not declared (the undeclared and coverage tests prove it raises NotSupportedError)"
            if not multi:
                return "a receive from any source needs a world size >= 2"
        elif test in ("objects", "unknown_shape"):
            if not any(target.messages(d) for d in self.devices):
                return (
                    "values travel as messages, which need send/recv declared, and uint8 declared for them "
                    "where the backend has no send_bytes/recv_bytes"
                )
        elif test == "subgroups":
            if not ops and not p2p and not any(target.messages(d) for d in self.devices):
                return "nothing is declared that a subgroup could run"
        elif test == "coalescing":
            if not any(op != "barrier" for d in self.devices for op in target.ops(d)) and not (p2p and multi):
                return "no collective but barrier is declared, and no point to point can run"
        elif test in ("sequences", "concurrent_groups"):
            if not ops and not (p2p and multi):
                return "no collective is declared, and no point to point can run"
            if test == "concurrent_groups" and not multi:
                return "concurrent groups need a world size >= 2"
        elif test == "timeouts":
            if not multi:
                return "a timeout needs a world size >= 2"
            if not p2p and not any(target.declared(op, d) for op in _TIMEOUT_OPS for d in self.devices):
                return f"none of {', '.join(_TIMEOUT_OPS)}, send/recv is declared"
        return None

    def execute(self, test: str, example: Example) -> None:
        """Run one example on the ranks and judge it; raise :class:`ConformanceFailure`."""
        self.examples[test] += 1
        self.sizes[test][example.world_size] += 1
        for lane in example.lanes:
            for call in lane.calls:
                for op in _counted(call):
                    self.calls[test][op] += 1
        hangs = self._hangs.get(test, [])
        if len(hangs) >= self.profile.max_hangs:
            last = hangs[-1]  # reported as it was: the example that hung, and its replay line
            raise ConformanceFailure(
                "deadline",
                f"{len(hangs)} examples of this test hung, so it stopped running examples (each costs the full "
                f"deadline); the last one that hung:\n{last.detail}",
                last.example,
                last.replay,
            )
        calls = sum(len(lane.calls) for lane in example.lanes)
        deadline = self.profile.deadline + self.profile.op_timeout * calls
        start = time.monotonic()
        try:
            results = self.pool(example.world_size).run(
                run_example, self.rank_ref, example.to_json(), self.profile.op_timeout, timeout=deadline
            )
        except RanksFailed as exc:
            failure = self._ranks_failed(test, exc, example)
            if failure.check == "deadline":
                self._hangs.setdefault(test, []).append(failure)
            raise failure from None
        finally:
            self.seconds[test] += time.monotonic() - start
        self.judge(test, example, results)
        from .coverage import note_exercised

        note_exercised(self.exercised, test, example)
        for lane in example.lanes:
            for call in lane.calls:
                for op, combo in _combos(call, example.device):
                    self.covered[op][combo].add((len(lane.members), call.async_op))

    def _ranks_failed(self, test: str, exc: RanksFailed, example: Example) -> ConformanceFailure:
        outcomes = exc.outcomes
        if any("did not finish" in o for o in outcomes.values()):
            check = "deadline"
        elif any(o.startswith("died") for o in outcomes.values()):
            check = "rank-died"
        elif any("leaked" in o for o in outcomes.values()):
            check = "leak"
        else:
            check = "rank-error"
        return self.fail(test, check, str(exc), example)

    # -- judging -------------------------------------------------------------------
    def judge(self, test: str, example: Example, results: list[Any]) -> None:
        for li, lane in enumerate(example.lanes):
            per_rank: list[list[dict[str, Any]]] = []
            for i, member in enumerate(lane.members):
                got = results[member]["lanes"].get(li)
                if got is None:  # the forming call passed its checks there, so this is not expected
                    raise self.fail(
                        test,
                        "declared-must-pass",
                        f"lane {li}: rank {i} (process {member}) never ran this subgroup's calls",
                        example,
                    )
                if isinstance(got, dict):  # the lane's group failed outside any call
                    raise self.fail(
                        test,
                        "declared-must-pass",
                        f"lane {li}: rank {i} (process {member}) failed to form, run or shut down its group: "
                        f"{got['type']}: {got['message']}",
                        example,
                    )
                per_rank.append(got)
            for ci in range(len(lane.calls)):
                records = [recs[ci] if ci < len(recs) else None for recs in per_rank]
                self._judge_call(test, example, (li, ci), records)

    def _judge_call(self, test: str, ex: Example, at: tuple[int, int], records: list[dict[str, Any] | None]) -> None:
        """Judge call ``at = (lane, call index)`` of ``ex`` from every lane rank's record."""
        li, ci = at
        call = ex.lanes[li].calls[ci]
        n = len(ex.lanes[li].members)
        where = f"lane {li} call [{ci}] {call.op}" if len(ex.lanes) > 1 else f"call [{ci}] {call.op}"
        p = call.params
        if call.op in ("undeclared", "bad_input", "timeout"):
            rec = records[p["caller"]]
            err = rec["error"] if rec is not None else None
            if call.op == "undeclared":
                said = {r for r, rec_ in enumerate(records) if rec_ is not None and rec_["supports"]}
                if said:
                    raise self.fail(
                        test, "supports", f"{where}: supports() says yes on ranks {sorted(said)} for {_probe(call)}", ex
                    )
                if err is None or "NotSupportedError" not in err["mro"]:
                    raise self.fail(
                        test,
                        "undeclared-must-raise",
                        f"{where}: {_probe(call)} is not declared, so it must raise NotSupportedError on the calling "
                        f"rank {p['caller']} before sending anything; {_said(err)}",
                        ex,
                    )
            elif call.op == "bad_input":
                from .rank import BAD_INPUTS

                if err is None or not ({"ValueError", "TypeError"} & set(err["mro"])) or "AssertionError" in err["mro"]:
                    raise self.fail(
                        test,
                        "bad-input",
                        f"{where}: {BAD_INPUTS[p['kind']]} on rank {p['caller']} must raise ValueError or TypeError "
                        f"locally; {_said(err)}",
                        ex,
                    )
            else:
                if err is None or "CollectiveTimeout" not in err["mro"]:
                    raise self.fail(
                        test,
                        "timeout",
                        f"{where}: rank {p['caller']} called {p['target']} with timeout={p['seconds']} s and no "
                        f"rank joined it, so it must raise CollectiveTimeout; {_said(err)}",
                        ex,
                    )
                took, asked = rec.get("seconds") if rec is not None else None, float(p["seconds"])
                if took is not None and not (TIMEOUT_EARLY * asked <= took <= asked + TIMEOUT_LATE_S):
                    raise self.fail(
                        test,
                        "timeout",
                        f"{where}: rank {p['caller']} called {p['target']} with timeout={asked} s and its "
                        f"CollectiveTimeout came after {took:.2f} s; it must come between {TIMEOUT_EARLY * asked:.2f} s "
                        f"and {asked + TIMEOUT_LATE_S:.2f} s (the requested time, less {1 - TIMEOUT_EARLY:.0%}, "
                        f"plus {TIMEOUT_LATE_S:g} s for a loaded machine)",
                        ex,
                    )
                if p["target"] not in ("recv", "recv_anysource", "recv_object") and err.get("op") != p["target"]:
                    raise self.fail(
                        test,
                        "timeout",
                        f"{where}: the CollectiveTimeout names op {err.get('op')!r}, not {p['target']!r}",
                        ex,
                    )
            return
        errors = {r: rec["error"] for r, rec in enumerate(records) if rec is not None and rec["error"] is not None}
        missing = [r for r, rec in enumerate(records) if rec is None]
        if errors or missing:
            lines = [f"rank {r}: {e['type']}: {e['message']}" for r, e in sorted(errors.items())]
            if missing:
                lines.append(f"ranks {missing} stopped before this call (an earlier call failed there)")
            raise self.fail(
                test,
                "declared-must-pass",
                f"{where} ({call.describe()}) is declared but failed:\n  " + "\n  ".join(lines),
                ex,
            )
        recs = [rec for rec in records if rec is not None]
        no = [r for r, rec in enumerate(recs) if rec["supports"] is False]
        if no:
            raise self.fail(test, "supports", f"{where}: supports() says no on ranks {no} for a declared call", ex)
        early = [r for r, rec in enumerate(recs) if rec["early"]]
        if early:
            raise self.fail(
                test,
                "early-completion",
                f"{where}: with async_op=True, the Work of ranks {early} was complete before rank {call.late} "
                "(whose data or arrival they need) had called the operation",
                ex,
            )
        if call.op in ("split", "new_group"):
            self._judge_subgroup(test, ex, at, recs, where)
            return
        if call.op in VALUE_OPS:
            self._judge_values(test, ex, at, recs, where)
            return
        if call.op == "any_source":
            self._judge_any_source(test, ex, at, recs, where)
            self._judge_inputs(test, ex, at, recs, where)
            return
        want = expected(call, ex.seed, li, ci, n)
        for r, rec in enumerate(recs):
            exp = want[r]
            if exp is None:
                continue
            outs = rec.get("outs", [])
            if len(outs) != len(exp):
                raise self.fail(
                    test, "reference", f"{where}: rank {r} returned {len(outs)} outputs, expected {len(exp)}", ex
                )
            for k, (got, e) in enumerate(zip(outs, exp, strict=True)):
                problem = _compare(got, e)
                if problem is not None:
                    name = _out_name(call, k, r)
                    raise self.fail(test, "reference", f"{where}: rank {r}, {name}: {problem}", ex)
            for k, got in sorted(rec.get("at_once", {}).items()):  # read as soon as its wait() returned
                problem = _compare(got, exp[k])
                if problem is not None:
                    name = _out_name(call, k, r)
                    raise self.fail(
                        test,
                        "reference",
                        f"{where}: rank {r}, {name}, read as soon as its wait() returned (the data must be final "
                        f"then): {problem}",
                        ex,
                    )
        if not (call.op == "p2p" and call.params.get("mode") == "overwrite"):  # on purpose, after each wait()
            self._judge_inputs(test, ex, at, recs, where)
        if call.op == "all_reduce":
            mask = want[0][0].mask if want[0] else None

            def result(rec: dict[str, Any]) -> torch.Tensor:
                out: torch.Tensor = rec["outs"][0]
                return out[mask] if mask is not None else out

            first = result(recs[0])
            differ = [r for r, rec in enumerate(recs) if not _same_bytes(result(rec), first)]
            if differ:
                raise self.fail(
                    test,
                    "ranks-agree",
                    f"{where}: all_reduce results are not bitwise identical: ranks {differ} differ from rank 0 "
                    "(every rank must reduce in the same order)",
                    ex,
                )

    def _judge_inputs(
        self, test: str, ex: Example, at: tuple[int, int], recs: list[dict[str, Any]], where: str
    ) -> None:
        """Every input buffer is as it was before the call."""
        li, ci = at
        before = input_bases(ex.lanes[li].calls[ci], ex.seed, li, ci, len(ex.lanes[li].members))
        for r, rec in enumerate(recs):
            for k, (got, orig) in enumerate(zip(rec.get("ins", []), before[r], strict=False)):
                if not _same_bytes(got, orig):
                    raise self.fail(
                        test, "inputs-unchanged", f"{where}: rank {r} input #{k} was modified by the operation", ex
                    )

    def _judge_any_source(
        self, test: str, ex: Example, at: tuple[int, int], recs: list[dict[str, Any]], where: str
    ) -> None:
        """Receives from any source, as MPI matches them: taken in the order the receiver posted
        them, each returned a sender that still had a message on its tag (the one it named, if
        it named one) and holds that sender's next message there, bit for bit. Messages of
        different senders may come in any order; each sender's come in the order it sent them."""
        li, ci = at
        call = ex.lanes[li].calls[ci]
        n = len(ex.lanes[li].members)
        p = call.params
        receiver = p["receiver"]
        bufs = [prepare(call, (ex.seed, li, ci), r, n) for r in range(n)]
        left: dict[tuple[int, int], list[int]] = {}  # (sender, tag) -> its messages not received yet, in order
        for m, (src, tag) in enumerate(p["messages"]):
            left.setdefault((src, tag), []).append(m)
        sources = recs[receiver].get("sources") or []
        outs = recs[receiver].get("outs", [])
        if len(sources) != len(p["plan"]) or len(outs) != len(p["plan"]):
            raise self.fail(
                test, "reference", f"{where}: rank {receiver} made {len(sources)} of {len(p['plan'])} receives", ex
            )
        for i, ((named, tag), sender) in enumerate(zip(p["plan"], sources, strict=True)):
            how = "from any source" if named is None else f"naming rank {named}"
            said = f"rank {sender}" if isinstance(sender, int) else repr(sender)
            queue = left.get((sender, tag))
            if (named is not None and sender != named) or not queue:
                sent = sum(1 for src, t in p["messages"] if (src, t) == (sender, tag))
                raise self.fail(
                    test,
                    "reference",
                    f"{where}: receive #{i} on rank {receiver} ({how}, tag {tag}) says it came from {said}, "
                    f"which sent {sent} message(s) there, "
                    + ("all received before it" if sent else "none")
                    + ("" if named is None else f"; it must come from rank {named}"),
                    ex,
                )
            m = queue.pop(0)
            k = [j for j, (src, _) in enumerate(p["messages"]) if src == sender].index(m)
            problem = _compare(outs[i], fill(call.torch_dtype, bufs[receiver], i, bufs[sender].ins[k], None))
            if problem is not None:
                raise self.fail(
                    test,
                    "reference",
                    f"{where}: receive #{i} on rank {receiver} ({how}, tag {tag}) says it came from rank {sender}, "
                    f"whose next message on that tag is message #{m} (each sender's messages arrive in the order it "
                    f"sent them), but it holds something else: {problem}",
                    ex,
                )

    def _judge_values(
        self, test: str, ex: Example, at: tuple[int, int], recs: list[dict[str, Any]], where: str
    ) -> None:
        """Values: what every sender passed is unchanged (``inputs-unchanged``, first, since a
        changed input explains a wrong value), and every rank got its reference value."""
        li, ci = at
        call = ex.lanes[li].calls[ci]
        n = len(ex.lanes[li].members)
        key = (ex.seed, li, ci)
        if call.op == "messages":
            msgs = call.params["messages"]
            for m, (src, dst, tag, kind, _recv_as, _spec) in enumerate(msgs):
                name = f"message #{m} ({kind}, rank {src} -> rank {dst}, tag {tag})"
                want = observe(message_value(call, key, m), device=ex.device)
                problem = _value_problem(recs[src].get("sent", {}).get(m), want)
                if problem is not None:
                    raise self.fail(
                        test, "inputs-unchanged", f"{where}: {name}: the sender's value, after sending: {problem}", ex
                    )
            for m, (src, dst, tag, kind, recv_as, _spec) in enumerate(msgs):
                name = f"message #{m} ({kind}, rank {src} -> rank {dst}, tag {tag}, received with {recv_as})"
                want = observe(message_value(call, key, m), device=ex.device)
                problem = _value_problem(recs[dst].get("received", {}).get(m), want)
                if problem is not None:
                    raise self.fail(test, "reference", f"{where}: {name}: {problem}", ex)
            return
        for r, rec in enumerate(recs):
            want = observe(collective_input(call, key, r), device=ex.device)
            problem = _value_problem(rec.get("input"), want)
            if problem is not None:
                raise self.fail(
                    test, "inputs-unchanged", f"{where}: rank {r}, the value it passed, after the call: {problem}", ex
                )
        for r, rec in enumerate(recs):
            want = observe(collective_result(call, key, r, n), device=ex.device)
            problem = _value_problem(rec.get("value"), want)
            if problem is not None:
                raise self.fail(test, "reference", f"{where}: rank {r}, the value returned: {problem}", ex)

    def _judge_subgroup(
        self, test: str, ex: Example, at: tuple[int, int], recs: list[dict[str, Any]], where: str
    ) -> None:
        """Every member's subgroup has the rank, size and ``parent_ranks`` the controller
        computed (MPI_Comm_split: same color together, ordered by key, then parent rank)."""
        li, ci = at
        call = ex.lanes[li].calls[ci]
        lane = ex.lanes[li]
        p = call.params
        absent = object()
        want: list[Any] = [absent] * len(lane.members)
        if call.op == "split":
            children = {color: child for color, child in p["lanes"]}
            for r, color in enumerate(p["colors"]):
                want[r] = None if color is None else _placement(ex, lane, children[color], lane.members[r])
        else:
            for r in p["ranks"]:
                want[r] = _placement(ex, lane, p["lane"], lane.members[r])
        for r, rec in enumerate(recs):
            got = rec.get("formed", absent)
            if got == want[r] or (got is absent and want[r] is absent):
                continue
            if call.op == "split":
                asked = f"split(color={p['colors'][r]}, key={p['keys'][r]})"
            else:
                asked = f"new_group({p['ranks']})"
            raise self.fail(
                test,
                "membership",
                f"{where}: rank {r} called {asked} and got {_formed(got, absent)}; expected {_formed(want[r], absent)}",
                ex,
            )

    # -- the checks that are not drawn -----------------------------------------------
    def check_coverage(self) -> None:
        """Every declared combination with values, every root, every odd one out, and a
        piece past 4 MiB per op (see :mod:`pg_core.testing.coverage`)."""
        from .coverage import coverage_examples

        examples = coverage_examples(self.target())
        if not examples:
            raise NotApplicable("nothing is declared: no collective, no point to point")
        for example in examples:
            self.execute("coverage", example)

    def declared_combinations(self) -> dict[str, list[tuple[str, str, str | None]]]:
        """Per op (``send``/``recv`` as ``p2p``; ``recv_anysource``), every declared (device, dtype, reduce op)."""
        target = self.target()
        out: dict[str, list[tuple[str, str, str | None]]] = {}
        for op in COLLECTIVE_OPS:
            combos = [
                (d, "-" if op == "barrier" else dtype_name(dtype), kind.name if kind else None)
                for d in self.devices
                for dtype, kind in target.declared(op, d)
            ]
            if combos:
                out[op] = combos
        p2p: list[tuple[str, str, str | None]] = [
            (d, dtype_name(dtype), None) for d in self.devices for dtype in target.p2p_dtypes(d)
        ]
        if p2p:
            out["p2p"] = p2p
        anyone: list[tuple[str, str, str | None]] = [
            (d, dtype_name(dtype), None) for d in self.devices for dtype in target.any_source(d)
        ]
        if anyone:
            out["recv_anysource"] = anyone
        return out

    def check_supports(self) -> None:
        """``ProcessGroup.supports`` on a formed group says exactly what the spec declares."""
        n = self.world_sizes[0]
        for device in self.devices:
            start = time.monotonic()
            results = self.pool(n).run(
                _supports_table, self.rank_ref, device, self.profile.op_timeout, timeout=self.profile.deadline
            )
            self.seconds["supports"] += time.monotonic() - start
            table: dict[tuple[str, str, str | None], bool] = results[0]
            caps = self.caps[device]
            wrong = []
            for (op, dname, kname), said in table.items():
                dtype = None if op == "barrier" else dtype_of(dname)
                declared = caps.supports(op, dtype, RedOpType[kname] if kname else None)
                if said != declared:
                    wrong.append(f"{op} {dname} {kname or ''}: supports() says {said}, declared {declared}")
            self.examples["supports"] += len(table)
            if wrong:
                raise ConformanceFailure("supports", f"on {device}:\n  " + "\n  ".join(wrong[:20]))

    def check_dead_peer(self) -> None:
        """A rank dies mid-job: the others get ``PeerFailureError`` (or, from a
        backend that cannot see deaths, ``CollectiveTimeout``), never a hang."""
        target = self.target()
        sizes = [n for n in self.world_sizes if n >= 2]
        if not sizes:
            raise NotApplicable("a dead peer needs a world size >= 2")
        seen = []
        for device in self.devices:
            ops = target.ops(device)
            if not ops and not target.p2p_dtypes(device):
                continue
            for n in sorted({sizes[0], sizes[-1]}):
                victim = n - 1
                op_timeout = min(self.profile.op_timeout, 5.0)
                self.examples["dead_peer"] += 1
                self.sizes["dead_peer"][n] += 1
                start = time.monotonic()
                try:
                    results = self.pool(n).run(
                        run_dead_peer,
                        self.rank_ref,
                        device,
                        victim,
                        op_timeout,
                        timeout=self.profile.deadline + 2 * op_timeout,
                        may_exit=[victim],
                    )
                except RanksFailed as exc:
                    check = "deadline" if any("did not finish" in o for o in exc.outcomes.values()) else "dead-peer"
                    raise ConformanceFailure(check, f"world size {n}, rank {victim} dies:\n{exc}") from None
                finally:
                    self.seconds["dead_peer"] += time.monotonic() - start
                for r, got in enumerate(results):
                    if r == victim:
                        continue
                    if got is None or not ({"PeerFailureError", "CollectiveTimeout"} & set(got["mro"])):
                        raise ConformanceFailure(
                            "dead-peer",
                            f"world size {n}: after rank {victim} died, rank {r}'s {got and got.get('op')} must raise "
                            f"PeerFailureError (or CollectiveTimeout); {_said(got)}",
                        )
                    seen.append(f"ws {n} rank {r}: {got['type']} after {got['seconds']:.2f} s")
        self.notes["dead_peer"] = "; ".join(seen)

    # -- reporting -----------------------------------------------------------------
    def summary(self) -> str:
        """A table: examples per test, the world sizes drawn, calls per op, time."""
        lines = [f"{'test':<24} {'examples':>8}  {'world sizes':<24} {'seconds':>7}  calls per op"]
        for test in TESTS:
            if not self.examples[test]:
                continue
            sizes = ",".join(f"{n}:{c}" for n, c in sorted(self.sizes[test].items()))
            calls = ", ".join(f"{op} {c}" for op, c in self.calls[test].most_common())
            lines.append(f"{test:<24} {self.examples[test]:>8}  {sizes:<24} {self.seconds[test]:>7.1f}  {calls}")
        from .coverage import exercised_lines

        lines += exercised_lines(TESTS, self.examples, self.exercised, self.notes)
        declared = self.declared_combinations()
        if any(self.covered.values()):
            sizes_run = {n for combos in self.covered.values() for runs in combos.values() for n, _ in runs}
            lines.append("")
            lines.append(
                "declared combinations (device, dtype, reduce op) run with values and checked; "
                "'both' = blocking and async, at two world sizes or more"
            )
            lines.append(f"{'op':<24} {'declared':>8} {'run':>5} {'both':>5}")
            for op, combos in declared.items():
                runs = [self.covered[op].get(c, set()) for c in combos]
                run = sum(1 for r in runs if r)
                both = sum(1 for r in runs if _both(r, multi=len(sizes_run) > 1))
                lines.append(f"{op:<24} {len(combos):>8} {run:>5} {both:>5}")
        return "\n".join(lines)


_TIMEOUT_OPS = ("all_reduce", "barrier", "all_gather", "broadcast")
#: A timeout must fire no sooner than this share of the requested time...
TIMEOUT_EARLY = 0.9
#: ... and no later than the requested time plus this many seconds (a loaded machine's delays).
TIMEOUT_LATE_S = 3.0


class NotApplicable(Exception):
    """The backend declares nothing this test could draw; the message says why."""


def _usable_devices(spec: BackendSpec, wanted: Sequence[str] | None) -> tuple[list[str], dict[str, str]]:
    # a launched backend was asked where its ranks run (resolve_backend_ref(here=False)); here it is unavailable
    why = None if spec.launcher is not None else spec.why_unavailable()
    if why is not None:
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError(f"backend {spec.name!r} is installed but unavailable: {why}")
    usable, skipped = [], {}
    for device in spec.devices:
        if wanted is not None and device not in wanted:
            skipped[device] = "not asked for"
            continue
        if device == "cpu":
            usable.append(device)
            continue
        module = getattr(torch, device, None)
        if module is None or not hasattr(module, "is_available") or not module.is_available():
            skipped[device] = f"torch has no usable {device} device here"
            continue
        usable.append(device)
    return usable, skipped


def _carries_bytes(spec: BackendSpec) -> bool:
    """Whether the spec's backend class implements ``send_bytes``/``recv_bytes`` (a factory
    that is not a ``Backend`` subclass is taken not to: values then need ``uint8`` sends)."""
    try:
        factory = spec.load_factory()
    except Exception:
        return False
    if not (isinstance(factory, type) and issubclass(factory, Backend)):
        return False
    return factory.send_bytes is not Backend.send_bytes and factory.recv_bytes is not Backend.recv_bytes


_METHODS = {"object": "send_object", "tensor": "send_tensor", "tensor_dict": "send_tensor_dict", "plain": "send"}


def _counted(call: Call) -> list[str]:
    """The operations a call stands for, as the summary counts them."""
    if call.op == "timeout":
        return [call.params["target"]]
    if call.op == "messages":
        return [_METHODS[m[3]] for m in call.params["messages"]]
    if call.op == "any_source":
        return ["recv_anysource"]
    return [call.op]


def _combos(call: Call, device: str) -> list[tuple[str, tuple[str, str, str | None]]]:
    """The declared combinations a passed call ran with values, as the summary counts them."""
    if call.op in COLLECTIVE_OPS:
        dtype = "-" if call.op == "barrier" else call.dtype
        return [(call.op, (device, dtype, call.params.get("reduce")))]
    if call.op == "p2p":
        return [("p2p", (device, m[4], None)) for m in call.params["messages"]]
    if call.op == "any_source":
        return [("recv_anysource", (device, call.dtype, None))]
    return []


def _both(runs: set[tuple[int, bool]], *, multi: bool) -> bool:
    """Run blocking and async, and (when the run has several world sizes) at two of them."""
    modes = {a for _, a in runs}
    return modes == {False, True} and (not multi or len({n for n, _ in runs}) >= 2)


def _value_problem(got: Any, want: Any) -> str | None:
    if got is None:
        return "no value came back (the operation returned nothing, or its Work did not finish)"
    return difference(got, want)


def _placement(ex: Example, parent: Any, child: int, member: int) -> dict[str, Any]:
    """What world rank ``member`` must see in subgroup lane ``child`` of lane ``parent``."""
    members = ex.lanes[child].members
    return {
        "rank": members.index(member),
        "size": len(members),
        "parent_ranks": [parent.members.index(w) for w in members],
    }


def _formed(got: Any, absent: object) -> str:
    if got is absent:
        return "no call (it is not a member)"
    if got is None:
        return "None (no subgroup)"
    return f"rank {got['rank']} of {got['size']} with parent_ranks {got['parent_ranks']}"


def _probe(call: Call) -> str:
    p = call.params
    if p["target"] in ("send_object", "broadcast_object"):
        return f"{p['target']} (values travel as messages on send/recv)"
    bits = [p["target"], call.dtype]
    if p.get("reduce"):
        bits.append(p["reduce"])
    if p.get("device"):
        bits.append(f"on device {p['device']}")
    return " ".join(bits)


def _said(err: dict[str, Any] | None) -> str:
    if err is None:
        return "it returned normally"
    return f"it raised {err['type']}: {err['message'][:500]}"


def _out_name(call: Call, k: int, rank: int) -> str:
    if call.op in ("all_gather", "gather"):
        return f"output_list[{k}] (from rank {k})"
    if call.op == "all_to_all":
        return f"output_list[{k}] (from rank {k})"
    if call.op == "p2p":
        return f"receive #{k} of this rank"
    return "the output" if k == 0 else f"output #{k}"


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def _compare(got: torch.Tensor, exp: Expected) -> str | None:
    if tuple(got.shape) != tuple(exp.value.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(exp.value.shape)}"
    g = got.to(exp.value.dtype)
    e = exp.value
    floating = e.dtype.is_floating_point or e.dtype.is_complex
    limit = "exactly" if exp.tol is None else "within tolerance"
    sign_only = torch.zeros(e.shape, dtype=torch.bool)
    if not floating:
        bad = g != e
    else:
        same = (g == e) | (torch.isnan(g) & torch.isnan(e))  # non-finite values exactly; NaN matches NaN
        if exp.tol is None:
            bad = ~same
        else:
            within = (g - e).abs().to(torch.float64) <= exp.tol
            bad = torch.where(torch.isfinite(e), ~within, ~same)
        if exp.tol is None:
            signed: torch.Tensor | None = e == 0
        else:
            signed = None if exp.signs is None else exp.signs & (e == 0)
        if signed is not None and bool(signed.any()):
            sign_only = signed & (_signbits(g) != _signbits(e)) & ~bad
            bad = bad | sign_only
    if not bool(bad.any()):
        return None
    idx = bad.nonzero()
    first = tuple(int(i) for i in idx[0])
    total = int(bad.sum())
    if floating and bool(sign_only[first]):
        limit = "(a zero's sign is part of the result here)"
    detail = f"got {_shown(g[first])}, expected {_shown(e[first])} {limit}"
    if exp.tol is not None and bool(torch.isfinite(e[first])):
        detail += f" (tolerance {exp.tol[first].item():.3g})"
    if exp.mask is not None and not bool(exp.mask[first]):
        detail += "; that element is outside the view: the storage around it, which must stay as it was"
    return f"{total} of {bad.numel()} elements wrong; first at index {list(first)}: {detail}"


def _signbits(t: torch.Tensor) -> torch.Tensor:
    """Per element, whether the sign bit is set (for complex: of either part, as a pair)."""
    if t.is_complex():
        parts = torch.view_as_real(t).signbit()
        return parts[..., 0] * 2 + parts[..., 1]
    return t.signbit()


def _shown(x: torch.Tensor) -> str:
    value = x.item()
    return "-0.0" if isinstance(value, float) and value == 0 and math.copysign(1.0, value) < 0 else repr(value)


def _supports_table(
    ctx: Any, backend_ref: str, device: str, op_timeout: float
) -> dict[tuple[str, str, str | None], bool]:
    """On a formed group: what ``supports()`` says for every (op, dtype, reduce op)."""
    from ..backend import DTYPES
    from ..group import ProcessGroup
    from ..ops import COLLECTIVE_OPS, OPTIONAL_OPS, RedOpType, ReduceOp

    reducing = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
    spec = resolve_backend_ref(backend_ref, device, factories=False)
    group = ProcessGroup(ctx.store, ctx.rank, ctx.size, backends={device: spec}, timeout=op_timeout)
    table: dict[tuple[str, str, str | None], bool] = {}
    try:
        for op in (*COLLECTIVE_OPS, "send", "recv", *OPTIONAL_OPS):
            for dtype in DTYPES:
                if op == "barrier":
                    table[(op, dtype_name(dtype), None)] = group.supports(op, device=device)
                    break
                if op in reducing:
                    for kind in RedOpType:
                        rop = ReduceOp.premul_sum(2.0) if kind == RedOpType.PREMUL_SUM else ReduceOp(kind)
                        table[(op, dtype_name(dtype), kind.name)] = group.supports(op, device, dtype, rop)
                else:
                    table[(op, dtype_name(dtype), None)] = group.supports(op, device, dtype)
    finally:
        group.shutdown()
    return table
