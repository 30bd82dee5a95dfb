"""Every vLLM name the plugin's code touches has a record in :mod:`epikv.vllm.pins` (issue 57 item 5).

An AST scan of every module under ``src/epikv/vllm`` (no vLLM needed). What it sees:
- ``from vllm... import X`` and ``import vllm...``: the name imported;
- attribute chains rooted at a name bound to vLLM (an import, or a local assigned from one, also
  through ``type(...)``): ``ops.cpu_attn_reshape_and_cache``, ``vllm.__version__``,
  ``InputProcessor.process_inputs``;
- ``getattr`` / ``hasattr`` / ``setattr`` / ``mock.patch.object`` with a literal name: on a name bound
  to vLLM, that dotted name; on anything else, the name must be epikv's own (``epikv...``), a member
  of some record, or listed in ``pins.NOT_VLLM`` with whose it is;
- in a class with a vLLM base (or a mixin combined with one in its module): ``super().m`` and every
  ``self.x`` the epikv classes do not set themselves, as members of that base.

What it cannot see, and what covers it instead: attribute reads on plain parameters and locals of
unknown type (``vllm_config.model_config.hf_config``, a wrapper's ``self``, ``builder.build``) and a
name passed to a helper that calls ``getattr`` with it: their records are checked against vLLM by
``tests/vllm/test_contract.py`` and, for live objects, ``tests/vllm/test_traffic.py``; and which
methods of a subclass override vLLM's, which the contract test checks against the installed classes.
A chain through ``__version__`` (a string) stops there.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import epikv.vllm
from epikv.vllm import pins

SRC = Path(epikv.vllm.__file__).parent
RECORDED = {p.dotted for p in pins.PINS}
MEMBERS = {p.member for p in pins.PINS if p.member is not None}
SETTERS = {"getattr", "hasattr", "setattr", "object"}  # object: mock.patch.object(owner, "name", ...)


def chain(node: ast.AST) -> tuple[str | None, list[str]]:
    """``a.b.c`` -> ("a", ["b", "c"]); (None, []) for a chain not rooted at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "type" and node.args:
        return chain(node.args[0])  # type(current_platform) is looked up on like the object
    return (node.id, parts[::-1]) if isinstance(node, ast.Name) else (None, [])


def bound_to_vllm(tree: ast.Module) -> dict[str, str]:
    """Local names -> the dotted vLLM name they hold: imports, then locals assigned from them."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "vllm":
                    bound[a.asname or "vllm"] = a.name if a.asname else "vllm"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for _ in range(3):  # a local from a local from an import
        for node in ast.walk(tree):
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            if isinstance(target, ast.Name):
                root, parts = chain(node.value)
                if root in bound:
                    bound[target.id] = ".".join([bound[root], *parts])
    return bound


def dotted(bound: dict[str, str], root: str, parts: list[str]) -> str:
    name = ".".join([bound[root], *parts])
    return name.split(".__version__")[0] + ".__version__" if ".__version__" in name else name


def covered(name: str) -> bool:
    """A record names it, or (a module or class) records some of its members."""
    return name in RECORDED or any(r.startswith(name + ".") for r in RECORDED)


def vllm_classes(tree: ast.Module, bound: dict[str, str]) -> dict[str, list[str]]:
    """Class name -> its vLLM bases, a mixin taking those of the classes that combine it with one."""
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    out: dict[str, list[str]] = {}
    for name, node in classes.items():
        bases = [chain(b) for b in node.bases]
        theirs = [dotted(bound, r, p) for r, p in bases if r in bound]
        if theirs:
            out[name] = theirs
            for root, _ in bases:
                if root in classes and root not in bound:
                    out.setdefault(root, []).extend(theirs)
    return out


def own_names(tree: ast.Module, family: set[str]) -> set[str]:
    """What the epikv classes of ``family`` define or set on ``self``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in family:
            for item in ast.walk(node):
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign | ast.AnnAssign | ast.AugAssign):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    for t in targets:
                        for sub in ast.walk(t):
                            if isinstance(sub, ast.Name) and isinstance(item, ast.Assign):
                                names.add(sub.id)
                            if isinstance(sub, ast.Attribute) and chain(sub)[0] == "self":
                                names.add(sub.attr)
    return names


