"""Makes this process see a CPU without AMX tiles, as CI's and other developers' hosts may be.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one; putting this folder
on ``PYTHONPATH`` of a vLLM process (and so of the engine processes it starts) makes every
``torch.cpu._is_amx_tile_supported()`` that vLLM's CPU platform asks answer False. vLLM then picks the reference
CPU MLA backend, forces ``block_size=16`` and turns MLA prefix caching off, as it does on such a host.
"""

import torch

torch.cpu._is_amx_tile_supported = lambda: False
