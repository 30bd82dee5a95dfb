"""One calibration run: traces -> occlusion labels -> signals -> ρ per layer -> bands -> profile.

This module owns the order of the steps, what is kept, their progress bars (traces, labels,
analysis; tqdm on stderr) and the files of a run folder:
``config.json``, ``traces.jsonl`` (reusable with ``--traces``), ``windows.jsonl`` (per-trace window
labels), ``tokens.npz`` (pooled per-token signals and labels; ``--reuse`` redoes the statistics from
it), ``rho.json`` (every curve with its interval, the choice, counts and timings; the plot reads only
this), ``rho.png`` and the profile. The profile is written there only: making it active is
``epikv profile use`` (see :mod:`epikv.profiles`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from epikv.calibrate.analysis import choose, position_rho, rho_curves, rho_record, scaled_bands, score_rho
from epikv.calibrate.config import KEEP, CalibrationConfig, config_from_file
from epikv.calibrate.occlusion import Labeller
from epikv.calibrate.profile import build_profile, write_profile
from epikv.calibrate.signals import SIGNALS, all_signals, step_changes
from epikv.calibrate.stats import BandChoice
from epikv.calibrate.traces import Trace, generate_traces, load_traces, save_traces
from epikv.profiles import BandProfile

__all__ = ["KEEP", "CalibrationConfig", "CalibrationResult", "config_from_file", "run_calibration"]

log = logging.getLogger(__name__)


def select_traces(traces: list[Trace], keep: str, min_span: int) -> list[Trace]:
    """Traces to label: finished with an answer (``answered``; a trace cut by the length cap ends
    mid-reasoning), graded correct (``correct``) or ``all``; and a reasoning span of at least
    ``min_span`` tokens."""
    chosen = []
    for trace in traces:
        first, end = trace.span
        if end - first < min_span:
            continue
        if keep == "answered" and (trace.answer is None or not trace.finished):
            continue
        if keep == "correct" and not trace.correct:
            continue
        chosen.append(trace)
    return chosen


def _problems(config: CalibrationConfig) -> tuple[list[tuple[str, str, str | None]], Any]:
    from epikv.eval.grading import GRADERS
    from epikv.eval.tasks import load_task

    task = load_task(config.dataset).slice(config.offset, config.limit)
    return [(ex.id, ex.problem, ex.answer) for ex in task], GRADERS[task.grader]


def _safe_grade(grader: Any) -> Any:
    def grade(key: str | None, gold: str) -> bool | None:
        try:
            return bool(grader(key, gold))
        except ImportError:
            return None

    return grade


def obtain_traces(
    config: CalibrationConfig, model: Any, tokenizer: Any, out: Path, progress: bool = False
) -> list[Trace]:
    if config.traces:  # --offset / --limit pick from the given traces as they would from the dataset
        traces = load_traces(Path(config.traces))[config.offset : config.offset + config.limit]
    else:
        problems, grader = _problems(config)
        with tqdm(total=len(problems), desc="calibrate: traces", disable=not progress) as bar:

            def on_batch(done: int) -> None:
                log.info("traces: %d/%d", done, len(problems))
                bar.update(done - bar.n)

            traces = generate_traces(
                model, tokenizer, problems, config.max_new_tokens, config.batch_size, config.markers,
                _safe_grade(grader), on_batch=on_batch,
            )  # fmt: skip
    save_traces(traces, out / "traces.jsonl")
    return traces


def label_and_measure(
    traces: list[Trace],
    model: Any,
    tokenizer: Any,
    config: CalibrationConfig,
    out: Path,
    progress: bool = False,
) -> dict[str, np.ndarray]:
    """Labels every trace and computes its signals; pooled arrays, also saved as ``tokens.npz``."""
    from epikv.calibrate.scorer import ModelScorer
    from epikv.generation import eos_ids
    from epikv.models import model_identity

    eos = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    labeller = Labeller(
        ModelScorer(model), config.labels, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        eos, pad, int(model.config.get_text_config(decoder=True).vocab_size),
    )  # fmt: skip
    signals, drops, flips, groups = [], [], [], []
    with (out / "windows.jsonl").open("w") as handle:
        for index, trace in enumerate(tqdm(traces, desc="calibrate: labels", disable=not progress)):
            started = time.perf_counter()
            labels = labeller.label(trace, index)
            d = step_changes(model, trace.ids, *trace.span)
            stacked = all_signals(d, config.rolling)
            signals.append(np.stack([stacked[name] for name in SIGNALS]))  # (S, L, T)
            drops.append(labels.token_drop)
            if labels.token_flip is not None:
                flips.append(labels.token_flip)
            groups.append(np.full(labels.token_drop.shape[0], index))
            row = {
                "id": trace.id, "windows": labels.windows, "drop": labels.window_drop.round(5).tolist(),
                "flip": None if labels.window_flip is None else labels.window_flip.tolist(),
                "reference": labels.reference, "decoded": labels.decoded,
            }  # fmt: skip
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            log.info("labelled %d/%d (%s, %d windows) in %.1fs", index + 1, len(traces), trace.id,
                     len(labels.windows), time.perf_counter() - started)  # fmt: skip
    pooled = {
        "signals": np.concatenate(signals, axis=-1),
        "loglik": np.concatenate(drops),
        "groups": np.concatenate(groups),
    }
    if flips:
        pooled["flip"] = np.concatenate(flips).astype(np.float64)
    identity = np.array(model_identity(model))
    np.savez_compressed(out / "tokens.npz", signal_names=np.array(SIGNALS), model=identity, **pooled)
    return pooled


def summarise_traces(traces: list[Trace], used: list[Trace]) -> dict[str, Any]:
    rules: dict[str, int] = {}
    for trace in used:
        rules[trace.answer_rule] = rules.get(trace.answer_rule, 0) + 1
    return {
        "generated": len(traces),
        "finished": sum(t.finished for t in traces),
        "answered": sum(t.finished and t.answer is not None for t in traces),
        "correct": sum(bool(t.correct) for t in traces),
        "used": len(used),
        "used_correct": sum(bool(t.correct) for t in used),
        "answer_rules": rules,
        "mean_span_tokens": float(np.mean([t.span[1] - t.span[0] for t in used])) if used else 0.0,
        "ids": [t.id for t in used],
    }


@dataclass
class CalibrationResult:
    """The profile (written to ``path``, in the run folder only) and the ρ record."""

    profile: BandProfile
    rho: dict[str, Any]
    path: Path


def run_calibration(
    config: CalibrationConfig,
    out: Path,
    model: Any = None,
    tokenizer: Any = None,
    reuse: bool = False,
    progress: bool = False,
) -> CalibrationResult:
    """Runs every step and writes the run folder; returns the profile and the ρ record.

    ``reuse``: take traces, labels and signals from the folder's ``traces.jsonl`` and ``tokens.npz``
    (an earlier run) and redo only the statistics, the choice and the profile: no model runs.
    ``progress``: a bar per phase (traces, labels, analysis) on stderr.
    """
    out.mkdir(parents=True, exist_ok=True)
    clock = [time.perf_counter()]
    if reuse:
        identity, traces, used, pooled = load_run(out, config)
        clock += [clock[0], clock[0]]
        earlier = _earlier_seconds(out)
    else:
        (out / "config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
        identity, traces, used, pooled = measure(config, out, model, tokenizer, clock, progress)
        earlier = {}
    with tqdm(total=5, desc="calibrate: analysis", disable=not progress) as bar:
        rho, choice = analyse(pooled, config, identity, summarise_traces(traces, used), bar)
        clock.append(time.perf_counter())
        names = ("traces", "labels_and_signals", "statistics")
        steps = dict(zip(names, np.diff(clock).round(1).tolist(), strict=True))
        rho["seconds"] = {**steps, **earlier}  # a reused run keeps its model steps' times
        rho["reused"] = reuse
        (out / "rho.json").write_text(json.dumps(rho, indent=2) + "\n")
        profile = make_profile(rho, choice, config, _count_windows(out), int(pooled["groups"].shape[0]))
        path = write_profile(profile, out)
        _try_plot(out)
        bar.update()
    return CalibrationResult(profile, rho, path)


def analyse(
    pooled: dict[str, np.ndarray], config: CalibrationConfig, identity: str, traces: dict[str, Any], bar: Any
) -> tuple[dict[str, Any], BandChoice]:
    """ρ per layer, the band choice, ρ of the whole score and of position; one bar step each."""
    curves = rho_curves(pooled, config)
    bar.update()
    choice = choose(curves, config)
    rho = rho_record(identity, config, curves, choice, traces)
    bar.update()
    pairs = {
        "chosen": (choice.band_a, choice.band_b),
        "scaled_default": tuple(scaled_bands(rho["num_layers"]).values()),
    }
    rho["score"] = score_rho(pooled, config, pairs)
    bar.update()
    rho["position"] = position_rho(pooled, config)
    bar.update()
    return rho, choice


def make_profile(
    rho: dict[str, Any], choice: BandChoice, config: CalibrationConfig, n_windows: int, n_tokens: int
) -> BandProfile:
    """The profile with its provenance: data, labels, statistics and the choice's warnings."""
    provenance = {
        "dataset": config.dataset, "n_problems": rho["n_problems"],
        "n_correct": rho["traces"]["used_correct"], "n_windows": n_windows, "n_tokens": n_tokens,
        "window": config.labels.window, "stride": config.labels.stride, "filler": config.labels.filler,
        "answer_tokens": config.labels.answer_tokens, "rolling": config.rolling, "keep": config.keep,
        "max_new_tokens": config.max_new_tokens, "bootstrap": rho["bootstrap"],
        "answer_rules": rho["traces"]["answer_rules"], "score_rho": rho["score"],
    }  # fmt: skip
    label, signal = config.labels.kind, config.signal
    return build_profile(rho["model"], rho["num_layers"], choice, label, signal, provenance)


