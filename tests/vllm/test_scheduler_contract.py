"""GlmPdConnector inside vLLM's own Scheduler and KVCacheManager (tests/support/vllm_engine.py), prefill and
decode engines in one process with real NIXL between them: what vLLM itself does with the connector's reports.

Each case asserts vLLM's state: its ``requests`` map, its block pool's free count, finish reasons and every token
of the healthy neighbours."""

from __future__ import annotations

import time

import pytest
from vllm.v1.request import RequestStatus

from glm_pd_common.errors import ConfigError
from glm_pd_common.handoff.wire.protocol import PROTOCOL_VERSION
from tests.support.device_double import DeviceDouble
from tests.support.ports import free_port_range
from tests.support.services import wait_for
from tests.support.vllm_engine import Engine, _mismatched
from tests.support.vllm_harness import STAGED

PROMPT = 300  # tokens: five blocks of 64, ten of 32, nineteen of 16
STREAM = 40  # tokens a healthy neighbour generates


@pytest.fixture
def pair(tiny_model):
    """Build a prefill and a decode engine (decode's pool sized in tokens); both are shut down at the end."""
    made: list[Engine] = []

    def build(decode_pool_tokens: int, prefill_job: dict | None = None, **decode_job) -> tuple[Engine, Engine]:
        port = free_port_range(8)
        base = {"model": tiny_model, "block_size": 64, "tp": 1, "port": port, "lease_s": 30.0,
                "module_path": "glm_pd_vllm.connector"}  # fmt: skip
        prefill = Engine({**base, "role": "kv_producer", "engine_id": "P", "pool_tokens": 64 * 64,
                          **(prefill_job or {})})  # fmt: skip
        made.append(prefill)
        decode = Engine({**base, "role": "kv_consumer", "engine_id": "D", "pool_tokens": decode_pool_tokens,
                         **decode_job})  # fmt: skip
        made.append(decode)
        return prefill, decode

    yield build
    for engine in made:
        engine.shutdown()


def both(prefill: Engine, decode: Engine, until, steps: int = 20000) -> None:
    """Both engines' loops, as two servers run them side by side."""
    decode.run(lambda: prefill.step() is not None and until(), steps)


def prefilled(prefill: Engine, rid: str, prompt: list[int], segments: list[tuple[int, int]]) -> dict:
    """The proxy's first leg: prefill computes the prompt and answers with decode's kv_transfer_params."""
    prefill.add(rid, prompt, segments, {"do_remote_decode": True})
    prefill.run(lambda: prefill.tracked[rid].finish is not None)
    params = prefill.tracked[rid].kv_transfer_params
    assert params and params["do_remote_prefill"], prefill.state()
    return params


def settled(prefill: Engine, decode: Engine) -> None:
    both(prefill, decode, lambda: prefill.idle() and decode.idle())


