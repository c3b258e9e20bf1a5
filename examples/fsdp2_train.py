"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over a pg-core group, with no init_process_group.

Each rank forms the job's group from its launcher's environment (``ProcessGroup.from_env``) on
the backend named, registers it with torch for the life of the group
(``group.to_torch(register=True)``: functional collectives, which FSDP2 and DTensor call, find
a group by its registered name) and shards a small model over ``group.device_mesh("cpu")``.
Every rank starts from the same weights (FSDP2 shards what each rank holds; it broadcasts
nothing) and trains on its shard of each batch; FSDP2 all-gathers the parameters before each
layer runs and reduce-scatters, averaged, the gradients after. Every rank then gathers the
full parameters (``DTensor.full_tensor()``) and checks them against single-process training
on the whole batch, and checks that ``torch.distributed.is_initialized()`` stayed False.

    pgrun -n 3 examples/fsdp2_train.py --backend gloo
    pgrun -n 2 examples/fsdp2_train.py --backend tcp

Started without a launcher, it starts its ranks under pgrun itself::

    python examples/fsdp2_train.py --world-size 3 --backend tcp --steps 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from pg_core import ProcessGroup
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

STEPS, BATCH, LR = 10, 24, 0.05
#: How far the sharded training may drift from one process's, per parameter. Both compute in
#: float32 (machine epsilon 1.2e-7) on parameters and gradients of order 1; they differ only in
#: the order of additions: a rank's loss is the mean over its shard, and FSDP2 averages the
#: ranks' gradients (sum, then divide by the world size) where one process takes the mean of the
#: whole batch at once. Each step's rounding difference is a few epsilon, scaled by the learning
#: rate into the parameters; over tens of steps that stays below 1e-6 (measured: under 1e-7 at
#: 10 steps). A sharding or reduction mistake (a missing shard, a sum instead of an average,
#: stale gathered weights) moves parameters by 1e-3 or more within a step.
TOLERANCE = 1e-5


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def train(model: torch.nn.Module, rows: slice, steps: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = torch.zeros(())
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
    return float(loss.detach())


def full(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter whole: FSDP2's are DTensors sharded on dim 0 (gathered over the mesh)."""
    return parameter.full_tensor() if isinstance(parameter, DTensor) else parameter


def rank_main(backend: str, steps: int) -> None:
    with ProcessGroup.from_env(backends=backend, timeout=60) as group:
        rank, size = group.rank, group.size
        if BATCH % size:
            raise SystemExit(f"fsdp2_train: the world size ({size}) must divide the batch of {BATCH}")
        group.to_torch(register=True)  # undone when the group shuts down, at the end of the block
        mesh = group.device_mesh("cpu", mesh_dim_names=("dp",))
        model = make_model()
        for layer in model.children():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        share = BATCH // size
        loss = train(model, slice(rank * share, (rank + 1) * share), steps)
        single = make_model()  # one process, the whole batch, the same initial weights
        train(single, slice(None), steps)
        pairs = zip(model.parameters(), single.parameters(), strict=True)
        diff = max(float((full(a) - b).detach().abs().max()) for a, b in pairs)
        assert diff < TOLERANCE, f"rank {rank}: FSDP2 differs from single-process training by {diff}"
        assert not dist.is_initialized(), "fsdp2_train: torch's default group was initialised"
        print(
            f"rank {rank}: loss on my shard {loss:.4f}; gathered parameters equal single-process training "
            f"(max diff {diff:.1e} < {TOLERANCE:.0e})",
            flush=True,
        )
        group.barrier()  # every rank got here: its parameters passed the check
        if rank == 0:
            print(
                f"fsdp2_train: {size} ranks trained {steps} steps with FSDP2 over pg-core backend {backend!r}, "
                f"max diff {diff:.1e} from single-process training",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", help="a pg-core backend for cpu (default gloo)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to start, when started without a launcher (default 2)"
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if any(var in os.environ for var in ("PG_RANK", "RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")):  # a launched rank
        rank_main(args.backend, args.steps)
        return 0
    if args.world_size < 1 or BATCH % args.world_size:
        parser.error(f"--world-size must divide the batch of {BATCH}, got {args.world_size}")
    pgrun = [sys.executable, "-m", "pg_core.launch", "-n", str(args.world_size), "--timeout", "300"]
    if args.backend == "mpi":  # pg-mpi's ranks are processes of one MPI job
        pgrun.append("--mpi")
    script = [os.path.abspath(__file__), "--backend", args.backend, "--steps", str(args.steps)]
    return subprocess.call([*pgrun, *script])


if __name__ == "__main__":
    sys.exit(main())
