"""Finished pieces of a long benchmark kept on disk, so a rerun does only what is missing.

A piece is one (batch, cell) result stored with a fingerprint of everything it was computed from
(the prompts, the settings, the cell's cache spec); a piece whose fingerprint differs is computed
again, never reused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from epikv.bench.shared.machine import load_average
from epikv.spec import CacheSpec


def fingerprint_of(*parts: Any) -> str:
    """A short hash of JSON-able values (sorted keys)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cell_print(fingerprint: str, spec: CacheSpec) -> str:
    """A batch's fingerprint extended by one cell's resolved cache spec."""
    return fingerprint + fingerprint_of(spec.config())[:8]


class Parts:
    """Finished (batch, cell) results under ``folder``; nothing is kept when ``folder`` is None."""

    def __init__(self, folder: str | None) -> None:
        self.folder = Path(folder) if folder else None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, batch: int, name: str) -> Path:
        assert self.folder is not None
        safe = name.replace("/", "_").replace(":", "_")
        return self.folder / f"b{batch:02d}" / f"{safe}.json"

    def get(self, batch: int, name: str, fingerprint: str) -> Any:
        """The stored results, or None when absent or computed from something else."""
        if self.folder is None or not self._path(batch, name).is_file():
            return None
        data = json.loads(self._path(batch, name).read_text())
        return data["results"] if data.get("fingerprint") == fingerprint else None

    def cost(self, batch: int, name: str) -> dict[str, Any] | None:
        """The seconds a stored piece took and the load average when it finished (None if absent)."""
        if self.folder is None or not self._path(batch, name).is_file():
            return None
        data = json.loads(self._path(batch, name).read_text())
        return {"seconds": data.get("seconds"), "load_average": data.get("load_average")}

    def put(self, batch: int, name: str, fingerprint: str, results: Any, seconds: float) -> None:
        """Store one piece atomically (written beside, then renamed), with its time and the load."""
        if self.folder is None:
            return
        doc = {"fingerprint": fingerprint, "cell": name, "seconds": round(seconds, 1)}
        doc["load_average"] = load_average()
        doc["results"] = results
        self.rewrite(batch, name, doc)

    def stored(self, batch: int, name: str) -> dict[str, Any] | None:
        """The whole stored piece (fingerprint, cost, results), whatever it was computed from; None
        when absent. For reading a finished study back (a re-grade), not for reuse: that is
        :meth:`get`, which checks the fingerprint."""
        if self.folder is None or not self._path(batch, name).is_file():
            return None
        return dict(json.loads(self._path(batch, name).read_text()))

    def rewrite(self, batch: int, name: str, piece: dict[str, Any]) -> None:
        """Write a whole piece (as :meth:`stored` returns it) atomically, as :meth:`put` writes one."""
        if self.folder is None:
            return
        path = self._path(batch, name)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(piece) + "\n")
        tmp.replace(path)
