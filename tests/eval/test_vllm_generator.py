"""``epikv eval --engine vllm`` on the caller's side: choosing vLLM's Python, the config field, and the
plugin's request rule checked here without vLLM (the runs themselves: tests/vllm/test_eval_engine.py)."""

from __future__ import annotations

import dataclasses

import pytest

from epikv.eval.config import ConfigMismatchError, EvalConfig, check_compatible, saved_form
from epikv.eval.prompts import build_messages
from epikv.eval.vllm_generator import VllmGenerator, vllm_python


def test_the_engine_is_checked_and_saved_and_a_folder_never_mixes_engines(tmp_path):
    with pytest.raises(ValueError, match=r"engine must be one of epikv, vllm, vllm-compiled, got 'tgi'"):
        EvalConfig("gsm8k", "full", engine="tgi")
    vllm = EvalConfig("gsm8k", "full", engine="vllm", vllm_python="/x/python")
    saved = saved_form(vllm)
    assert saved["engine"] == "vllm" and "vllm_python" not in saved
    check_compatible(saved, saved_form(dataclasses.replace(vllm, vllm_python="/y")), tmp_path)
    with pytest.raises(ConfigMismatchError, match=r"engine: saved 'vllm', now 'epikv'"):
        check_compatible(saved, saved_form(EvalConfig("gsm8k", "full")), tmp_path)
    old = {k: v for k, v in saved_form(EvalConfig("gsm8k", "full")).items() if k != "engine"}
    check_compatible(old, saved_form(EvalConfig("gsm8k", "full")), tmp_path)  # saved before the field


def test_vllm_python_is_given_or_found_or_refused_in_one_line(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"--vllm-python '/no/such': no such file"):
        vllm_python("/no/such")
    monkeypatch.delenv("EPIKV_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"--engine vllm needs a Python with vLLM.*setup.sh --vllm"):
        vllm_python()
    (tmp_path / ".venv-vllm/bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm/bin/python").write_text("")
    assert vllm_python() == ".venv-vllm/bin/python"


def test_prompts_are_checked_by_the_plugins_rule_as_the_engine_checks_them():
    from epikv.generation import make_generator

    problems = ["What is 2 + 2?", "Add the numbers " + " ".join(str(i) for i in range(60)) + "."]
    prompts = [build_messages(p) for p in problems]
    for policy, budget in (("epikv", 100), ("streaming", 64), ("full", None)):
        mine = VllmGenerator(None, policy, budget, None, {}, dtype="float32", max_new_tokens=64)
        theirs = make_generator(None, policy, budget)
        assert mine.spec.config() == theirs.spec.config()
        assert mine.resolved_policy == theirs.resolved_policy
        got, want = mine.fit(prompts), theirs.fit(prompts)
        assert [(f.prompt_tokens, f.problem, f.min_budget) for f in got] == [
            (f.prompt_tokens, f.problem, f.min_budget) for f in want
        ]
        assert mine.longest_prompt == max(f.prompt_tokens for f in want) and mine.process is None
    assert got[0].problem is None
    refused = VllmGenerator(None, "epikv", 100, None, {}, dtype="float32", max_new_tokens=64).fit(prompts)
    assert refused[0].problem is None and "budget 100 cannot hold" in refused[1].problem
