"""SGLang's sender, receiver and bootstrap server with glm-pd's checks; the manager (conn.py) does the work."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, ClassVar

import numpy as np
import requests
import zmq
from aiohttp import web
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVReceiver,
    CommonKVSender,
    _get_bootstrap_session,
)
from sglang.srt.environ import envs

from glm_pd_common.counted_log import CountedLog
from glm_pd_common.errors import GlmPdError
from glm_pd_common.handoff.wire.trust import Trust
from glm_pd_sglang.bootstrap_auth import asks_shape, authorization, refusal
from glm_pd_sglang.config import GlmPdSglangConfig
from glm_pd_sglang.conn import GlmPdKVManager
from glm_pd_sglang.rooms import check_suffix, int_pages

logger = logging.getLogger(__name__)


class GlmPdKVSender(CommonKVSender):
    """SGLang's sender; glm-pd applies failures decided before it existed, records the suffix size and presents the
    deployment's token to the bootstrap server."""

    def __init__(self, mgr: GlmPdKVManager, bootstrap_addr: str, bootstrap_room: int, *args: Any, **kwargs: Any):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        reason = mgr._pending_failures.pop(bootstrap_room, None)
        if reason is not None:
            mgr.record_failure(bootstrap_room, reason)
            mgr.update_status(bootstrap_room, KVPoll.Failed)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        super().init(num_kv_indices, aux_index)
        self.kv_mgr._expected_pages[self.bootstrap_room] = int(num_kv_indices)

    def abort(self) -> None:
        super().abort()
        self.kv_mgr.prefill_aborted(self.bootstrap_room)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr._expected_pages.pop(self.bootstrap_room, None)
        self.kv_mgr._sent_pages.pop(self.bootstrap_room, None)

    def _register_prefill_dp_rank(self) -> None:
        """SGLang's note to the bootstrap server of which DP rank serves this room, presenting the deployment's
        token (the server takes it from holders only); without a credential, SGLang's own."""
        trust: Trust = self.kv_mgr.trust
        if not trust.authenticated:
            super()._register_prefill_dp_rank()
            return
        url = f"http://{self.bootstrap_server_url}/register_dp_rank"
        note = {"bootstrap_room": self.bootstrap_room, "dp_rank": self.kv_mgr.attn_dp_rank}
        try:
            response = requests.post(url, json=note, headers=authorization(trust), timeout=5)
        except requests.RequestException as exc:
            logger.error("glm-pd prefill: could not tell %s room %s's DP rank: %s", url, self.bootstrap_room, exc)
            return
        if response.status_code != 200:
            logger.error(
                "glm-pd prefill: %s refused room %s's DP rank: HTTP %s %s",
                url,
                self.bootstrap_room,
                response.status_code,
                response.text[:200],
            )