def test_an_abort_while_waiting_for_blocks_leaves_decode_serving(pair) -> None:
    """Decode's cache is full with two running requests; a third waits for blocks and its client goes away. The
    release that frees prefill's blocks must not be reported to vLLM as a finished load (before: vLLM's
    ``assert req_id in self.requests`` ended the engine)."""
    prefill, decode = pair(12 * 64)  # two requests of 5 blocks (+1 to decode) fill it: a third must wait
    bs = decode.block_size
    per_request = -(-(PROMPT + STREAM) // bs)
    if 3 * per_request <= decode.num_blocks - 1:
        pytest.skip(f"blocks of {bs}: a third request fits in {decode.num_blocks - 1} blocks")
    prompts = {rid: list(range(seed, seed + PROMPT)) for seed, rid in enumerate("abc", start=1)}
    params = {rid: prefilled(prefill, rid, p, [(PROMPT, i)]) for i, (rid, p) in enumerate(prompts.items())}
    for i, rid in enumerate("ab"):
        decode.add(rid, prompts[rid], [(PROMPT, i)], params[rid], max_tokens=STREAM)
    both(prefill, decode, lambda: all(len(decode.tracked[r].tokens) > 2 for r in "ab"))
    decode.add("c", prompts["c"], [(PROMPT, 2)], params["c"], max_tokens=STREAM)
    for _ in range(5):
        decode.step()
    assert str(decode.scheduler.requests["c"].status) == "WAITING", decode.state()
    decode.abort("c")
    both(prefill, decode, lambda: all(decode.tracked[r].finish for r in "ab"))
    for rid in "ab":
        assert decode.tracked[rid].finish == "length" and len(decode.tracked[rid].tokens) == STREAM
        assert decode.tracked[rid].mismatched == []
    assert "c" not in decode.scheduler.requests
    settled(prefill, decode)  # prefill freed c's blocks on decode's release; every pool is whole again


def test_a_skipped_read_releases_prefill_without_a_load(pair) -> None:
    """``skip_reading_prefix_cache``: vLLM discards the connector's count, allocates with no external tokens and
    computes the prompt itself; the connector frees prefill's blocks and reports nothing. Decode's release may
    reach prefill before prefill's next step hands the finished request to its connector: it is held, and the
    blocks are released then (before: refused, and held until the lease ran out)."""
    prefill, decode = pair(32 * 64)
    prompt = list(range(1, PROMPT + 1))
    params = prefilled(prefill, "s", prompt, [(PROMPT, 9)])  # prefill's grant waits for its next step
    decode.add("s", prompt, [(PROMPT, 9)], params, max_tokens=4, skip_reading_prefix_cache=True)
    decode.run(lambda: decode.tracked["s"].finish is not None)
    decode.run(lambda: not decode.workers[0]._worker.decode.leftovers()["queued"])
    time.sleep(0.5)  # the release reaches prefill's service, which has no lease for s yet
    assert decode.tracked["s"].finish == "length" and len(decode.tracked["s"].tokens) == 4
    assert decode.invalid_block_ids == set()
    settled(prefill, decode)
    assert prefill.counts.get("prefill_released") == 1 and not prefill.counts.get("prefill_expired"), prefill.counts
    # the next request's steps carry whatever the worker still had to say about s: nothing, or vLLM asserts
    nxt = list(range(7, PROMPT + 7))
    decode.add("t", nxt, [(PROMPT, 10)], prefilled(prefill, "t", nxt, [(PROMPT, 10)]), max_tokens=4)
    both(prefill, decode, lambda: decode.tracked["t"].finish is not None)
    assert decode.tracked["t"].finish == "length" and decode.tracked["t"].mismatched == []
    assert "s" not in decode.reported_recving, "vLLM never waited for a load of s: a report must not reach it"
    settled(prefill, decode)


def _shared_prefix(pair, policy: str) -> tuple[Engine, Engine, int]:
    """A is loaded and streaming; B shares A's first blocks, decode hits them locally, and B's load fails."""
    prefill, decode = pair(48 * 64, failure_policy=policy)
    if not decode.prefix_caching:
        pytest.skip("vLLM turned prefix caching off for MLA here (no AMX): decode has no hit to share")
    bs = decode.block_size
    shared = (PROMPT // 2) // bs * bs
    a = list(range(1, PROMPT + 1))
    b = a[:shared] + list(range(5000, 5000 + PROMPT - shared))
    segs_a, segs_b = [(PROMPT, 1)], [(shared, 1), (PROMPT, 2)]  # the shared tokens' KV is the same bytes
    pa, pb = prefilled(prefill, "A", a, segs_a), prefilled(prefill, "B", b, segs_b)
    decode.add("A", a, segs_a, pa, max_tokens=STREAM)
    both(prefill, decode, lambda: len(decode.tracked["A"].tokens) > 2)
    decode.faults["B"] = "transport_error"
    decode.add("B", b, segs_b, pb, max_tokens=4)
    return prefill, decode, shared


def test_a_failed_load_fails_only_its_own_request(pair) -> None:
    """Only the blocks the load was writing are reported: the prefix hit B shares with the running A is not, so
    vLLM leaves A alone (before: A was truncated and failed with B)."""
    prefill, decode, shared = _shared_prefix(pair, "fail")
    both(prefill, decode, lambda: decode.tracked["A"].finish is not None and decode.tracked["B"].finish is not None)
    assert decode.tracked["B"].finish == "error", decode.tracked["B"]
    a = decode.tracked["A"]
    assert a.finish == "length" and len(a.tokens) == STREAM and a.mismatched == []
    hit = set(a.table[: shared // decode.block_size])
    assert decode.invalid_block_ids and not decode.invalid_block_ids & hit
    settled(prefill, decode)


def test_recompute_policy_computes_a_failed_suffix_locally(pair) -> None:
    """``kv_load_failure_policy="recompute"``: vLLM recomputes B from its valid prefix and serves it in full."""
    prefill, decode, shared = _shared_prefix(pair, "recompute")
    both(prefill, decode, lambda: decode.tracked["A"].finish is not None and decode.tracked["B"].finish is not None)
    for rid, n in (("A", STREAM), ("B", 4)):
        track = decode.tracked[rid]
        assert track.finish == "length" and len(track.tokens) == n and track.mismatched == [], (rid, track)
    hit = set(decode.tracked["A"].table[: shared // decode.block_size])
    assert decode.invalid_block_ids and not decode.invalid_block_ids & hit
    settled(prefill, decode)


def test_data_parallel_siblings_on_one_node_serve_their_own_requests(tiny_model) -> None:
    """Two prefill engines of one DP group start from one config (same base port) on one node: each binds ports
    of its own, and decode's load of each request lands the bytes of the engine that computed it."""
    port = free_port_range(8)
    base = {"model": tiny_model, "block_size": 64, "tp": 1, "port": port, "lease_s": 30.0, "dp_size": 2,
            "module_path": "glm_pd_vllm.connector", "pool_tokens": 32 * 64}  # fmt: skip
    engines = []
    try:
        for rank in range(2):  # vLLM names DP engines <id>_dp<rank> before the connector is built
            engines.append(Engine({**base, "role": "kv_producer", "engine_id": f"P_dp{rank}", "dp_rank": rank}))
        decode = Engine({**base, "role": "kv_consumer", "engine_id": "D", "dp_size": 1})
        engines.append(decode)
        siblings = engines[:2]
        prompt = list(range(1, PROMPT + 1))
        params = [prefilled(p, f"r{i}", prompt, [(PROMPT, 20 + i)]) for i, p in enumerate(siblings)]
        assert params[0]["remote_port"] != params[1]["remote_port"]
        for i, p in enumerate(params):
            decode.add(f"r{i}", prompt, [(PROMPT, 20 + i)], p, max_tokens=2)

        def step_all() -> bool:
            for sibling in siblings:
                sibling.step()
            return all(decode.tracked[f"r{i}"].finish for i in range(2))

        decode.run(step_all)
        for i in range(2):
            track = decode.tracked[f"r{i}"]
            assert track.finish == "length" and track.mismatched == [], (i, track)
        decode.run(lambda: all(s.step() is not None and s.idle() for s in siblings) and decode.idle())
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_hit_on_blocks_an_earlier_load_filled_loads_only_the_rest(pair) -> None:
    """A second turn: B extends A's prompt; decode's prefix hit is the blocks A's load filled, and B's load must
    land the rest of its prompt around them, byte for byte."""
    prefill, decode = pair(48 * 64)
    if not decode.prefix_caching:
        pytest.skip("vLLM turned prefix caching off for MLA here (no AMX): decode has no hit")
    first = 130
    a = list(range(1, PROMPT + 1))
    pa = prefilled(prefill, "A", a[:first], [(first, 3)])
    decode.add("A", a[:first], [(first, 3)], pa, max_tokens=2)
    both(prefill, decode, lambda: decode.tracked["A"].finish is not None)
    pb = prefilled(prefill, "B", a, [(PROMPT, 3)])
    decode.add("B", a, [(PROMPT, 3)], pb, max_tokens=2)
    both(prefill, decode, lambda: decode.tracked["B"].finish is not None)
    b = decode.tracked["B"]
    assert b.finish == "length" and b.mismatched == [], b
    assert set(decode.tracked["A"].table[: first // decode.block_size]) <= set(b.table), "B hit A's blocks"
    settled(prefill, decode)


def test_a_request_queued_past_the_lease_is_kept_by_renewals(pair) -> None:
    """Decode's run slots are taken (``max_num_seqs`` 2), so vLLM queues C without asking the connector; C
    waits longer than prefill's lease. Decode renews C's lease while it waits, and C loads when it runs."""
    lease = 1.0
    prefill, decode = pair(110 * 64, max_num_seqs=2, lease_s=lease, prefill_job={"lease_s": lease})
    prompts = {rid: list(range(seed * 1000, seed * 1000 + PROMPT)) for seed, rid in enumerate("ABC", start=1)}
    params = {rid: prefilled(prefill, rid, p, [(PROMPT, 30 + i)]) for i, (rid, p) in enumerate(prompts.items())}
    for i, rid in enumerate("AB"):
        decode.add(rid, prompts[rid], [(PROMPT, 30 + i)], params[rid], max_tokens=3000)
    both(prefill, decode, lambda: all(decode.tracked[r].tokens for r in "AB"))
    decode.add("C", prompts["C"], [(PROMPT, 32)], params["C"], max_tokens=2)
    queued = time.monotonic()
    both(prefill, decode, lambda: time.monotonic() - queued > 3 * lease)
    assert not decode.tracked["C"].checked and not decode.tracked["A"].finish, "C must still wait behind A and B"
    for rid in "AB":  # their clients leave: C gets a slot
        decode.abort(rid)
    both(prefill, decode, lambda: decode.tracked["C"].finish is not None)
    c = decode.tracked["C"]
    assert c.finish == "length" and c.mismatched == [], c
    settled(prefill, decode)


@pytest.mark.parametrize(
    ("prefill_job", "decode_job"),
    [({}, {"tp": 2, "dcp": 2, "interleave": 4}), ({"tp": 2, "dcp": 2}, {"tp": 2})],
    ids=["replicated-into-dcp2", "dcp2-into-replicated"],
)
def test_a_context_parallel_side_loads_and_decodes(pair, prefill_job, decode_job) -> None:
    """DCP on either side inside vLLM's own scheduler: one block id spans block_size x DCP tokens (vLLM's
    ``resolve_kv_cache_block_sizes``), prefill's params carry its sharding, each decode rank's blocks hold its
    token shard of the prompt at the first forward, and the request decodes to its length."""
    prefill, decode = pair(32 * 64, prefill_job, **decode_job)
    for engine, job in ((prefill, prefill_job), (decode, decode_job)):
        assert engine.scheduler_block == engine.block_size * job.get("dcp", 1)
    prompt = list(range(1, PROMPT + 1))
    params = prefilled(prefill, "r", prompt, [(PROMPT, 1)])
    assert (params["remote_token_shards"], params["remote_interleave"]) == (prefill_job.get("dcp", 1), 1)
    assert len(params["remote_block_ids"]) == -(-PROMPT // prefill.scheduler_block)
    decode.add("r", prompt, [(PROMPT, 1)], params, max_tokens=STREAM)
    both(prefill, decode, lambda: decode.tracked["r"].finish is not None)
    track = decode.tracked["r"]
    assert track.checked == set(range(decode_job["tp"])) and track.mismatched == [], track
    assert track.finish == "length" and len(track.tokens) == STREAM
    assert decode.reported_failed == set() and decode.reported_recving == ["r"]
    settled(prefill, decode)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_streamed_request_is_read_while_prefill_computes_it(pair, staged: bool) -> None:
    """Streamed mode inside vLLM's own schedulers. Prefill runs chunked prefill (64 tokens a step: five steps for
    300 tokens); decode admitted the request at once, from the transfer id and prefill's address alone. After
    each prefill step, decode's own caches already hold every whole block vLLM's prefill scheduler had computed
    by then (read from decode's memory, against the request's content); then the request decodes, its first
    forward checking every block. Staged: every read, while prefill runs and after, goes through slots."""
    streamed = {"extra": {"streamed": True, **(STAGED if staged else {})}}
    prefill, decode = pair(32 * 64, {**streamed, "max_num_batched_tokens": 64}, **streamed)
    if not prefill.chunked_prefill:
        pytest.skip("this vLLM turned chunked prefill off (MLA on a CPU without AMX): one step, no chunk to stream")
    port = prefill.connector._scheduler.port
    prompt, segments = list(range(5000, 5000 + PROMPT)), [(PROMPT, 41)]
    prefill.add("S", prompt, segments, {"do_remote_decode": True, "glm_pd_transfer_id": "tx-S"})
    params = {"do_remote_prefill": True, "glm_pd_protocol": PROTOCOL_VERSION, "glm_pd_transfer_id": "tx-S",
              "remote_host": "127.0.0.1", "remote_port": port}  # fmt: skip
    decode.add("S", prompt, segments, params, max_tokens=3)
    decode.run(lambda: decode.scheduler.requests["S"].status == RequestStatus.WAITING_FOR_REMOTE_KVS)
    table = decode.scheduler.kv_cache_manager.get_block_ids("S")[0]
    held = []
    while prefill.tracked["S"].finish is None:
        prefill.step()
        request = prefill.scheduler.requests.get("S")
        if request is None or prefill.tracked["S"].finish is not None:
            break
        whole = request.num_computed_tokens // decode.block_size * decode.block_size
        deadline = time.monotonic() + 10
        while _mismatched(decode.caches[0], table, segments, whole) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _mismatched(decode.caches[0], table, segments, whole), f"decode lacks tokens < {whole}"
        held.append(whole)
    assert len(held) >= 3 and held == sorted(held) and held[-1] < PROMPT, held
    both(prefill, decode, lambda: decode.tracked["S"].finish is not None)
    s = decode.tracked["S"]
    assert s.finish == "length" and s.mismatched == [], s
    moved = decode.counts["bytes_main"] + decode.counts["bytes_indexer"]
    assert moved and decode.counts["bytes_staged"] == (moved if staged else 0), decode.counts
    settled(prefill, decode)


def test_a_refused_streamed_request_leaves_its_transfer_to_the_decode_that_takes_it(pair) -> None:
    """A decode's API server refuses a streamed leg (admission control, 503) and vLLM hands the connector a
    pre-aborted stand-in to free what the request pinned. The transfer must stay open: the router sends the leg to
    another decode (here the same engine stands in for it), which reads it; before, the stand-in's release ended the
    transfer ("decode needs none of its bytes") and that load failed. A refused pull-mode request still frees
    prefill's lease."""
    streamed = {"extra": {"streamed": True}}
    prefill, decode = pair(32 * 64, streamed, **streamed)
    port = prefill.connector._scheduler.port
    prompt, segments = list(range(7000, 7000 + PROMPT)), [(PROMPT, 43)]
    prefill.add("S", prompt, segments, {"do_remote_decode": True, "glm_pd_transfer_id": "tx-R"})
    params = {"do_remote_prefill": True, "glm_pd_protocol": PROTOCOL_VERSION, "glm_pd_transfer_id": "tx-R",
              "remote_host": "127.0.0.1", "remote_port": port}  # fmt: skip
    decode.refuse("refused-S", params)
    assert "refused-S" not in decode.scheduler.requests
    decode.add("S", prompt, segments, params, max_tokens=3)
    both(prefill, decode, lambda: decode.tracked["S"].finish is not None)
    s = decode.tracked["S"]
    assert s.finish == "length" and s.mismatched == [] and decode.reported_failed == set(), s
    settled(prefill, decode)
    pulled = list(range(9000, 9000 + PROMPT))
    decode.refuse("refused-P", prefilled(prefill, "P", pulled, [(PROMPT, 44)]))
    settled(prefill, decode)
    assert prefill.counts.get("prefill_released") == 2, prefill.counts  # S after its load, P on the refusal


def test_prefill_knows_a_streamed_transfer_before_its_first_forward(pair) -> None:
    """vLLM calls ``start_load_kv`` only once the step's forward is launched (on CPU, once it has run): a decode
    that subscribed first must not wait that long for prefill to know the transfer (a first step longer than
    decode's timeout failed it: "prefill has no request for this transfer id"). The transfer opens when vLLM binds
    the step's metadata, before the forward."""
    streamed = {"extra": {"streamed": True}}
    prefill, _ = pair(32 * 64, streamed, **streamed)
    prefill.add("S", list(range(PROMPT)), [(PROMPT, 5)], {"do_remote_decode": True, "glm_pd_transfer_id": "tx"})
    out = prefill.scheduler.schedule()
    service = prefill.workers[0]._worker.prefill
    assert service.leftovers()["streams"] == 0
    prefill.workers[0].bind_connector_metadata(out.kv_connector_metadata)
    deadline = time.monotonic() + 5
    while service.leftovers()["streams"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.leftovers()["streams"] == 1, "the transfer is not open before the step's forward"
    prefill.workers[0].clear_connector_metadata()


def test_every_glm_pd_thread_selects_the_rank_device(pair, monkeypatch) -> None:
    """The worker derives its threads' setup from its regions (``DeviceDouble`` stands in for torch's device
    selection, as if the caches sat on CUDA device 1): prefill's service thread and decode's load lanes select
    that device before their first call, so no event query or copy of theirs opens GPU 0's context."""
    import glm_pd_vllm.worker

    devices = DeviceDouble()
    monkeypatch.setattr(glm_pd_vllm.worker, "thread_device", lambda regions, _: devices.setup_for(regions, 1))
    prefill, decode = pair(32 * 64)
    prompt = list(range(1, PROMPT + 1))
    decode.add("A", prompt, [(PROMPT, 3)], prefilled(prefill, "A", prompt, [(PROMPT, 3)]), max_tokens=2)
    both(prefill, decode, lambda: decode.tracked["A"].finish is not None)
    assert decode.tracked["A"].mismatched == [], decode.tracked["A"]
    selected = {name for name, call, device in devices.calls if call == "set_device" and device == 1}
    assert any(name.startswith("glm-pd-prefill") for name in selected), devices.calls
    assert any(name.startswith("glm-pd-decode") for name in selected), devices.calls
    settled(prefill, decode)


def test_a_claim_is_answered_before_the_forward_of_the_step_that_grants_it(pair) -> None:
    """The step after a request finished carries its grant; vLLM binds that step's metadata, launches the forward,
    then calls ``start_load_kv``. Granting at bind, behind an event recorded there, lets prefill answer decode's
    claim while that forward runs: here prefill's step stops after the bind, and decode's load still completes."""
    prefill, decode = pair(32 * 64)
    prompt = list(range(1, PROMPT + 1))
    params = prefilled(prefill, "A", prompt, [(PROMPT, 3)])
    out = prefill.scheduler.schedule()
    worker = prefill.workers[0]
    assert out.kv_connector_metadata.grants, "the step after A finished carries no grant"
    worker.bind_connector_metadata(out.kv_connector_metadata)  # the forward would be launched next
    service = worker._worker.prefill
    held = wait_for(service.leftovers, lambda h: h["leases"] == 1, 5.0)
    assert held["leases"] == 1, f"no lease before the step's forward: {held}"
    decode.add("A", prompt, [(PROMPT, 3)], params, max_tokens=2)
    decode.run(lambda: decode.tracked["A"].finish is not None)
    assert decode.tracked["A"].finish == "length" and decode.tracked["A"].mismatched == [], decode.tracked["A"]
    worker.clear_connector_metadata()


RANK_HOSTS = ["127.0.0.1", "127.0.0.2"]  # both local: each prefill rank as if on its own node


def test_a_prefill_whose_ranks_sit_on_two_hosts_is_read_on_both(pair) -> None:
    """TP 16 over two H100 nodes, in small: each prefill rank binds its own node's address, the workers publish it
    through vLLM's handshake metadata, the scheduler relays every rank's host in the params, and decode dials each
    rank where it is. DCP 2 shards the tokens over both prefill ranks, so decode must read both."""
    prefill, decode = pair(32 * 64, {"tp": 2, "dcp": 2, "rank_hosts": RANK_HOSTS}, tp=2)
    prompt = list(range(1, PROMPT + 1))
    params = prefilled(prefill, "r", prompt, [(PROMPT, 1)])
    assert params["remote_hosts"] == RANK_HOSTS and params["remote_host"] == RANK_HOSTS[0], params
    decode.add("r", prompt, [(PROMPT, 1)], params, max_tokens=STREAM)
    both(prefill, decode, lambda: decode.tracked["r"].finish is not None)
    track = decode.tracked["r"]
    assert track.checked == {0, 1} and track.mismatched == [] and track.finish == "length", track
    dialed = {link.client.address for w in decode.workers for link in w._worker.decode._links.all()}
    port = prefill.workers[0]._worker.prefill.port
    assert dialed == {f"{RANK_HOSTS[0]}:{port}", f"{RANK_HOSTS[1]}:{port + 1}"}, dialed
    settled(prefill, decode)


@pytest.mark.parametrize(
    ("prefill_job", "refusal"),
    [
        ({"extra": {"side_channel_host": "0.0.0.0"}}, "binds every interface but is no address decode can dial"),
        ({"rank_hosts": RANK_HOSTS, "extra": {"streamed": True}}, "streamed mode needs every prefill rank on one"),
    ],
    ids=["wildcard", "streamed-across-hosts"],
)
def test_a_prefill_glm_pd_cannot_serve_across_nodes_is_refused_at_start(tiny_model, prefill_job, refusal) -> None:
    job = {"model": tiny_model, "block_size": 64, "tp": 2, "port": free_port_range(8), "lease_s": 30.0,
           "module_path": "glm_pd_vllm.connector", "role": "kv_producer", "engine_id": "P", "pool_tokens": 64 * 64,
           **prefill_job}  # fmt: skip
    with pytest.raises(ConfigError, match=refusal):
        Engine(job).shutdown()
