import json
import re
import subprocess
import sys

import pytest

from glm_pd_common.tools.cli import main

M = 1 << 20


def run_json(capsys, *args):
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_glm53_million_token_account(capsys):
    a = run_json(capsys, "--preset", "glm-5.3", "--tokens", "1M")
    assert a["bytes_per_token"] == {"main": 51_168, "indexer": 2_772, "total": 53_940}
    assert a["bytes_per_token_with_mtp"] == 54_728
    assert a["bytes_per_request"]["main"] == 51_168 * M
    assert a["bytes_per_request"]["indexer"] == 2_772 * M
    assert round(a["bytes_per_request"]["main"] / 1e9, 1) == 53.7
    assert round(a["bytes_per_request"]["indexer"] / 1e9, 2) == 2.91
    assert a["tokens"] == M and a["pages"] == 16_384 and a["page_tokens"] == 64
    assert len(a["full_indexer_layers"]) == 21 and a["mtp_layers"] == [78]
    assert a["regions_per_rank"] == 101
    assert a["runs"] == {"contiguous": 101, "worst_case": 101 * 16_384}
    assert a["link_seconds"] == pytest.approx(a["bytes_moved_per_rank"]["total"] / 50e9)


def test_prefix_hit_shrinks_what_moves(capsys):
    a = run_json(capsys, "--tokens", "128k", "--prefix-tokens", "64k", "--decode-tp", "8", "--prefill-tp", "4")
    assert a["suffix_pages"] == 1024
    assert a["bytes_moved_per_rank"]["total"] == (53_940 + 656 + 132) * 65_536
    assert a["sources_of_decode_rank"] == [[0], [0], [1], [1], [2], [2], [3], [3]]
    assert a["bytes_over_network"] == 8 * a["bytes_moved_per_rank"]["total"]


def test_human_output_runs(capsys):
    assert main(["plan", "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "53,940 B" in out and "exposed, pull" in out and "exposed, streamed" in out


def test_pull_exposes_the_whole_load(capsys):
    a = run_json(capsys, "--tokens", "1M", "--link-gbps", "400")
    # 54,728 B/token with MTP (FACTS.md §2) x 2^20 tokens = 57,386,467,328 B at 400 Gbit/s = 50e9 B/s
    assert a["exposed"]["pull"]["seconds"] == pytest.approx(57_386_467_328 / 50e9)
    assert "exposed_seconds" not in a and "streamed_tail_bound_seconds" not in a


def test_human_output_prints_the_link_time_as_exposed_when_pulled(capsys):
    assert main(["plan", "--tokens", "1M"]) == 0
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in capsys.readouterr().out.splitlines()[1:])
    assert rows["time on the link"] == "1.148 s"
    assert rows["exposed, pull"].startswith("1.148 s + 2 round trips (")
    # 128 chunks of 8,192 tokens; the last moves 54,728 x 8,192 = 448,331,776 B: 8.97 ms at 50e9 B/s
    assert rows["exposed, streamed"].startswith("unknown without --prefill-tokens-per-s; at least 8.97 ms")
    assert rows["prefill chunks"].startswith("128 of 8,192 tokens; the last (8,192 tokens) moves 448.33 MB")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--page-tokens", "48"], "page_tokens"),
        (["--prefix-tokens", "100", "--tokens", "1000"], "page-aligned"),
        (["--preset", "nope"], "unknown preset"),
        (["--kv-cache-dtype", "fp16"], "fp16"),
        (["--decode-tp", "3"], "tp_size"),
        (["--chunk-tokens", "0"], "--chunk-tokens"),
        (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s"),
        (["--rtt-ms", "-1"], "--rtt-ms"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(capsys, args, needle):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_disagreeing_config_exits_nonzero_with_layers(tmp_path):
    cfg = {
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": 4,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
        "indexer_types": ["full", "shared", "full", "full"],
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "glm_pd_common.tools.cli", "plan", "--config", str(path), "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "[1]" in proc.stderr
