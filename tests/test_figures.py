"""Every performance figure says where it comes from, and every ratio reads one way.

docs/explanation/performance.md gives each figure with its RESULTS.md entry (its date),
the machine, the commit measured and the command, so that anyone can measure it again
on the same code; and every ratio there is a speed ratio, ours over theirs, so that no
reader has to guess which way a number points. These checks only read files (and ask
git whether a commit exists): no session, no engine.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "explanation" / "performance.md"


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Each markdown table in text: its header's cells and its rows' cells (the
    |---| line dropped)."""
    found: list[tuple[list[str], list[list[str]]]] = []
    block: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            found.append((block[0], [r for r in block[1:] if not set("".join(r)) <= set("-: ")]))
            block = []
    return found


def column(header: list[str], *names: str) -> int:
    """The index of the first column whose header names one of names."""
    hits = [i for i, h in enumerate(header) if any(n in h.lower() for n in names)]
    assert hits, f"a table in {PAGE.name} has no {' or '.join(names)} column: {header}"
    return hits[0]


@functools.cache
def is_commit(sha: str) -> bool:
    """Whether this repository's history holds the commit."""
    return subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=REPO,
                          capture_output=True).returncode == 0


def _history() -> None:
    """Skip where there is no history to look commits up in (an sdist, a shallow clone)."""
    got = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO,
                         capture_output=True, text=True)
    if got.returncode != 0 or got.stdout.strip() != "false":
        pytest.skip("no full git history here to find the page's commits in")


def test_the_page_has_tables_with_rows():
    """A guard for the checks below: they pass vacuously on a page they cannot parse."""
    found = tables(PAGE.read_text())
    assert len(found) >= 4 and all(rows for _, rows in found)


def test_every_figure_names_its_date_commit_machine_and_command():
    """A row without its date, commit, machine or command cannot be measured again."""
    _history()
    for header, rows in tables(PAGE.read_text()):
        date, commit = column(header, "entry", "date"), column(header, "commit")
        machine, command = column(header, "machine"), column(header, "command")
        for row in rows:
            assert re.search(r"\b\d{4}-\d\d-\d\d\b", row[date]), f"no date (YYYY-MM-DD): {row}"
            shas = re.findall(r"\b[0-9a-f]{7,40}\b", row[commit])
            assert shas, f"no commit (7 or more hex digits): {row}"
            for sha in shas:
                assert is_commit(sha), f"{sha} is not a commit of this repository: {row}"
            assert row[machine].strip("—- "), f"no machine: {row}"
            assert row[command].strip("`—- "), f"no command: {row}"


def test_every_ratio_column_says_higher_is_better():
    """A ratio column is a speed, ours over theirs, and its header says which way is up."""
    for header, _ in tables(PAGE.read_text()):
        for name in header:
            if re.search(r"speed|ratio|/", name, flags=re.I):
                assert "higher is better" in name, f"a ratio column that does not say 'higher is better': {name!r}"


def test_no_page_and_no_new_results_entry_says_lower_is_better():
    """One direction everywhere: a time ratio is written as its inverse, a speed. Older
    RESULTS entries are a log and stay as recorded; the newest one follows the rule."""
    results = (REPO / "benchmarks" / "RESULTS.md").read_text()
    newest = re.split(r"^## ", results, flags=re.M)[1]
    pages = {str(p.relative_to(REPO)): p.read_text() for p in
             [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))] if "_build" not in p.parts}
    pages["benchmarks/RESULTS.md (newest entry)"] = newest
    said = [name for name, text in pages.items() if "lower is better" in text.lower()]
    assert said == [], f"'lower is better' in {said}"
