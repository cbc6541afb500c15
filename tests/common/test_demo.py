"""Smoke tests of ``glm-pd demo``: two real processes, a real transport, every decode byte checked."""

import ctypes.util
import json
import re
import subprocess
import sys

import pytest

from glm_pd_common.tools.demo_peers import MISMATCHES


def demo(*args, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "glm_pd_common.tools.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("transport", "p", "d", "allocator"),
    [("nixl", 64, 64, "shuffled"), ("nixl", 64, 32, "contiguous"), ("mooncake", 16, 64, "shuffled")],
)
def test_demo_hands_off_and_verifies(transport, p, d, allocator):
    proc = demo(
        "--allow-tcp",
        "--json",
        "--tokens",
        "2000",
        "--prefix-tokens",
        "512",
        "--transport",
        transport,
        "--prefill-page-tokens",
        str(p),
        "--decode-page-tokens",
        str(d),
        "--allocator",
        allocator,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert out["ok"] is True
    assert out["transport"] == transport and out["tokens"] == 2000 and out["prefix_tokens"] == 512
    assert out["states"] == ["BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING", "SUCCESS"]
    assert out["bytes"]["total"] == out["bytes"]["main"] + out["bytes"]["indexer"] > 0
    assert out["bytes"]["indexer"] > 0  # the indexer travelled, in its own regions
    assert out["regions"] == 101 and out["prefill_outcome"] == "released" and out["memory"] == "host"
    # Measured on decode: its own prefix bytes untouched (GLM-5.3: 79 main rows of 656 B, 22 indexer rows of
    # 132 B per token), and every suffix token equal to prefill's.
    assert out["prefix_bytes_kept"] == 512 * (79 * 656 + 22 * 132)
    assert out["suffix_tokens_checked"] == 2000 - 512
    for key in ("pages", "runs", "seconds", "gbps", "memcpy_gbps"):
        assert key in out


@pytest.mark.parametrize("staging", ["always", "auto"])
def test_demo_stages_where_told_and_posts_host_memory_directly_by_default(staging):
    """``always``: every byte through 256 KiB slots (tens of them, cutting runs mid-page), checked on decode as
    posted directly would be; ``auto`` posts host memory directly, as the engines do."""
    args = ["--allow-tcp", "--json", "--tokens", "2000", "--prefix-tokens", "512", "--prefill-page-tokens", "32"]
    proc = demo(*args, "--staging", staging, "--staging-mib", "2", "--staging-slot-kib", "256")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert out["ok"] is True and out["suffix_tokens_checked"] == 2000 - 512, out
    if staging == "always":
        assert out["staging"] == {"slot_bytes": 256 << 10, "mode": "always"}
        assert out["staged_bytes"] == out["bytes"]["total"]
        assert out["posted_batches"] == -(-out["bytes"]["total"] // (256 << 10))  # slots: runs cut at slot ends
    else:
        assert out["staging"] is None and out["staged_bytes"] == 0


def test_staging_settings_that_cannot_hold_a_pair_of_slots_are_refused():
    proc = demo(
        "--allow-tcp", "--tokens", "512", "--prefix-tokens", "0", "--staging", "always", "--staging-mib", "1",
        "--staging-slot-kib", "1024",
    )  # fmt: skip
    assert proc.returncode == 2 and "must hold two slots of 1024 KiB" in proc.stderr, proc.stderr


@pytest.mark.parametrize("field", sorted(MISMATCHES))
def test_mismatch_is_refused_naming_the_field(field):
    proc = demo("--allow-tcp", "--tokens", "512", "--prefix-tokens", "0", "--mismatch", field)
    assert proc.returncode != 0
    assert f"{field}: prefill=" in proc.stderr


def test_demo_refuses_tcp_unless_allowed():
    proc = demo("--tokens", "512", "--prefix-tokens", "0")
    assert proc.returncode != 0
    assert "would move KV over TCP" in proc.stderr and "--allow-tcp" in proc.stderr


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="this machine has a CUDA driver")
def test_demo_on_a_gpu_is_refused_before_any_process_where_there_is_none():
    proc = demo("--allow-tcp", "--tokens", "512", "--prefix-tokens", "0", "--device", "cuda:1")
    assert proc.returncode == 2 and "no CUDA driver (libcuda) on this machine" in proc.stderr, proc.stderr


def test_a_device_that_is_not_cpu_or_cuda_is_refused_by_name():
    proc = demo("--device", "gpu1")
    assert proc.returncode == 2 and "'gpu1': expected cpu, cuda or cuda:N" in proc.stderr, proc.stderr


def test_million_tokens_refused_where_memory_is_short():
    proc = demo("--allow-tcp", "--tokens", "1M")
    assert proc.returncode == 2
    assert "of host memory" in proc.stderr and "available" in proc.stderr


@pytest.mark.parametrize(
    ("p", "d", "prefix"),
    [(64, 64, 0), (16, 64, 0), (64, 16, 64), (32, 128, 256)],
    ids=["64-64", "16-64 (the byte flipped before lay outside the plan)", "64-16 prefix 64", "32-128 prefix 256"],
)
def test_corruption_is_caught_naming_layer_kind_and_page_and_prefill_frees(p, d, prefix):
    """The negative control flips a byte the plan moves, so it fails for every page-size pair and prefix."""
    proc = demo(
        "--allow-tcp",
        "--json",
        "--tokens",
        "1000",
        "--prefix-tokens",
        str(prefix),
        "--prefill-page-tokens",
        str(p),
        "--decode-page-tokens",
        str(d),
        "--inject-corruption",
    )
    assert proc.returncode == 1, proc.stdout
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert out["ok"] is False and out["states"][-1] == "FAILED"
    assert re.search(r"checksum mismatch in layer \d+ (main|indexer) region, destination page \d+ ", out["error"])
    assert out["prefill_outcome"] == "aborted"


def test_corruption_without_digests_is_caught_by_the_byte_check():
    """With --no-verify the load succeeds, and the demo's own byte check must still refuse the result."""
    proc = demo(
        "--allow-tcp", "--json", "--tokens", "1000", "--prefix-tokens", "0", "--no-verify", "--inject-corruption"
    )
    assert proc.returncode == 1, proc.stdout
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert out["ok"] is False and "decode pages differ from prefill's tokens" in out["error"]
