"""Serving pattern: prefill workers busy in a group of their own, decode workers joining at run time.

    python examples/serving_pattern.py

This script hosts a TCPStore on a free port and starts four worker processes:

1. Two prefill workers form the group "prefill-tp" and keep it busy from a
   background thread (all_reduce after all_reduce, as tensor-parallel prefill
   would).
2. Only then do two decode workers start. They know the store's address and
   nothing else: not the prefill group, not who else is running.
3. All four meet in the group "serving" with pg_core.rendezvous. Ranks are
   given in arrival order, so the workers first tell each other who is who.
4. Each prefill worker sends its decode partner a kv cache, a dict of tensors
   whose shapes the decode worker does not know, with send_tensor_dict, while
   "prefill-tp" keeps reducing.
5. "serving" splits (MPI_Comm_split style) into a prefill and a decode group,
   and the decode pair goes on in its own group.

Nothing here touches torch.distributed's default group.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from datetime import timedelta

import torch
from pg_core import ProcessGroup, ReduceOp, TCPStore, rendezvous

TIMEOUT = 60  # seconds, for every operation: a mistake is an error, not a hang


def log(role: str, message: str) -> None:
    sys.stdout.write(f"[{role}] {message}\n")  # one write per line: four processes share the terminal
    sys.stdout.flush()


class BusyLoop(threading.Thread):
    """Stands in for tensor-parallel prefill: all_reduce until every rank has called stop()."""

    def __init__(self, group: ProcessGroup) -> None:
        super().__init__(name=f"{group.name}-loop")
        self.group, self.steps, self.stopping = group, 0, False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while True:
                x = torch.ones(4096)
                self.group.all_reduce(x)
                assert x[0].item() == self.group.size
                # agree on whether to go on, so that every rank leaves after the same step
                go_on = torch.tensor([0 if self.stopping else 1])
                self.group.all_reduce(go_on, op=ReduceOp.MAX)
                self.steps += 1
                if go_on.item() == 0:
                    return
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self.stopping = True
        self.join(timeout=TIMEOUT)
        if self.error is not None:
            raise self.error
        assert not self.is_alive(), "the loop did not stop"


def who_is_who(serving: ProcessGroup, role: str) -> dict[str, int]:
    """Role -> rank in ``serving`` (rendezvous ranks are in arrival order)."""
    roles = serving.all_gather_object(role)
    return {r: rank for rank, r in enumerate(roles)}


def prefill(store: TCPStore, index: int) -> None:
    role = f"prefill-{index}"
    with ProcessGroup(store, rank=index, size=2, name="prefill-tp", timeout=TIMEOUT) as tp:
        loop = BusyLoop(tp)
        loop.start()
        store.set(f"ready/{role}", "1")  # the launcher starts the decode workers once both are busy
        log(role, f"busy in {tp!r}")

        with rendezvous(store, "serving", 4, timeout=TIMEOUT) as serving:
            rank_of = who_is_who(serving, role)
            log(role, f"joined 'serving' as rank {serving.rank}; ranks: {rank_of}")
            steps = loop.steps
            seq = 24 + 16 * index  # only this worker knows the shapes
            kv_cache = {
                "request": f"req-{index}",
                "seq_len": seq,
                "layers": {
                    layer: {"k": torch.randn(8, seq, 64).bfloat16(), "v": torch.randn(8, seq, 64).bfloat16()}
                    for layer in range(2)
                },
            }
            partner = rank_of[f"decode-{index}"]
            serving.send_tensor_dict(kv_cache, dst=partner)
            serving.recv_object(src=partner)  # the decode worker's receipt
            log(role, f"sent {kv_cache['request']} to decode-{index} while prefill-tp ran {loop.steps - steps} steps")

            group = serving.split(color=0, key=index)
            assert group is not None
            with group:
                log(role, f"after the split: rank {group.rank} of {group.size}, serving ranks {group.parent_ranks}")
        loop.stop()
        log(role, f"prefill-tp ran {loop.steps} steps in all")


def decode(store: TCPStore, index: int) -> None:
    role = f"decode-{index}"
    with rendezvous(store, "serving", 4, timeout=TIMEOUT) as serving:
        rank_of = who_is_who(serving, role)
        log(role, f"joined 'serving' as rank {serving.rank}; ranks: {rank_of}")
        partner = rank_of[f"prefill-{index}"]
        kv_cache = serving.recv_tensor_dict(src=partner)  # shapes and dtypes arrive with the data
        serving.send_object("received", dst=partner)
        k = kv_cache["layers"][0]["k"]
        log(role, f"received {kv_cache['request']}: {len(kv_cache['layers'])} layers of k/v {tuple(k.shape)} {k.dtype}")

        group = serving.split(color=1, key=index)
        assert group is not None
        with group:
            batch = group.all_gather_object(kv_cache["request"])  # the decode pair agrees on its batch
            log(role, f"decode group rank {group.rank} of {group.size} (serving ranks {group.parent_ranks}): {batch}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:  # a worker
        store = TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=TIMEOUT))
        kind, index = args.role.split("-")
        (prefill if kind == "prefill" else decode)(store, int(index))
        return 0

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port 0: a free port

    def start(role: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, __file__, "--role", role, "--port", str(store.port)]
        return subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"})

    procs = [start("prefill-0"), start("prefill-1")]
    try:
        store.wait(["ready/prefill-0", "ready/prefill-1"], timedelta(seconds=TIMEOUT))
        print("launcher: prefill-tp is busy; starting two decode workers", flush=True)
        procs += [start("decode-0"), start("decode-1")]
        codes = [proc.wait(timeout=2 * TIMEOUT) for proc in procs]
    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the store's wait, or a worker that hangs
        print(f"launcher: {exc}", file=sys.stderr)
        return 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(codes):
        print(f"launcher: worker exit codes {codes}", file=sys.stderr)
        return 1
    print("launcher: all four workers finished OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
