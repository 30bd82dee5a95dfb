"""Running the accuracy study's cells, one at a time, through the eval's own runner.

A cell is resumed where its run folder stopped (the eval's resume: finished problems are never
generated again), its prompts are checked before any generation, and a problem whose prompt a
policy cannot protect at the cell's K is recorded as skipped (the summary excludes it for every
policy at that K). The spec the engine resolved is saved beside the records as ``spec.json``,
as ``epikv eval`` saves it. Owns the order of the work and the per-cell estimate; the design is
``design.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from epikv.bench.accuracy.design import Cell, Study
from epikv.bench.shared import machine
from epikv.eval.generator import Generator, engine_for_config, generator_factory
from epikv.eval.plan import plan_run
from epikv.eval.records import load_run_results, load_skipped
from epikv.eval.runner import RunOutcome, run_eval
from epikv.models.loading import bf16_matrix_units


def _head() -> str | None:
    """The commit the code ran at (None outside a git checkout), with ``+dirty`` for local changes."""
    import subprocess

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    return None if not head else head + ("+dirty" if git("status", "--porcelain", "src") else "")


def cell_status(study: Study, cell: Cell, out: str) -> dict[str, Any]:
    """What a cell's folder holds: problems done (records and skips), owed, and its throughput."""
    plan = plan_run(cell.config(out, study.model, study.dtype, progress=False))
    records = load_run_results(plan.folder) if plan.folder.is_dir() else []
    skipped = load_skipped(plan.folder) if plan.folder.is_dir() else []
    selected = plan.selected_keys
    done = [r for r in records if r.key in selected]
    seconds = sum(r.seconds for r in done)
    tokens = sum(r.tokens_generated for r in done)
    return {
        "cell": cell.name, "engine": cell.engine, "folder": str(plan.folder), "problems": cell.problems,
        "done": len(done), "skipped": sum(s.key in selected for s in skipped), "owed": len(plan.work),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "mean_tokens": round(tokens / len(done), 1) if done else None,
    }  # fmt: skip


def estimate_minutes(status: dict[str, Any], statuses: list[dict[str, Any]]) -> float | None:
    """Minutes the cell's owed problems take at its engine's measured speed (its own, else the mean
    of finished cells on that engine) and its own mean length (else ``full``'s of its arm)."""
    if not status["owed"]:
        return 0.0
    same = [s for s in statuses if s["engine"] == status["engine"] and s["tokens_per_s"]]
    speed = status["tokens_per_s"] or (sum(s["tokens_per_s"] for s in same) / len(same) if same else None)
    arm = status["cell"].split("/")[0]
    full = next((s for s in statuses if s["cell"] == f"{arm}/full@full" and s["mean_tokens"]), None)
    length = status["mean_tokens"] or (full["mean_tokens"] if full else None)
    if speed is None or length is None:
        return None
    return round(status["owed"] * length / speed / 60, 1)


def timed_cell(
    study: Study, name: str, engine: str, batch: int, problems: int, scratch: str
) -> dict[str, Any]:
    """Cell ``name``'s first ``problems`` problems generated afresh into ``scratch`` on ``engine`` at
    ``batch`` (the study's prompts, precision and cap): generated tokens over the generate calls'
    wall time (start-up excluded), each request's peak cache, the load before and after, and the
    token ids per problem (so two runs can be compared)."""
    cell = dataclasses.replace(study.find(name), engine=engine, batch_size=batch, problems=problems)
    before = machine.load_average()
    started = time.perf_counter()
    outcome = run_cell(study, cell, scratch, progress=False)
    records = load_run_results(outcome.folder)
    seconds = sum(r.seconds for r in records)
    tokens = sum(r.tokens_generated for r in records)
    peaks = [r.peak_cache_tokens for r in records]
    return {
        "cell": name, "engine": engine, "batch": batch, "problems": len(records), "tokens": tokens,
        "generate_s": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 2),
        "peak_cache_mean": round(sum(peaks) / len(peaks), 1), "peak_cache_max": max(peaks),
        "wall_s_with_start": round(time.perf_counter() - started, 1), "load_before": before,
        "load_after": machine.load_average(), "accuracy": outcome.summary.get("accuracy"),
        "token_ids": {r.id: r.token_ids for r in records},
    }  # fmt: skip


EMULATED_BF16 = (
    "the study runs in bfloat16 and this CPU has no bf16 matrix units (AMX-BF16 or AVX512-BF16), so "
    "bf16 is emulated here, several times slower; run it on a CPU with them, or pass --emulated-bf16 "
    "to run here anyway"
)


def bf16_refused(study: Study) -> bool:
    """Whether :func:`run_cell` refuses ``study`` here without ``emulated_bf16``."""
    return study.dtype == "bfloat16" and bf16_matrix_units("cpu") is None


def run_cell(
    study: Study,
    cell: Cell,
    out: str,
    progress: bool = True,
    limit: int | None = None,
    emulated_bf16: bool = False,
) -> RunOutcome:
    """Generates what ``cell`` still owes on its first ``limit`` problems (default: all of them),
    resuming its folder, and saves the resolved spec. ``limit`` must be a whole number of batches:
    in bf16 a problem's tokens depend on its batch-mates, so a cell is only reproducible from
    scratch if every run of it formed the batches one run over all its problems forms. A bf16 study
    is refused on a CPU that emulates bf16 (:data:`EMULATED_BF16`) unless ``emulated_bf16``."""
    if limit is not None and (limit % cell.batch_size or not 0 < limit <= cell.problems):
        raise ValueError(
            f"--limit {limit}: a cell runs whole batches of {cell.batch_size} problems, up to its "
            f"{cell.problems}; use a multiple of {cell.batch_size}"
        )
    if not emulated_bf16 and bf16_refused(study):
        raise ValueError(EMULATED_BF16)
    config = cell.config(out, study.model, study.dtype, progress)
    if limit is not None:
        config = dataclasses.replace(config, limit=limit)
    made: list[Generator] = []

    def make(policy: str, budget: int | None) -> Generator:
        resolved = plan_run(config).config  # the task's cap resolved, as the vLLM worker needs it
        generator = generator_factory(engine_for_config(resolved), resolved)(policy, budget)
        made.append(generator)
        return generator

    started = time.perf_counter()
    try:
        outcome = run_eval(config, make, skip_unfit=True)
    finally:
        for generator in made:
            getattr(generator, "close", lambda: None)()
    if made and made[0].spec is not None:
        record = {**made[0].spec.record(), "engine": cell.engine}
        (outcome.folder / "spec.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    elapsed = time.perf_counter() - started
    log_path = Path(out) / "runs.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a", encoding="utf-8") as handle:  # when each piece of compute ran, and how long
        entry = {"cell": cell.name, "generated": outcome.generated, "skipped": outcome.skipped}
        entry |= {"wall_s": round(elapsed, 1), "ended": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        entry |= {"cpu": machine.cpu(), "load_average": machine.load_average(), "code": _head()}
        handle.write(json.dumps(entry) + "\n")
    return outcome
