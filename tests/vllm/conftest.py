import pytest

from tests.support.ports import free_port_range
from tests.support.vllm_harness import Proc, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("glm5-tiny"))


@pytest.fixture(scope="session")
def tiny_model_other_layers(tmp_path_factory) -> str:
    """The same model with every layer full: a different indexer layer set, a byte-relevant difference."""
    return make_tiny_model(tmp_path_factory.mktemp("glm5-tiny-all-full"), index_topk_freq=1)


@pytest.fixture
def pd(tiny_model, tmp_path):
    """Start instances of a prefill/decode pair; every process is killed at the end."""
    procs = []
    port = free_port_range(8)

    def start(role: str, **kw) -> Proc:
        job = {
            "role": role,
            "engine_id": "P" if role == "kv_producer" else "D",
            "model": tiny_model,
            "block_size": 64,
            "tp": 1,
            "pool_tokens": 48 * 64,
            "port": port,
            "lease_s": 90.0,
            "wait_s": 150.0,
            "tokens": 1000,
            "prefix_tokens": 0,
            "requests": ["req-1"],
            "module_path": "glm_pd_vllm.connector",
            **kw,
        }
        proc = Proc(job, tmp_path)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.close()
