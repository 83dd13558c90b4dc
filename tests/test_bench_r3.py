"""`vime bench r3` end to end with tiny settings (the real run is in docs/benchmarks.md)."""

import json

import pytest

pytest.importorskip("transformers")

KEYS = {"abs_diff_no_r3", "abs_diff_r3", "routing_agreement_no_r3", "routing_agreement_r3",
        "routing_agreement_unreplayed", "abs_diff_reduction", "target_met"}  # fmt: skip


def test_bench_r3_json(capsys):
    from vime.cli import _cmd_bench

    rc = _cmd_bench(["r3", "--json", "--sft-steps", "30", "--prompts", "6", "--samples-per-prompt", "4",
                     "--max-new-tokens", "6", "--threads", "1"])  # fmt: skip
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= result.keys()
    assert result["routing_agreement_r3"] == 1.0  # measured inside the replayed forward
    assert 0.0 < result["routing_agreement_no_r3"] < 1.0  # bf16 and fp32 route some token apart
    assert result["routing_agreement_unreplayed"] == result["routing_agreement_no_r3"]
    assert result["abs_diff_r3"] < result["abs_diff_no_r3"]


def test_bench_unknown_name():
    from vime.cli import _cmd_bench

    assert _cmd_bench(["nope"]) == 2
