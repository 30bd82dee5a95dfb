"""Rebuild the shipped fidelity genres ``prose`` and ``code`` (src/epikv/data/{prose,code}.jsonl).

Where the text comes from (fetched with the ordinary clients into --work, SHA-256 checked):

* prose: the SQLite documentation (public domain), Debian 12 package ``sqlite3-doc``
  3.40.1-2+deb12u2, HTML pages ``/usr/share/doc/sqlite3/*.html``. The running text of a page is its
  ``<p>`` paragraphs and ``<h1>``-``<h3>`` headings, in page order; code blocks, lists and tables are
  left out.
* code: Python modules of three wheels from PyPI: networkx 3.6.1 (BSD-3-Clause), sympy 1.14.0
  (BSD-3-Clause) and pydantic 2.14.4 (MIT), 16 modules each. Tests, ``__init__.py`` and pydantic's
  ``v1/`` (a frozen copy of pre-2023 code) are left out.

Selection (deterministic): a page or module is a candidate when its text, from the first paragraph
(prose) or the first top-level ``def``/``class``/decorator line (code), holds at least ``--tokens``
tokens with the embedded SmolLM2 tokenizer; code also needs at least half of its passage outside
string literals and comments (many scientific modules are mostly docstring). Candidates are sorted by
path and taken evenly spaced: ``candidates[i * n // count]``. A passage is the shortest run of whole
paragraphs or lines from the start that reaches ``--tokens`` tokens. Needs network access to Debian's
and PyPI's registries only to fetch; run from the repository root.
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import io
import json
import re
import subprocess
import sys
import tokenize
import zipfile
from pathlib import Path

DEB = ("sqlite3-doc", "3.40.1-2+deb12u2", "466e30d7066e2641fa13e56bc662a2ad521b8cc9c17dde9c9dac3d4f105e32f2")
WHEELS = {
    # name: (version, wheel file, sha256, package folder, SPDX licence, licence file in the wheel)
    "networkx": (
        "3.6.1",
        "networkx-3.6.1-py3-none-any.whl",
        "d47fbf302e7d9cbbb9e2555a0d267983d2aa476bac30e90dfbe5669bd57f3762",
        "networkx",
        "BSD-3-Clause",
        "networkx-3.6.1.dist-info/licenses/LICENSE.txt",
    ),
    "sympy": (
        "1.14.0",
        "sympy-1.14.0-py3-none-any.whl",
        "e091cc3e99d2141a0ba2847328f5479b05d94a6635cb96148ccb3f34671bd8f5",
        "sympy",
        "BSD-3-Clause",
        "sympy-1.14.0.dist-info/licenses/LICENSE",
    ),
    "pydantic": (
        "2.14.4",
        "pydantic-2.14.4-py3-none-any.whl",
        "653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc",
        "pydantic",
        "MIT",
        "pydantic-2.14.4.dist-info/licenses/LICENSE",
    ),
}
SKIPPED_PAGES = re.compile(r"(changes|news|oldnews|chronology|sitemap|.*crossref|.*_index|copyright)\.html$")
BLOCKS = {"p", "div", "ul", "ol", "li", "pre", "table", "blockquote", "dl", "dt", "dd", "h4", "h5", "h6"}
HEADINGS = {"h1", "h2", "h3"}
SKIPPED_TAGS = {"pre", "script", "style", "table"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(work: Path) -> tuple[Path, dict[str, Path]]:
    """Download the .deb and the wheels into ``work`` (once) and check their digests."""
    work.mkdir(parents=True, exist_ok=True)
    name, version, digest = DEB
    deb = work / f"{name}_{version}_all.deb"
    if not deb.exists():
        subprocess.run(["apt-get", "download", f"{name}={version}"], cwd=work, check=True)
    wheels = {}
    for pkg, (ver, wheel, _, *_rest) in WHEELS.items():
        wheels[pkg] = work / wheel
        if not wheels[pkg].exists():
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
            subprocess.run([*cmd, "-d", str(work), f"{pkg}=={ver}"], check=True)
    checks = [(deb, digest)] + [(wheels[p], WHEELS[p][2]) for p in WHEELS]
    for path, expected in checks:
        if sha256(path) != expected:
            raise SystemExit(f"{path.name}: SHA-256 {sha256(path)} is not the pinned {expected}")
    return deb, wheels


class Paragraphs(html.parser.HTMLParser):
    """Running text of an SQLite documentation page: ``<p>`` paragraphs and h1-h3 headings."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._open: list[str] | None = None
        self._skip = 0

    def _close(self) -> None:
        if self._open is not None:
            text = " ".join("".join(self._open).split())
            if text:
                self.paragraphs.append(text)
        self._open = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in SKIPPED_TAGS:
            self._close()
            self._skip += 1
        elif tag in BLOCKS or tag in HEADINGS:
            self._close()
            if tag == "p" or tag in HEADINGS:
                self._open = []

    def handle_endtag(self, tag: str) -> None:
        if tag in SKIPPED_TAGS:
            self._skip = max(0, self._skip - 1)
        elif tag in BLOCKS or tag in HEADINGS:
            self._close()

    def handle_data(self, data: str) -> None:
        if self._open is not None and not self._skip:
            self._open.append(data)


