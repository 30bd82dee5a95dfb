"""A vLLM engine with the epikv plugin behind a pipe: what ``epikv eval --engine vllm`` generates on.

Run as ``python -m epikv.vllm.eval_worker`` in the environment that has vLLM (``.venv-vllm``); the
evaluation itself (tasks, grading, records) stays in the caller's environment, which tokenizes and
sends token ids, so both engines see the same prompt ids. Protocol: one JSON object a line on
stdin, one reply a line on the protocol stream (the process's original stdout; vLLM's own output
goes to stderr):

* ``{"op": "start", "model", "policy", "budget", "interval", "policy_params", "dtype",
  "max_model_len", "max_num_seqs", "enforce_eager"}`` builds ``vllm.LLM`` with
  :func:`epikv.vllm.engine_kwargs`; replies the spec the plugin resolved and vLLM's version. Optional:
  ``"pool_tokens"`` sizes the KV pool to exactly that many usable tokens (whole blocks; vLLM then
  queues and preempts as it would with that much memory) instead of room for every request at its
  longest; ``"plain": true`` starts vLLM without the plugin (``full`` as plain vLLM runs it; the
  reply's ``spec`` is None).
* ``{"op": "generate", "prompts", "max_tokens", "temperature", "top_p", "seeds", "stop"}``: all
  prompts in one ``llm.generate`` call; per prompt its token ids, finish reason and the plugin's
  counters, the call's wall time, and what the scheduler did during it (``scheduler``: the most
  requests running at once, the preemptions and the steps, :class:`SchedulerWatch`).
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
        self.watch: SchedulerWatch | None = None

    def start(self, msg: dict[str, Any]) -> dict[str, Any]:
        import vllm

        import epikv.vllm

        plain = bool(msg.get("plain"))
        kwargs = {} if plain else epikv.vllm.engine_kwargs(
            msg["policy"], msg.get("budget"), msg.get("interval"), rank_every=msg.get("rank_every"),
            **(msg.get("policy_params") or {}),
        )  # fmt: skip
        options = {
            "dtype": msg["dtype"], "enforce_eager": bool(msg.get("enforce_eager", True)), "seed": 0,
            "max_model_len": int(msg["max_model_len"]), "max_num_seqs": int(msg["max_num_seqs"]),
            "block_size": KV_BLOCK, "enable_prefix_caching": False, **kwargs,
            # room for every running request at its longest: vLLM never preempts (a preempted request
            # would recompute its prompt, and the plugin fails a preempted evicting request)
            "kv_cache_memory_bytes": int(msg["max_num_seqs"]) * int(msg["max_model_len"]) * token_bytes(msg),
        }  # fmt: skip
        if msg.get("pool_tokens") is not None:
            options.update(pool_options(int(msg["pool_tokens"]), int(msg["max_model_len"]), token_bytes(msg)))
        options.update(msg.get("options") or {})
        if plain and "additional_config" in options:
            raise ValueError("a plain start (vLLM without the plugin) takes no additional_config")
        started = time.perf_counter()
        self.llm = vllm.LLM(model=msg["model"], **options)
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        self.spec = getattr(scheduler, "epikv_spec", None)  # plain vLLM's scheduler has none
        self.watch = SchedulerWatch(scheduler)
        return {
            "vllm": vllm.__version__,
            "plain": plain,
            "pool_tokens": (scheduler.kv_cache_config.num_blocks - 1) * KV_BLOCK,  # less the null block
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
        assert self.watch is not None
        self.watch.reset()
        started = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        return {"wall_s": wall, "results": [result(out) for out in outs], "scheduler": self.watch.read()}


class SchedulerWatch:
    """What vLLM's scheduler did over one ``generate`` call: the steps, the most requests running at once (the
    length of its running queue after each ``schedule``, the quantity of vLLM's own
    ``vllm:num_requests_running`` gauge, whose metrics keep only the last value, not the largest),
    and the requests it preempted (each step's ``preempted_req_ids``, the ids its ``_preempt_request``
    put back in the waiting queue since the step before: a preempted request recomputes its prompt and
    what it generated). Wraps this one scheduler's ``schedule`` (the engine runs in this process);
    nothing else of vLLM changes."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.schedule = scheduler.schedule
        scheduler.schedule = self._schedule
        self.reset()

    def reset(self) -> None:
        self.max_running = self.preemptions = self.steps = self.running_steps = 0

    def _schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = self.schedule(*args, **kwargs)
        running = len(self.scheduler.running)
        self.max_running = max(self.max_running, running)
        self.running_steps += running
        self.preemptions += len(output.preempted_req_ids or ())
        self.steps += 1
        return output

    def read(self) -> dict[str, Any]:
        """The counts, and the requests running per step on average (``mean_running``)."""
        mean = self.running_steps / self.steps if self.steps else 0.0
        return {
            "max_running": self.max_running, "mean_running": mean, "preemptions": self.preemptions,
            "steps": self.steps,
        }  # fmt: skip


def pool_options(pool_tokens: int, max_model_len: int, per_token: int) -> dict[str, int]:
    """vLLM options for a KV pool of exactly ``pool_tokens`` usable tokens: that many blocks, plus
    the null block vLLM's block pool holds back (``num_gpu_blocks_override`` sets the block count
    exactly; the memory is what those blocks take, so the CPU worker neither probes nor warms up for
    a size). Refuses a pool that is not whole blocks, or that holds no request of ``max_model_len``
    (vLLM's own start-up check would refuse it less plainly)."""
    if pool_tokens % KV_BLOCK or pool_tokens < max_model_len:
        raise ValueError(
            f"pool_tokens={pool_tokens} must be whole blocks of {KV_BLOCK} tokens and at least one "
            f"request's max_model_len ({max_model_len})"
        )
    blocks = pool_tokens // KV_BLOCK + 1
    return {"num_gpu_blocks_override": blocks, "kv_cache_memory_bytes": blocks * KV_BLOCK * per_token}


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
