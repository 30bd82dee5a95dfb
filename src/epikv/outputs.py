"""Where a command will write, checked before it works (issue #12: a benchmark measured for 102 s,
then died writing into ``--out`` that was a file).

Owns one rule for every command's output (``eval``/``bench``/``calibrate --out``, ``report --plots``,
``bench plot --png``): a folder may exist or be created with its parents (as ``mkdir -p`` would), a
file may be replaced, and either way the nearest folder that exists must take a new file now. The
check writes nothing that stays: it creates no folder and removes its probe. A failure is an
:class:`OutputPathError`, a ``ValueError``, so the command line prints it as one line (status 2).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class OutputPathError(ValueError):
    """An output path the command could not write; the message names the flag and the path."""


def check_output_dir(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """``path`` as a folder the command can fill: an existing folder, or one that can be created."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"{flag} {path} is a file, not a folder: choose a folder for the results")
    _check_writable(folder, path, flag)
    return folder


def check_output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a file the command can write (replacing it if it exists)."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise OutputPathError(f"{flag} {path} is a folder, not a file")
    _check_writable(file.parent, path, flag)
    return file


def _check_writable(folder: Path, asked: str | os.PathLike[str], flag: str) -> None:
    existing = folder.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputPathError(f"{flag} {asked}: {existing} is a file, so no folder can be made under it")
    try:
        # A real write, not os.access: root passes access checks on read-only file systems.
        with tempfile.TemporaryFile(dir=existing, prefix=".epikv-probe-"):
            pass
    except OSError as error:
        raise OutputPathError(f"{flag} {asked}: cannot write in {existing} ({error.strerror})") from error
