"""Evaluation on vLLM with the epikv plugin: a :class:`~epikv.eval.generator.Generator` whose
engine is ``epikv.vllm.eval_worker`` in vLLM's environment.

``epikv eval --engine vllm`` runs the same tasks, prompts, grading, records and resume as on epikv's
own engine; only the generation moves. This side owns the tokenizer (the same one, and so the same
prompt ids, as ``load_model``'s: :func:`epikv.models.loading.load_tokenizer`), the sampling seeds
(:func:`epikv.generation.row_seed`), the stop ids, and the worker process: started at the first
call that knows the prompts (``fit``), sized so that vLLM never preempts, ended with the generator.
vLLM reports no per-step cache size, so ``final_cache_tokens`` and ``mean_cache_tokens`` are None;
``seconds`` is the wall time of the batch's one ``generate`` call.

Does not know: grading or the run folder (``runner.py``), or vLLM itself (the worker).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epikv.eval.prompts import Messages

if TYPE_CHECKING:
    from epikv.engine import Completion
    from epikv.engine.admission import PromptFit
    from epikv.generation import SamplingConfig
    from epikv.spec import CacheSpec

VLLM_PYTHON_ENV = "EPIKV_VLLM_PYTHON"
BLOCK = 32  # the worker's block size


class VllmWorkerError(RuntimeError):
    """The vLLM worker failed or answered with an error (its one line)."""


def vllm_python(given: str | None = None) -> str:
    """The Python that runs vLLM: ``given``, else ``$EPIKV_VLLM_PYTHON``, else this interpreter when it
    has vLLM, else ``.venv-vllm/bin/python`` in the working folder (``scripts/setup.sh --vllm``)."""
    chosen = given or os.environ.get(VLLM_PYTHON_ENV)
    if chosen:
        if not Path(chosen).is_file():
            raise ValueError(f"--vllm-python {chosen!r}: no such file")
        return chosen
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    local = Path(".venv-vllm/bin/python")
    if local.is_file():
        return str(local)
    raise ValueError(
        "--engine vllm needs a Python with vLLM: pass --vllm-python PATH (or set EPIKV_VLLM_PYTHON); "
        "`bash scripts/setup.sh --vllm` makes .venv-vllm"
    )


_LIVE: VllmGenerator | None = None  # the generator whose worker is running


def plugin_config(
    policy: str,
    budget: int | None,
    interval: int | None,
    params: dict[str, Any],
    rank_every: int | None = None,
) -> dict[str, Any]:
    """What the run hands the plugin as ``additional_config["epikv"]`` (``rank_every`` only when set)."""
    from epikv.vllm.config import EpiKVSettings

    return EpiKVSettings(policy, budget, interval, dict(params), rank_every=rank_every).as_config()


def plugin_spec(source: str, settings: dict[str, Any]) -> CacheSpec:
    """The spec the plugin builds for ``source`` from ``settings`` (:func:`plugin_config`), as the
    plugin reads them (:meth:`EpiKVSettings.from_config`, then :meth:`EpiKVSettings.spec`)."""
    from transformers import AutoConfig

    from epikv.policies.base import ModelInfo
    from epikv.vllm.config import KEY, EpiKVSettings

    config = AutoConfig.from_pretrained(source)
    identity = getattr(config, "epikv_model_id", None) or source
    read = EpiKVSettings.from_config({KEY: settings})
    assert read is not None  # the mapping has the key
    return read.spec(ModelInfo.from_config(config.get_text_config(), identity))


class VllmGenerator:
    """One (model, policy, budget) on a vLLM worker; the :class:`Generator` contract."""

    def __init__(
        self,
        model: str | None,
        policy: str,
        budget: int | None,
        interval: int | None,
        policy_params: dict[str, Any],
        *,
        dtype: str,
        max_new_tokens: int,
        max_num_seqs: int = 64,
        enforce_eager: bool = True,
        python: str | None = None,
        rank_every: int | None = None,
    ) -> None:
        from epikv.models.loading import load_tokenizer, model_source

        self.source = model_source(model)
        self.tokenizer = load_tokenizer(model)
        settings = plugin_config(policy, budget, interval, policy_params, rank_every)
        self.spec = plugin_spec(self.source, settings)
        self.resolved_policy: dict[str, Any] | None = self.spec.policy.config()
        self.start_msg: dict[str, Any] = {
            "op": "start", "model": self.source, "policy": policy, "budget": budget, "interval": interval,
            "policy_params": policy_params, "dtype": dtype, "max_num_seqs": max_num_seqs,
            "enforce_eager": enforce_eager,
        }  # fmt: skip
        if rank_every is not None:  # the worker hands it to engine_kwargs (saved only when set)
            self.start_msg["rank_every"] = rank_every
        self.max_new_tokens = max_new_tokens
        self.longest_prompt = 0
        self.python = python  # resolved when the worker starts: fit() needs no vLLM
        self.process: subprocess.Popen[str] | None = None
        self.started: dict[str, Any] = {}
        self._stop = self._stop_ids()

    def _stop_ids(self) -> list[int]:
        from transformers import GenerationConfig

        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        try:
            eos = GenerationConfig.from_pretrained(self.source).eos_token_id
        except OSError:
            eos = None
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        return sorted(ids)

    def prompt_ids(self, prompts: Sequence[Messages]) -> list[list[int]]:
        from epikv.generation import encode_prompt_ids

        return encode_prompt_ids(self.tokenizer, list(prompts))

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin and self.process.stdout
        self.process.stdin.write(json.dumps(msg) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise VllmWorkerError(
                f"the vLLM worker ended (exit {code}) during {msg['op']!r}; see its log above"
            )
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise VllmWorkerError(f"vLLM worker, {msg['op']}: {reply['error']}")
        return reply

    def _ensure_started(self, longest_prompt: int) -> None:
        if self.process is not None:
            if longest_prompt > self.longest_prompt:
                raise VllmWorkerError(
                    f"a prompt of {longest_prompt} tokens is longer than the {self.longest_prompt} the "
                    "worker was sized for (check every prompt with fit() first)"
                )
            return
        global _LIVE
        if _LIVE is not None and _LIVE is not self:  # one engine at a time: runs go one after another
            _LIVE.close()
        _LIVE = self
        self.longest_prompt = max(self.longest_prompt, longest_prompt)
        need = self.longest_prompt + self.max_new_tokens
        self.start_msg["max_model_len"] = -(-need // BLOCK) * BLOCK
        self.process = subprocess.Popen(
            [vllm_python(self.python), "-m", "epikv.vllm.eval_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")},
        )  # fmt: skip
        self.started = self._ask(self.start_msg)
        if self.started["spec"] != self.spec.config():
            raise VllmWorkerError(
                f"the plugin resolved {self.started['spec']}, not this run's {self.spec.config()}"
            )

    def fit(self, prompts: list[Messages], /) -> list[PromptFit]:
        """The plugin's own request rule for each prompt (:func:`epikv.vllm.config.plan_request`),
        here, without vLLM, after the strict rule of comparisons at equal K (a prompt whose protected
        tokens pass K is skipped, as on epikv's engine, not run at a raised K); remembers the longest
        prompt, which sizes the worker."""
        from epikv.engine.admission import PromptFit
        from epikv.vllm.config import plan_request

        fits = []
        for row in self.prompt_ids(prompts):
            smallest = self.spec.min_budget(len(row)) if self.spec.evicts else None
            try:
                self.spec.check_prompt(len(row))
                plan_request(self.spec, len(row), self.max_new_tokens, None)
                fits.append(PromptFit(len(row), None, smallest))
            except ValueError as err:
                fits.append(PromptFit(len(row), str(err), smallest))
            self.longest_prompt = max(self.longest_prompt, len(row))
        return fits

    def __call__(self, prompts: list[Messages], sampling: SamplingConfig, /) -> list[Completion]:
        from epikv.engine import Completion
        from epikv.generation import row_seed

        ids = self.prompt_ids(prompts)
        self._ensure_started(max(len(row) for row in ids))
        seen: dict[tuple[int, ...], int] = {}
        seeds = []
        for row in ids:
            seen[tuple(row)] = seen.get(tuple(row), -1) + 1
            seeds.append(row_seed(sampling.seed, row, seen[tuple(row)]))
        reply = self._ask({
            "op": "generate", "prompts": ids, "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "seeds": seeds,
            "stop": [] if sampling.ignore_eos else self._stop,
        })  # fmt: skip
        return [self._completion(n, r, reply["wall_s"], Completion) for n, r in enumerate(reply["results"])]

    def _completion(self, n: int, r: dict[str, Any], wall: float, kind: type[Completion]) -> Completion:
        return kind(
            request_id=n, token_ids=r["token_ids"], finish_reason=r["finish_reason"],
            prompt_tokens=r["prompt_tokens"], peak_cache_tokens=r["peak_cache_tokens"] or 0,
            final_cache_tokens=None, evictions=r["evictions"] or 0, compactions=r["compactions"] or 0,
            first_evicted_index=None, prefill_seconds=0.0, seconds=wall, mean_cache_tokens=None,
            text=self.tokenizer.decode(r["token_ids"], skip_special_tokens=True),
        )  # fmt: skip

    def close(self) -> None:
        if self.process is None:
            return
        try:
            if self.process.stdin:
                self.process.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.process.stdin.close()
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
        self.process = None

    def __del__(self) -> None:
        self.close()
