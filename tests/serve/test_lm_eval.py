"""lm-evaluation-harness, a client no one here wrote, against `epikv serve` offline: the local GSM8K
generate-until task through `local-completions` and `local-chat-completions`, the multiple-choice
log-likelihood task through `local-completions` (echo + logprobs), with an API key. Its scores are
its own; what is checked is that every request succeeded and that each log-likelihood it computed
from our echoed prompt log-probabilities equals a plain transformers forward."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.serve import free_port, wait_healthy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KEY = "lm-eval-key"


def lm_eval(*args: str, env: dict[str, str]) -> None:
    executable = shutil.which("lm_eval", path=str(Path(sys.executable).parent))
    if executable is None:
        pytest.skip("lm_eval is not installed (pip install 'epikv[harness]')")
    done = subprocess.run([executable, *args], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


def results(folder: Path) -> tuple[dict, dict[str, list[dict]]]:
    (summary,) = folder.rglob("results_*.json")
    samples = {}
    for path in folder.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return json.loads(summary.read_text())["results"], samples


def test_lm_eval_drives_the_server(serve_model_folder, serve_model, embedded_tokenizer, tmp_path):
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    subprocess.run([sys.executable, str(ROOT / "scripts/lm_eval_tasks.py"), "--out", str(tasks),
                    "--problems", "3", "--max-gen-toks", "24"], check=True, env={**os.environ,
                    "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    port = free_port()
    # fp32: the log-likelihoods are compared with a plain fp32 forward below
    argv = [sys.executable, "-m", "epikv.cli", "serve", "--model", str(serve_model_folder), "--policy",
            "streaming", "--budget", "64", "--port", str(port), "--served-model-name", "m",
            "--max-tokens", "64", "--threads", "1", "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EPIKV_API_KEY": KEY, "PYTHONPATH": str(ROOT / "src")}
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(port, server, lambda: (tmp_path / "server.log").read_text())
        client_env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                      "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        base = f"model=m,num_concurrent=2,max_retries=1,base_url=http://127.0.0.1:{port}/v1"
        completions = f"{base}/completions,tokenizer={serve_model_folder},tokenizer_backend=huggingface"
        lm_eval("--model", "local-completions", "--model_args", completions, "--include_path", str(tasks),
                "--tasks", "epikv_gsm8k_gen,epikv_gsm8k_mc", "--output_path", str(tmp_path / "completions"),
                "--log_samples", env=client_env)  # fmt: skip
        lm_eval("--model", "local-chat-completions", "--model_args", f"{base}/chat/completions",
                "--apply_chat_template", "--include_path", str(tasks), "--tasks", "epikv_gsm8k_gen",
                "--output_path", str(tmp_path / "chat"), "--log_samples", env=client_env)  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)
    scores, samples = results(tmp_path / "completions")
    assert 0 <= scores["epikv_gsm8k_gen"]["exact_match,flexible-extract"] <= 1
    assert 0 <= scores["epikv_gsm8k_mc"]["acc,none"] <= 1
    assert len(samples["epikv_gsm8k_gen"]) == len(samples["epikv_gsm8k_mc"]) == 3
    assert all(isinstance(s["resps"][0][0], str) for s in samples["epikv_gsm8k_gen"])
    chat_scores, chat_samples = results(tmp_path / "chat")
    assert len(chat_samples["epikv_gsm8k_gen"]) == 3 and "epikv_gsm8k_gen" in chat_scores
    # every log-likelihood lm-eval summed from our echoed prompt log-probabilities is transformers'
    tok = embedded_tokenizer
    for sample in samples["epikv_gsm8k_mc"]:
        for argument, response in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = argument["arg_0"], argument["arg_1"]
            whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
            start = len(tok(context, add_special_tokens=False)["input_ids"])
            with torch.no_grad():
                logprobs = torch.log_softmax(
                    serve_model(input_ids=torch.tensor([whole])).logits[0].float(), -1
                )
            expected = sum(float(logprobs[i - 1, whole[i]]) for i in range(start, len(whole)))
            assert float(response[0][0]) == pytest.approx(expected, abs=1e-3)
    lines = [json.loads(x) for x in (tmp_path / "server.log").read_text().splitlines() if '"request_id"' in x]
    assert lines and all(line["status"] == 200 for line in lines if line["path"].startswith("/v1/"))
    assert "Traceback" not in (tmp_path / "server.log").read_text()
