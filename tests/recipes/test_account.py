"""The capacity accounts pasted in recipes/README.md are what `glm-pd plan` prints today."""

import contextlib
import io
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
