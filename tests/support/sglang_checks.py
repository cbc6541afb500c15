"""What every SGLang handoff test checks once its rooms end (shared by test_handoff and test_fault_matrix)."""

SUCCESS, FAILED = 4, 0  # KVPoll.Success, KVPoll.Failed


def assert_clean(prefill: dict | None, decode: dict) -> None:
    """Nothing is held once every room ended: no per-room state on either side, every page back."""
    for report in [decode] + ([prefill] if prefill else []):
        for held in report["leftovers"]:
            assert not any(held.values()), held
        assert all(n == report["pool_pages"] for n in report["free_pages"])


def assert_exact(prefill: dict, decode: dict, prefill_tp: int = 1, decode_tp: int = 1) -> None:
    for p, d in zip(prefill["results"], decode["results"], strict=True):
        assert d["states"] == [SUCCESS] * decode_tp, d["reasons"]
        assert p["states"] == [SUCCESS] * prefill_tp, p["reasons"]
        for rank in range(decode_tp):
            src = rank * prefill_tp // decode_tp  # SGLang pairs MLA ranks in contiguous groups
            assert d["dst_digests"][rank] == p["src_digests"][src], f"room {d['room']} decode rank {rank}"
            assert d["prefix_after"][rank] == d["prefix_before"][rank]  # decode's own prefix pages untouched
            assert d["aux_room"][rank] == d["room"]  # the metadata row landed before Success
