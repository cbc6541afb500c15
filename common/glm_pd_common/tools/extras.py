"""What a plain ``pip install glm-pd`` lacks and which extra brings it, so a command that needs it can say so.

A plain install (numpy, msgspec, xxhash) runs ``glm-pd plan``, ``doctor`` and ``--help``; the side channel
(pyzmq) and the transports are extras, and pyzmq comes with either transport's extra.
"""

from __future__ import annotations

from importlib.util import find_spec

from glm_pd_common.errors import ConfigError

# import name -> (distribution, extra that installs it)
OPTIONAL_MODULES = {
    "zmq": ("pyzmq", "nixl"),
    "nixl": ("nixl", "nixl"),
    "mooncake": ("mooncake-transfer-engine", "mooncake"),
}


def installed(module: str) -> bool:
    return find_spec(module) is not None


def install_hint(extra: str) -> str:
    return f"pip install 'glm-pd[{extra}]'"


def require_transport(command: str, transport: str) -> None:
    """Refuse ``command`` naming the extra when the side channel or ``transport``'s library is missing."""
    missing = [OPTIONAL_MODULES[m][0] for m in ("zmq", transport) if not installed(m)]
    if missing:
        raise ConfigError(
            f"glm-pd {command} --transport {transport} needs {' and '.join(missing)}, which this install lacks: "
            f"{install_hint(transport)}"
        )
