"""Exposed handoff time, pulled after prefill or streamed per prefill chunk: numbers worked out from FACTS.md."""

import json

import pytest

from glm_pd_common.layout.exposure import streamed_seconds
from glm_pd_common.tools.cli import main

M = 1 << 20
RATE = 400e9 / 8  # one 400 Gbit/s NIC: 50e9 B/s (FACTS.md §7)
PER_TOKEN = 78 * 656 + 21 * 132 + 656 + 132  # main + indexer + the MTP layer's pair (FACTS.md §2): 54,728 B
WHOLE = PER_TOKEN * M  # 57,386,467,328 B: what each replicated decode rank reads of a 1M-token request


def plan(capsys, *args: str) -> dict:
    assert main(["plan", "--json", "--tokens", "1M", "--prefill-tp", "8", "--decode-tp", "8", *args]) == 0
    return json.loads(capsys.readouterr().out)["exposed"]


def test_pull_exposes_the_whole_copy_and_streaming_its_last_chunk_without_a_prefill_rate(capsys) -> None:
    e = plan(capsys)
    assert WHOLE == 57_386_467_328
    assert e["pull"]["seconds"] == pytest.approx(1.14772934656)  # 57,386,467,328 / 50e9
    st = e["streamed"]
    # H200: both engines chunk long prompts by 8,192 tokens; 2^20 / 2^13 = 128 chunks, the last one whole
    assert (st["chunk_tokens"], st["chunks"], st["last_chunk_tokens"]) == (8192, 128, 8192)
    assert st["last_chunk_bytes"] == PER_TOKEN * 8192 == 448_331_776
    assert st["last_chunk_seconds"] == pytest.approx(0.00896663552)  # 448,331,776 / 50e9
    assert st["seconds"] is None and st["transfer_seconds"] is None and st["prefill_seconds"] is None
    # each decode rank claims from its one prefill rank and releases it, after prefill answers, untimed
    assert (e["round_trips"], e["rtt_seconds"]) == (2, None)


def test_a_link_faster_than_prefill_exposes_only_the_last_chunk(capsys) -> None:
    # 100,000 tokens/s: a chunk takes 81.92 ms to compute and 8.97 ms to move, so each is gone before the next
    st = plan(capsys, "--prefill-tokens-per-s", "100000")["streamed"]
    assert st["seconds"] == pytest.approx(0.00896663552)
    assert st["backlog_seconds"] == pytest.approx(0.0, abs=1e-12)
    assert st["prefill_seconds"] == pytest.approx(10.48576)  # 1,048,576 / 100,000


def test_a_link_slower_than_prefill_leaves_a_backlog(capsys) -> None:
    # 1M tokens/s: a chunk computes in 8.192 ms but moves in 8.967 ms. The link is busy from the first chunk's
    # end (8.192 ms) on, so it finishes at 8.192 ms + 1.14772934656 s; prefill answers at 1.048576 s:
    # 1.14772934656 - (1,048,576 - 8,192) / 1e6 = 0.10734534656 s exposed, 0.09837871104 s more than the last chunk
    st = plan(capsys, "--prefill-tokens-per-s", "1e6")["streamed"]
    assert st["seconds"] == pytest.approx(0.10734534656)
    assert st["backlog_seconds"] == pytest.approx(0.09837871104)


def test_round_trips_are_timed_in_both_modes_when_given(capsys) -> None:
    e = plan(capsys, "--prefill-tokens-per-s", "100000", "--rtt-ms", "0.5")
    assert e["rtt_seconds"] == pytest.approx(0.0005)
    assert e["pull"]["seconds"] == pytest.approx(1.14772934656 + 2 * 0.0005)
    assert e["streamed"]["seconds"] == pytest.approx(0.00896663552 + 2 * 0.0005)


def test_b200_chunks_by_16k_and_dcp_moves_an_eighth_per_rank(capsys) -> None:
    e = plan(capsys, "--gpu", "b200")["streamed"]
    # 2^20 / 2^14 = 64 chunks; the last moves 54,728 x 16,384 = 896,663,552 B: 17.93 ms
    assert (e["chunks"], e["last_chunk_bytes"]) == (64, 896_663_552)
    assert e["last_chunk_seconds"] == pytest.approx(0.01793327104)
    e = plan(capsys, "--prefill-cp", "8", "--decode-dcp", "8")
    # each rank holds every 8th token: 54,728 x 131,072 = 7,173,308,416 B, 143.47 ms pulled; a chunk is 1/128
    assert e["pull"]["seconds"] == pytest.approx(0.14346616832)
    assert e["streamed"]["last_chunk_bytes"] == 7_173_308_416 // 128 == 56_041_472


def test_a_prefix_hit_leaves_only_the_suffix_to_chunk(capsys) -> None:
    # decode holds 256K: prefill computes the other 786,432 tokens, 96 chunks of 8,192
    st = plan(capsys, "--prefix-tokens", "256K")["streamed"]
    assert (st["chunks"], st["last_chunk_bytes"]) == (96, PER_TOKEN * 8192)


def test_every_source_and_every_idle_copy_costs_a_round_trip(capsys) -> None:
    # SGLang's layer split 8 -> replicated decode: each decode rank claims from and releases all 8 prefill ranks
    assert plan(capsys, "--prefill-layer-split", "8")["round_trips"] == 16
    # prefill TP 8 -> decode TP 4: decode rank d reads prefill rank 2d and also releases idle rank 2d + 1
    assert main(["plan", "--json", "--tokens", "4096", "--prefill-tp", "8", "--decode-tp", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["exposed"]["round_trips"] == 3


def test_a_short_last_chunk_can_leave_the_one_before_it_exposed() -> None:
    # 10 tokens in chunks of 4 (4, 4, 2); 0.5 s per token on the link, 0.6 s per token to compute.
    # Chunk 0 is written at 2.4 s and moves until 4.4; chunk 1 is written at 4.8 and moves until 6.8;
    # chunk 2 is written at 6.0 but waits for the link until 6.8 and moves until 7.8. Prefill answered at 6.0:
    # 1.8 s exposed, more than the last chunk's 1.0 s and more than link minus overlap (5 - 6 x 0.6 = 1.4).
    assert streamed_seconds(10, 4, 5.0, 1 / 0.6) == pytest.approx(1.8)
    # one chunk: nothing overlaps, the whole link time is exposed
    assert streamed_seconds(10, 16, 5.0, 1.0) == pytest.approx(5.0)
