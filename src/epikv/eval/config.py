"""The configuration of one evaluation run and the folder it lives in.

Owns `EvalConfig` (validated), its resolution against a task (filling the task's length cap), the run
folder layout `OUT/<dataset>/<policy>/K<budget|full>/`, and the rule for when a saved config and a new
one may share a folder. It does not load tasks or run anything.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epikv.eval.prompts import PAPER_SYSTEM_PROMPT
from epikv.spec import parse_rank_every

# Fields that choose which examples run or how fast, not what any one result is: they may change
# between invocations on the same run folder. Every other field must match the saved config.
NON_RESULT_FIELDS = frozenset({"out", "limit", "offset", "batch_size", "shard", "progress", "vllm_python"})
# Fields describing one process rather than the run; left out of config.json so that concurrent
# shards write identical files.
UNSAVED_FIELDS = frozenset({"out", "shard", "progress", "vllm_python"})
# What generates: epikv's own engine, or vLLM with the epikv plugin (eager, or vLLM's default compiled
# mode): a result-affecting field, so a run folder never mixes engines.
ENGINES = ("epikv", "vllm", "vllm-compiled")
_SHARD = re.compile(r"^(\d+)/(\d+)$")


class ConfigMismatchError(ValueError):
    """A run folder already holds results made with a different configuration."""


def parse_shard(shard: str | None) -> tuple[int, int]:
    """`"I/N"` as (I, N) with 0 <= I < N; None means the single shard (0, 1)."""
    if shard is None:
        return 0, 1
    match = _SHARD.match(shard)
    if match is None:
        raise ValueError(f"shard must look like I/N (e.g. 0/4), got {shard!r}")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1 or index >= count:
        raise ValueError(f"shard index must satisfy 0 <= I < N, got {shard!r}")
    return index, count


@dataclass(frozen=True)
class EvalConfig:
    """One (dataset, policy, budget) evaluation. `budget=None` means no eviction (full cache);
    `max_new_tokens=None` takes the task's cap (8192, AIME 16384); `rank_every` is rho
    (:func:`epikv.spec.parse_rank_every`; None: score at every eviction), saved only when set."""

    dataset: str
    policy: str
    budget: int | None = None
    out: str = "runs"
    model: str | None = None
    limit: int | None = None
    offset: int = 0
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    n_samples: int = 1
    seed: int = 0
    batch_size: int = 1
    shard: str | None = None
    interval: int | None = None
    rank_every: int | None = None
    policy_params: dict[str, Any] = field(default_factory=dict)
    system_prompt: str = PAPER_SYSTEM_PROMPT
    progress: bool = True
    dtype: str = "float32"  # resolved (never "auto"): a resumed run keeps the precision it started with
    engine: str = "epikv"
    vllm_python: str | None = None  # the Python that runs vLLM (engine vllm); None: found by rule

    def __post_init__(self) -> None:
        self._check_names()
        self._check_counts()
        self._check_sampling()
        parse_shard(self.shard)
        tau = self.interval if self.interval is not None else self.policy_params.get("interval")
        object.__setattr__(self, "rank_every", parse_rank_every(self.rank_every, tau))  # digits: an int

    def _check_names(self) -> None:
        if not self.dataset:
            raise ValueError("dataset must be non-empty")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be float32, bfloat16 or float16 (auto is resolved first), got {self.dtype!r}"
            )
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", self.policy):
            raise ValueError(f"policy must be a plain name (letters, digits, _.+-), got {self.policy!r}")

    def _check_counts(self) -> None:
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"budget must be >= 1 or None (no eviction), got {self.budget}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {self.limit}")
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or None, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.interval is not None and self.interval < 1:
            raise ValueError(f"interval must be >= 1 or None, got {self.interval}")

    def _check_sampling(self) -> None:
        from epikv.engine.request import SamplingParams  # the engine owns the sampling rules

        SamplingParams(self.temperature, self.top_p, self.seed)
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {self.n_samples}")
        if self.n_samples > 1 and self.temperature == 0:
            raise ValueError(
                f"n_samples={self.n_samples} needs temperature > 0: greedy samples are identical"
            )

    @property
    def budget_label(self) -> str:
        return "Kfull" if self.budget is None else f"K{self.budget}"


def resolve(config: EvalConfig, task_max_new_tokens: int) -> EvalConfig:
    """The config with the task's length cap filled in when none was given."""
    if config.max_new_tokens is not None:
        return config
    return dataclasses.replace(config, max_new_tokens=task_max_new_tokens)


def run_dir(config: EvalConfig, task_name: str) -> Path:
    return Path(config.out) / task_name / config.policy / config.budget_label


def saved_form(config: EvalConfig) -> dict[str, Any]:
    """The JSON object written to config.json (JSON-normalised, so it compares equal after a reload)."""
    data = {k: v for k, v in dataclasses.asdict(config).items() if k not in UNSAVED_FIELDS}
    if config.rank_every is None:  # a field added later: runs without it keep their saved form
        del data["rank_every"]
    normalised: dict[str, Any] = json.loads(json.dumps(data, sort_keys=True))
    return normalised


# Fields added after runs were saved without them, with the value those runs had.
SAVED_BEFORE = {"dtype": "float32", "engine": "epikv", "rank_every": None}


def differing_fields(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Result-affecting fields whose values differ between two saved forms."""
    keys = (set(saved) | set(current)) - NON_RESULT_FIELDS
    return sorted(key for key in keys if saved.get(key, SAVED_BEFORE.get(key)) != current.get(key))


def check_compatible(saved: dict[str, Any], current: dict[str, Any], folder: Path) -> None:
    """Raises ConfigMismatchError naming every result-affecting field that changed."""
    changed = differing_fields(saved, current)
    if changed:
        details = "; ".join(f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}" for k in changed)
        raise ConfigMismatchError(
            f"{folder} holds results from a different configuration ({details}). "
            "Use another --out folder or remove this run folder to start over."
        )