def measure(
    config: CalibrationConfig,
    out: Path,
    model: Any,
    tokenizer: Any,
    clock: list[float],
    progress: bool = False,
) -> tuple[str, list[Trace], list[Trace], dict[str, np.ndarray]]:
    """Traces, selection, labels and signals (the model part of a run); appends step times to clock."""
    from epikv.models import load_model, model_identity

    if model is None:
        import torch

        model, tokenizer = load_model(config.model, dtype=getattr(torch, config.dtype))
        clock[0] = time.perf_counter()  # loading the model is not a calibration step
    traces = obtain_traces(config, model, tokenizer, out, progress)
    clock.append(time.perf_counter())
    used = _usable(traces, config)
    pooled = label_and_measure(used, model, tokenizer, config, out, progress)
    clock.append(time.perf_counter())
    return model_identity(model), traces, used, pooled


def load_run(
    out: Path, config: CalibrationConfig
) -> tuple[str, list[Trace], list[Trace], dict[str, np.ndarray]]:
    """An earlier run's traces and pooled arrays, checked against the selection they were made with."""
    for name in ("traces.jsonl", "tokens.npz"):
        if not (out / name).is_file():
            raise FileNotFoundError(f"--reuse needs {out / name} from an earlier run")
    traces = load_traces(out / "traces.jsonl")
    used = _usable(traces, config)
    with np.load(out / "tokens.npz") as data:
        pooled = {key: data[key] for key in data.files if key not in ("signal_names", "model")}
        identity = str(data["model"]) if "model" in data.files else _identity_of(config.model)
    if config.labels.kind not in pooled:
        raise ValueError(f"{out / 'tokens.npz'} holds no {config.labels.kind!r} labels")
    if len(np.unique(pooled["groups"])) != len(used):
        raise ValueError(
            f"{out / 'tokens.npz'} was made with another trace selection than keep={config.keep!r}"
        )
    return identity, traces, used, pooled


