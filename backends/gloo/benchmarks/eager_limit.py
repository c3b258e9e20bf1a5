"""How pg-gloo's two message forms compare by size: where its eager limit belongs.

    python backends/gloo/benchmarks/eager_limit.py [--rounds 5]

Two ranks, each pinned to its own core (where there are two), ping-pong through the group.
Per size, both forms run back to back in every round: *eager* (the payload copied into one
Gloo message with its header, copied out on the receiver) and *zero-copy* (a header, then the
payload as a second Gloo message from and into the tensors). The form is switched on both
ranks between barriers by setting the module's limit, which is what this program is for (the
declared limit is :data:`pg_gloo.plugin.EAGER_LIMIT_BYTES`). Prints the medians over rounds,
one way, and their ratio: the limit belongs where the ratio crosses 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
from pg_core import ProcessGroup, TCPStore
from pg_gloo import messages

SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]
FORMS = {"eager": 64 << 20, "zero-copy": 0}  # the limit that makes every size take the form


def _set_limit(limit: int) -> None:
    messages._INLINE, messages._FIRST = limit, messages._HEAD + limit


def _rank(rank: int, port: int, rounds: int, out: dict[tuple[int, str], list[float]]) -> None:
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {rank})
    store = TCPStore("127.0.0.1", port, is_master=False)
    with ProcessGroup(store, rank, 2, backends="gloo", timeout=120) as group:
        peer = 1 - rank
        for _ in range(rounds):
            for n in SIZES:
                msg, got = torch.ones(n // 4), torch.empty(n // 4)
                for form, limit in FORMS.items():
                    _set_limit(limit)
                    group.barrier()  # both ranks use the same form from here
                    iters = 40 if n <= (1 << 20) else 10

                    def once(msg: torch.Tensor = msg, got: torch.Tensor = got) -> None:
                        if rank == 0:
                            group.send(msg, peer)
                            group.recv(got, peer)
                        else:
                            group.recv(got, peer)
                            group.send(got, peer)

                    for _ in range(3):
                        once()
                    start = time.perf_counter()
                    for _ in range(iters):
                        once()
                    if rank == 0:
                        key = (n, form)
                        out[key] = [*out.get(key, []), (time.perf_counter() - start) / iters / 2 * 1e6]
        group.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    store = TCPStore("127.0.0.1", 0, is_master=True)
    out = mp.Manager().dict()
    procs = [mp.Process(target=_rank, args=(r, store.port, args.rounds, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    print(f"{'bytes':>10} {'eager us':>10} {'zero-copy us':>13} {'zero-copy/eager':>16}")
    for n in SIZES:
        eager, zero = statistics.median(out[(n, "eager")]), statistics.median(out[(n, "zero-copy")])
        print(f"{n:>10} {eager:10.1f} {zero:13.1f} {zero / eager:16.2f}")


if __name__ == "__main__":
    main()
