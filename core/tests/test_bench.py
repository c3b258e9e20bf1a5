"""`pg-core bench`: the checker that decides ok / WRONG, the arithmetic of the report, and
the program itself, run for real (rank processes, torch's Gloo, pg-core groups).

The pg-core side runs on backends defined in this file (``--backends test_bench:NAME``,
with this folder on the ranks' PYTHONPATH): one correct, one that corrupts a result,
one that corrupts bytes in transit, one that crashes on rank 1. pg-tcp is benchmarked
too once it is installed and available.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import itertools
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_core import bench
from pg_core.backend import Backend, BackendContext, Capabilities
from pg_core.bench import catalog, cli, config, inputs, plot, report, sizing
from pg_core.ops import OPS, ReduceOp
from pg_core.procs import wait_exited
from pg_core.store import wait_for

HERE = Path(__file__).resolve().parent
SIZES = [4, 4096]
TINY = ["--sizes", ",".join(map(str, SIZES)), "--iters", "5", "--warmup", "1", "--time-budget", "0.2"]


# -- backends the ranks load by "test_bench:NAME" ---------------------------------------------------


class StoreBackend(Backend):
    """send/recv as keys in the group's store: slow and simple, and correct; every collective
    comes from pg_core.algorithms. Enough to drive the whole pg-core path of the benchmark."""

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._lock = threading.Lock()
        self._next: dict[tuple[str, int, int], int] = {}

    def _key(self, way: str, src: int, dst: int, tag: int) -> str:
        peer = dst if way == "send" else src
        with self._lock:
            seq = self._next.get((way, peer, tag), 0)
            self._next[(way, peer, tag)] = seq + 1
        return f"msg/{src}/{dst}/{tag}/{seq}"

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        self.ctx.store.set(self._key("send", self.rank, dst, tag), data)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        key = self._key("recv", src, self.rank, tag)
        wait_for(self.ctx.store, [key], timeout)  # not store.wait: that holds the client isend's thread needs
        data = self.ctx.store.get(key)
        self.ctx.store.delete_key(key)
        if data:
            tensor.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


class WrongSumBackend(StoreBackend):
    """Correct, except that rank 0's all_reduce result is off by one in its last element.
    It declares no barrier, so the benchmark lines the ranks up on the store instead."""

    capabilities = Capabilities(ops=frozenset(OPS) - {"barrier"})

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        super().all_reduce(tensor, op, timeout=timeout)
        if self.rank == 0:
            tensor.view(-1)[-1] += 1


class ManglingBackend(StoreBackend):
    """Corrupts what it receives: the first run of the benchmark's float32 input in a
    message ([1, 2, 3, 1, 2, 3] becomes [1, 2, 3, 1, 2, 5]) and the first 16 bytes of
    request_object's payload (all 0xff), wherever they fall in the bytes, whatever
    the message format around them. Lengths stay, so messages still parse."""

    MANGLED = {
        inputs.input_values(0, 6, torch.float32).numpy().tobytes(): torch.tensor(
            [1, 2, 3, 1, 2, 5], dtype=torch.float32
        )
        .numpy()
        .tobytes(),
        bytes(inputs.request_object(16)["payload"]): b"\xff" * 16,
    }

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        super().recv(tensor, src, tag, timeout=timeout)
        view = tensor.reshape(-1).view(torch.uint8)
        data = view.numpy().tobytes()
        for pattern, replacement in self.MANGLED.items():
            at = data.find(pattern)
            if at >= 0:
                view[at : at + len(pattern)] = torch.frombuffer(bytearray(replacement), dtype=torch.uint8)


class LoggedA(StoreBackend):
    """Correct; each all_reduce appends the class's name to ``calls-<rank>.log`` in the
    working directory (with ``-async`` where the group's progress thread runs it: an
    ``async_op=True`` call, on this backend that does not launch), so a test can see the order
    in which the benchmark ran two backends and the two forms of an op."""

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        super().all_reduce(tensor, op, timeout=timeout)
        form = "" if threading.current_thread() is threading.main_thread() else "-async"
        with open(f"calls-{self.rank}.log", "a") as log:
            log.write(type(self).__name__ + form + "\n")


class LoggedB(LoggedA):
    """LoggedA under another name."""


class CrashOnRank1Backend(StoreBackend):
    """Rank 1 raises in all_reduce; rank 0 is left waiting for it."""

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, timeout: float) -> None:
        if self.rank == 1:
            raise RuntimeError("planted failure in all_reduce on rank 1")
        super().all_reduce(tensor, op, timeout=timeout)


# -- the checker --------------------------------------------------------------------------------------


def simulate(op: str, n: int, count: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Each rank's output, computed from the inputs with plain tensor ops (independently of bench)."""
    big = [inputs.input_values(r, count, dtype).double() for r in range(n)]
    block = count // n
    if op == "all_reduce":
        return [sum(big)] * n  # type: ignore[list-item]
    if op == "broadcast":
        return [big[0]] * n
    if op == "reduce":
        return [sum(big)] + [None] * (n - 1)  # type: ignore[list-item]
    if op == "all_gather_into_tensor":
        small = [inputs.input_values(r, block, dtype).double() for r in range(n)]
        return [torch.cat(small)] * n
    if op == "reduce_scatter_tensor":
        return [sum(big)[r * block : (r + 1) * block] for r in range(n)]  # type: ignore[index]
    if op == "all_to_all_single":
        return [torch.cat([big[q].chunk(n)[r] for q in range(n)]) for r in range(n)]
    if op == "send_recv":
        return [big[0], big[0]] + [None] * (n - 2)
    if op == "send_tensor":  # the same, in the shape only the sender knows
        return [big[0].reshape(inputs.tensor_shape(count))] * 2 + [None] * (n - 2)
    raise AssertionError(op)


