"""``torch.compile`` of a function that calls functional collectives, over a pg-core group, with
no init_process_group.

Functional collectives (``torch.distributed._functional_collectives``) are the collectives that
``torch.compile``, DTensor and FSDP2 trace: they return a new tensor instead of writing into
their argument, and name the group they run on by its *registered name*. So each rank forms
the job's group from its launcher's environment (``ProcessGroup.from_env``) and registers it
with torch for the block (``with group.torch_registered() as tg:``); the compiled function
takes ``tg`` as its group. It all-reduces a tensor and all-gathers another inside one compiled
graph (``fullgraph=True``: a graph break would fail, not hide); then a compiled loss whose
all-gather is differentiable (``all_gather_tensor_autograd``, what tensor parallelism's compiled
graphs use) is differentiated, its backward a reduce-scatter over the same group. Every rank
checks the results and the gradient against the same functions computed on the ranks' inputs
in one process, and that ``torch.distributed.is_initialized()`` stayed False.

``--compile-backend`` picks torch.compile's backend: ``aot_eager`` (the default) traces the
function into one graph with its collectives as graph nodes, through AOTAutograd, and runs
that graph with torch's own kernels; ``inductor`` (torch.compile's default) also generates
and compiles C++ for the graph, which needs a C++ compiler and takes tens of seconds of
compilation on a small CPU machine the first time; ``eager`` only captures the graph.

    pgrun -n 2 examples/compile_collective.py --backend gloo
    pgrun -n 2 examples/compile_collective.py --backend tcp --compile-backend inductor

Started without a launcher, it starts its ranks under pgrun itself::

    python examples/compile_collective.py --world-size 2 --backend tcp
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from pg_core import ProcessGroup

WIDTH = 6
#: float32 on values of order 1: the compiled graph and the reference add the ranks' inputs in
#: possibly different orders and may fuse the elementwise ops differently, a few ulp (1.2e-7
#: each) apart; a wrong or missing reduction (a gradient not summed over the ranks) is off by
#: 0.1 or more.
TOLERANCE = 1e-5


def rank_input(rank: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, WIDTH) * (rank + 1)


def step(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """What is compiled: an all-reduce and an all-gather, with elementwise work around them."""
    total = funcol.all_reduce(x * 2.0, "sum", group)
    gathered = funcol.all_gather_tensor(x.cos(), 0, group)
    return total.sin() + 1.0, gathered * 3.0


def loss(w: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """What is compiled and differentiated: every rank's ``w`` gathered, then summed elementwise.
    Each rank's loss depends on every rank's ``w``, so the backward of the all-gather (a
    reduce-scatter) sums, into each rank's gradient, what every rank's loss says of it."""
    return funcol.all_gather_tensor_autograd(w * 2.0, 0, group).sin().sum()


def expected_gradient(w: torch.Tensor, size: int) -> torch.Tensor:
    """The gradient of ``loss`` at this rank's ``w``, summed over the ``size`` ranks' losses."""
    return 2.0 * torch.cos(2.0 * w) * size


def expected(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``step`` on every rank's input, in one process."""
    inputs = [rank_input(r) for r in range(size)]
    total = torch.stack([x * 2.0 for x in inputs]).sum(dim=0)
    return total.sin() + 1.0, torch.cat([x.cos() for x in inputs]) * 3.0


def rank_main(backend: str, compile_backend: str) -> None:
    with ProcessGroup.from_env(backends=backend, timeout=120) as group, group.torch_registered() as tg:
        rank, size = group.rank, group.size
        compiled = torch.compile(step, backend=compile_backend, fullgraph=True)
        reduced, gathered = compiled(rank_input(rank), tg)
        want_reduced, want_gathered = expected(size)
        assert gathered.shape == want_gathered.shape, f"rank {rank}: all_gather_tensor gave shape {gathered.shape}"
        diff = max(float((reduced - want_reduced).abs().max()), float((gathered - want_gathered).abs().max()))
        assert diff < TOLERANCE, f"rank {rank}: the compiled collectives differ from the reference by {diff}"
        w = rank_input(rank).requires_grad_()
        torch.compile(loss, backend=compile_backend, fullgraph=True)(w, tg).backward()
        assert w.grad is not None, f"rank {rank}: no gradient reached w through the compiled all_gather"
        grad_diff = float((w.grad - expected_gradient(w.detach(), size)).abs().max())
        assert grad_diff < TOLERANCE, f"rank {rank}: the gradient differs from the reference by {grad_diff}"
        diff = max(diff, grad_diff)
        assert not dist.is_initialized(), "compile_collective: torch's default group was initialised"
        print(
            f"rank {rank}: compiled all_reduce and all_gather, and the gradient through the all_gather, equal the "
            f"reference (max diff {diff:.1e})",
            flush=True,
        )
        group.barrier()  # every rank got here: its results passed the check
        if rank == 0:
            print(
                f"compile_collective: {size} ranks ran torch.compile(backend={compile_backend!r}) functional "
                f"collectives over pg-core backend {backend!r}, max diff {diff:.1e} from the reference",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", help="a pg-core backend for cpu (default gloo)")
    parser.add_argument(
        "--compile-backend",
        default="aot_eager",
        choices=("eager", "aot_eager", "inductor"),
        help="torch.compile's backend (default aot_eager)",
    )
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to start, when started without a launcher (default 2)"
    )
    args = parser.parse_args()
    if any(var in os.environ for var in ("PG_RANK", "RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")):  # a launched rank
        rank_main(args.backend, args.compile_backend)
        return 0
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    pgrun = [sys.executable, "-m", "pg_core.launch", "-n", str(args.world_size), "--timeout", "300"]
    if args.backend == "mpi":  # pg-mpi's ranks are processes of one MPI job
        pgrun.append("--mpi")
    script = [os.path.abspath(__file__), "--backend", args.backend, "--compile-backend", args.compile_backend]
    return subprocess.call([*pgrun, *script])


if __name__ == "__main__":
    sys.exit(main())
