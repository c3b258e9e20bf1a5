"""Tensor parallelism (DTensor, ``parallelize_module``) over a pg-core group, with no init_process_group.

Each rank forms the job's group from its launcher's environment (``ProcessGroup.from_env``) on
the backend named and trains a small MLP split over the ranks the Megatron way: the first
linear layer column-wise (``ColwiseParallel``: each rank holds some of its output features),
the second row-wise (``RowwiseParallel``: the matching input features; the partial outputs are
summed across the ranks). Every rank sees the whole batch. Then it gathers the parameters
(``DTensor.full_tensor()``) and checks them against single-process training, and checks that
``torch.distributed.is_initialized()`` is False: the 1-D mesh (``group.device_mesh("cpu")``)
needs no default group.

With ``--dp N`` (N > 1) the ranks form a 2-D mesh instead: N data-parallel replicas of the
tensor-parallel MLP. The job's group is split into a data-parallel group (the ranks at the same
place in each replica) and a tensor-parallel group (the ranks of one replica);
``pg_core.device_mesh("cpu", [dp_group, tp_group], mesh_dim_names=("dp", "tp"))`` makes the
mesh, ``parallelize_module`` splits the MLP over ``mesh["tp"]`` and FSDP2 (``fully_shard``)
shards it over ``mesh["dp"]``; each replica trains on its share of the batch. Torch (2.13)
slices a 2-D mesh with ``dist.get_rank()``, which reads its default group, so this part runs
inside ``with world.as_torch_default():`` (the job's group is torch's default for that block
only; afterwards ``is_initialized()`` is False again, and the example checks it).

    pgrun -n 2 examples/dtensor_tp.py --backend gloo
    pgrun -n 4 examples/dtensor_tp.py --backend tcp --dp 2

Started without a launcher, it starts its ranks under pgrun itself::

    python examples/dtensor_tp.py --world-size 2 --backend tcp
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pg_core
import torch
import torch.distributed as dist
from pg_core import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STEPS, BATCH, LR, HIDDEN = 8, 24, 0.05, 32
#: How far the parallel training may drift from one process's, per parameter. Both compute in
#: float32 (machine epsilon 1.2e-7) on values of order 1; the split MLP differs only in the order
#: of additions (the second layer's partial sums added across ranks; with --dp, gradients
#: averaged across replicas). That is a few epsilon per step, scaled by the learning rate into
#: the parameters, well under 1e-6 over these steps; a wrong split or a missing reduction moves
#: them by 1e-3 or more within a step.
TOLERANCE = 1e-5


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))


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
    """A parameter whole: a DTensor's shards gathered over its mesh."""
    return parameter.full_tensor() if isinstance(parameter, DTensor) else parameter


