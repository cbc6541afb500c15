import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

RECIPES = Path(__file__).parents[2] / "recipes"
KEY = "/etc/glm-pd/site.key_secret"  # what an operator's deployment key path looks like (the recipes only pass it)


@pytest.fixture
def run_recipe(tmp_path: Path):
    """Run a recipe script with its engine binary replaced by a stand-in that records argv and environment.

    The stand-in is the only double: the script itself runs unchanged, and the recorded command line is then
    parsed by the real engine's parser (the engines need GPUs to go further)."""
    shim = tmp_path / "record"
    out = tmp_path / "argv.json"
    shim.write_text(
        "#!/usr/bin/env python3\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(out)!r}, 'w'))\n"
    )
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)

    def run(script: str, **env: str) -> tuple[list[str], dict[str, str]]:
        full = {**os.environ, "VLLM": str(shim), "PYTHON": str(shim), "GLM_PD_CREDENTIAL": KEY, **env}
        done = subprocess.run(["bash", str(RECIPES / script)], env=full, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        record = json.loads(out.read_text())
        return record["argv"], record["env"]

    return run
