"""``vllm.general_plugins`` entry point: register ``GlmPdConnector`` with vLLM's connector factory.

vLLM loads general plugins in every process (API server, engine core, workers); registering twice raises in
vLLM's factory, so this checks first. The module-path route (``kv_connector_module_path``) needs no plugin.
"""

from __future__ import annotations

CONNECTOR_NAME = "GlmPdConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "glm_pd_vllm.connector", CONNECTOR_NAME)
