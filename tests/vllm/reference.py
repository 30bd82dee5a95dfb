"""epikv's own engine as the reference for the vLLM plugin's tests, run in epikv's environment
(``.venv``: transformers 5.24), since vLLM's environment pins an older transformers.

``python reference.py serve`` is the worker the tests keep for a session (``engines.reference``):
it reads one JSON job per stdin line and answers each with one line, ``REFERENCE {...}`` (the job's
result) or ``ERROR "..."`` (the job's traceback, as a JSON string; the worker goes on). A job's
``kind`` is ``run`` (the default), ``chat`` or ``folder``, below. Models stay loaded by
folder (:data:`CACHE_BYTES`, least recently used first out), and every ``run`` job gets a fresh
:class:`~epikv.engine.Engine`, so a job's answer is the one a process of its own would give.

``python reference.py folder`` prints the embedded model's safetensors folder (made if missing;
scripts/vllm_soak.py). A ``folder`` job answers the same; a ``chat`` job (``model``, ``texts``) the
chat-formatted ids of each text with the tokenizer of a model folder (the real-weights tests); a
``run`` job (policy, budget, prompts, max_tokens, and optionally ``model``, a saved model folder
instead of the embedded model, and ``interval``) runs the prompts greedily in float32 and answers
each request's tokens, the true positions it kept at every compaction (first layer group, first
head) and its counters (peak, evictions, compactions, budget: what the plugin's outputs carry).
"""

from __future__ import annotations

import gc
import json
import sys
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import Any

TEXTS = [
    "What is 17 * 23? Think step by step.",
    "Explain how a rainbow forms.",
    "Write a short poem about the sea, then explain its rhyme scheme in detail.",
    "List three prime numbers greater than 50 and prove each is prime.",
]
CACHE_BYTES = 2 << 30
"""float32 weights the worker keeps loaded: the embedded model (0.5 GiB) and the tiny ones stay,
a larger model (the real Qwen, 6 GiB) pushes every other one out before it loads."""
MODELS: OrderedDict[str | None, tuple[Any, int]] = OrderedDict()  # folder (None: embedded) -> (model, bytes)


def folder() -> dict:
    """The embedded model's safetensors folder, and the chat-formatted ids of TEXTS."""
    from epikv.models import load_model
    from epikv.models.embedded import embedded_cache_folder

    _, tokenizer = load_model()  # converts the GGUF once if the cached copy is missing
    prompts = []
    for text in TEXTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append([int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return {"folder": str(embedded_cache_folder()), "prompts": prompts}


def load(model_folder: str | None) -> Any:
    """The float32 model of a saved folder (``None``: the embedded model), loaded once per worker."""
    if model_folder in MODELS:
        MODELS.move_to_end(model_folder)
        return MODELS[model_folder][0]
    stored = sum(f.stat().st_size for f in Path(model_folder).glob("*.safetensors")) if model_folder else 0
    evict(CACHE_BYTES - stored)
    if model_folder:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_folder, dtype="float32")
    else:
        from epikv.models import load_model

        model, _ = load_model()
    model = model.float()
    MODELS[model_folder] = (model, sum(p.numel() * p.element_size() for p in model.parameters()))
    evict(CACHE_BYTES, keep=model_folder)
    return model


def evict(room: int, keep: str | None = "") -> None:
    """Drop the least recently used models until the rest take at most ``room`` bytes (never ``keep``)."""
    while MODELS and sum(size for _, size in MODELS.values()) > max(room, 0):
        oldest = next(iter(MODELS))
        if oldest == keep:
            break
        del MODELS[oldest]
    gc.collect()


def run(job: dict) -> dict:
    """One job's tokens and kept sets (see the module docstring), on a fresh engine."""
    from epikv.engine import Engine, Request
    from epikv.integration import build_spec

    model = load(job.get("model") or None)
    spec = build_spec(model, job["policy"], job.get("budget"), interval=job.get("interval"))
    engine = Engine(model, spec)
    traces: list[list[list[int]]] = [[] for _ in job["prompts"]]
    requests = []
    for i, prompt in enumerate(job["prompts"]):

        def kept(index, positions, i=i):
            row = positions[0, 0]
            traces[i].append(sorted(int(p) for p in row[row >= 0]))

        request = Request(prompt, max_new_tokens=job["max_tokens"], on_compaction=kept)
        requests.append(request)
        engine.submit(request)
    done = {}
    while engine.has_work():
        for completion in engine.step():
            done[completion.request_id] = completion
    counted = ("peak_cache_tokens", "evictions", "compactions", "budget")
    return {
        "tokens": [done[r.id].token_ids for r in requests],
        "kept": traces,
        "counters": [{name: getattr(done[r.id], name) for name in counted} for r in requests],
    }


def chat(model_folder: str, texts: list[str]) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    prompts = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append([int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return {"prompts": prompts}


def answer(job: dict) -> dict:
    kind = job.get("kind", "run")
    if kind == "folder":
        return folder()
    if kind == "chat":
        return chat(job["model"], job["texts"])
    if kind == "run":
        return run(job)
    raise ValueError(f"unknown job kind {kind!r}: folder, chat or run")


def serve() -> None:
    """Answer jobs from stdin until it closes (see the module docstring). Whatever the library prints
    goes to stderr, so stdout carries the answers alone."""
    answers, sys.stdout = sys.stdout, sys.stderr
    for line in iter(sys.stdin.readline, ""):
        if not line.strip():
            continue
        try:
            out = "REFERENCE " + json.dumps(answer(json.loads(line)))
        except Exception:
            MODELS.clear()  # a job that failed half way leaves nothing behind for the next one
            gc.collect()
            out = "ERROR " + json.dumps(traceback.format_exc())
        answers.write(out + "\n")
        answers.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    elif sys.argv[1:] == ["folder"]:
        print("REFERENCE " + json.dumps(folder()))
    else:
        sys.exit(f"reference.py: no command {' '.join(sys.argv[1:])!r}: serve or folder")
