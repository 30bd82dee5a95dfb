"""Evaluation of KV-cache policies on math reasoning benchmarks.

Layout: `tasks` (what a task is: examples, slicing, the grading entry point; and where tasks come
from: the shipped files, JSONL, the hub), `extract` and `grading` (pure answer handling), `loops`
(repetition detection, exact and near-periodic, and where two generations part), `metrics`
(aggregates), `config` / `records` / `runner` (resumable, shardable runs), `runs`, `report` and
`plots` (read finished runs from files), `cli` (argparse glue).
The generation engine is reached only through the `Generator` protocol in `generator`.
"""

from epikv.eval.config import ConfigMismatchError, EvalConfig
from epikv.eval.extract import extract_boxed
from epikv.eval.generator import Generator, GeneratorFactory
from epikv.eval.grading import grade_math, grade_numeric, normalize_number
from epikv.eval.loops import Loop, LoopConfig, detect_loop, detect_near_loop
from epikv.eval.metrics import METRICS, Metric, summarize, wilson_interval
from epikv.eval.prompts import PAPER_SYSTEM_PROMPT, build_messages
from epikv.eval.records import ExampleResult
from epikv.eval.report import report
from epikv.eval.runner import RunOutcome, run_eval
from epikv.eval.tasks import BUILTIN_TASKS, Example, Grade, Task, load_task

__all__ = [
    "BUILTIN_TASKS",
    "METRICS",
    "PAPER_SYSTEM_PROMPT",
    "ConfigMismatchError",
    "EvalConfig",
    "Example",
    "ExampleResult",
    "Generator",
    "GeneratorFactory",
    "Grade",
    "Loop",
    "LoopConfig",
    "Metric",
    "RunOutcome",
    "Task",
    "build_messages",
    "detect_loop",
    "detect_near_loop",
    "extract_boxed",
    "grade_math",
    "grade_numeric",
    "load_task",
    "normalize_number",
    "report",
    "run_eval",
    "summarize",
    "wilson_interval",
]