def tensor_parallel(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """The MLP split over ``mesh``: layer 0 by output features, layer 2 by input features.

    Every rank built the same weights from the same seed, so each takes its own shard of them
    (``src_data_rank=None``) instead of receiving it from the mesh's first rank: torch's
    scatter from a rank asks ``torch.distributed.get_rank(group)``, which reads torch's default
    group even for a registered one (torch 2.13), and this example has no default group."""
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return parallelize_module(model, mesh, plan, src_data_rank=None)


def layout_problem(size: int, dp: int) -> str | None:
    """Why ``size`` ranks cannot form ``dp`` replicas of the split MLP, or ``None``."""
    if size % dp:
        return f"--dp ({dp}) must divide the world size ({size})"
    if BATCH % dp:
        return f"--dp ({dp}) must divide the batch of {BATCH}"
    if HIDDEN % (size // dp):
        return f"the tensor-parallel size (world size / --dp = {size // dp}) must divide the hidden width {HIDDEN}"
    return None


def rank_main(backend: str, steps: int, dp: int) -> None:
    with ProcessGroup.from_env(backends=backend, timeout=60) as world:
        rank, size = world.rank, world.size
        problem = layout_problem(size, dp)
        if problem is not None:
            raise SystemExit(f"dtensor_tp: {problem}")
        if dp == 1:
            world.to_torch(register=True)  # undone when the group shuts down, at the end of the block
            model = tensor_parallel(make_model(), world.device_mesh("cpu", mesh_dim_names=("tp",)))
            layout = f"a 1-D mesh of {size} tensor-parallel ranks"
            loss, diff = train_and_check(model, slice(None), steps, rank)
        else:
            # rank r is replica r // tp, place r % tp in it: the 2-D mesh is arange(size).view(dp, tp)
            tp = size // dp
            dp_group = world.split(color=rank % tp, key=rank)
            tp_group = world.split(color=rank // tp, key=rank)
            assert dp_group is not None and tp_group is not None
            share = BATCH // dp
            rows = slice(dp_group.rank * share, (dp_group.rank + 1) * share)
            # A 2-D mesh needs torch's default group for as long as its sub-meshes are used:
            # torch 2.13 builds mesh["tp"] and mesh["dp"], and reads their ranks on every use,
            # with dist.get_rank(), which reads the default group. So the job's group is torch's
            # default for this block (opt-in, undone at its end); the 1-D mesh above needs none.
            with dp_group, tp_group, world.as_torch_default():
                mesh = pg_core.device_mesh("cpu", [dp_group, tp_group], mesh_dim_names=("dp", "tp"))
                model = tensor_parallel(make_model(), mesh["tp"])
                fully_shard(model, mesh=mesh["dp"])  # in place: the model's class becomes an FSDP module
                loss, diff = train_and_check(model, rows, steps, rank)
            layout = f"a 2-D mesh of {dp} data-parallel x {tp} tensor-parallel ranks (FSDP2 on dp, TP on tp)"
        assert not dist.is_initialized(), "dtensor_tp: torch's default group outlived this example's use of it"
        print(
            f"rank {rank}: loss {loss:.4f}; gathered parameters equal single-process training "
            f"(max diff {diff:.1e} < {TOLERANCE:.0e})",
            flush=True,
        )
        world.barrier()  # every rank got here: its parameters passed the check
        if rank == 0:
            print(
                f"dtensor_tp: {size} ranks trained {steps} steps on {layout} over pg-core backend {backend!r}, "
                f"max diff {diff:.1e} from single-process training",
                flush=True,
            )


def train_and_check(model: torch.nn.Module, rows: slice, steps: int, rank: int) -> tuple[float, float]:
    """Train the parallel ``model`` on ``rows`` of each batch, then compare its gathered
    parameters with one process trained on the whole batch: (last loss, largest difference)."""
    loss = train(model, rows, steps)
    single = make_model()  # one process, the whole batch, the same initial weights
    train(single, slice(None), steps)
    pairs = zip(model.parameters(), single.parameters(), strict=True)
    diff = max(float((full(a) - b).detach().abs().max()) for a, b in pairs)
    assert diff < TOLERANCE, f"rank {rank}: tensor-parallel training differs from one process's by {diff}"
    return loss, diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", help="a pg-core backend for cpu (default gloo)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas; above 1, a 2-D mesh (default 1)")
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to start, when started without a launcher (default 2)"
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.dp < 1:
        parser.error(f"--dp must be at least 1, got {args.dp}")
    if any(var in os.environ for var in ("PG_RANK", "RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")):  # a launched rank
        rank_main(args.backend, args.steps, args.dp)
        return 0
    problem = layout_problem(args.world_size, args.dp) if args.world_size >= 1 else "--world-size must be at least 1"
    if problem is not None:
        parser.error(f"{problem} (--world-size {args.world_size}, --dp {args.dp})")
    pgrun = [sys.executable, "-m", "pg_core.launch", "-n", str(args.world_size), "--timeout", "300"]
    if args.backend == "mpi":  # pg-mpi's ranks are processes of one MPI job
        pgrun.append("--mpi")
    script = [os.path.abspath(__file__), "--backend", args.backend, "--steps", str(args.steps), "--dp", str(args.dp)]
    return subprocess.call([*pgrun, *script])


if __name__ == "__main__":
    sys.exit(main())