def touched(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every vLLM name the module touches that the scan can see."""
    tree = ast.parse(path.read_text())
    bound = bound_to_vllm(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Attribute) and not isinstance(node.parent, ast.Attribute):  # type: ignore[attr-defined]
            root, parts = chain(node)
            if root in bound:
                found.append((node.lineno, dotted(bound, root, parts)))
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and _name_of(node.func) in SETTERS:
            literal = node.args[1]
            if isinstance(literal, ast.Constant) and isinstance(literal.value, str):
                root, parts = chain(node.args[0])
                if root in bound:
                    found.append((node.lineno, dotted(bound, root, [*parts, literal.value])))
                elif not _not_vllm(literal.value):
                    found.append((node.lineno, f"?.{literal.value}"))
    found += _through_classes(tree, bound)
    return found


def _through_classes(tree: ast.Module, bound: dict[str, str]) -> list[tuple[int, str]]:
    """``super().m`` and ``self.x`` (not the epikv classes' own) in classes with a vLLM base."""
    classes = vllm_classes(tree, bound)
    family = set(classes)
    mine = own_names(tree, family)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ClassDef) and node.name in classes):
            continue
        bases = classes[node.name]
        for item in ast.walk(node):
            if not isinstance(item, ast.Attribute):
                continue
            value = item.value
            is_super = isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super"
            is_self = isinstance(value, ast.Name) and value.id == "self" and item.attr not in mine
            if (is_super or is_self) and not _not_vllm(item.attr):
                found.append((item.lineno, " | ".join(f"{b}.{item.attr}" for b in bases)))
    return found


def _name_of(func: ast.AST) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _not_vllm(name: str) -> bool:
    return name.startswith(("epikv", "_epikv")) or name in pins.NOT_VLLM or name.startswith("__")


def unrecorded(path: Path) -> list[str]:
    missing = []
    for line, name in touched(path):
        if name.startswith("?."):
            ok = name[2:] in MEMBERS
        else:
            ok = any(covered(alternative) for alternative in name.split(" | "))
        if not ok:
            missing.append(f"{path.name}:{line} {name}")
    return missing


@pytest.mark.parametrize("path", sorted(SRC.glob("*.py")), ids=lambda p: p.name)
def test_every_vllm_name_the_plugin_touches_has_a_record(path):
    assert unrecorded(path) == [], "add a record to epikv/vllm/pins.py for each"


def test_the_scan_sees_each_kind_of_touch(tmp_path):
    """A name of each kind the scan claims to see, unrecorded, is flagged (the scan is not blind)."""
    module = tmp_path / "touches.py"
    module.write_text(
        "import vllm\n"
        "from vllm.v1.worker import cpu_worker\n"
        "from vllm.v1.core.sched.scheduler import Scheduler\n"
        "from vllm.brand_new import Thing\n"
        "from unittest import mock\n"
        "platform = type(vllm.platforms.current_platform)\n"
        "x = vllm.newer\n"
        "y = getattr(cpu_worker, 'Renamed', None)\n"
        "z = getattr(object(), 'renamed_field', False)\n"
        "mock.patch.object(cpu_worker, 'Other', None)\n"
        "w = platform.new_hook\n"
        "class S(Scheduler):\n"
        "    def schedule(self):\n"
        "        self.epikv_mine = self.new_state\n"
        "        return super().schedule()\n"
    )
    got = {name.split(" ", 1)[1] for name in unrecorded(module)}
    assert got == {
        "vllm.brand_new.Thing",
        "vllm.newer",
        "vllm.v1.worker.cpu_worker.Renamed",
        "?.renamed_field",
        "vllm.v1.worker.cpu_worker.Other",
        "vllm.platforms.current_platform.new_hook",
        "vllm.v1.core.sched.scheduler.Scheduler.new_state",
        "vllm.v1.core.sched.scheduler.Scheduler.schedule",
    }
