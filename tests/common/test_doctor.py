"""``glm-pd doctor`` against this machine (no RDMA, no GPU) and against a live demo prefill peer."""

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from glm_pd_common.handoff.wire.trust import make_credential
from glm_pd_common.tools.demo_peers import MARK
from glm_pd_common.tools.doctor import check_rdma, check_ucx_path
from glm_pd_common.transport.base import rdma_devices
from glm_pd_common.transport.datapath import parse
from glm_pd_common.transport.node import node_id

TABLES = Path(__file__).parents[1] / "transport" / "data" / "ucx_proto"


def doctor(*args):
    return subprocess.run(
        [sys.executable, "-m", "glm_pd_common.tools.cli", "doctor", "--json", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.skipif(bool(rdma_devices()), reason="this host has RDMA devices")
def test_doctor_fails_without_rdma_and_says_how_to_fix():
    proc = doctor("--skip-probe")
    assert proc.returncode == 1
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert checks["nixl"]["status"] == "PASS"
    assert checks["rdma devices"]["status"] == "FAIL" and "allow_tcp" in checks["rdma devices"]["fix"]
    assert checks["node"]["status"] == "INFO" and checks["node"]["detail"].startswith(node_id())


def recorded(table: str) -> tuple[list, str]:
    """A GPU probe's answer, as UCX printed it in a recorded table."""
    return parse((TABLES / table).read_text()), ""


def test_without_rdma_gpu_memory_by_cuda_ipc_is_a_warning_intra_node_only():
    (check,) = check_rdma((), recorded("cuda_get_cuda_ipc.txt"))
    assert check.status == "WARN" and "cuda_ipc for READ, intra-node only" in check.detail, check
    assert "NIC driver" in check.fix


@pytest.mark.parametrize("probe", [recorded("cuda_get_tcp.txt"), ([], "no CUDA driver (libcuda)"), None])
def test_without_rdma_an_emulated_or_unobserved_gpu_path_fails(probe):
    (check,) = check_rdma((), probe)
    assert check.status == "FAIL" and "KV would move over TCP" in check.detail and "allow_tcp" in check.fix


def test_rdma_devices_pass_whatever_the_gpu_path():
    (check,) = check_rdma(("mlx5_0",), recorded("cuda_get_tcp.txt"))
    assert check.status == "PASS" and check.detail.startswith("mlx5_0")


def test_ucx_probe_observes_reads_and_writes_on_host_memory():
    """This machine's loopback (no RDMA NIC): both directions observed, each named with what UCX chose."""
    checks = check_ucx_path("host")
    assert [c.name for c in checks] == ["ucx data path (host)"] * 2
    details = " ".join(c.detail for c in checks)
    assert "READ host->host" in details and "WRITE host->host" in details
    assert all(c.status == "WARN" and "between hosts this is tcp" in c.detail for c in checks)


def test_a_gpu_probe_that_cannot_run_fails_naming_why():
    """Where no GPU buffer can be made (no CUDA driver here), the probe's own error is the check's detail."""
    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("a CUDA driver is installed here: this check is for a machine whose probe cannot make a GPU buffer")
    (check,) = check_ucx_path("cuda")
    assert check.status == "FAIL" and "no CUDA driver (libcuda)" in check.detail


@pytest.fixture
def credential(tmp_path) -> str:
    return str(make_credential(tmp_path, "site"))


@pytest.fixture
def prefill_peer(credential):
    job = {
        "preset": "glm-5.3",
        "kv_cache_dtype": "fp8_ds_mla",
        "scale_format": "fp32",
        "tokens": 256,
        "prefix_tokens": 0,
        "prefill_page_tokens": 64,
        "decode_page_tokens": 64,
        "allocator": "contiguous",
        "transport": "nixl",
        "allow_tcp": True,
        "mismatch": None,
        "verify": False,
        "timeout_s": 20,
        "lease_s": 20,
        "credential": credential,
        "device": None,
        "staging": "never",
        "staging_mib": 256,
        "staging_slot_kib": 32768,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "glm_pd_common.tools.demo_peers", "prefill"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.close()
    ready = next(json.loads(ln[len(MARK) :]) for ln in proc.stdout if ln.startswith(MARK))
    yield f"127.0.0.1:{ready['port']}"
    proc.kill()
    proc.wait()


def test_doctor_peer_matches_and_mismatches(prefill_peer, credential):
    same = {
        c["name"]: c
        for c in json.loads(doctor("--skip-probe", "--peer", prefill_peer, "--credential", credential).stdout)
    }
    assert same["peer fingerprint"]["status"] == "PASS"
    other = json.loads(
        doctor(
            "--skip-probe", "--peer", prefill_peer, "--credential", credential, "--kv-cache-dtype", "bfloat16"
        ).stdout
    )
    bad = {c["name"]: c["detail"] for c in other if c["name"].startswith("peer fingerprint ")}
    assert bad["peer fingerprint main_row_bytes"] == "this node 1152, prefill-0 656"
    assert "peer fingerprint cache_dtype" in bad


def test_doctor_peer_unreachable_fails_bounded():
    checks = json.loads(doctor("--skip-probe", "--peer", "127.0.0.1:1").stdout)
    peer = next(c for c in checks if c["name"] == "peer")
    assert peer["status"] == "FAIL" and "no answer" in peer["detail"]


def test_doctor_without_the_peers_credential_learns_nothing(prefill_peer, tmp_path):
    checks = json.loads(doctor("--skip-probe", "--peer", prefill_peer).stdout)
    peer = next(c for c in checks if c["name"] == "peer")
    assert peer["status"] == "FAIL" and "security mechanism" in peer["detail"] and "--credential" in peer["fix"]
    assert not any(c["name"].startswith("peer fingerprint") for c in checks)
    foreign = str(make_credential(tmp_path / "other", "site"))
    checks = json.loads(doctor("--skip-probe", "--peer", prefill_peer, "--credential", foreign).stdout)
    peer = next(c for c in checks if c["name"] == "peer")
    assert peer["status"] == "FAIL" and "cut short" in peer["detail"], peer
