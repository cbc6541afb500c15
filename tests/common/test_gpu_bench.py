"""The GPU bench's pure parts (``benchmarks/gpu/``): its page pools, which UCX table names a row's path, and how
the issue's targets read the rows. The bench itself runs on a GPU (``scripts/gpu_bench.sh``) or with
``--memory host``; nothing of its figures is asserted."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest

from benchmarks.gpu.paths import chosen_path
from benchmarks.gpu.prefill import ParentReplies
from benchmarks.gpu.ranks import page_tables
from benchmarks.gpu.rows import Row
from benchmarks.gpu.targets import targets
from benchmarks.gpu_bench import parse

# Two agents' tables in one process's log, as UCX prints them under UCX_PROTO_INFO=y (the prefix cut short)
LOG = """
[1.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1:0]   | bench-raw-decode intra-node cfg#1                        |
[1.0] [vm:1:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |
[1.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1:0]   | 0..inf | zero-copy   | cuda_ipc/cuda                     |
[1.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[2.0] [vm:1:0]   | bench-decode-tp0 intra-node cfg#2                        |
[2.0] [vm:1:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |
[2.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[2.0] [vm:1:0]   | 0..inf | software emulation | tcp/lo                     |
[2.0] [vm:1:0]   +--------+-------------+-----------------------------------+
"""


def test_pools_hold_the_request_in_order_or_scattered_over_the_whole_pool() -> None:
    tables = page_tables(64, 128, seed=1)
    src, dst = tables["contiguous"]
    assert np.array_equal(src, np.arange(64)) and np.array_equal(dst, np.arange(64))
    for side in tables["shuffled"]:
        assert side.size == 64 and np.unique(side).size == 64 and side.max() < 128
        assert np.sum(np.diff(side) == 1) < 8  # hardly two neighbours: a run a page


def test_a_rows_path_is_the_table_of_the_agent_that_posted_it() -> None:
    raw, pull = (
        chosen_path(LOG, "bench-raw-decode", "READ", "cuda"),
        chosen_path(LOG, "bench-decode-tp0", "READ", "cuda"),
    )
    assert raw is not None and raw.path == "cuda_ipc"
    assert pull is not None and pull.path == "emulation"
    assert chosen_path(LOG, "bench-decode-tp0", "WRITE", "cuda") is None


def test_targets_judge_rates_against_the_faster_raw_rate_and_name_what_was_not_measured() -> None:
    gb = 10**9
    rows = [
        Row("raw", op="WRITE", bytes=gb, seconds=0.01),  # 100 GB/s: the ceiling
        Row("raw", op="READ", bytes=gb, seconds=0.02),
        Row("pull", "contiguous", op="READ", bytes=gb, seconds=0.011, extra={"load_s": 0.012}),
        Row("pull", "contiguous", True, op="READ", bytes=gb, seconds=0.011, extra={"load_s": 0.0125}),
        Row("pull", "shuffled", op="READ", bytes=gb, seconds=0.1, extra={"load_s": 0.1}),
        Row("staged", "shuffled", op="READ", bytes=gb, seconds=0.05, batches=16, extra={"load_s": 0.05}),
        Row("streamed", "shuffled", op="READ", bytes=gb, seconds=0.01),
        Row("staged streamed", "shuffled", op="READ", bytes=gb, seconds=0.01),
    ]
    got = {t.name: t for t in targets(rows, [("decode READ", "tcp", "emulation")])}
    staged = got["staged shuffled of raw"]
    assert staged.ok is False and staged.measured == pytest.approx(0.2)
    assert got["staged contiguous of raw"].ok is None and got["staged contiguous of raw"].detail == "not measured"
    assert got["staged push shuffled of raw"].ok is None  # held to the staged target too, once measured
    assert got["pull contiguous of raw"].ok is True
    assert got["pull contiguous of raw"].measured == pytest.approx(1 / 1.1)
    assert got["push contiguous of raw"].ok is None
    digests = got["pull contiguous: digests of transfer"]
    assert digests.ok is True and digests.measured == pytest.approx(0.0005 / 0.011)
    assert got["pull shuffled: digests of transfer"].ok is None
    exposure = got["streamed exposure of pull"]
    assert exposure.ok is True and exposure.measured == pytest.approx(0.1)
    staged_exposure = got["staged streamed exposure of staged"]
    assert staged_exposure.ok is False and staged_exposure.measured == pytest.approx(0.2)
    assert got["decode READ: reported path is UCX's"].ok is False


def test_staging_options_default_to_64_mib_slots_in_512_mib_and_must_hold_a_pair() -> None:
    args = parse(["--memory", "host"])
    assert (args.slot_mib, args.staging_mib) == (64, 512)
    with pytest.raises(SystemExit):
        parse(["--slot-mib", "64", "--staging-mib", "100"])


def test_a_failed_staged_push_leaves_the_next_command_to_be_read_as_one(monkeypatch, capsys) -> None:
    """The child's replies to the parent (benchmarks/gpu/prefill.py): slots 0 and 1 said landed, slot 0 refused;
    the answer for slot 1 is still on the pipe and must not be taken for the next command."""
    refused, freed, command = {"freed": 0, "error": "outside"}, {"freed": 1, "error": ""}, {"op": "finished"}
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(json.dumps(m) + "\n" for m in (refused, freed, command))))
    replies = ParentReplies()
    replies.landed(0, False, np.zeros(1), np.zeros(1))
    replies.landed(1, True, np.zeros(1), np.zeros(1))
    with pytest.raises(RuntimeError, match="decode refused slot 0: outside"):
        replies.freed(0)
    replies.drain()
    assert json.loads(sys.stdin.readline()) == command
    assert capsys.readouterr().out.count('"landed"') == 2