def _earlier_seconds(out: Path) -> dict[str, float]:
    path = out / "rho.json"
    if not path.is_file():
        return {}
    seconds = json.loads(path.read_text()).get("seconds", {})
    return {key: seconds[key] for key in ("traces", "labels_and_signals") if key in seconds}


def _identity_of(name: str | None) -> str:
    """Identity for runs saved before tokens.npz recorded it: the embedded model needs no loading."""
    from epikv.models import DEFAULT_MODEL, is_embedded_name, load_model, model_identity

    return DEFAULT_MODEL if is_embedded_name(name) else model_identity(load_model(name)[0])


def _usable(traces: list[Trace], config: CalibrationConfig) -> list[Trace]:
    used = select_traces(traces, config.keep, min_span=config.labels.window)
    if len(used) < 2:
        raise ValueError(
            f"only {len(used)} of {len(traces)} traces are usable (keep={config.keep!r}, span >= "
            f"{config.labels.window} tokens); raise --limit or use --keep all"
        )
    return used


def _count_windows(out: Path) -> int:
    lines = (out / "windows.jsonl").read_text().splitlines()
    return sum(len(json.loads(line)["windows"]) for line in lines if line.strip())


def _try_plot(out: Path) -> None:
    from epikv.calibrate.plot import plot_rho

    try:
        plot_rho(out / "rho.json", out / "rho.png")
    except ImportError as err:
        log.warning("no plot: %s", err)
