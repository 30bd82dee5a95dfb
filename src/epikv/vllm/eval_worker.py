"""A vLLM engine with the epikv plugin behind a pipe: what ``epikv eval --engine vllm`` generates on.

Run as ``python -m epikv.vllm.eval_worker`` in the environment that has vLLM (``.venv-vllm``); the
evaluation itself (tasks, grading, records) stays in the caller's environment, which tokenizes and
sends token ids, so both engines see the same prompt ids. Protocol: one JSON object a line on
stdin, one reply a line on the protocol stream (the process's original stdout; vLLM's own output
goes to stderr):

* ``{"op": "start", "model", "policy", "budget", "interval", "policy_params", "dtype",
  "max_model_len", "max_num_seqs", "enforce_eager"}`` builds ``vllm.LLM`` with
  :func:`epikv.vllm.engine_kwargs`; replies the spec the plugin resolved and vLLM's version.
* ``{"op": "generate", "prompts", "max_tokens", "temperature", "top_p", "seeds", "stop"}``: all
  prompts in one ``llm.generate`` call; per prompt its token ids, finish reason and the plugin's
  counters, and the call's wall time.
* ``{"op": "stop"}`` ends the process. An exception replies ``{"error": "Type: message"}``.

Does not know: tasks, grading, tokenizers or the run folder (``epikv.eval.vllm_generator``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import IO, Any

# vLLM's finish reasons in epikv's words (a stop id is the engine's "eos").
FINISH = {"stop": "eos", "length": "length", "abort": "cancelled"}
KV_BLOCK = 32  # vLLM CPU attention needs a multiple of 32


class Worker:
    def __init__(self) -> None:
        self.llm: Any = None
        self.spec: Any = None

    def start(self, msg: dict[str, Any]) -> dict[str, Any]:
        import vllm

        import epikv.vllm

        kwargs = epikv.vllm.engine_kwargs(
            msg["policy"], msg.get("budget"), msg.get("interval"), **(msg.get("policy_params") or {})
        )
        options = {
            "dtype": msg["dtype"], "enforce_eager": bool(msg.get("enforce_eager", True)), "seed": 0,
            "max_model_len": int(msg["max_model_len"]), "max_num_seqs": int(msg["max_num_seqs"]),
            "block_size": KV_BLOCK, "enable_prefix_caching": False, **kwargs,
            # room for every running request at its longest: vLLM never preempts (a preempted request
            # would recompute its prompt, and the plugin fails a preempted evicting request)
            "kv_cache_memory_bytes": int(msg["max_num_seqs"]) * int(msg["max_model_len"]) * token_bytes(msg),
        }  # fmt: skip
        options.update(msg.get("options") or {})
        started = time.perf_counter()
        self.llm = vllm.LLM(model=msg["model"], **options)
        self.spec = self.llm.llm_engine.engine_core.engine_core.scheduler.epikv_spec
        return {
            "vllm": vllm.__version__,
            "spec": None if self.spec is None else self.spec.config(),
            "resolved_policy": None if self.spec is None else self.spec.policy.config(),
            "llm_options": {k: v for k, v in options.items() if k not in kwargs},
            "engine_kwargs": kwargs,
            "init_s": round(time.perf_counter() - started, 1),
        }

    def generate(self, msg: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                temperature=msg["temperature"],
                top_p=msg["top_p"],
                seed=seed,
                max_tokens=msg["max_tokens"],
                stop_token_ids=msg["stop"],
                ignore_eos=not msg["stop"],
            )
            for seed in msg["seeds"]
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in msg["prompts"]]
        started = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        return {"wall_s": wall, "results": [result(out) for out in outs]}


def token_bytes(msg: dict[str, Any]) -> int:
    """KV bytes per token of the model in ``msg["model"]`` at ``msg["dtype"]`` (every layer, K and V),
    from the shape the plugin itself reads (:meth:`epikv.policies.base.ModelInfo.from_config`)."""
    from transformers import AutoConfig

    from epikv.policies.base import ModelInfo

    config = AutoConfig.from_pretrained(msg["model"])
    info = ModelInfo.from_config(config.get_text_config(), msg["model"])
    width = 4 if msg["dtype"] == "float32" else 2
    return info.num_layers * 2 * info.num_kv_heads * info.head_dim * width


def result(output: Any) -> dict[str, Any]:
    done = output.outputs[0]
    counters = (output.kv_transfer_params or {}).get("epikv") or {}
    return {
        "token_ids": list(done.token_ids),
        "finish_reason": FINISH.get(done.finish_reason, str(done.finish_reason)),
        "prompt_tokens": len(output.prompt_token_ids),
        **{k: counters.get(k) for k in ("evictions", "compactions", "peak_cache_tokens")},
    }


def serve(requests: IO[str], replies: IO[str]) -> None:
    worker = Worker()
    handlers = {"start": worker.start, "generate": worker.generate}
    for line in requests:
        msg = json.loads(line)
        if msg.get("op") == "stop":
            break
        try:
            reply = handlers[msg["op"]](msg)
        except Exception as err:  # the caller raises it as one line
            reply = {"error": f"{type(err).__name__}: {err}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's prints and logs go to stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