@pytest.mark.parametrize("op", catalog.TENSOR_OPS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_expected_output_agrees_with_a_simulation_of_the_op(op: str, n: int) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        count = sizing.element_count(op, 60, n, dtype.itemsize)
        for rank, out in enumerate(simulate(op, n, count, dtype)):
            expected = inputs.expected_output(op, rank, n, count)
            assert (expected is None) == (out is None)
            if out is not None:
                assert expected is not None
                assert torch.equal(expected, out.reshape(-1)), (op, n, rank, dtype)
                assert inputs.check_output(op, rank, n, count, out.to(dtype), dtype=dtype) is None


def test_expected_output_by_hand_for_two_ranks() -> None:
    assert inputs.input_values(0, 4, torch.float32).tolist() == [1, 2, 3, 1]
    assert inputs.input_values(1, 4, torch.int32).tolist() == [2, 4, 6, 2]
    assert inputs.expected_output("all_reduce", 1, 2, 4).tolist() == [3, 6, 9, 3]  # type: ignore[union-attr]
    assert inputs.expected_output("all_gather_into_tensor", 0, 2, 4).tolist() == [1, 2, 2, 4]  # type: ignore[union-attr]
    assert inputs.expected_output("reduce_scatter_tensor", 1, 2, 4).tolist() == [9, 3]  # type: ignore[union-attr]
    assert inputs.expected_output("all_to_all_single", 1, 2, 4).tolist() == [3, 1, 6, 2]  # type: ignore[union-attr]
    assert inputs.expected_output("reduce", 1, 2, 4) is None


@pytest.mark.parametrize(
    ("op", "rank", "corrupt", "message"),
    [
        (
            "all_reduce",
            0,
            lambda t: t.view(-1)[5].add_(1),
            "1 of 8 elements wrong; first at index 5: got 10, expected 9",
        ),
        ("broadcast", 1, lambda t: t.copy_(inputs.input_values(1, 8, t.dtype)), "8 of 8 elements wrong"),
        ("all_gather_into_tensor", 0, lambda t: t.copy_(t.roll(4)), "wrong; first at index 0: got 2, expected 1"),
        ("reduce_scatter_tensor", 1, lambda t: t.fill_(-1), "4 of 4 elements wrong"),  # the poison left in place
        ("all_to_all_single", 1, lambda t: t.view(-1)[7].fill_(float("nan")), "at index 7: got nan"),
        ("send_recv", 1, lambda t: t.view(-1)[0].sub_(1e-3), "1 of 8 elements wrong; first at index 0"),
        ("send_tensor", 0, lambda t: t[0, 6].add_(1), "1 of 8 elements wrong; first at index 6: got 2, expected 1"),
    ],
)
def test_check_output_reports_a_wrong_result(op: str, rank: int, corrupt: Any, message: str) -> None:
    out = simulate(op, 2, 8, torch.float32)[rank]
    assert out is not None
    out = out.float()
    assert inputs.check_output(op, rank, 2, 8, out) is None
    corrupt(out)
    problem = inputs.check_output(op, rank, 2, 8, out)
    assert problem is not None and problem.startswith(f"{op}: rank {rank}") and message in problem, problem


def test_checking_in_chunks_gives_the_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    full = inputs.expected_output("all_to_all_single", 1, 3, 12)
    assert full is not None
    assert torch.equal(inputs.expected_output("all_to_all_single", 1, 3, 12, start=5, stop=9), full[5:9])  # type: ignore[arg-type]
    out = full.float()
    out[7] = 0
    out[10] = 0
    whole = inputs.check_output("all_to_all_single", 1, 3, 12, out)
    assert whole is not None and "2 of 12 elements wrong; first at index 7: got 0, expected" in whole
    monkeypatch.setattr(inputs, "CHECK_CHUNK", 4)
    assert inputs.check_output("all_to_all_single", 1, 3, 12, out) == whole


def test_check_output_reports_a_wrong_shape_and_a_missing_output() -> None:
    assert "shape (3,), expected (4,)" in str(inputs.check_output("all_reduce", 0, 2, 4, torch.ones(3)))
    assert "no output" in str(inputs.check_output("reduce", 0, 2, 4, None))
    assert inputs.check_output("reduce", 1, 2, 4, None) is None  # nothing is defined on a non-root


def test_send_tensor_is_checked_for_its_shape_and_dtype() -> None:
    assert inputs.tensor_shape(1024) == (16, 64)  # 4 KiB of float32
    assert inputs.tensor_shape(96) == (3, 32)
    assert inputs.tensor_shape(1) == (1, 1)
    right = inputs.input_values(0, 96, torch.float32).reshape(3, 32)
    assert inputs.check_output("send_tensor", 1, 2, 96, right, dtype=torch.float32) is None
    flat = inputs.check_output("send_tensor", 1, 2, 96, right.reshape(-1), dtype=torch.float32)
    assert flat == "send_tensor: rank 1 output has shape (96,), expected (3, 32)"
    assert "shape (32, 3)" in str(inputs.check_output("send_tensor", 1, 2, 96, right.reshape(32, 3)))
    as_double = inputs.check_output("send_tensor", 0, 2, 96, right.double(), dtype=torch.float32)
    assert as_double == "send_tensor: rank 0 output has dtype torch.float64, expected torch.float32"
    assert "no output" in str(inputs.check_output("send_tensor", 0, 2, 96, None))
    assert inputs.check_output("send_tensor", 2, 3, 96, None) is None  # rank 2 takes no part


def test_request_object_is_a_serving_request_with_a_payload_of_the_size_asked() -> None:
    for payload in (1, 4, 250, 251, 4096, 100_003):
        obj = inputs.request_object(payload)
        assert isinstance(obj["payload"], bytes) and len(obj["payload"]) == payload
        assert obj == inputs.request_object(payload)  # the same on every rank
        assert {"request_id", "prompt_token_ids", "sampling"} <= obj.keys()
    assert len(set(inputs.request_object(4096)["payload"])) == 251  # not one repeated byte
    assert 100 < inputs.object_size(4) < 400
    assert 4092 <= inputs.object_size(4096) - inputs.object_size(4) < 4092 + 8  # the payload, pickled in-band
    assert sizing.element_count("send_object", 4096, 2, 4) == 4096  # object ops count payload bytes


def test_check_object_reports_a_wrong_object() -> None:
    def check(op: str, rank: int, obj: object) -> str | None:
        return inputs.check_object(op, rank, 3, 300, obj)

    right = inputs.request_object(300)
    for op in catalog.OBJECT_OPS:
        assert check(op, 1, inputs.request_object(300)) is None
    corrupt = dict(right, payload=right["payload"][:7] + b"\xff" + right["payload"][8:])
    assert check("send_object", 0, corrupt) == (
        "send_object: rank 0: the object['payload'] differs first at index 7: got 255, expected 49"
    )
    short = dict(right, payload=right["payload"][:-1])
    assert (
        check("broadcast_object", 2, short)
        == "broadcast_object: rank 2: the object['payload'] has length 299, expected 300"
    )
    nested = dict(right, sampling=dict(right["sampling"], top_p=0.9))
    assert "the object['sampling']['top_p'] is 0.9, expected 0.95" in str(check("send_object", 1, nested))
    fewer = {k: v for k, v in right.items() if k != "priority"}
    assert "lacks keys ['priority'] and has extra keys []" in str(check("broadcast_object", 0, fewer))
    assert "the object is a NoneType, expected a dict" in str(check("broadcast_object", 1, None))
    assert "no object received" in str(check("send_object", 1, inputs.NOTHING))
    assert check("send_object", 2, None) is None  # rank 2 takes no part in the echo
    with pytest.raises(ValueError, match="not an object op"):
        inputs.check_object("send_recv", 0, 2, 4, right)
    with pytest.raises(ValueError, match="no tensor output"):
        inputs.expected_output("broadcast_object", 0, 2, 4)


# -- sizes, counts, bandwidth, planning -----------------------------------------------------------------


def test_parse_size() -> None:
    assert [sizing.parse_size(s) for s in ("4", "1K", "64k", "1M", "2G", "1KiB", "3MB")] == [
        4,
        1024,
        65536,
        1 << 20,
        2 << 30,
        1024,
        3 << 20,
    ]
    for bad in ("", "1T", "-4", "1.5K", "K"):
        with pytest.raises(ValueError, match="cannot read"):
            sizing.parse_size(bad)


def test_sweep_sizes() -> None:
    assert sizing.sweep_sizes(4, 64, 2) == [4, 8, 16, 32, 64]
    assert sizing.sweep_sizes(1024, 1 << 20, 32) == [1024, 32768, 1 << 20]
    assert sizing.sweep_sizes(5, 5, 2) == [5]
    assert sizing.sweep_sizes(1, 10, 1.5) == [1, 2, 3, 5, 8]  # rounded, repeats dropped
    with pytest.raises(ValueError, match="stepfactor must be a finite number greater than 1, got 1"):
        sizing.sweep_sizes(4, 64, 1)
    with pytest.raises(ValueError, match="1 <= -b/--minbytes <= -e/--maxbytes, got 64 and 4"):
        sizing.sweep_sizes(64, 4, 2)
    with pytest.raises(ValueError, match="makes 1001 sizes, more than 1000"):
        sizing.sweep_sizes(1, 2**1000, 2)
    assert len(sizing.sweep_sizes(1, 2**999, 2)) == sizing.MAX_SIZES


def test_sizes_as_nccl_tests_spells_them() -> None:
    nccl = config.config_from_args(_args("--backends", "", "-b", "8", "-e", "64M", "-f", "2")).sizes
    assert nccl == [8 << k for k in range(24)] and nccl[-1] == 64 << 20
    for spelled in (
        ["--minbytes", "8", "--maxbytes", "64M", "--stepfactor", "2"],
        ["--min-bytes", "8", "--max-bytes", "65536K", "--factor", "2.0"],
        ["-b", "8B", "-e", "64MiB"],  # -f defaults to 2
    ):
        assert config.config_from_args(_args("--backends", "", *spelled)).sizes == nccl, spelled
    assert config.config_from_args(_args("--backends", "", "-e", "64")).sizes == [4, 8, 16, 32, 64]  # -b defaults to 4
    assert config.config_from_args(_args("--backends", "", "-b", "1K", "-e", "1M", "-f", "32")).sizes == [
        1024,
        32768,
        1 << 20,
    ]
    assert config.config_from_args(_args("--backends", "", "--sizes", "4, 1K,4")).sizes == [
        4,
        1024,
    ]  # --sizes as before
    assert config.config_from_args(_args("--backends", "")).sizes == [4, 1024, 65536, 1 << 20, 64 << 20]


def test_help_shows_every_spelling_of_the_sweep() -> None:
    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for spelling in ("-b SIZE, --minbytes SIZE, --min-bytes SIZE", "-e SIZE, --maxbytes SIZE", "-f F, --stepfactor F"):
        assert spelling in text


def test_element_count_rounds_to_whole_blocks_per_rank() -> None:
    assert sizing.element_count("all_reduce", 4, 3, 4) == 1
    assert sizing.element_count("all_reduce", 2, 3, 4) == 1  # never zero
    assert sizing.element_count("all_gather_into_tensor", 4, 3, 4) == 3  # one element per rank at least
    assert sizing.element_count("all_to_all_single", 1024, 3, 4) == 255
    assert sizing.element_count("send_recv", 1024, 2, 2) == 512


def test_busbw_factors_are_nccl_tests() -> None:
    assert sizing.busbw_factor("all_reduce", 4) == 1.5
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        assert sizing.busbw_factor(op, 4) == 0.75
    for op in ("broadcast", "reduce", "send_recv", "send_tensor", "send_object", "broadcast_object"):
        assert sizing.busbw_factor(op, 4) == 1.0


def test_plan_iterations_respects_the_budget_and_the_bounds() -> None:
    # 10 us per iteration, 2 s budget: all the warmup and the most iterations
    assert sizing.plan_iterations(10_000, warmup=5, warmup_done=2, max_iters=200, budget_s=2.0) == (3, 200)
    # 0.1 s per iteration, 1 s budget: two more warmups (a fifth of the budget), then the 8 that fit
    assert sizing.plan_iterations(100_000_000, 5, 2, 200, 1.0) == (2, 8)
    # 3 s per iteration: no more warmup, and still the minimum of 5 timed iterations
    assert sizing.plan_iterations(3_000_000_000, 5, 2, 200, 1.0) == (0, sizing.MIN_ITERS)
    # fewer than the minimum if the user asks for fewer
    assert sizing.plan_iterations(3_000_000_000, 5, 2, 3, 1.0) == (0, 3)


def test_each_round_starts_one_row_further_along() -> None:
    rows = ["raw", "raw.again", "gloo"]
    orders = [sizing.rotated(rows, turn) for turn in range(6)]
    assert orders[:3] == [["raw", "raw.again", "gloo"], ["raw.again", "gloo", "raw"], ["gloo", "raw", "raw.again"]]
    assert orders[3:] == orders[:3]
    for name in rows:  # each row first, and after each other row, once in three rounds
        assert [order.index(name) for order in orders[:3]] in ([0, 2, 1], [1, 0, 2], [2, 1, 0])
    assert sizing.rotated([], 4) == [] and sizing.rotated(["x"], 7) == ["x"]


def _row(backend: str, median: float, *, baseline: bool = False, op: str = "all_reduce") -> report.Row:
    return report.Row(
        op=op,
        backend=backend,
        baseline=baseline,
        size=1024,
        requested_size=1024,
        count=256,
        dtype="float32",
        world_size=2,
        warmup=2,
        iters=5,
        min_us=median / 2,
        median_us=median,
        max_us=median * 2,
        algbw_gbps=1024 / median / 1e3,
        busbw_gbps=1024 / median / 1e3,
        status="ok",
    )


def test_reports() -> None:
    rows = [_row(catalog.BASELINE, 100.0, baseline=True), _row("tcp", 85.0)]
    report.add_ratios(rows)
    assert rows[0].ratio is None and rows[1].ratio == pytest.approx(0.85) and rows[1].ratio_to == catalog.BASELINE
    table = report.format_table(rows)
    assert "# all_reduce (world size 2, float32, sum)" in table
    assert "0.85x torch-gloo" in table and "85.0" in table
    assert json.loads(report.format_json(rows))[1]["ratio"] == pytest.approx(0.85)
    lines = report.format_csv(rows).splitlines()
    assert lines[0].startswith("op,backend,baseline,size,") and len(lines) == 3
    assert "vs " not in table  # all_reduce has no reference op


def test_with_rounds_each_rounds_medians_are_compared_round_by_round() -> None:
    base, gloo, tcp = _row(catalog.BASELINE, 100.0, baseline=True), _row("gloo", 104.0), _row("tcp", 90.0)
    base.round_median_us = [100.0, 200.0, 100.0, 100.0, 100.0]  # the machine slowed down in round 2
    gloo.round_median_us = [104.0, 204.0, 102.0, 101.0, 106.0]  # paired: that round weighs as little as the others
    tcp.round_median_us = [90.0, 180.0, 90.0]  # rounds that do not pair up give no round ratios
    for row in (base, gloo, tcp):
        row.rounds = 5
    rows = [base, gloo, tcp]
    report.add_ratios(rows)
    assert gloo.round_ratios == pytest.approx([1.04, 1.02, 1.02, 1.01, 1.06])
    assert base.round_ratios is None and tcp.round_ratios is None and tcp.ratio == pytest.approx(0.9)
    assert report.quartiles(gloo.round_ratios) == pytest.approx((1.02, 1.04))
    assert report.quartiles([1.5]) == (1.5, 1.5)
    table = report.format_table(rows)
    assert "1.04x torch-gloo [1.02-1.04]" in table and "0.90x torch-gloo [" not in table
    assert "interleaved in 5 rounds" in table and "# [a-b] (--rounds)" in table
    assert "# [a-b]" not in report.format_table([base, tcp])  # no round ratios: no legend for them
    assert json.loads(report.format_json(rows))[1]["round_ratios"] == pytest.approx(gloo.round_ratios)


def test_send_tensor_is_compared_with_send_recv_on_the_same_backend() -> None:
    rows = [
        _row(catalog.BASELINE, 300.0, baseline=True, op="send_tensor"),
        _row("tcp", 60.0, op="send_tensor"),
        _row(catalog.BASELINE, 50.0, baseline=True, op="send_recv"),
        _row("tcp", 48.0, op="send_recv"),
        _row("other", 10.0, op="send_tensor"),  # no send_recv row of its own: no comparison
    ]
    report.add_ratios(rows)
    st_base, st_tcp, sr_base, sr_tcp, other = rows
    assert st_base.ref_ratio == pytest.approx(6.0) and st_base.ref_op == "send_recv"
    assert st_tcp.ref_ratio == pytest.approx(1.25) and st_tcp.ratio == pytest.approx(0.2)
    assert sr_base.ref_ratio is None and sr_tcp.ref_ratio is None and other.ref_ratio is None
    table = report.format_table(rows)
    send_tensor = table.split("\n\n")[0].splitlines()
    assert send_tensor[0].startswith("# send_tensor (world size 2, float32, shape unknown to the receiver")
    assert send_tensor[1].split()[-2:] == ["send_recv", "check"]  # the "vs send_recv" column
    assert send_tensor[3].split()[-5:] == ["0.20x", "torch-gloo", "1.25x", "+12.0us", "ok"]
    assert send_tensor[4].split()[-2:] == ["-", "ok"]
    assert "send_tensor vs send_recv is the cost of a shape the receiver does not" in table
    assert json.loads(report.format_json(rows))[1]["ref_ratio"] == pytest.approx(1.25)
    assert json.loads(report.format_json(rows))[1]["ref_diff_us"] == pytest.approx(12.0)


def test_an_asynchronous_form_is_compared_with_its_blocking_op() -> None:
    rows = [
        _row("tcp", 50.0, op="all_reduce"),
        _row("tcp", 53.5, op="all_reduce_async"),
        _row("tcp", 40.0, op="send_recv"),
        _row("tcp", 38.0, op="isend_irecv"),
    ]
    report.add_ratios(rows)
    assert rows[1].ref_op == "all_reduce" and rows[1].ref_diff_us == pytest.approx(3.5)
    assert rows[3].ref_op == "send_recv" and rows[3].ref_diff_us == pytest.approx(-2.0)
    assert rows[0].ref_ratio is None and rows[2].ref_ratio is None
    tables = report.format_table(rows).split("\n\n")
    assert tables[1].startswith("# all_reduce_async (world size 2, float32, sum, async_op=True then wait()")
    assert tables[1].splitlines()[2].split()[-3:] == ["1.07x", "+3.5us", "ok"]
    assert "# [+a +b]" not in report.format_table(rows)  # no rounds: no round differences
    assert "isend().wait() then irecv().wait()" in tables[3]
    # the asynchronous form leaves what its op leaves, and moves as much
    assert torch.equal(
        inputs.expected_output("all_reduce_async", 1, 2, 4), inputs.expected_output("all_reduce", 1, 2, 4)
    )
    assert sizing.busbw_factor("all_reduce_async", 4) == sizing.busbw_factor("all_reduce", 4)


def test_with_rounds_an_asynchronous_forms_difference_is_given_round_by_round_too() -> None:
    blocking, launched = _row("shm", 10.0, op="send_recv"), _row("shm", 14.0, op="isend_irecv")
    blocking.round_median_us = [10.0, 30.0, 10.0, 11.0, 10.0]  # round 2: the machine was busy
    launched.round_median_us = [12.0, 31.0, 13.0, 14.0, 13.0]
    for row in (blocking, launched):
        row.rounds = 5
    rows = [blocking, launched]
    report.add_ratios(rows)
    assert launched.ref_round_diffs_us == pytest.approx([2.0, 1.0, 3.0, 3.0, 3.0])
    assert blocking.ref_round_diffs_us is None
    table = report.format_table(rows)
    assert "1.40x +4.0us [+2.0 +3.0]" in table and "# [+a +b] after a vs OP difference" in table
    assert json.loads(report.format_json(rows))[1]["ref_round_diffs_us"] == pytest.approx([2.0, 1.0, 3.0, 3.0, 3.0])


def test_async_adds_each_asynchronous_form_after_its_op() -> None:
    cfg = config.config_from_args(_args("--backends", "", "--ops", "all_reduce,reduce,send_recv", "--async"))
    assert cfg.ops == ["all_reduce", "all_reduce_async", "reduce", "send_recv", "isend_irecv"]
    assert config.config_from_args(_args("--backends", "", "--ops", "broadcast_async")).ops == ["broadcast_async"]
    assert "all_reduce_async" not in config.config_from_args(_args("--backends", "")).ops  # 'all' leaves them out
    with pytest.raises(catalog.BenchError, match="unknown reduce_async"):
        config.config_from_args(_args("--backends", "", "--ops", "reduce_async"))


def test_each_backend_is_compared_with_its_own_librarys_baseline() -> None:
    baselines = [catalog.BASELINE, catalog.MPI4PY]
    assert report.compared_with("gloo", baselines) == catalog.BASELINE
    assert report.compared_with("mpi", baselines) == catalog.MPI4PY
    assert report.compared_with("tcp", baselines) == catalog.BASELINE  # no library of its own: the first
    assert report.compared_with("tcp", baselines[::-1]) == catalog.MPI4PY
    assert report.compared_with("mpi", [catalog.BASELINE]) == catalog.BASELINE  # its own was not measured
    assert report.compared_with("mpi", []) is None
    rows = [
        _row(catalog.BASELINE, 100.0, baseline=True),
        _row(catalog.MPI4PY, 10.0, baseline=True),
        _row("tcp", 50.0),
        _row("gloo", 120.0),
        _row("mpi", 15.0),
        _row("gloo.to_torch", 110.0),
        _row(catalog.MPI4PY + catalog.CONTROL, 11.0),  # --control: a baseline again, compared with itself
        _row(catalog.BASELINE + catalog.CONTROL, 97.0),
    ]
    report.add_ratios(rows)
    got = {r.backend: (r.ratio_to, r.ratio) for r in rows}
    assert got == {
        catalog.BASELINE: (None, None),
        catalog.MPI4PY: (None, None),
        "tcp": (catalog.BASELINE, pytest.approx(0.5)),
        "gloo": (catalog.BASELINE, pytest.approx(1.2)),
        "mpi": (catalog.MPI4PY, pytest.approx(1.5)),
        "gloo.to_torch": (catalog.BASELINE, pytest.approx(1.1)),
        "mpi4py.again": (catalog.MPI4PY, pytest.approx(1.1)),
        "torch-gloo.again": (catalog.BASELINE, pytest.approx(0.97)),
    }
    table = report.format_table(rows)
    assert "1.50x mpi4py" in table and "1.20x torch-gloo" in table


def test_baselines_auto_adds_mpi4py_only_where_mpiexec_starts_the_ranks() -> None:
    assert config.choose_baselines("auto", set()) == [catalog.BASELINE]
    if importlib.util.find_spec("mpi4py") is None:  # pg-mpi brings it; without it, auto leaves it out
        assert config.choose_baselines("auto", {"mpiexec"}) == [catalog.BASELINE]
        with pytest.raises(catalog.BenchError, match="--baseline mpi4py needs mpi4py"):
            config.choose_baselines("mpi4py", set())
        return
    assert config.choose_baselines("auto", {"mpiexec"}) == [catalog.BASELINE, catalog.MPI4PY]
    assert config.choose_baselines(" mpi4py , torch-gloo,mpi4py", set()) == [catalog.MPI4PY, catalog.BASELINE]
    cfg = config.config_from_args(_args("--backends", "", "--baseline", "torch-gloo,mpi4py"))
    assert cfg.baselines == [catalog.BASELINE, catalog.MPI4PY] and cfg.launcher == "mpiexec"
    assert cfg.runners() == 2


def _sized(row: report.Row, size: int) -> report.Row:
    return dataclasses.replace(row, size=size, requested_size=size, count=size // 4)


def test_plot_has_a_row_of_panels_per_op_with_units_and_its_legend_off_the_data(tmp_path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rows = [
        _sized(
            _row(
                backend,
                100.0 * (k + 1) * (100 if op == "send_recv" else 1),
                baseline=backend in catalog.BASELINES,
                op=op,
            ),
            size,
        )
        for op in ("all_reduce", "send_recv")
        for size in (4, 64 << 10, 1 << 20)
        for k, backend in enumerate([catalog.BASELINE, catalog.MPI4PY, "tcp", "gloo", "mpi"])
    ]
    rows.append(dataclasses.replace(rows[0], size=16, median_us=None, status="skipped"))  # no time: not drawn
    colours = plot.plot_colours(rows)
    assert colours[catalog.BASELINE] == colours["gloo"] and colours[catalog.MPI4PY] == colours["mpi"]
    assert len({colours["tcp"], colours["gloo"], colours["mpi"]}) == 3
    fig = plot.plot_figure(rows)
    assert len(fig.axes) == 4  # per op: time, bus bandwidth
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    (legend,) = fig.legends  # one for the figure, none in a panel
    assert all(ax.get_legend() is None for ax in fig.axes)
    assert {t.get_text() for t in legend.get_texts()} == {catalog.BASELINE, catalog.MPI4PY, "tcp", "gloo", "mpi"}
    legend_box = legend.get_window_extent(renderer)
    for op, (latency, bandwidth) in zip(("all_reduce", "send_recv"), [fig.axes[:2], fig.axes[2:]], strict=True):
        assert latency.get_title().startswith(f"{op}: median time") and bandwidth.get_title().startswith(f"{op}: bus")
        for ax in (latency, bandwidth):
            assert not legend_box.overlaps(ax.get_window_extent(renderer)), f"the legend covers {ax.get_title()}"
            assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
            assert ax.get_xlabel() == "message size per rank (bytes)"
            assert [t.get_text() for t in ax.get_xticklabels()] == ["4 B", "64 KiB", "1 MiB"]
            lines = {line.get_label(): line for line in ax.get_lines()}
            assert set(lines) == {catalog.BASELINE, catalog.MPI4PY, "tcp", "gloo", "mpi"}  # this op's only
            for label, line in lines.items():
                assert line.get_color() == colours[label]
                assert line.get_linestyle() == ("--" if label in catalog.BASELINES else "-"), label
                assert list(line.get_xdata()) == [4, 64 << 10, 1 << 20]
            assert len({line.get_marker() for line in lines.values()}) == 5
        assert bandwidth.get_ylabel() == "bus bandwidth (GB/s)"
    assert fig.axes[0].get_ylabel() == "median time per iteration (µs)"
    assert list(fig.axes[0].get_lines()[2].get_ydata()) == [300.0] * 3  # tcp's median times, in µs
    assert fig.axes[2].get_ylabel() == "median time per iteration (ms)"  # 10 to 50 ms: read in ms
    assert list(fig.axes[2].get_lines()[2].get_ydata()) == [30.0] * 3
    assert "world size 2" in fig._suptitle.get_text() and "float32" in fig._suptitle.get_text()
    many = [_sized(_row("tcp", 10.0 * (k + 1)), 4 << k) for k in range(20)]  # 4 B .. 2 MiB: 20 sizes
    labels = [t.get_text() for t in plot.plot_figure(many).axes[0].get_xticklabels()]
    assert 2 <= len(labels) <= 9 and labels[0] == "4 B" and all(label.endswith(("B", "iB")) for label in labels)
    path = tmp_path / "plot.png"
    plot.write_plot(rows, str(path))
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 10_000
    with pytest.raises(catalog.BenchError, match="no row has a time to plot"):
        plot.plot_figure([rows[-1]])


def test_the_report_says_what_every_backend_it_shows_is() -> None:
    from pg_core.registry import default_registry

    entries = default_registry().entries()
    installed = [e for e in entries if e.distribution is not None]
    assert installed, "no backend plugin is installed: make install puts the in-repo ones in the venv"
    labels = [catalog.BASELINE, catalog.MPI4PY, *(e.name for e in installed), "gloo.to_torch", "test_bench:OK_SPEC"]
    about = report.describe_backends([*labels, catalog.BASELINE + ".again"], entries)
    said = dict(line.split(": ", 1) for line in about)
    assert list(said) == [catalog.BASELINE, catalog.MPI4PY, *(e.name for e in installed), "test_bench:OK_SPEC"]
    assert "torch's own ProcessGroupGloo" in said[catalog.BASELINE] and "mpi4py" in said[catalog.MPI4PY]
    for entry in installed:  # its distribution, and the summary its metadata gives
        assert entry.distribution is not None
        summary = bench_metadata(entry.distribution)
        assert said[entry.name] == f"{entry.distribution} {entry.version}: {summary}", said[entry.name]
    assert said["test_bench:OK_SPEC"].startswith("not an installed plugin")
    first = installed[0]
    pinned = f"{first.name}@{first.distribution}"  # a pinned name is its plugin's; a dotted reference is listed
    again = dict(line.split(": ", 1) for line in report.describe_backends([pinned, "pkg.mod:SPEC"], entries))
    assert again[pinned] == said[first.name] and again["pkg.mod:SPEC"].startswith("not an installed plugin")
    by_distribution = {e.distribution: e.name for e in installed}
    if "pg-storecomm" in by_distribution:  # the repository's example plugin (examples/third_party_plugin)
        assert "example" in said[by_distribution["pg-storecomm"]].lower()
    rows = [_row(catalog.BASELINE, 100.0, baseline=True), _row("tcp", 50.0)]
    table = report.format_table(rows, ["torch-gloo: what it is", "tcp: what that is"])
    assert "# backends:\n#   torch-gloo: what it is\n#   tcp: what that is\n# size:" in table


def bench_metadata(distribution: str) -> str:
    from importlib import metadata

    return str(metadata.metadata(distribution).json["summary"])


def test_make_demo_ends_with_a_short_bench_whose_arguments_hold() -> None:
    """The Makefile's demo target runs `pg-core bench $(DEMO_BENCH)`: the arguments parse and
    validate (a renamed option would break `make demo`), and the run stays small."""
    import re
    import shlex

    makefile = (HERE.parent.parent / "Makefile").read_text()
    found = re.search(r"^DEMO_BENCH\s*:=\s*(.+)$", makefile, flags=re.MULTILINE)
    assert found is not None
    assert "pg-core bench $(DEMO_BENCH)" in makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    cfg = config.config_from_args(_args(*shlex.split(found.group(1))))
    assert cfg.ops == ["all_reduce"] and cfg.world_size == 2
    assert len(cfg.sizes) <= 4 and cfg.time_budget <= 0.5  # a few rows, well under a minute


# -- the progress bar ---------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_is_drawn_only_on_a_terminal_and_not_when_quiet() -> None:
    from pg_core.progress import ProgressBar

    assert ProgressBar.wanted(_Terminal())
    assert not ProgressBar.wanted(_Terminal(), quiet=True)
    assert not ProgressBar.wanted(io.StringIO())
    closed = io.StringIO()
    closed.close()
    assert not ProgressBar.wanted(closed)  # isatty raises ValueError on a closed stream


def test_progress_bar_shows_cases_what_runs_and_the_time() -> None:
    from pg_core.progress import REDRAW_S, ProgressBar

    now = [100.0]
    out = _Terminal()
    bar = ProgressBar(out, 40, width=80, clock=lambda: now[0])
    bar.update(current="all_reduce 64 KiB on gloo")
    assert out.getvalue() == "\r\x1b[K[>                   ]  0/40  all_reduce 64 KiB on gloo  0:00"
    now[0] += 75
    bar.done = 10
    bar.print("bench: [10/40] a finished row")
    assert out.getvalue().endswith(
        "\r\x1b[Kbench: [10/40] a finished row\n\r\x1b[K[=====>              ]  10/40  all_reduce 64 KiB on gloo  1:15"
    )
    drawn = out.getvalue()
    bar.tick()  # the clock has not moved on
    assert out.getvalue() == drawn
    now[0] += 3600 + REDRAW_S
    bar.tick()
    assert out.getvalue().endswith("10/40  all_reduce 64 KiB on gloo  1:01:15")
    bar.update(done=41)
    assert out.getvalue().endswith("[====================]  40/40  all_reduce 64 KiB on gloo  1:01:15")
    bar.close()
    assert out.getvalue().endswith("\r\x1b[K") and "\n" not in out.getvalue().split("a finished row\n")[1]
    narrow = ProgressBar(_Terminal(), 3, width=30, clock=lambda: 0.0)
    assert len(narrow.line()) == 29
    quiet = _Terminal()
    ProgressBar(quiet, 3).close()  # never drawn: nothing to erase
    assert quiet.getvalue() == ""


def _args(*argv: str) -> Any:
    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ops", "all_reduce,allreduce"], "--ops: unknown allreduce"),
        (["--backends", "no-such-backend"], "no-such-backend"),
        (["--backends", "pg_core.bench:Nope"], "cannot load 'pg_core.bench:Nope': module pg_core.bench defines no"),
        (["--backends", "", "--no-baseline"], "nothing to measure"),
        (["--backends", "tcp", "--no-baseline", "--control"], "--control times a baseline twice"),
        (["--sizes", "4,1T"], "cannot read '1T'"),
        (["--sizes", "4", "--max-bytes", "1M"], "either --sizes or -b/-e/-f"),
        (["--sizes", "4", "-f", "4"], "either --sizes or -b/-e/-f"),
        (["--sizes", " , "], "--sizes: no size given"),
        (["--sizes", "0,4"], "--sizes: every size must be at least 1 byte, got 0"),
        (["-b", "1T"], "-b/--minbytes: cannot read '1T' as a size"),
        (["-e", "64 M B"], "-e/--maxbytes: cannot read '64 M B' as a size"),
        (["-b", "64M", "-e", "8"], "a sweep needs 1 <= -b/--minbytes <= -e/--maxbytes, got 67108864 and 8 bytes"),
        (["-b", "0", "-e", "8"], "a sweep needs 1 <= -b/--minbytes"),
        (["-f", "1"], "-f/--stepfactor must be a finite number greater than 1, got 1"),
        (["-f", "0.5"], "-f/--stepfactor must be a finite number greater than 1, got 0.5"),
        (["-f", "nan"], "-f/--stepfactor must be a finite number greater than 1, got nan"),
        (["-f", "inf"], "-f/--stepfactor must be a finite number greater than 1, got inf"),
        (["-f", "two"], "-f/--stepfactor: cannot read 'two' as a number"),
        (["-b", "8", "-e", "64M", "-f", "1.001"], "makes 15951 sizes, more than 1000: raise -f/--stepfactor"),
        (["--baseline", "torch-gloo,nccl"], "--baseline: unknown nccl; known: torch-gloo, mpi4py"),
        (["--baseline", ","], "--baseline: unknown nothing named"),
        (["--world-size", "0"], "--world-size must be >= 1"),
        (["--rounds", "0"], "--rounds must be >= 1, got 0"),
        (["--backends", "", "--plot", "no/such/folder/x.png"], "--plot no/such/folder/x.png: the folder"),
    ],
)
def test_bad_arguments_fail_before_any_rank_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(_args(*argv)) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_says_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # as if matplotlib were not installed
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    assert bench.main(_args("--backends", "", "--plot", "x.png")) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


# -- the program, for real ---------------------------------------------------------------------------------


def _tcp_reason() -> str | None:
    from pg_core.registry import default_registry

    for entry in default_registry().entries():
        if entry.name == "tcp":
            return None if entry.status == "available" else f"pg-tcp's backend 'tcp' is {entry.status}: {entry.reason}"
    return "pg-tcp (backend 'tcp') is not installed"


_MARKER = f"pg-core-bench-test-{uuid.uuid4().hex}"


def _commands(tmp: Path) -> dict[str, list[str]]:
    commands = {
        # the baseline alone, and again as its own control row (compared with the first)
        "baseline": ["--backends", "", "--control", "--csv", *TINY],
        # one good and one bad pg-core backend beside the baseline; the bad one declares no barrier
        "mixed": [
            "--backends",
            "test_bench:StoreBackend,test_bench:WrongSumBackend",
            "--ops",
            "all_reduce,broadcast,send_recv",
            "--json",
            *TINY,
            "--plot",
            str(tmp / "bench.png"),  # matplotlib is a dev dependency (Makefile)
        ],
        "crash": [
            "--backends",
            "test_bench:CrashOnRank1Backend",
            "--no-baseline",
            "--ops",
            "broadcast,all_reduce",
            "--timeout",
            "20",
            *TINY,
        ],
        # the object and unknown-shape ops through pg-core's messages on a backend without
        # send_bytes, beside one that corrupts bytes in transit (its rows must be WRONG);
        # with the ranks pinned to CPUs where the platform can
        "objects": [
            "--backends",
            "test_bench:StoreBackend,test_bench:ManglingBackend",
            "--no-baseline",
            *(["--pin-ranks"] if hasattr(os, "sched_setaffinity") else []),
            "--ops",
            "send_object,broadcast_object,send_tensor,send_recv",
            "--json",
            *TINY,
        ],
    }
    # two backends, all_reduce and its asynchronous form, timed in 3 interleaved rounds; the only
    # run here whose backends log their calls
    commands["rounds"] = [
        "--backends",
        "test_bench:LoggedA,test_bench:LoggedB",
        "--no-baseline",
        "--ops",
        "all_reduce",
        "--async",
        "--sizes",
        "4",
        "--iters",
        "6",
        "--warmup",
        "1",
        "--time-budget",
        "0.2",
        "--rounds",
        "3",
    ]
    if _tcp_reason() is None:
        commands["tcp"] = ["--backends", "tcp", "--json", *TINY]
    return commands


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """Every bench run of this module, started at once (each pays torch's import time).

    Timing numbers mean nothing here (the runs share the CPUs); the tests check the
    shape of the output, the checks and the exit statuses, never speed.
    """
    tmp = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PG_CORE_BENCH_TEST_MARKER=_MARKER)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "pg_core.bench", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp,
        )
        for name, argv in _commands(tmp).items()
    }
    results: dict[str, subprocess.CompletedProcess[str]] = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        yield results
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def _rows(run: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    assert isinstance(rows, list)
    return rows


def _well_formed(
    rows: list[dict[str, Any]], ops: tuple[str, ...], backends: list[str], sizes: list[int] = SIZES
) -> None:
    fields = {f.name for f in dataclasses.fields(report.Row)}
    wanted = {(op, size, b) for op, size, b in itertools.product(ops, sizes, backends)}
    assert {(r["op"], r["requested_size"], r["backend"]) for r in rows} == wanted
    assert len(rows) == len(wanted)
    baseline = catalog.BASELINE in backends
    for r in rows:
        assert set(r) == fields
        assert r["status"] == "ok", r
        assert r["world_size"] == 2
        assert r["iters"] == 5 and r["warmup"] >= 1
        assert 0 < r["min_us"] <= r["median_us"] <= r["max_us"], r
        if r["op"] in catalog.OBJECT_OPS:  # count: the payload's bytes; size: the object pickled
            assert r["dtype"] == "object" and r["count"] == r["requested_size"]
            assert r["size"] == inputs.object_size(r["count"])
        else:
            assert r["dtype"] == "float32"
            assert r["size"] == r["count"] * 4 and r["size"] >= 4
        assert r["algbw_gbps"] == pytest.approx(r["size"] / r["median_us"] / 1e3)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * sizing.busbw_factor(r["op"], 2))
        if r["baseline"] or not baseline:
            assert r["backend"] in (catalog.BASELINE if baseline else backends) and r["ratio"] is None
        else:
            base = next(b for b in rows if b["baseline"] and (b["op"], b["size"]) == (r["op"], r["size"]))
            assert r["ratio"] == pytest.approx(r["median_us"] / base["median_us"])
            assert r["ratio_to"] == catalog.BASELINE
        ref_op = catalog.REFERENCE_OPS.get(r["op"])
        ref = [b for b in rows if (b["op"], b["size"], b["backend"]) == (ref_op, r["size"], r["backend"])]
        if ref:  # send_tensor beside send_recv of the same size on the same backend
            assert r["ref_op"] == ref_op and r["ref_ratio"] == pytest.approx(r["median_us"] / ref[0]["median_us"])
        else:
            assert r["ref_op"] is None and r["ref_ratio"] is None


