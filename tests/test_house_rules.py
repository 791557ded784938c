"""The house rules a newcomer relies on (docs/architecture.md, "Layers"; issue 48's targets): files
small enough to read, code that states rules rather than dated measurements, a short README, one
benchmarks page, and raw results that the docs cite and the index lists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "tandem"
RESULTS = ROOT / "docs" / "results"
DATE = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}")
CITED = re.compile(r"docs/results/[A-Za-z0-9_./\-]+")     # a literal path (patterns like {19,20} or * stop it)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_source_file_is_too_long_to_read():
    long = {p.relative_to(SRC).as_posix(): n for p in SRC.rglob("*.py") if (n := lines(p)) > 400}
    long |= {p.relative_to(SRC).as_posix(): n for p in SRC.rglob("*.cpp") if (n := lines(p)) > 500}
    assert not long, f"split these (400 lines per .py, 500 per .cpp): {long}"


def test_code_carries_no_dates():
    hits = [f"{p.relative_to(SRC)}:{i}" for p in [*SRC.rglob("*.py"), *SRC.rglob("*.cpp"), *SRC.rglob("*.h")]
            for i, line in enumerate(p.read_text().splitlines(), 1) if DATE.search(line)]
    assert not hits, f"code states rules, not dated runs; cite the docs section instead: {hits}"


@pytest.mark.parametrize("name,most", [("README.md", 160), ("docs/benchmarks.md", 600)])
def test_front_pages_stay_short(name, most):
    assert lines(ROOT / name) <= most, f"{name}: move detail to a topic page (at most {most} lines)"


def cited_paths(text: str) -> list[str]:
    """The literal docs/results paths a page cites; a pattern (`x_{19,20}.json`, `*_zen3`) is left out."""
    return [m.group(0).rstrip(".,") for m in CITED.finditer(text) if text[m.end():m.end() + 1] not in ("{", "*", "[")]


def test_every_cited_result_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]
    missing = sorted({f"{page.relative_to(ROOT)}: {path}" for page in pages for path in cited_paths(page.read_text())
                      if not (ROOT / path).exists()})
    assert not missing, f"cited but absent: {missing}"


def test_the_results_index_lists_every_entry():
    """docs/results/README.md names each top-level file and folder (what it backs, or superseded)."""
    index = (RESULTS / "README.md").read_text()
    unlisted = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md" and f"`{p.name}" not in index)
    assert not unlisted, f"add to docs/results/README.md: {unlisted}"


def test_the_checks_can_fail():
    """The patterns are not vacuous."""
    assert DATE.search('"""a run of 2026-12-03"""') and not DATE.search("version 2.13.0")
    page = "raw: docs/results/spec_vllm/spec.json, docs/results/shapes/x_{19,20}.json and docs/results/a/*_b."
    assert cited_paths(page) == ["docs/results/spec_vllm/spec.json"]
