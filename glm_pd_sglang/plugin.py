"""The ``sglang.srt.plugins`` entry point: make ``--disaggregation-transfer-backend glm-pd`` resolve.

SGLang calls ``register`` in its launcher and again in every scheduler, DP-controller and detokenizer
process (``load_plugins``; ``SGLANG_PLUGINS`` filters by entry-point name ``glm_pd``). It must be
idempotent and must leave every other backend exactly as it was. It:
- adds ``glm-pd`` to the argument parser's backend choices;
- adds a ``GLM_PD`` member to SGLang's closed ``TransferBackend`` enum, so ``TransferBackend("glm-pd")``
  resolves where the scheduler and the bootstrap service build it;
- wraps ``get_kv_class`` (an AROUND hook in SGLang's HookRegistry) so ``glm-pd`` returns glm-pd's classes.
"""

from __future__ import annotations

from typing import Any

BACKEND = "glm-pd"
MEMBER = "GLM_PD"
_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"
_hook_registered = False


def register() -> None:
    global _hook_registered
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _add_enum_member()
    if not _hook_registered:
        HookRegistry.register(_TARGET, _get_kv_class, HookType.AROUND)
        _hook_registered = True
    import sglang.srt.plugins as plugins

    if getattr(plugins, "_plugins_loaded", False):
        HookRegistry.apply_hooks()  # called outside load_plugins (which applies hooks itself at its end)


def _add_enum_member() -> None:
    """SGLang's ``TransferBackend`` has no extension point; add the member the way ``Enum`` stores one."""
    from sglang.srt.disaggregation.utils import TransferBackend

    if BACKEND in TransferBackend._value2member_map_:
        return
    member = object.__new__(TransferBackend)
    member._name_ = MEMBER
    member._value_ = BACKEND
    type.__setattr__(TransferBackend, MEMBER, member)
    TransferBackend._member_map_[MEMBER] = member
    TransferBackend._value2member_map_[BACKEND] = member
    TransferBackend._member_names_.append(MEMBER)


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", transfer_backend) != BACKEND or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from glm_pd_sglang import conn, endpoints

    return {
        KVClassType.MANAGER: conn.GlmPdKVManager,
        KVClassType.SENDER: endpoints.GlmPdKVSender,
        KVClassType.RECEIVER: endpoints.GlmPdKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: endpoints.GlmPdKVBootstrapServer,
    }[class_type]
