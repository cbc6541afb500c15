"""A deployment member that is not a room's decode, acting from inside a decode process (a hostile-peer double).

It holds the credential, as every deployment member does, and writes on the genuine receiver's own socket to a
prefill rank, so prefill reads its messages in order with the genuine ones (no race decides the case):
- ``borrowed``: a registration under the genuine rank's agent name, carrying another NIXL agent of that name
  (this impostor's, which registered no memory) and a proof of its own. Accepted, it would replace the genuine
  decode's agent: the room's writes would go to the impostor and fail.
- ``register_as_itself`` and ``describe``: a registration under the impostor's own name (with the genuine hello's
  regions), then, after the genuine room message, the same room described as the impostor's. Accepted, prefill
  would write the room to both, and the impostor's writes would fail the room.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from glm_pd_common.handoff.wire import protocol
from glm_pd_common.transport.base import Transport, TransportConfig
from glm_pd_common.transport.factory import create_transport
from glm_pd_sglang import wire
from glm_pd_sglang.registrations import agent_name


class Impostor:
    def __init__(self, mgr: Any, receiver: Any) -> None:
        self.mgr, self.receiver = mgr, receiver
        self.info = receiver.bootstrap_infos[0]
        self.prefill = (str(self.info["rank_ip"]), int(self.info["rank_port"]))
        self.agents: list[Transport] = []

    def _agent(self, name: str) -> Transport:
        agent = create_transport(name, TransportConfig(backend=self.mgr.transport.backend, allow_tcp=True))
        self.agents.append(agent)
        return agent

    def _send(self, message: list[bytes]) -> None:
        sock, lock = self.receiver._connect_to_bootstrap_server(self.info)
        with lock:
            sock.send_multipart(message)

    def _registration(self, name: str) -> list[bytes]:
        genuine = wire.parse(self.mgr.build_receiver_registration_message(self.prefill), wire.Registration)
        hello = protocol.decode(genuine.hello)
        forged = msgspec.structs.replace(
            hello, agent_name=name, agent_metadata=self._agent(name).metadata(), proof=secrets.token_bytes(32)
        )
        return wire.frames(wire.TAG_REGISTER, msgspec.structs.replace(genuine, hello=protocol.encode(forged)))

    def borrowed(self) -> None:
        self._send(self._registration(self.mgr.transport.agent_name))

    def register_as_itself(self) -> None:
        self.name = agent_name("decode", self.mgr.local_ip, self.mgr.rank_port)
        self._send(self._registration(self.name))

    def describe(self, room: int, pages: Any, aux_index: int, state: list, prefix: int) -> None:
        """The room message the genuine rank sent for ``room``, naming this impostor instead."""
        genuine = self.mgr.build_receiver_metadata_message(
            bootstrap_room=room,
            required_dst_info_num=self.receiver.required_dst_info_num,
            kv_indices=pages,
            aux_index=aux_index,
            state_indices=state,
            decode_prefix_len=prefix,
            is_dummy=False,
        )
        room_msg = msgspec.structs.replace(wire.parse(genuine, wire.Room), agent_name=self.name)
        self._send(wire.frames(wire.TAG_ROOM, room_msg))

    def close(self) -> None:
        for agent in self.agents:
            agent.close()
