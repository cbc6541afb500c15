"""The fault matrix (fault_matrix.py) over GlmPdConnector with real NIXL between two processes: every fault,
at every handoff state it can hit, must end with the faulted request failed loudly or never served, no
output from bad KV, both block pools back to empty, no per-request state left in the services, a bounded
time to detect, and the next request served byte-exact. Runs once per session (about four minutes)."""

from dataclasses import asdict

import pytest

from tests.support import vllm_fault_matrix as fault_matrix
from tests.support.ports import free_port
from tests.support.vllm_harness import make_tiny_model

NAMES = [f"{name} / {state}" for name, state, *_ in fault_matrix.cases("", "")]


@pytest.fixture(scope="module")
def rows(tmp_path_factory, tiny_model, tiny_model_other_layers) -> dict[str, fault_matrix.Row]:
    no_mtp = make_tiny_model(tmp_path_factory.mktemp("glm5-tiny-no-mtp"), num_nextn_predict_layers=0)
    logs = tmp_path_factory.mktemp("fault-matrix")
    out = fault_matrix.run(tiny_model, tiny_model_other_layers, no_mtp, logs, free_port())
    return {f"{r.case} / {r.state}": r for r in out}


@pytest.mark.parametrize("name", NAMES)
def test_fault_is_handled(rows, name: str) -> None:
    row = rows[name]
    assert fault_matrix.problems(row) == [], asdict(row)


def test_failures_name_their_cause(rows) -> None:
    """The reasons decode logs are the ones an operator needs (spot checks over the matrix)."""
    expect = {
        "lease expiry / before read": "lease on this request already ended: expired",
        "digest mismatch (byte flipped) / after transfer": "checksum",
        "transport never completes / mid-transfer": "did not complete in",
        "transport error / mid-transfer": "(injected)",
        "prefill restarts, new identity / stale params": "no handshake from this peer yet",
        "lease expiry / before confirmation": "no lease held",
        "decode SIGKILL / mid-transfer": "prefill freed the blocks",
        "retry after failure / after failure": "already ended: aborted",
    }
    for name, needle in expect.items():
        assert any(needle in r for r in rows[name].reasons), (name, rows[name].reasons)
