"""The prompts the engine tests send (token ids), in the order the reference pair runs them.

The reference is a prefill/decode pair over vLLM's own NixlConnector: it computes each request exactly as a
glm-pd pair does (prefill's kernels over the whole prompt, the last prompt token recomputed in a decode step
over the loaded cache), so byte-exact KV gives identical tokens on every host. A plain server cannot: MLA's bf16
prefill and decode kernels round differently, and where vLLM turns MLA prefix caching off (CPUs without AMX)
no plain run takes decode's path.
"""

from __future__ import annotations

import random

MAX_TOKENS = 12  # tokens decoded per request, and compared


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 320) for _ in range(n)]  # 0 is <eos>


SINGLE = {n: ids(n, n) for n in (1, 33, 97, 161, 289)}  # shorter than a block (1) up to 289 tokens
INSIDE_BLOCK = ids(20, 20)
SHARED_PREFIX = 128  # tokens the two shared prompts have in common: whole blocks of 16 and of 32
_SHARED = ids(SHARED_PREFIX, 7)
SHARED = [_SHARED + ids(33, 8), _SHARED + ids(65, 9)]  # 161 and 193 tokens

# (name, prompt) in the order the tests send them, so both pairs' decode prefix caches see the same history.
RUNS = [(f"single-{n}", p) for n, p in sorted(SINGLE.items())] + [(f"shared-{i}", p) for i, p in enumerate(SHARED)]
