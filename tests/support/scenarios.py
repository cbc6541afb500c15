"""The prompts the engine tests send (token ids), and the plain runs each one is compared with."""

from __future__ import annotations

import random


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 320) for _ in range(n)]  # 0 is <eos>


SINGLE = {n: ids(n, n) for n in (1, 33, 97, 161, 289)}  # shorter than a block (1) up to 10 blocks of 32
INSIDE_BLOCK = ids(20, 20)
_SHARED = ids(128, 7)
SHARED = [_SHARED + ids(33, 8), _SHARED + ids(65, 9)]  # 161 and 193 tokens sharing 4 blocks

# (cache_salt, prompt) in the order the plain server runs them; one salt is one prefix cache, so the shared
# pair sees the same cache history on the plain server as on prefill and decode.
PLAIN_RUNS = [(f"salt-{n}", p) for n, p in SINGLE.items()] + [("salt-shared", p) for p in SHARED]