class GlmPdKVReceiver(CommonKVReceiver):
    """SGLang's receiver; glm-pd checks decode's suffix before announcing it and verifies before Success. Its
    sends to prefill ranks (registrations, rooms) go through sockets of its own context, which are clients of the
    deployment's authenticated servers once a manager with a credential exists."""

    _ctx = zmq.Context()
    _ctx.set(zmq.MAX_SOCKETS, envs.SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS.get())
    _socket_cache: ClassVar[dict] = {}
    _socket_locks: ClassVar[dict] = {}
    _global_lock = threading.Lock()
    _pages: np.ndarray | None = None
    _verified: bool = False
    _verifying: Future[str | None] | None = None
    _verify_by = 0.0  # monotonic deadline of the verification

    def __init__(self, mgr: GlmPdKVManager, *args: Any, **kwargs: Any) -> None:
        for option, value in mgr.trust.client_options().items():
            type(self)._ctx.setsockopt(option, value)  # the same options for every manager of the process
        super().__init__(mgr, *args, **kwargs)

    def _register_kv_args(self) -> bool:
        """SGLang's registration with each prefill rank, as SGLang sends it, each carrying this process's proof
        for that rank (``build_receiver_registration_message``)."""
        if self.bootstrap_infos is None:
            return False
        for info in self.bootstrap_infos:
            message = self.kv_mgr.build_receiver_registration_message((str(info["rank_ip"]), int(info["rank_port"])))
            if not self._send_bootstrap_message(bootstrap_info=info, message=message, operation="_register_kv_args"):
                return False
        return True

    def _get_bootstrap_info_from_server(
        self, prefill_dp_rank: int, prefill_cp_rank: int, target_tp_rank: int, target_pp_rank: int
    ) -> dict | None:
        """SGLang's query for one prefill rank's address, on SGLang's own session to that bootstrap server (one per
        thread), which from now on presents the deployment's token: the server reveals ranks to holders only."""
        mgr: GlmPdKVManager = self.kv_mgr
        _get_bootstrap_session(self.bootstrap_addr).headers.update(authorization(mgr.trust))
        return super()._get_bootstrap_info_from_server(prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank)

    def send_metadata(
        self,
        kv_indices: np.ndarray,
        aux_index: int | None = None,
        state_indices: list | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices: np.ndarray | None = None,
    ) -> None:
        mgr: GlmPdKVManager = self.kv_mgr
        pages = int_pages(kv_indices, what="decode page ids")
        state = None if state_indices is None else state_indices[mgr.caches.dsa_component]
        try:
            check_suffix(
                int(decode_prefix_len or 0),
                pages,
                int_pages(state, what="decode DSA state page ids"),
                mgr.caches.page_tokens,
                side="decode",
            )
            for region in mgr.caches.regions:
                region.check_pages(pages, side="decode")
        except GlmPdError as exc:
            mgr.record_failure(self.bootstrap_room, f"glm-pd refused room {self.bootstrap_room}: {exc}")
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            self.ensure_abort_notified()
            return
        self._pages = pages
        with mgr._lock:
            mgr._room_pages[self.bootstrap_room] = pages  # where staged slots of this room may land
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, destination, device_kv_indices)

    def clear(self) -> None:
        """SGLang's cleanup, the room's digests (a room failed on another rank is never verified here) and its
        staging slots."""
        super().clear()
        mgr: GlmPdKVManager = self.kv_mgr
        with mgr._lock:
            mgr._digests.pop(self.bootstrap_room, None)
        mgr.release_room_slots(self.bootstrap_room)

    def poll(self) -> int:
        """SGLang's state, but with checksums on, Success only once glm-pd's verifier thread found the landed
        bytes equal to prefill's digests (Transferring meanwhile): the scheduler thread never hashes a page. A
        verification not done within ``timeout_s`` fails the room (SGLang's own timeouts do not cover this
        state)."""
        status = super().poll()
        mgr: GlmPdKVManager = self.kv_mgr
        if status == KVPoll.Success and mgr.glm_config.verify_checksums and not self._verified:
            if self._verifying is None:
                pages = self._pages if self._pages is not None else np.zeros(0, dtype=np.int64)
                self._verifying = mgr.verify_later(self.bootstrap_room, pages)
                self._verify_by = time.monotonic() + mgr.glm_config.timeout_s
            if not self._verifying.done():
                if time.monotonic() < self._verify_by:
                    return KVPoll.Transferring
                self._verifying.cancel()  # if it has not started: the verifier's next room need not wait for it
                timeout = mgr.glm_config.timeout_s
                problem: str | None = f"the landed bytes were not verified within {timeout:g} s (the verifier is stuck)"
            else:
                problem = self._verifying.result()
            if problem is not None:
                mgr.record_failure(self.bootstrap_room, f"glm-pd room {self.bootstrap_room}: {problem}")
                mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                self.conclude_state = KVPoll.Failed
                return KVPoll.Failed
            self._verified = True
        return status


class GlmPdKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap server (routes, readiness, health), whose routes that register or reveal prefill ranks
    answer holders of the deployment's credential only (bootstrap_auth.py); without one, unchanged. SGLang starts
    it before, and apart from, any manager, so it reads the credential itself."""

    def __init__(self, host: str, port: int) -> None:
        config = GlmPdSglangConfig.from_env()
        self.trust = Trust.from_settings(config.credential, config.insecure)
        self.refused = CountedLog(
            logger, "glm-pd bootstrap server: refused %d request(s) without the deployment's token%s"
        )
        super().__init__(host, port)  # starts serving

    def _refusal(self, request: web.Request) -> web.Response | None:
        refused = refusal(self.trust, request)
        if refused is not None:
            self.refused.note(f" (last: {request.method} {request.path} from {request.remote})")
        return refused

    async def _handle_route(self, request: web.Request) -> web.Response:
        refused = None if asks_shape(request) else self._refusal(request)
        return refused if refused is not None else await super()._handle_route(request)

    async def _handle_register_dp_rank(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        return refused if refused is not None else await super()._handle_register_dp_rank(request)