def page_paragraphs(path: Path) -> list[str]:
    parser = Paragraphs()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return parser.paragraphs


def code_lines(source: str) -> list[str] | None:
    """The module's lines from its first top-level def/class/decorator on, or None if it has none."""
    lines = source.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if re.match(r"(async def|def|class) |@", line):
            return lines[i:]
    return None


def code_fraction(text: str) -> float:
    """Share of characters outside string literals and comments (1.0 when it cannot be tokenized)."""
    literal = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                literal += len(tok.string)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass  # the passage ends mid-statement; the count so far is what we want
    return 1.0 - literal / max(1, len(text))


def shortest_prefix(pieces: list[str], joiner: str, count, tokens: int) -> str | None:
    for end in range(1, len(pieces) + 1):
        text = joiner.join(pieces[:end])
        if count(text) >= tokens:
            return text
    return None


def evenly(candidates: list[dict], count: int) -> list[dict]:
    if len(candidates) < count:
        raise SystemExit(f"only {len(candidates)} candidates for {count} passages")
    return [candidates[i * len(candidates) // count] for i in range(count)]


def prose_records(deb: Path, work: Path, count_tokens, tokens: int, count: int) -> list[dict]:
    root = work / "deb"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    folder = root / "usr/share/doc/sqlite3"
    candidates, seen = [], set()
    for page in sorted(folder.glob("*.html")):
        if SKIPPED_PAGES.match(page.name):
            continue
        text = shortest_prefix(page_paragraphs(page), "\n\n", count_tokens, tokens)
        if text is not None and text not in seen:  # fileformat.html and fileformat2.html are one page
            seen.add(text)
            origin = f"Debian 12 package {DEB[0]} {DEB[1]}: /usr/share/doc/sqlite3/{page.name}"
            candidates.append({"id": f"prose/sqlite-doc/{page.stem}", "text": text, "origin": origin})
    return [{**r, "license": "public-domain", "license_file": None} for r in evenly(candidates, count)]


def code_records(wheels: dict[str, Path], count_tokens, tokens: int, per_package: int) -> list[dict]:
    records = []
    for pkg, wheel in wheels.items():
        version, _, _, folder, spdx, _ = WHEELS[pkg]
        candidates = []
        with zipfile.ZipFile(wheel) as archive:
            for name in sorted(archive.namelist()):
                parts = name.split("/")
                if (
                    not name.endswith(".py")
                    or parts[0] != folder
                    or parts[-1] in ("__init__.py", "conftest.py")
                    or parts[-1].startswith("test_")
                    or {"tests", "testing", "v1"} & set(parts[1:-1])
                ):
                    continue
                lines = code_lines(archive.read(name).decode("utf-8"))
                text = lines and shortest_prefix(lines, "", count_tokens, tokens)
                if text and code_fraction(text) >= 0.5:
                    origin = f"PyPI wheel {WHEELS[pkg][1]} ({pkg} {version}): {name}"
                    candidates.append({"id": f"code/{name}", "text": text, "origin": origin})
        license_file = f"licenses/{pkg}-{version}.txt"
        chosen = evenly(candidates, per_package)
        records += [{**r, "license": spdx, "license_file": license_file} for r in chosen]
    return records


def copy_licenses(wheels: dict[str, Path], out: Path) -> None:
    folder = out / "licenses"
    folder.mkdir(parents=True, exist_ok=True)
    for pkg, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as archive:
            text = archive.read(WHEELS[pkg][5]).decode("utf-8")
        (folder / f"{pkg}-{WHEELS[pkg][0]}.txt").write_text(text, encoding="utf-8")


def write_jsonl(records: list[dict], genre: str, path: Path, count_tokens) -> None:
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            row = {"id": record["id"], "source": genre, "text": record["text"], "origin": record["origin"]}
            row |= {"license": record["license"], "license_file": record["license_file"]}
            row["smollm2_tokens"] = count_tokens(record["text"])
            out.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/epikv-genres"))
    parser.add_argument("--out", type=Path, default=Path("src/epikv/data"))
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per passage (SmolLM2)")
    parser.add_argument("--count", type=int, default=48, help="passages per genre")
    args = parser.parse_args()

    from epikv.models import load_model

    _, tokenizer = load_model()

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    deb, wheels = fetch(args.work)
    prose = prose_records(deb, args.work, count_tokens, args.tokens, args.count)
    code = code_records(wheels, count_tokens, args.tokens, args.count // len(WHEELS))
    write_jsonl(prose, "prose", args.out / "prose.jsonl", count_tokens)
    write_jsonl(code, "code", args.out / "code.jsonl", count_tokens)
    copy_licenses(wheels, args.out)


if __name__ == "__main__":
    main()
