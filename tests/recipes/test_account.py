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


def test_the_guide_calls_the_whole_load_exposed() -> None:
    """Decode schedules a request after its whole load: the guide may not present the last layer as exposed."""
    text = README.read_text()
    assert "exposed tail" not in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["plan", "--json", "--tokens", "1M", "--prefill-tp", "8", "--decode-tp", "8"]
        assert main([*argv, "--prefill-cp", "8", "--decode-dcp", "8"]) == 0
    account = json.loads(out.getvalue())
    assert f"waits {account['exposed_seconds']:.2f} s for its KV" in text
    assert f"The {account['streamed_tail_bound_seconds'] * 1e3:.1f} ms is only the" in text
