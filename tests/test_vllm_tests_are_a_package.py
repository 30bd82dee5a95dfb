"""The vLLM plugin's tests import their helpers as a package module (``tests.vllm.engines``), never as
a bare ``engines`` that only pytest's import mode puts on the path (issue 58 item 5)."""

from __future__ import annotations

import ast
from pathlib import Path

FOLDER = Path(__file__).parent / "vllm"


def test_the_plugin_tests_are_a_package_importing_helpers_by_their_full_name():
    assert (FOLDER / "__init__.py").is_file()
    helpers = {p.stem for p in FOLDER.glob("*.py") if not p.stem.startswith(("test_", "__", "conftest"))}
    assert {"engines", "reference"} <= helpers
    bare = []
    for path in sorted(FOLDER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bare += [f"{path.name}: {n}" for n in names if n.split(".")[0] in helpers]
    assert bare == []
