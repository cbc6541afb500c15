"""The capacity accounts pasted in recipes/README.md are what `glm-pd plan` prints today."""

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

from glm_pd_common.tools.cli import main

README = Path(__file__).parents[2] / "recipes" / "README.md"


def test_pasted_plan_outputs_are_current() -> None:
    blocks = re.findall(r"```text\n\$ (glm-pd plan[^\n]*)\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    for command, pasted in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(shlex.split(command)[1:]) == 0
        assert out.getvalue() == pasted, command


def test_the_guide_quotes_both_modes_exposed_times() -> None:
    """Pulled, the whole load is exposed; streamed, at least the last chunk of the recipe's 16,384-token chunks."""
    text = README.read_text()
    assert "exposed tail" not in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["plan", "--json", "--tokens", "1M", "--prefill-tp", "8", "--decode-tp", "8", "--chunk-tokens", "16K"]
        assert main([*argv, "--prefill-cp", "8", "--decode-dcp", "8"]) == 0
    exposed = json.loads(out.getvalue())["exposed"]
    assert f"waits {exposed['pull']['seconds']:.2f} s for its KV" in text
    assert f"at least the last chunk's {exposed['streamed']['last_chunk_seconds'] * 1e3:.2f} ms" in text
    assert "--max-num-batched-tokens 16384" in (README.parent / "vllm" / "prefill.sh").read_text()
