"""glm_pd_common: the engine-free core of glm-pd.

Layout math, page mapping, transfer plans, fingerprints and checksums for a GLM-5.x
prefill/decode handoff. Nothing here imports torch, vLLM or SGLang.
"""

__version__ = "0.1.0"
