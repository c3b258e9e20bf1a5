"""``pg-core bench``: an nccl-tests-style sweep of collectives, correctness-checked,
with the raw libraries (torch's own Gloo, mpi4py) measured side by side in the same run.

    python -m pg_core.bench --world-size 2 --backends tcp --sizes 4,1K,64K,1M
    pg-core bench --backends tcp,gloo,mpi --ops all_reduce -b 8 -e 64M -f 2 --plot allreduce.png
    pg-core bench --ops all_reduce,send_recv --minbytes 8 --maxbytes 16M --stepfactor 4 --json
    pg-core bench --backends tcp --ops send_object,broadcast_object,send_tensor,send_recv --sizes 4K

**What runs.** The program hosts a ``TCPStore`` and starts ``--world-size`` rank
processes of its own (one thread of intra-op parallelism each). Every rank forms
one :class:`~pg_core.ProcessGroup` per pg-core backend named in ``--backends``
(a name that ``pg-core backends`` lists, or ``module:attr`` / ``path/file.py:attr``
of a ``BackendSpec`` or ``Backend`` subclass under development, read as ``pg-core
conformance`` reads it: :func:`pg_core.backend_refs.resolve_backend_ref`; by default
every backend available for cpu, a backend whose ranks a launcher must start
included when it is available in a process started that way), plus, unless
``--no-baseline``, the baselines: torch's ``ProcessGroupGloo`` used directly
through its own API, labelled ``torch-gloo``, and raw mpi4py (``MPI_COMM_WORLD``
on numpy views of the tensors, labelled ``mpi4py``). ``--baseline`` names them
(comma-separated); its default, ``auto``, is ``torch-gloo``, plus ``mpi4py``
when mpiexec starts the ranks anyway. Rows are measured in the order op, size,
backend, so the baselines and the pg-core backends are measured one right after
the other at each op and size. A backend whose spec declares a launcher (pg-mpi:
``mpiexec``), or the mpi4py baseline, has every rank started by that launcher,
in one command; the other backends and baselines run in those ranks as well, so
``--backends tcp,gloo,mpi`` is one run and one table.

**Objects and unknown shapes.** Besides the tensor collectives, three ops measure
what torch.distributed makes painful. ``send_object`` (pg-core's
``send_object``/``recv_object``; torch's ``send_object_list``/``recv_object_list``)
and ``broadcast_object`` (``broadcast_object`` against ``broadcast_object_list``)
carry :func:`~pg_core.bench.inputs.request_object`: a serving request as a dict of a few strings, ints,
a list and nested sampling parameters, plus a ``bytes`` payload of the requested
size. ``send_tensor`` sends a tensor whose shape (:func:`~pg_core.bench.inputs.tensor_shape`) and dtype
the receiver does not know: pg-core's ``send_tensor``/``recv_tensor`` against the
three send/recv pairs a torch user writes (number of dimensions and dtype, shape,
data). Its table has a ``vs send_recv`` column, its median over the plain
``send``/``recv`` of a known shape on the same backend at the same size, when
``send_recv`` is in ``--ops`` too. torch's object functions need
``init_process_group``, which the baseline then calls in the rank processes (see
:class:`~pg_core.bench.baselines.TorchGlooRunner`).

**Asynchronous calls.** ``--async`` measures each selected op that has an asynchronous form
(:data:`~pg_core.bench.catalog.ASYNC_OPS`) in that form too, beside it at each size (with ``--rounds``, in
the same rounds: :func:`~pg_core.bench.sizing.sweep_batches`): ``all_reduce_async`` and
``broadcast_async`` call the group with ``async_op=True`` and ``wait()`` at once,
``isend_irecv`` is ``send_recv``'s echo with ``isend(...).wait()`` and ``irecv(...).wait()``
(raw mpi4py: ``Iallreduce``, ``Ibcast``, ``Isend``, ``Irecv``; torch's Gloo returns a work
either way). Its ``vs`` column is its median over the blocking op's on the same backend and
size, and their difference in microseconds: what going asynchronous costs. The forms can
be named in ``--ops`` too; ``all`` leaves them out.

**Sizes.** ``--sizes 4,64K,1M`` lists them; ``-b 8 -e 64M -f 2`` (nccl-tests'
spelling; also ``--minbytes``, ``--maxbytes``, ``--stepfactor`` and the older
``--min-bytes``, ``--max-bytes``, ``--factor``) sweeps from ``-b`` to ``-e``,
multiplying by ``-f`` (:func:`~pg_core.bench.sizing.sweep_sizes`: the one rule, checked before any rank
starts). A size is the bytes of the largest buffer on one rank, as nccl-tests
counts it: the tensor of ``all_reduce``, ``broadcast``, ``reduce`` and the
message of ``send_recv`` and ``send_tensor``; the *output* of ``all_gather_into_tensor`` (each rank
contributes ``size / n``); the *input* of ``reduce_scatter_tensor``; input and
output of ``all_to_all_single``. Element counts are rounded down to a multiple
of the world size where the op splits the buffer (at least one element per
rank); the ``size`` column shows the bytes actually moved, ``requested_size``
the bytes asked for. For the object ops the requested size is the payload's
bytes (``count``), and ``size`` the whole object pickled with protocol 5.

**What is timed.** For each (op, size, backend) every rank runs one or two
untimed iterations (up to three, fewer if ``--warmup`` says so), then rank 0 plans,
at the median pace of those after the first, how many more untimed warmup iterations
(up to ``--warmup``) and how many timed ones to run: at least 5 and at most
``--iters``, as many as fit in ``--time-budget`` seconds.
After a barrier, timed iterations run back to back; each is timed on its own
with ``time.perf_counter_ns`` around the blocking call. An iteration's time is
the *maximum over ranks* (the collective is done when the slowest rank is);
for ``send_recv``, ``send_tensor`` and ``send_object`` rank 0 sends to rank 1
and rank 1 echoes what it received back, and the time is rank 0's round trip
divided by 2 (one-way latency); serializing and deserializing are inside it. Buffers
that an op reduces into (``all_reduce``, ``reduce``, the input of
``reduce_scatter_tensor``) are refilled before every iteration, outside the
timed region. With ``--rounds R`` (R > 1) the rows of one (op, size) are timed
together: every runner warms up and is planned as above, all of them then get the
smallest of their plans (so the blocks a ratio pairs are alike), and each runs its
share of its timed iterations (after a barrier and one untimed iteration) in turn, R
times over, each round starting one row further along (no row is always the one right
after another, or right after the barrier); each row's statistics are over all its
iterations. A drift of the machine's
speed during the run (another tenant, frequency, the host's scheduler) then weighs on
each row alike rather than on whichever ran during it, which is what a ratio of two
rows measured seconds apart is most sensitive to.

**What is reported.** ``min``/``median``/``max`` of the per-iteration times,
in microseconds; ``algbw = size / median time`` and ``busbw = algbw * factor``
in GB/s (1e9 bytes/s), with nccl-tests' factors: ``2(n-1)/n`` for
``all_reduce``, ``(n-1)/n`` for ``all_gather_into_tensor``,
``reduce_scatter_tensor`` and ``all_to_all_single``, 1 for the others. For a pg-core backend, ``ratio`` is its median
time divided by its baseline's median at the same op and size: the baseline of
the library it wraps (:func:`~pg_core.bench.report.compared_with`: ``gloo`` against ``torch-gloo``,
``mpi`` against ``mpi4py``) when measured, else the first baseline. ``0.85x
torch-gloo`` means 15% less time than torch's Gloo, ``2.00x`` twice as long.
With ``--rounds R``, each row also keeps the median of each round's iterations
(``round_median_us``), and a pg-core backend's row the ratios of its round medians
to its baseline's, round by round (``round_ratios``): each pairs blocks timed
moments apart, so a slow spell of the machine weighs on both sides of one ratio.
The table shows their middle half after the ratio (``1.03x torch-gloo
[1.01-1.05]``): how far the ratio can be trusted in this run. ``--control`` times each
baseline a second time as a row of its own (``torch-gloo.again``, a Gloo object of its
own; ``mpi4py.again``, the same calls), compared with the first like a backend: two rows
doing the very same work, so its ratio is what this run's noise alone makes of 1.00x.
``--json`` and ``--csv`` give every row; ``--plot PNG`` draws median time and
bus bandwidth against size (:func:`~pg_core.bench.plot.plot_figure`). On stderr, a line per row
(not with ``--quiet``) and, when stderr is a terminal, a progress bar below them
(:class:`pg_core.progress.ProgressBar`).

**Correctness.** Rank ``r`` fills its input with ``(r + 1) * (1 + i % 3)`` at
element ``i`` (exact in every supported dtype for small world sizes); outputs
are poisoned before the last timed iteration, and after it every rank compares
its output with the value :func:`~pg_core.bench.inputs.expected_output` computes in float64 (for
``send_tensor`` also its shape and dtype; for the object ops, equality with
:func:`~pg_core.bench.inputs.request_object`). A mismatch marks the row ``WRONG`` (with the first bad
element) and makes the exit status 1.

**Noise.** Absolute times depend on the machine, its load, CPU frequency and
where the scheduler puts the ranks; the median resists outliers, not a busy
machine. Compare the ratios, measured side by side in one run, rather than
absolute times across runs or machines. Placement can matter more than anything
else on a small (virtual) machine: with two ranks on two CPUs, Gloo's send/recv
was seen to take either ~40 us or a whole scheduler tick (~2 ms one way) depending
on whether the two ranks shared a CPU, and pg-tcp to be faster sharing one.
``--pin-ranks`` puts rank ``r`` on the ``r``-th allowed CPU, so the placement is
the same in every run.

**Bounds.** ``--timeout`` bounds every operation, store access and group
formation in the ranks; the parent additionally kills ranks that make no
progress (after dumping their Python stacks), shows the traceback of a rank that
fails, exits non-zero, and never leaves a rank process behind.

Exit status: 0 when every row is correct, 1 when a row is ``WRONG`` or a rank
failed, 2 for bad arguments or a backend that cannot run here.

**How the package is laid out**, one job per module, each importing only those above it:
:mod:`~pg_core.bench.catalog` (the ops, their families, the baselines, the dtypes),
:mod:`~pg_core.bench.sizing` (sizes, sweeps, counts, bandwidth, iteration plans),
:mod:`~pg_core.bench.inputs` (inputs, expected outputs, the checks),
:mod:`~pg_core.bench.report` (rows, ratios, table/JSON/CSV), :mod:`~pg_core.bench.plot`
(``--plot``), :mod:`~pg_core.bench.config` (the configuration the ranks get, from the command
line), :mod:`~pg_core.bench.baselines` and :mod:`~pg_core.bench.runners` (what a rank times
through), :mod:`~pg_core.bench.cases` (one op's buffers and its timed call),
:mod:`~pg_core.bench.rank` (a rank process), :mod:`~pg_core.bench.parent` (the process that
supervises them), :mod:`~pg_core.bench.cli` (the command line); ``--overhead`` is
:mod:`~pg_core.bench.overhead`, on the backends of :mod:`~pg_core.bench.nullbackend`.
"""

from __future__ import annotations

from .cli import add_parser, main
from .sizing import rotated

__all__ = ["add_parser", "main", "rotated"]
