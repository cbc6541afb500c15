"""One error hierarchy for the core; every message names the field and both values."""

from __future__ import annotations


class GlmPdError(Exception):
    """Base class of every error glm-pd raises on purpose."""


class ConfigError(GlmPdError, ValueError):
    """A model config, preset or user setting is unusable; the message names the field."""


class LayoutMismatch(GlmPdError):
    """Two peers disagree on a byte-relevant fact; carries every differing field."""

    def __init__(self, diffs: list[tuple[str, object, object]], *, local: str = "local", remote: str = "remote"):
        self.diffs = diffs
        lines = "; ".join(f"{name}: {local}={a!r} {remote}={b!r}{_set_delta(a, b)}" for name, a, b in diffs)
        super().__init__(f"layout mismatch on {len(diffs)} field(s): {lines}")


def _set_delta(a: object, b: object) -> str:
    """For two id lists, the ids on which they differ (long layer lists are hard to compare by eye)."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return f" (differ on {sorted(set(a) ^ set(b))})"
    return ""


class PageOutOfRange(GlmPdError, IndexError):
    """A page id (often supplied by a remote peer) does not exist in a region."""


class PlanError(GlmPdError, ValueError):
    """The inputs of a transfer plan are inconsistent (prefix, lengths, page tables, pairing)."""


class ProtocolError(GlmPdError, ValueError):
    """A wire message has an unknown version, the wrong shape or the wrong size."""


class AuthenticationFailed(GlmPdError):
    """A peer did not complete the authenticated handshake: it lacks the deployment's credential, or we do."""


class TransferFailed(GlmPdError):
    """A transport operation failed; the message says which peer, region and operation."""


class LeaseExpired(GlmPdError):
    """Prefill's hold on a request's pages ran out before decode confirmed its read."""


class ChecksumMismatch(GlmPdError):
    """Bytes differ after a transfer; names the layer, the region kind and the page."""
