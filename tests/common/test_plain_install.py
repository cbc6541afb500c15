"""A plain ``pip install glm-pd`` (numpy, msgspec, xxhash) runs ``--help``, ``plan`` and ``doctor``; the demo
names the extra it needs.

Each command runs in a child interpreter started with ``-S`` (no site-packages) whose only path entry is a
folder holding the runtime dependencies, then the folder ``glm_pd_common`` lies in: pyzmq, NIXL and Mooncake are
simply not there, as after a plain install.
"""

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import glm_pd_common

RUNTIME_DEPS = ("numpy", "msgspec", "xxhash")
OPTIONAL = ("zmq", "nixl", "mooncake")


def make_site(root: Path, dists: tuple[str, ...]) -> Path:
    """A folder with the top-level entries of ``dists`` (packages, bundled libs, metadata)."""
    site = root / "site"
    site.mkdir()
    for name in dists:
        dist = metadata.distribution(name)
        for top in sorted({f.parts[0] for f in dist.files or () if f.parts[0] != ".."}):
            if not (site / top).exists():
                (site / top).symlink_to(Path(str(dist.locate_file(top))))
    return site


def run_in(site: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    core = Path(glm_pd_common.__file__).parent.parent
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join((str(site), str(core)))}
    return subprocess.run(
        [sys.executable, "-S", "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )


def glm_pd(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """What the ``glm-pd`` console script runs."""
    return run_in(site, "import sys; from glm_pd_common.tools.cli import main; sys.exit(main())", *args)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = make_site(tmp_path_factory.mktemp("plain"), RUNTIME_DEPS)
    probe = "import importlib.util as u, sys; sys.exit(sum(u.find_spec(m) is not None for m in sys.argv[1:]))"
    assert run_in(site, probe, *OPTIONAL).returncode == 0, "the plain site must not see pyzmq, NIXL or Mooncake"
    return site


@pytest.fixture(scope="module")
def with_pyzmq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_site(tmp_path_factory.mktemp("zmq"), (*RUNTIME_DEPS, "pyzmq"))


def test_help_runs(plain: Path) -> None:
    proc = glm_pd(plain, "--help")
    assert proc.returncode == 0, proc.stderr
    assert all(cmd in proc.stdout for cmd in ("plan", "demo", "doctor"))


def test_plan_runs(plain: Path) -> None:
    proc = glm_pd(plain, "plan", "--preset", "glm-5.3", "--tokens", "1M", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["bytes_per_token"]["total"] == 53_940  # FACTS.md §2


def test_doctor_reports_what_is_missing_and_the_extra(plain: Path) -> None:
    proc = glm_pd(plain, "doctor", "--json", "--peer", "127.0.0.1:9")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    for name in ("side channel", "nixl", "peer"):
        assert checks[name]["status"] == "FAIL" and "glm-pd[nixl]" in checks[name]["fix"], checks[name]
    assert "glm-pd[mooncake]" in checks["mooncake"]["fix"]


@pytest.mark.parametrize("args", [("--allow-tcp",), ("--help",), ("--transport", "mooncake", "--tokens", "1k")])
def test_demo_without_pyzmq_names_the_extra(plain: Path, args: tuple[str, ...]) -> None:
    proc = glm_pd(plain, "demo", *args)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "pyzmq" in proc.stderr and "glm-pd[nixl]" in proc.stderr and "glm-pd[mooncake]" in proc.stderr


@pytest.mark.parametrize(("transport", "library"), [("nixl", "nixl"), ("mooncake", "mooncake-transfer-engine")])
def test_demo_without_the_transport_names_its_extra(with_pyzmq: Path, transport: str, library: str) -> None:
    proc = glm_pd(with_pyzmq, "demo", "--allow-tcp", "--transport", transport)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert library in proc.stderr and f"glm-pd[{transport}]" in proc.stderr
    assert "pyzmq" not in proc.stderr