@pytest.mark.slow
def test_baseline_alone_and_again_as_its_control(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = runs["baseline"]
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    fields = lines[0].split(",")
    rows: list[dict[str, Any]] = []
    for line in lines[1:]:
        r: dict[str, Any] = dict(zip(fields, line.split(","), strict=True))
        r.update({k: int(r[k]) for k in ("size", "requested_size", "count", "world_size", "warmup", "iters")})
        r.update({k: float(r[k]) for k in ("min_us", "median_us", "max_us", "algbw_gbps", "busbw_gbps")})
        r.update(
            baseline=r["baseline"] == "True",
            ratio=float(r["ratio"]) if r["ratio"] else None,
            ratio_to=r["ratio_to"] or None,
            detail=r["detail"] or None,
        )
        r.update(ref_ratio=float(r["ref_ratio"]) if r["ref_ratio"] else None, ref_op=r["ref_op"] or None)
        rows.append(r)
    again = catalog.BASELINE + catalog.CONTROL
    _well_formed(rows, catalog.OPS, [catalog.BASELINE, again])
    assert {r["ratio_to"] for r in rows if r["backend"] == again} == {catalog.BASELINE}
    assert "\r" not in run.stderr and "\x1b" not in run.stderr  # stderr is a pipe here: no progress bar
    total = 2 * len(catalog.OPS) * len(SIZES)
    assert f"bench: [{total}/{total}] {catalog.OPS[-1]} {inputs.object_size(SIZES[-1])} B {again}" in run.stderr


@pytest.mark.slow
@pytest.mark.requires_backend("tcp")  # the root conftest: pg-tcp missing or broken fails, never skips
def test_tcp_beside_the_baseline(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    _well_formed(_rows(runs["tcp"]), catalog.OPS, [catalog.BASELINE, "tcp"])


@pytest.mark.slow
def test_objects_and_unknown_shapes_through_pg_core_and_what_corrupts_them(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = runs["objects"]
    assert run.returncode == 1, run.stderr  # ManglingBackend's rows
    rows = json.loads(run.stdout)
    ops = ("send_object", "broadcast_object", "send_tensor", "send_recv")
    _well_formed([r for r in rows if r["backend"] == "StoreBackend"], ops, ["StoreBackend"])
    mangled = {(r["op"], r["requested_size"]): r for r in rows if r["backend"] == "ManglingBackend"}
    assert set(mangled) == set(itertools.product(ops, SIZES))
    # at 4 bytes the patterns it corrupts do not occur; at 4 KiB every op delivers wrong data to rank 1
    expected = {
        "send_recv": "send_recv: rank 1: ",
        "send_tensor": "send_tensor: rank 1: ",
        "send_object": "send_object: rank 1: the object['payload'] differs first at index 0: got 255, expected 0",
        "broadcast_object": "broadcast_object: rank 1: the object['payload'] differs first at index 0: got 255",
    }
    for op, start in expected.items():
        r = mangled[(op, 4096)]
        assert r["status"] == "WRONG" and r["median_us"] > 0, r
        assert start in r["detail"], r["detail"]
        if op in ("send_recv", "send_tensor"):
            assert "elements wrong; first at index 5: got 5, expected 3" in r["detail"], r["detail"]
    assert "4 row(s) gave WRONG results" in run.stderr
    assert all(mangled[(op, 4)]["status"] == "ok" for op in ops)
    assert mangled[("send_tensor", 4096)]["ref_op"] == "send_recv"  # still compared


@pytest.mark.slow
def test_a_wrong_result_is_reported_and_fails_the_run(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = runs["mixed"]
    assert run.returncode == 1, run.stderr
    rows = json.loads(run.stdout)
    wrong = [r for r in rows if r["backend"] == "WrongSumBackend" and r["op"] == "all_reduce"]
    assert [r["requested_size"] for r in wrong] == SIZES
    for r in wrong:
        count = r["count"]
        assert r["status"] == "WRONG"
        assert r["detail"].startswith(f"all_reduce: rank 0: 1 of {count} elements wrong; first at index {count - 1}")
        assert r["median_us"] > 0 and r["ratio"] > 0  # still timed and compared
    assert "2 row(s) gave WRONG results" in run.stderr
    # everything else is right, and well-formed, WrongSumBackend's other ops included
    good = [r for r in rows if r not in wrong]
    _well_formed(
        [r for r in good if r["backend"] != "WrongSumBackend"],
        ("all_reduce", "broadcast", "send_recv"),
        [catalog.BASELINE, "StoreBackend"],
    )
    assert sorted((r["op"], r["status"]) for r in good if r["backend"] == "WrongSumBackend") == [
        ("broadcast", "ok"),
        ("broadcast", "ok"),
        ("send_recv", "ok"),
        ("send_recv", "ok"),
    ]


def _on_a_terminal(argv: list[str], tmp: Path) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the bench with stderr on a pseudo-terminal (stdout a pipe): the run, and what the terminal showed."""
    import pty

    main, child = pty.openpty()
    shown = bytearray()

    def drain() -> None:  # the terminal's buffer must not fill up, or the bench would block on it
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:  # EIO: every writer closed its end
                return
            if not data:
                return
            shown.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pg_core.bench", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=child,
            text=True,
            cwd=tmp,
            env=dict(os.environ, PG_CORE_BENCH_TEST_MARKER=_MARKER),
        )
    finally:
        os.close(child)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
        proc.wait()
        reader.join(timeout=10)
        os.close(main)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), shown.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.requires_backend("tcp", "gloo")
def test_tcp_and_gloo_side_by_side_in_one_run_with_a_progress_bar_and_a_plot(tmp_path: Path) -> None:
    png = tmp_path / "tcp-gloo.png"
    argv = ["--backends", "tcp,gloo", "--ops", "all_reduce,send_recv", "-b", "8", "-e", "4K", "-f", "8"]
    argv += ["--iters", "5", "--warmup", "1", "--time-budget", "0.2", "--json", "--plot", str(png)]
    run, terminal = _on_a_terminal(argv, tmp_path)
    assert run.returncode == 0, terminal
    sizes = [8, 64, 512, 4096]
    _well_formed(json.loads(run.stdout), ("all_reduce", "send_recv"), [catalog.BASELINE, "tcp", "gloo"], sizes)
    total = 2 * len(sizes) * 3
    assert "\r\x1b[K[>" in terminal  # the bar, drawn from the start
    assert f"]  {total}/{total}  " in terminal  # and to the end
    assert f"bench: [{total}/{total}] send_recv 4096 B gloo: median" in terminal  # the row lines, above it
    assert "send_recv 4 KiB on gloo" in terminal  # what runs now
    assert terminal.endswith("\r\x1b[K")  # erased at the end
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 10_000


def _leftovers() -> list[int]:
    """Processes still alive that inherited this module's marker."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if _MARKER.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
def test_a_failing_rank_shows_its_traceback_and_no_rank_is_left(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = runs["crash"]
    assert run.returncode == 1
    assert "# broadcast (world size 2" in run.stdout  # the rows measured before the failure are shown
    assert "rank 1 exited with status 1" in run.stderr
    assert "Traceback" in run.stderr and "planted failure in all_reduce on rank 1" in run.stderr
    wait_exited(_leftovers(), 5.0)  # killed ranks may still be exiting: wait for their exit, not a while
    assert _leftovers() == []


@pytest.mark.slow
def test_rounds_interleave_the_backends_timed_iterations_and_an_ops_two_forms(
    runs: dict[str, subprocess.CompletedProcess[str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = runs["rounds"]
    assert run.returncode == 0, run.stderr
    assert "# all_reduce (world size 2, float32, sum, interleaved in 3 rounds)" in run.stdout
    assert "# all_reduce_async (world size 2, float32, sum, async_op=True then wait(), interleaved in 3 rounds)" in (
        run.stdout
    )
    rows = [line.split() for line in run.stdout.splitlines() if line.strip().startswith("4 ")]
    assert [r[2] for r in rows] == ["LoggedA", "LoggedB"] * 2 and all(r[-1] == "ok" for r in rows)
    planned = {int(r[3]) for r in rows}
    assert len(planned) == 1 and 5 <= min(planned) <= 6, rows  # one plan for the rows compared
    (n,) = planned
    logs = {log.resolve() for log in tmp_path_factory.getbasetemp().glob("bench*/calls-0.log")}  # benchcurrent: a link
    assert len(logs) == 1
    calls = logs.pop().read_text().split()
    # rank 0's all_reduce calls, run by run: each row's warmup, then three rounds of (one
    # untimed iteration and a third of the timed ones) for each row in turn, the blocking and the
    # asynchronous form in the same rounds, each round starting one further along
    turns = [name for name, _ in itertools.groupby(calls)]
    slots = ["LoggedA", "LoggedB", "LoggedA-async", "LoggedB-async"]
    order = slots + [name for turn in range(3) for name in sizing.rotated(slots, turn)]
    assert order[4:8] == slots and order[8:12] == ["LoggedB", "LoggedA-async", "LoggedB-async", "LoggedA"]
    assert turns == [name for name, _ in itertools.groupby(order)], turns
    for name in slots:
        assert calls.count(name) == 1 + 3 + n  # --warmup 1, one per round, the timed ones


@pytest.mark.slow
def test_plot_is_written(
    runs: dict[str, subprocess.CompletedProcess[str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert runs["mixed"].returncode == 1  # the WRONG rows; the plot is written all the same
    pngs = list(tmp_path_factory.getbasetemp().glob("bench*/bench.png"))
    assert pngs and pngs[0].read_bytes().startswith(b"\x89PNG")


def test_a_reference_op_is_measured_in_the_batch_of_its_op() -> None:
    from pg_core.bench.sizing import sweep_batches

    assert sweep_batches(["send_tensor", "all_reduce", "send_recv"], [4, 8]) == [
        [("send_tensor", 4), ("send_recv", 4)],
        [("send_tensor", 8), ("send_recv", 8)],
        [("all_reduce", 4)],
        [("all_reduce", 8)],
    ]
    assert sweep_batches(["send_tensor", "all_reduce"], [4]) == [[("send_tensor", 4)], [("all_reduce", 4)]]
    # an asynchronous form with its blocking op, size by size, whichever comes first in the list
    assert sweep_batches(["all_reduce_async", "all_reduce"], [4, 8]) == [
        [("all_reduce_async", 4), ("all_reduce", 4)],
        [("all_reduce_async", 8), ("all_reduce", 8)],
    ]
    assert sweep_batches(["all_reduce", "all_reduce_async", "send_recv", "isend_irecv"], [4]) == [
        [("all_reduce", 4), ("all_reduce_async", 4)],
        [("send_recv", 4), ("isend_irecv", 4)],
    ]


# -- --overhead: the core's own cost per call, in this process ----------------------------------------------


def test_overhead_reports_every_op_in_three_modes(capsys: pytest.CaptureFixture[str]) -> None:
    from pg_core.bench import overhead

    assert bench.main(_args("--overhead", "--overhead-iters", "20", "--repeats", "2", "-q")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# core overhead (world size 1, one process, NullBackend; float32 tensors of 1 element")
    assert "median of 2 batches of 20 calls" in lines[0]
    assert lines[1].split() == [
        "op",
        "direct",
        "blocking",
        "async+wait",
        "overhead",
        "async",
        "overhead",
        "launched+wait",
        "launch",
        "cost",
    ]
    table = [line.split() for line in lines[2 : 2 + len(overhead.OPS)]]
    assert [row[0] for row in table] == list(overhead.OPS)
    for row in table:  # seven numbers (us per call); overheads after the times they are of
        direct, blocking, async_, over, async_over, launched, launch_cost = map(float, row[1:])
        assert over == pytest.approx(blocking - direct, abs=2e-3)
        assert async_over == pytest.approx(async_ - direct, abs=2e-3)
        assert launch_cost == pytest.approx(launched - blocking, abs=2e-3)
    assert lines[2 + len(overhead.OPS)] == ""
    assert lines[3 + len(overhead.OPS)].startswith("# core overhead per blocking call: at most ")
    assert "the target of 3 us" in lines[3 + len(overhead.OPS)]


def test_overhead_as_json_for_chosen_ops(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--overhead", "--overhead-iters", "10", "--repeats", "1", "--ops", "barrier,all_reduce", "--json", "-q")
    assert bench.main(_args(*argv)) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["op"] for r in rows] == ["barrier", "all_reduce"]
    for r in rows:
        assert (r["iters"], r["repeats"], r["dtype"], r["numel"]) == (10, 1, "float32", 1)
        assert r["overhead_ns"] == pytest.approx(r["blocking_ns"] - r["direct_ns"])
        assert r["async_overhead_ns"] == pytest.approx(r["async_ns"] - r["direct_ns"])
        assert r["launch_cost_ns"] == pytest.approx(r["launched_ns"] - r["blocking_ns"])
        assert min(r["direct_ns"], r["blocking_ns"], r["async_ns"], r["launched_ns"]) > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ops", "send_recv"], "--ops: send_recv not measured by --overhead"),
        (["--repeats", "0"], "--overhead-iters and --repeats must be >= 1"),
        (["--backends", "tcp"], "--backends and --plot do not apply"),
    ],
)
def test_overhead_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(_args("--overhead", *argv)) == 2
    assert message in capsys.readouterr().err


def test_overhead_is_in_the_help() -> None:
    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    text = parser.format_help()
    assert "--overhead" in text and "--overhead-iters" in text and "--repeats" in text
    assert "blocking - direct" in text


# -- the package: one job per module, layered -------------------------------------------------------------

#: pg_core.bench's modules, lowest first: each may import only those before it (so no cycle).
LAYERS = [
    "catalog",
    "sizing",
    "inputs",
    "report",
    "plot",
    "config",
    "baselines",
    "runners",
    "cases",
    "rank",
    "parent",
    "nullbackend",
    "overhead",
    "cli",
    "__init__",
    "__main__",
]


def _bench_imports(path: Path) -> set[str]:
    """The modules of pg_core.bench that the module at ``path`` imports, at its top or in a function."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .X import ... / from . import X
            found.update([node.module] if node.module else [alias.name for alias in node.names])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pg_core.bench"):
            parts = node.module.split(".")  # from pg_core.bench.X import ... / from pg_core.bench import ...
            found.add(parts[2] if len(parts) > 2 else "__init__")
    return found


def test_each_module_of_the_package_imports_only_those_below_it() -> None:
    folder = Path(bench.__file__).parent
    assert sorted(p.stem for p in folder.glob("*.py")) == sorted(LAYERS), "a module is missing from LAYERS"
    for i, name in enumerate(LAYERS):
        above = set(LAYERS[i:])
        assert not _bench_imports(folder / f"{name}.py") & above, f"{name} imports a module at or above it"
    for name in LAYERS:
        lines = len((folder / f"{name}.py").read_text().splitlines())
        assert lines <= 400, f"pg_core/bench/{name}.py has {lines} lines: split it along a seam of its own"


def test_the_package_exports_what_is_documented() -> None:
    # pg-core's own command line calls add_parser; CHANGELOG names pg_core.bench.rotated
    assert sorted(bench.__all__) == ["add_parser", "main", "rotated"]
    assert bench.main is cli.main and bench.add_parser is cli.add_parser and bench.rotated is sizing.rotated
