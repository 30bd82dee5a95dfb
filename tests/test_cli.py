"""CLI: argument handling and the policy listing (generation itself is covered in test_embedded)."""

from __future__ import annotations

import argparse
import json

import pytest

from epikv.archs import ARCHITECTURES, HYBRID_PROVEN, PROVEN
from epikv.cli import build_parser, main
from epikv.policies import policy_class, policy_names
from epikv.spec import parse_policy_params


def test_policies_json_lists_every_policy_with_needs(capsys):
    assert main(["policies", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["name"] for r in rows) == policy_names()
    by_name = {r["name"]: r for r in rows}
    assert by_name["epikv-segq"]["aliases"] == ["epikv"]
    assert by_name["epikv-segq"]["needs"] == {
        "hidden_states": True,
        "recent_queries": True,
        "attention_weights": False,
    }
    assert by_name["epikv-flat"]["defaults"]["window"] == 64
    assert by_name["streaming"]["defaults"]["n_sink"] == 4


def test_models_lists_every_architecture_with_its_query_path_and_the_refused_with_why(capsys):
    assert main(["policies", "--models", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    by_type = {row["model_type"]: row for row in listing["supported"]}
    assert sorted(by_type) == sorted(ARCHITECTURES)
    assert by_type["phi3"]["query_path"] == "input_layernorm > qkv_proj[:Hq*d] > RoPE"
    assert by_type["olmo2"]["query_path"] == "(no input norm) > q_proj > q_norm (all heads) > RoPE"
    assert by_type["gpt_oss"]["query_path"] == "input_layernorm > q_proj > RoPE > softmax with learned sinks"
    for row in listing["supported"]:
        hybrid = row["model_type"] in ("gemma3_text", "olmo3", "gpt_oss", "exaone4", "smollm3")
        assert row["sliding_windows"] == hybrid
        assert row["proven"] == list(PROVEN) + (list(HYBRID_PROVEN) if hybrid else [])
    refused = {row["model_type"]: row["reason"] for row in listing["not_yet"]}
    assert "softcapping" in refused["gemma2"] and "multi-head latent" in refused["deepseek_v3"]
    assert main(["policies", "--models"]) == 0
    out = capsys.readouterr().out
    assert "| `qwen3_moe` | input_layernorm > q_proj > q_norm (per head) > RoPE | refused |" in out
    assert "| `gemma3_text` | input_layernorm > q_proj > q_norm (per head) > RoPE (table of the" in out


def test_parse_params_by_field_type():
    segq = policy_class("epikv")
    assert parse_policy_params(segq, ["window=32", "band_mode=a_only", "fill=False", "weight=0.5"]) == {
        "window": 32,
        "band_mode": "a_only",
        "fill": False,
        "weight": 0.5,
    }
    assert parse_policy_params(segq, ["query_layer=none", "recent=7"]) == {"query_layer": None, "recent": 7}
    assert parse_policy_params(policy_class("thinkv"), ["schedule=8,4,2"]) == {"schedule": (8, 4, 2)}
    for bad, message in (
        (["window"], "KEY=VALUE"),
        (["fill=maybe"], r"fill='maybe' is not a boolean"),
        (["window=abc"], r"window='abc' is not an integer"),
        (["windw=3"], r"unknown parameter 'windw'; did you mean 'window'"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_policy_params(segq, bad)


def test_version_comes_from_the_package_metadata(capsys):
    from importlib import metadata

    import epikv

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert (
        capsys.readouterr().out.strip()
        == f"epikv {metadata.version('epikv')}"
        == f"epikv {epikv.__version__}"
    )


def _commands(parser) -> dict[str, str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {choice.dest: choice.help for choice in sub._choices_actions}


def test_help_lists_every_command_with_a_one_line_description(capsys):
    parser = build_parser()
    commands = _commands(parser)
    assert set(commands) == {
        "generate",
        "policies",
        "eval",
        "report",
        "bench",
        "calibrate",
        "profile",
        "serve",
    }
    for name, text in commands.items():
        assert text and "\n" not in text and "``" not in text and len(text) <= 70, name
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and all(f"    {name}" in out for name in commands)


def test_unknown_policy_is_a_clear_error(capsys):
    assert main(["generate", "--policy", "epikv-flt", "hello"]) == 2
    assert "did you mean 'epikv-flat'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--budget", "0", "hello"], "budget must be a positive"),
        (["generate", "   "], "prompt 0 is empty"),
        (["generate", "--threads", "two", "hello"], "--threads must be 'auto' or a positive number"),
        (["generate", "--threads", "0", "hello"], "got '0'"),
    ],
)
def test_bad_generate_input(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_generate_json_reports_the_cache(capsys):
    argv = [
        "generate",
        "--json",
        "--policy",
        "epikv-flat",
        "--budget",
        "48",
        "--max-new-tokens",
        "20",
        "--ignore-eos",
        "Say hi.",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    for key in (
        "text",
        "prompt_tokens",
        "tokens_generated",
        "peak_cache_tokens",
        "final_cache_tokens",
        "evictions",
        "finish_reason",
        "seconds",
        "tokens_per_second",
        "attn_implementation",
        "policy",
    ):
        assert key in report
    assert report["attn_implementation"] == "sdpa" and report["tokens_generated"] == 20
    assert report["policy"]["name"] == "epikv-flat" and report["policy"]["band_a"] is not None
    assert report["peak_cache_tokens"] <= 49 and report["budget"] == 48


def test_generate_runs_a_prompt_past_its_budget_at_the_smallest_that_holds_it(capsys):
    argv = ["generate", "--json", "--policy", "epikv-flat", "--budget", "8", "--max-new-tokens", "4", "hi"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    prompt, k = report["prompt_tokens"], report["budget"]
    # the prompt and its recent window, min(128, K // 4), fit K and not K - 1 (K 8 holds neither)
    assert k > 8 and prompt + k // 4 <= k and prompt + (k - 1) // 4 > k - 1
