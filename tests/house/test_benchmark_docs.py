"""The benchmark docs and results agree: every results file the docs cite exists, every
current one (outside benchmarks/results/superseded/) is cited, the index lists every file, and
each figure in docs/benchmarks.md's tables is a number in the results file its row names (a
ratio: the baseline's figure over blockserve's, to the digits shown)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CITED = re.compile(r"benchmarks/results/([\w./\-]+\.(?:json|png|txt))")
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def results_files() -> set[str]:
    return {
        str(p.relative_to(RESULTS))
        for p in RESULTS.rglob("*")
        if p.is_file() and p.name != "README.md"
    }


def cited() -> dict[str, set[str]]:
    """Results file -> the docs that cite it."""
    found: dict[str, set[str]] = {}
    for doc in DOCS:
        for name in CITED.findall(doc.read_text()):
            found.setdefault(name, set()).add(str(doc.relative_to(ROOT)))
    return found


def test_every_cited_results_file_exists() -> None:
    assert sorted(set(cited()) - results_files()) == []


def test_every_current_results_file_is_cited() -> None:
    current = {name for name in results_files() if not name.startswith("superseded/")}
    assert sorted(current - set(cited())) == []


def test_the_index_lists_every_results_file() -> None:
    index = (RESULTS / "README.md").read_text()
    assert sorted(name for name in results_files() if name not in index) == []


def numbers(value: object) -> list[float]:
    """Every number in a JSON document."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return []
    return [float(value)]


def first_number(cell: str) -> tuple[float, int] | None:
    """The cell's first number and its count of decimals, or None."""
    match = NUMBER.search(cell)
    if match is None:
        return None
    text = match.group().replace(",", "").rstrip(".")
    return float(text), len(text.split(".")[1]) if "." in text else 0


def table_rows() -> list[dict[str, str]]:
    """docs/benchmarks.md's table rows that name a results file, by column."""
    rows, header = [], None
    for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(cells[0]) <= {"-"}:
            rows.append(dict(zip(header, cells, strict=True)))
    return [row for row in rows if "json" in row.get("Result", "")]


def test_each_figure_in_the_tables_is_in_its_results_file() -> None:
    rows = table_rows()
    assert len(rows) >= 20
    for row in rows:
        (name,) = CITED.findall(row["Result"])
        leaves = numbers(json.loads((RESULTS / name).read_text()))
        figures = [row[c] for c in ("blockserve", "vLLM-CPU", "Baseline", "Figure") if c in row]
        for cell in figures:
            parsed = first_number(cell)
            assert parsed is not None, row
            value, digits = parsed
            assert any(round(leaf, digits) == value for leaf in leaves), (name, cell)
        if "Ratio" in row:
            ours, theirs = (first_number(cell)[0] for cell in figures)  # type: ignore[index]
            ratio, digits = first_number(row["Ratio"])  # type: ignore[misc]
            assert abs(theirs / ours - ratio) <= 0.5 * 10**-digits + 1e-9, (name, row["Ratio"])
