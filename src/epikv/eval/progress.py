"""Progress of runs written by other processes, read from their results files.

Owns incremental reading of `results*.jsonl` files that shard processes (local or Ray tasks) are
appending to: each poll reads only the bytes added since the last one and returns the (id, sample)
keys of the complete lines. It never writes, and a torn or unparseable line is skipped (the writer
repairs its own file, see `records.repair_tail`).
"""

from __future__ import annotations

import json
from pathlib import Path

from epikv.eval.records import RESULTS_GLOB

Key = tuple[str, int]
_TAIL = 256


class ResultsWatcher:
    """Finished (id, sample) keys appearing in the results files of some run folders."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders = list(dict.fromkeys(folders))
        # Per file: bytes consumed (whole lines only) and the last of them, to notice a rewrite.
        self._read: dict[Path, tuple[int, bytes]] = {}

    def poll(self) -> dict[Path, set[Key]]:
        """The keys of lines completed since the previous poll, per run folder. A file rewritten
        underneath (a writer's `repair_tail`) is read again from the start, so after one a key may
        come back a second time."""
        found: dict[Path, set[Key]] = {}
        for folder in self.folders:
            keys: set[Key] = set()
            for path in sorted(folder.glob(RESULTS_GLOB)):
                keys.update(self._read_new(path))
            found[folder] = keys
        return found

    def _read_new(self, path: Path) -> list[Key]:
        offset, tail = self._read.get(path, (0, b""))
        try:
            with path.open("rb") as handle:
                size = handle.seek(0, 2)
                handle.seek(offset - len(tail))
                if size < offset or handle.read(len(tail)) != tail:
                    offset, tail = 0, b""
                handle.seek(offset)
                data = handle.read(size - offset)
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._read[path] = (offset + len(complete), (tail + complete)[-_TAIL:])
        return [key for line in complete.splitlines() if (key := _key(line)) is not None]


def _key(line: bytes) -> Key | None:
    try:
        record = json.loads(line)
        return str(record["id"]), int(record["sample"])
    except (ValueError, KeyError, TypeError):
        return None
