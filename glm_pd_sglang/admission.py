"""Which decode ranks a prefill rank serves, and for which rooms.

A registration (glm-pd's hello, SGLang's endpoint and metadata buffers) is checked field by field, then its
agent's NIXL metadata is loaded; one under a registered agent's name replaces it only with that agent's proof
(``registrations``). A room message names its decode rank's pages; the ranks that first describe a room own it.
A message that must change nothing is answered with nothing: SGLang's sockets are PULL, and the address a
message names may be another decode's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.utils.network import NetworkAddress

from glm_pd_common.errors import ConfigError, GlmPdError, ProtocolError
from glm_pd_common.handoff.recent import RecentIds
from glm_pd_common.handoff.wire import protocol
from glm_pd_common.handoff.wire.handshake import accept_hello
from glm_pd_sglang import wire
from glm_pd_sglang.registrations import Registrations
from glm_pd_sglang.rooms import Target, check_aux, check_suffix, int_pages
from glm_pd_sglang.transfer import DecodePeer

logger = logging.getLogger(__name__)

_MAX_DECODE_RANKS = 256  # decode attention-TP ranks one prefill rank may serve for a room


class PrefillAdmission:
    """The admission half of ``GlmPdKVManager`` on prefill (mixed in ahead of SGLang's ``CommonKVManager``)."""

    # Set by the manager / CommonKVManager.
    caches: Any
    endpoint: Any
    transport: Any
    transfer_infos: dict[int, dict[str, Target]]
    req_to_decode_prefix_len: dict[int, int]
    request_status: Any
    _peers: dict[str, DecodePeer]
    _registrations: Registrations
    _refused: RecentIds
    _pending_failures: dict[int, str]
    _released: bool

    if TYPE_CHECKING:  # CommonKVManager's and the manager's (a stub here would shadow them in the MRO)

        def update_status(self, bootstrap_room: int, status: KVPoll) -> None: ...
        def record_failure(self, bootstrap_room: int, failure_reason: str) -> None: ...
        def resolve_kv_replica_factor(self, infos: dict[str, Target]) -> None: ...
        def send_kv_status_message(self, **kwargs: Any) -> None: ...
        def _send_multipart_locked(self, endpoint: str, message: list[bytes]) -> None: ...
        def _prefill_unique_rank(self) -> int: ...

    def _on_register(self, reg: wire.Registration) -> None:
        peer = protocol.clip(f"{reg.decode_ip}:{reg.decode_port}", 80)
        agent = ""
        try:
            hello = protocol.decode(reg.hello)
            if not isinstance(hello, protocol.Hello):
                raise ProtocolError(f"registration carries a {type(hello).__name__}, not a hello")
            if why := self._registrations.impostor(hello.agent_name, hello.proof):
                # answered with nothing: the address it names may be the registered decode's own
                logger.error("glm-pd prefill: ignored a registration from %s: %s", peer, why)
                return
            agent = hello.agent_name
            view = accept_hello(
                self.endpoint.spec, hello, backend=self.transport.backend, role="decode", local_role="prefill"
            )
            if view.shape.page_tokens != self.caches.page_tokens:
                raise ConfigError(
                    f"page size differs: prefill {self.caches.page_tokens}, decode {view.shape.page_tokens} tokens "
                    "(SGLang pairs pages one to one; set the same --page-size on both)"
                )
            aux = check_aux(self.caches.aux_item_lens, [(a.ptr, a.data_len, a.item_len) for a in reg.aux], peer=peer)
            evict, full = self._registrations.make_way(agent, self._waited_for())
            if full:
                raise ProtocolError(full)
            if evict is not None:
                self._forget_decode(evict, f"least recently used of {self._registrations.cap} decode ranks")
            if self._released:  # no transport until SGLang resumes the memory: loaded then, with the newest
                self._registrations.add(agent, reg, hello.proof)  # (a decode that resumed first re-registered)
                self._refused.discard(agent)
                return
            if agent in self._peers:  # the same decode again (its proof): its memory moved
                self._forget_decode(agent, "it registered again")
            self.transport.add_peer(hello.agent_metadata, [*view.spans, *aux])
        except GlmPdError as exc:
            reason = f"glm-pd prefill rank {self._prefill_unique_rank()} refused decode {peer} at registration: {exc}"
            logger.error(reason)
            if agent:
                self._refused.add(agent, reason)
            self._send_multipart_locked(
                NetworkAddress(reg.decode_ip, reg.decode_port).to_tcp(),
                wire.frames(wire.TAG_REFUSED, wire.Refused(self._prefill_unique_rank(), reason)),
            )
            return
        self._peers[agent] = DecodePeer(view, aux)
        self._registrations.add(agent, reg, hello.proof)
        self._refused.discard(agent)
        logger.info("glm-pd prefill: decode %s registered (tp %s/%s)", peer, view.shape.tp_rank, view.shape.tp_size)

    def _waited_for(self) -> set[str]:
        """Decode agents some room is waiting on (never evicted to make way)."""
        return {agent for infos in self.transfer_infos.values() for agent in infos}

    def _forget_decode(self, agent: str, why: str) -> None:
        if not self._released:
            self.transport.remove_peer(agent)
        self._peers.pop(agent, None)
        self._registrations.pop(agent)
        logger.info("glm-pd prefill: forgot decode agent %s (%s)", agent, why)

    def _on_room(self, m: wire.Room) -> None:
        key = (m.decode_ip, m.decode_port)
        if (refused := self._refused.get(m.agent_name)) is not None:
            self._fail_room(m.room, refused, key)
            return
        if self._released:
            self._fail_room(m.room, f"glm-pd prefill released its KV memory; room {m.room} cannot be served", key)
            return
        if m.agent_name not in self._peers:
            why = f"decode {protocol.clip(m.agent_name, 80)} sent room {m.room} before registering"
            self._fail_room(m.room, why, key)
            return
        if why := self._not_for(m):
            # answered with nothing: the address it names may be that of the decode the room belongs to
            logger.error("glm-pd prefill: ignored room %d from decode %s: %s", m.room, protocol.clip(m.agent_name), why)
            return
        try:
            pages = int_pages(m.dst_pages, what="decode page ids")
            if not 1 <= m.required_dst_info_num <= _MAX_DECODE_RANKS:
                raise ProtocolError(f"room {m.room} expects {m.required_dst_info_num} decode ranks")
        except GlmPdError as exc:
            self._fail_room(m.room, f"glm-pd refused room {m.room}: {exc}", key)
            return
        if not m.is_dummy:
            try:
                check_suffix(
                    m.decode_prefix_len,
                    pages,
                    int_pages(m.dst_state_pages, what="decode DSA state page ids"),
                    self.caches.page_tokens,
                    side=f"decode {m.decode_ip}:{m.decode_port}",
                )
            except GlmPdError as exc:
                self._fail_room(m.room, f"glm-pd refused room {m.room}: {exc}", key)
                return
        target = Target(
            m.agent_name,
            m.decode_ip,
            m.decode_port,
            m.is_dummy,
            m.required_dst_info_num,
            pages,
            m.aux_index,
            m.decode_prefix_len,
        )
        self._registrations.touch(m.agent_name)
        infos = self.transfer_infos.setdefault(m.room, {})
        infos[m.agent_name] = target
        if len(infos) == m.required_dst_info_num:
            self.req_to_decode_prefix_len[m.room] = m.decode_prefix_len
            self.resolve_kv_replica_factor(infos)
            self.update_status(m.room, KVPoll.WaitingForInput)

    def _not_for(self, m: wire.Room) -> str:
        """Why a room message must change nothing, or "". The decode ranks that first describe a room own it (its
        id, drawn by the router, is the grant): another message for it, once it has the ranks it expects, or
        naming another count of them, or a rank that already described it, is nobody's to act on."""
        infos = self.transfer_infos.get(m.room)
        if not infos:
            return ""
        if m.agent_name in infos:
            return "that decode rank already described this room"
        expected = next(iter(infos.values())).required_dst_info_num
        if expected != m.required_dst_info_num:
            return f"the room expects {expected} decode ranks, this message {m.required_dst_info_num}"
        if len(infos) >= expected:
            return "the room already has every decode rank it expects"
        return ""

    def _fail_room(self, room: int, reason: str, target: tuple[str, int]) -> None:
        """Fail a room on both sides, whether or not prefill's scheduler has created its sender yet."""
        logger.error("glm-pd: %s", reason)
        self.record_failure(room, reason)
        if room in self.request_status:
            self.update_status(room, KVPoll.Failed)
        else:
            self._pending_failures[room] = reason
        self.send_kv_status_message(targets=[target], bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason)
