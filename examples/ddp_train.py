"""DistributedDataParallel over a pg-core group, with no init_process_group.

Each rank forms the job's group from its launcher's environment (``ProcessGroup.from_env``)
on the backend named (pg-gloo by default: its Gloo object is registered on the torch group as
it is; any other backend goes through pg-core's adapter), wraps a small model in
``DistributedDataParallel(model, process_group=group.to_torch())``, starting from weights of
its own (DDP broadcasts rank 0's), and trains on its shard of each batch. Every rank then
checks that its parameters equal single-process training on the whole batch, and that
``torch.distributed.is_initialized()`` was False throughout.

    pgrun -n 3 examples/ddp_train.py --backend gloo
    pgrun -n 3 examples/ddp_train.py --backend tcp
    pgrun -n 2 --mpi examples/ddp_train.py --backend mpi

Started without a launcher, it starts its ranks under pgrun itself (``--mpi`` for pg-mpi)::

    python examples/ddp_train.py --world-size 3 --backend gloo
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from pg_core import ProcessGroup

STEPS, BATCH, LR = 20, 24, 0.05


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
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


def rank_main(backend: str, steps: int) -> None:
    with ProcessGroup.from_env(backends=backend, timeout=60) as group:
        rank, size = group.rank, group.size
        if BATCH % size:
            raise SystemExit(f"ddp_train: the world size ({size}) must divide the batch of {BATCH}")
        ddp = torch.nn.parallel.DistributedDataParallel(make_model(seed=rank), process_group=group.to_torch())
        share = BATCH // size
        loss = train(ddp, slice(rank * share, (rank + 1) * share), steps)
        single = make_model(seed=0)  # one process, the whole batch, rank 0's initial weights
        train(single, slice(None), steps)
        pairs = zip(ddp.parameters(), single.parameters(), strict=True)
        diff = max(float((a - b).detach().abs().max()) for a, b in pairs)
        assert diff < 1e-5, f"rank {rank}: DDP differs from single-process training by {diff}"
        assert not dist.is_initialized()
        print(
            f"rank {rank}: loss on my shard {loss:.4f}; parameters equal single-process training (max diff {diff:.1e})",
            flush=True,
        )
        group.barrier()  # every rank got here: its parameters passed the check
        if rank == 0:
            print(f"ddp_train: {size} ranks trained with DDP over pg-core backend {backend!r}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", help="a pg-core backend for cpu (default gloo)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    parser.add_argument(
        "--world-size", type=int, default=3, help="ranks to start, when started without a launcher (default 3)"
    )
    args = parser.parse_args()
    if any(var in os.environ for var in ("PG_RANK", "RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")):  # a launched rank
        rank_main(args.backend, args.steps)
        return 0
    if BATCH % args.world_size:
        parser.error(f"--world-size must divide the batch of {BATCH}")
    pgrun = [sys.executable, "-m", "pg_core.launch", "-n", str(args.world_size), "--timeout", "300"]
    if args.backend == "mpi":  # pg-mpi's ranks are processes of one MPI job
        pgrun.append("--mpi")
    script = [os.path.abspath(__file__), "--backend", args.backend, "--steps", str(args.steps)]
    return subprocess.call([*pgrun, *script])


if __name__ == "__main__":
    sys.exit(main())
