"""Result documents, prompt sources and the random models every benchmark can use."""

from __future__ import annotations

import json

import pytest

from epikv.bench.shared import documents, model_loading, prompt_loading


def test_documents_round_trip_and_are_checked(tmp_path):
    doc = documents.make_document("speed", {"a": 1}, {"x": [1, 2]})
    path = documents.write_result(doc, tmp_path)
    assert path.name == "speed.json"
    back = documents.read_result(path, "speed")
    assert back["results"] == {"x": [1, 2]}
    assert back["machine"]["versions"]["torch"]
    with pytest.raises(ValueError, match="expected 'memory'"):
        documents.read_result(path, "memory")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "speed"}))
    with pytest.raises(ValueError, match="missing"):
        documents.read_result(bad)


def test_reporter_records_each_spec_once_and_draws_bars_only_when_asked(capsys):
    said = []
    reporter = documents.Reporter(announce=said.append, progress=True)
    for record in ({"describe": "policy=a"}, {"describe": "policy=b"}, {"describe": "policy=a"}):
        reporter.uses(record)
    assert reporter.specs == [{"describe": "policy=a"}, {"describe": "policy=b"}]
    assert said == ["policy=a", "policy=b"]
    with reporter.bar(3, "speed", unit="tok") as bar:
        bar.update(3)
    assert "bench speed: 100%" in capsys.readouterr().err
    with documents.Reporter().bar(3, "speed") as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""


def test_prompt_sources(tmp_path, short_prompts):
    assert prompt_loading.load_prompts("gsm8k", 2)[0].startswith("Janet")
    assert len(prompt_loading.load_prompts("math500", 3, offset=10)) == 3
    assert prompt_loading.load_prompts(str(short_prompts), 5)[1].startswith("A train")
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text(json.dumps({"question": "why?"}) + "\n")
    assert prompt_loading.load_prompts(str(jsonl), 1) == ["why?"]
    with pytest.raises(FileNotFoundError):
        prompt_loading.load_prompts("no-such-task", 1)


def test_random_models_and_byte_tokenizer():
    model, tok = model_loading.load_bench_model("random:tiny-qwen2")
    assert model.config.model_type == "qwen2" and model_loading.model_name(model) == "random:tiny-qwen2"
    ids = prompt_loading.encode_prompt(tok, "hi")
    assert ids.shape == (1, 2) and int(ids.max()) < model.config.vocab_size
    with pytest.raises(ValueError, match="unknown random model"):
        model_loading.random_model("huge")
