"""epikv's own engine as the reference for the vLLM plugin's tests, run in epikv's environment
(``.venv``: transformers 5.24), since vLLM's environment pins an older transformers.

``python reference.py folder`` prints the embedded model's safetensors folder (made if missing);
``python reference.py chat FOLDER TEXT...`` prints the chat-formatted ids of each text with the
tokenizer of a model folder (the real-weights tests);
``python reference.py run SPEC.json`` runs the prompts of SPEC (policy, budget, prompts, max_tokens,
and optionally ``model``, a saved model folder instead of the embedded model) greedily in float32
and prints each request's tokens and the true positions it kept at every compaction (first layer
group, first head), as one JSON line.
"""

from __future__ import annotations

import json
import sys

TEXTS = [
    "What is 17 * 23? Think step by step.",
    "Explain how a rainbow forms.",
    "Write a short poem about the sea, then explain its rhyme scheme in detail.",
    "List three prime numbers greater than 50 and prove each is prime.",
]


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


def run(spec_path: str) -> dict:
    from epikv.engine import Engine, Request
    from epikv.integration import build_spec
    from epikv.models import load_model

    job = json.loads(open(spec_path).read())
    if job.get("model"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(job["model"], dtype="float32")
    else:
        model, _ = load_model()
    model = model.float()
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
    return {"tokens": [done[r.id].token_ids for r in requests], "kept": traces}


def chat(model_folder: str, texts: list[str]) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    prompts = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append([int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return {"prompts": prompts}


if __name__ == "__main__":
    if sys.argv[1] == "chat":
        out = chat(sys.argv[2], sys.argv[3:])
    else:
        out = folder() if sys.argv[1] == "folder" else run(sys.argv[2])
    print("REFERENCE " + json.dumps(out))
