import json
from pathlib import Path

import pytest

from tests.support.sglang_pair import Pair
from tests.support.tiny_glm import TINY_GLM


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A GLM-5.x-shaped config: 6 layers, full layers 0-2 (freq 4 / offset 3), shared 3-5, one MTP layer."""
    path = tmp_path_factory.mktemp("tiny-glm")
    (path / "config.json").write_text(json.dumps(TINY_GLM))
    return str(path)


@pytest.fixture
def pair(tmp_path: Path, tiny_model: str) -> Pair:
    return Pair(tmp_path, tiny_model)


@pytest.fixture(scope="module")
def module_pair(tmp_path_factory: pytest.TempPathFactory, tiny_model: str) -> Pair:
    """One pair for a module whose tests all read one long run."""
    return Pair(tmp_path_factory.mktemp("pair"), tiny_model)
