"""Which of SGLang's bootstrap HTTP routes ask for the deployment's bearer token, and how a client presents it.

With a credential, the routes that register or reveal prefill ranks answer its holders only: ``PUT /route``
(a rank's registration: a stranger's would send decodes elsewhere), ``GET /route`` for one rank (its address)
and ``POST /register_dp_rank`` (which DP rank serves a room). Open, as SGLang serves them: ``/health`` (decode's
heartbeat), ``GET /route`` with every rank -1 (the instance's sizes and page size, no address: SGLang's decode
manager asks it with a request of its own that a backend cannot add a header to) and ``/query_dp_ranks``
(SGLang's decode asks it through ``CommonKVReceiver`` itself, not the backend's receiver).
"""

from __future__ import annotations

from aiohttp import web

from glm_pd_common.handoff.wire.trust import Trust

HEADER = "Authorization"
SCHEME = "Bearer"
_RANK_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


def authorization(trust: Trust) -> dict[str, str]:
    """The header a client of the bootstrap server sends (none without a credential)."""
    token = trust.bearer_token()
    return {} if token is None else {HEADER: f"{SCHEME} {token}"}


def refusal(trust: Trust, request: web.Request) -> web.Response | None:
    """A 401 for a request without the deployment's token, None to serve it (always, without a credential). The
    reply says what is missing, never what was sent."""
    if not trust.authenticated:
        return None
    scheme, _, presented = request.headers.get(HEADER, "").partition(" ")
    if scheme.lower() == SCHEME.lower() and trust.admits_bearer(presented.strip()):
        return None
    return web.Response(
        status=401,
        text="glm-pd: this bootstrap route needs the deployment's bearer token",
        headers={"WWW-Authenticate": SCHEME},
    )


def asks_shape(request: web.Request) -> bool:
    """Whether ``request`` is the query SGLang answers with the instance's shape only (every rank -1)."""
    try:
        return request.method == "GET" and all(int(request.query.get(name, "")) == -1 for name in _RANK_QUERY)
    except ValueError:
        return False
