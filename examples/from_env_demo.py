"""Form the job's group from its launcher's environment, and print what a few collectives give.

The same script runs under every launcher ``ProcessGroup.from_env()`` understands::

    pgrun -n 3 examples/from_env_demo.py
    python -m torch.distributed.run --standalone --nproc-per-node 3 examples/from_env_demo.py
    srun -n 3 python examples/from_env_demo.py
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 mpiexec -n 3 python examples/from_env_demo.py

Every rank prints one line, ``from_env_demo: rank R/N ...``; the results depend only on the
world size, so every launcher prints the same lines.
"""

from __future__ import annotations

import argparse
import sys

import torch
from pg_core import ProcessGroup, ReduceOp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=None, help="e.g. tcp or cpu:gloo (default: PG_BACKENDS, else the best)")
    args = parser.parse_args()
    with ProcessGroup.from_env(backends=args.backends, timeout=120) as group:
        rank, size = group.rank, group.size
        summed = torch.arange(4, dtype=torch.float32) + rank
        group.all_reduce(summed)
        biggest = torch.tensor([float(rank * 10 + 1)])
        group.all_reduce(biggest, op=ReduceOp.MAX)
        last = torch.full((2,), float(rank))
        group.broadcast(last, src=size - 1)
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        group.all_gather(gathered, torch.tensor([rank * rank]))
        names = group.all_gather_object(f"r{rank}")
        line = (
            f"from_env_demo: rank {rank}/{size} all_reduce={summed.tolist()} max={biggest.tolist()} "
            f"broadcast={last.tolist()} all_gather={[int(t) for t in gathered]} objects={names}\n"
        )
        sys.stdout.write(line)  # one write: under torchrun the ranks share one stdout, and print() writes twice
        sys.stdout.flush()
        group.barrier()


if __name__ == "__main__":
    main()
