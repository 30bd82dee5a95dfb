"""Per-example results and the files that hold them.

Owns the `ExampleResult` record, its JSONL files (`results.jsonl`, or `results.shard-I-of-N.jsonl`
per shard), the `SkippedExample` record of a problem that could not run (its prompt does not fit the
budget or the model's context; in `skipped.jsonl` or `skipped.shard-I-of-N.jsonl`: counted apart,
never graded, so a skip is never a wrong answer) and the files' crash-safety rules: each record is
one line written with a single write, then flushed and fsynced, so a kill loses at most the examples
in flight and can leave at most one torn last line, which `repair_tail` truncates and readers ignore.
Merging dedupes by (id, sample) and refuses conflicting duplicates; a regrade's new verdicts are
set in place (`update_results`). It does not grade or compute metrics.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

RESULTS_GLOB = "results*.jsonl"
SKIPPED_GLOB = "skipped*.jsonl"
# Fields that must agree between two copies of the same (id, sample); timings may differ.
_CONTENT_FIELDS = ("correct", "extracted", "gold", "tokens_generated", "finish_reason")
_Record = TypeVar("_Record")


class _Line:
    """A record of one (id, sample) that is one JSON line of a file."""

    id: str
    sample: int

    @property
    def key(self) -> tuple[str, int]:
        return self.id, self.sample

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)  # type: ignore[call-overload]


@dataclass(frozen=True)
class ExampleResult(_Line):
    """One graded generation; one JSON line in a results file.

    `seconds` is this sequence's share of its generate call (call seconds / sequences in the call),
    so summing it over a run gives the run's generation wall time.
    """

    id: str
    sample: int
    correct: bool
    extracted: str | None
    gold: str
    tokens_generated: int
    prompt_tokens: int
    finish_reason: str
    cap_hit: bool
    loop: bool
    loop_onset: int | None
    loop_period: int | None
    seconds: float
    call_seconds: float
    batch_size: int
    peak_cache_tokens: int
    final_cache_tokens: int | None  # None: the engine does not report it (vLLM)
    evictions: int
    text: str
    mean_cache_tokens: float | None = None  # absent from records written before it was kept
    # The generated token ids (absent from records written before they were kept): the loop
    # detectors and first divergences are recomputed from them without a model.
    token_ids: list[int] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExampleResult:
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = required - set(data)
        if missing:
            raise ValueError(f"result record lacks field(s) {sorted(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class SkippedExample(_Line):
    """A (problem, sample) that was not generated because its prompt cannot run: one JSON line."""

    id: str
    sample: int
    reason: str
    prompt_tokens: int

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SkippedExample:
        return cls(str(data["id"]), int(data["sample"]), str(data["reason"]), int(data["prompt_tokens"]))


def results_filename(shard_index: int, shard_count: int, kind: str = "results") -> str:
    """`results.jsonl` (or `skipped.jsonl` for ``kind="skipped"``), with the shard in the name."""
    if shard_count == 1:
        return f"{kind}.jsonl"
    return f"{kind}.shard-{shard_index}-of-{shard_count}.jsonl"


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def repair_tail(path: Path) -> int:
    """Truncates a torn or unparseable last line left by a kill; returns the bytes removed.

    Only the writer of a file may call this (other processes may be appending to theirs).
    """
    if not path.exists():
        return 0
    data = path.read_bytes()
    keep = len(data)
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
    elif data:
        previous_end = data.rfind(b"\n", 0, len(data) - 1) + 1
        if not _parses(data[previous_end:]):
            keep = previous_end
    if keep < len(data):
        with path.open("r+b") as handle:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
    return len(data) - keep


def read_results(path: Path) -> list[ExampleResult]:
    """The records of one file, ignoring a torn last line; a bad line elsewhere is an error."""
    return _read_lines(path, ExampleResult.from_dict)


def read_skipped(path: Path) -> list[SkippedExample]:
    """The skipped records of one file (same rules as :func:`read_results`)."""
    return _read_lines(path, SkippedExample.from_dict)


def _read_lines(path: Path, parse: Callable[[dict[str, Any]], _Record]) -> list[_Record]:
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(parse(json.loads(line)))
        except (ValueError, KeyError, TypeError) as err:
            if number >= len(lines) - 1:
                continue  # the last line may be torn by a kill mid-write
            raise ValueError(f"{path}:{number}: corrupt result line ({err})") from err
    return records


def append_result(handle: IO[str], record: ExampleResult | SkippedExample) -> None:
    """Writes one line in a single write, then flushes and fsyncs, so it survives a kill."""
    handle.write(record.to_json() + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def merge_results(groups: Iterable[Iterable[ExampleResult]], source: str = "") -> list[ExampleResult]:
    """Records deduplicated by (id, sample); conflicting duplicates raise ValueError."""
    merged: dict[tuple[str, int], ExampleResult] = {}
    for records in groups:
        for record in records:
            seen = merged.get(record.key)
            if seen is None:
                merged[record.key] = record
                continue
            conflicts = [f for f in _CONTENT_FIELDS if getattr(seen, f) != getattr(record, f)]
            if conflicts:
                raise ValueError(
                    f"{source}: example {record.id!r} sample {record.sample} appears twice with "
                    f"different {', '.join(conflicts)}"
                )
    return list(merged.values())


def load_run_results(folder: Path) -> list[ExampleResult]:
    """Every record in a run folder, all shard files merged."""
    files = sorted(folder.glob(RESULTS_GLOB))
    return merge_results((read_results(path) for path in files), source=str(folder))


def load_skipped(folder: Path) -> list[SkippedExample]:
    """Every skipped record in a run folder, all shard files merged (one per (id, sample))."""
    merged: dict[tuple[str, int], SkippedExample] = {}
    for path in sorted(folder.glob(SKIPPED_GLOB)):
        merged.update((record.key, record) for record in read_skipped(path))
    return list(merged.values())


def update_results(folder: Path, changes: dict[tuple[str, int], dict[str, Any]]) -> int:
    """Sets the fields in ``changes[(id, sample)]`` on those records in every results file of
    ``folder`` (a regrade: new ``correct`` and ``extracted``), each file replaced atomically; every
    other line is kept byte for byte. Returns the lines changed. Not for a folder being written to."""
    changed = 0
    for path in sorted(folder.glob(RESULTS_GLOB)):
        out, before = [], changed
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            data = json.loads(line) if line.strip() else None
            fields = changes.get((str(data["id"]), int(data["sample"]))) if data else None
            if data is not None and fields is not None and any(data[k] != v for k, v in fields.items()):
                line = json.dumps(data | fields, ensure_ascii=False) + "\n"
                changed += 1
            out.append(line)
        if changed == before:
            continue
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text("".join(out), encoding="utf-8")
        os.replace(temporary, path)
    return changed
