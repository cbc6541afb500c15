"""glm_pd_vllm: the vLLM adapter of glm-pd (``GlmPdConnector``). Thin: vLLM objects in, core values out."""
