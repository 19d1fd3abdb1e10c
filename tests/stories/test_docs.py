"""The docs point at things that exist (every test the fault matrix cites, every result file a doc cites),
and the API reference is the docstrings' own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_test_the_fault_matrix_cites_exists():
    text = (ROOT / "docs" / "faults.md").read_text()
    cited = re.findall(r"`(test_\w+\.py)::(test_\w+)`", text)
    assert len(cited) >= 20
    where = {p.name: p for p in (ROOT / "tests").rglob("test_*.py")}  # cited by name: tests/<area>/ holds them
    missing = [f"{f}::{t}" for f, t in cited if f not in where or t not in _test_names(where[f])]
    assert not missing, missing


def _cited_results() -> set[str]:
    """Result files the docs name: ``results/<file>`` anywhere, bare ``<file>`` in benchmarks/README.md."""
    cited = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        cited |= set(re.findall(r"results/([\w.]+\.(?:txt|json))", doc.read_text()))
    text = (ROOT / "benchmarks" / "README.md").read_text()
    cited |= set(re.findall(r"`([\w.]+\.(?:txt|json))`", text))
    for stem, exts in re.findall(r"`([\w]+)\.\{([\w,]+)\}`", text):  # name.{txt,json}
        cited |= {f"{stem}.{ext}" for ext in exts.split(",")}
    return cited


def test_every_result_file_the_docs_cite_exists():
    cited = _cited_results()
    assert len(cited) >= 10
    missing = sorted(name for name in cited if not (ROOT / "benchmarks" / "results" / name).exists())
    assert not missing, missing


def test_the_api_reference_is_generated_from_the_current_docstrings():
    """docs/api.md is written by docs/make_api.py; edit the docstrings and run it, never the file."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "make_api.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = (ROOT / "docs" / "api.md").read_text()
    for name in ("PhaseTimer(", "attach(", "timer.close(", "RunTotals", "Diagnosis", "phase-timer compare"):
        assert name in text, name


def test_every_result_file_is_cited_by_a_doc():
    """benchmarks/results holds current figures only: a file no doc cites is superseded or stray."""
    present = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    assert not present - _cited_results(), sorted(present - _cited_results())


_API_ENTRY = re.compile(r"^- (`[^`]+`(?:, `[^`]+`)*): (.+)$")


def _api_sections() -> dict[str, tuple[list[str], list[str]]]:
    """Per ``## `` section of docs/api.md that has an ``Args`` list: its signature's parameters and the list's lines."""
    out = {}
    for section in re.split(r"^## ", (ROOT / "docs" / "api.md").read_text(), flags=re.M)[1:]:
        args = re.search(r"^\*\*Args[^\n]*\*\*\n\n((?:.+\n)+)", section, flags=re.M)
        sig = re.search(r"^```python\n\S+\(\n((?:    .*\n)+)\)", section, flags=re.M)
        if args and sig:
            params = [p.strip().split(":")[0].split("=")[0].strip().rstrip(",") for p in sig.group(1).splitlines()]
            out[section.splitlines()[0]] = ([p for p in params if p != "*"], args.group(1).splitlines())
    return out


def test_each_documented_argument_is_its_own_entry_of_the_api_reference():
    """Every line of an Args list is one entry that names parameters of the signature above it (a Google-style
    list of names wrapped onto the next line included), each parameter is documented once, and no description
    runs into the next parameters' names (``...logging_steps). warmup_steps, max_pending, ...``)."""
    sections = _api_sections()
    assert {"`phase_timer.PhaseTimer`", "`phase_timer.attach`", "`phase_timer.PhaseTimerCallback`"} <= {
        title.split(":")[0] for title in sections}
    for title, (params, lines) in sections.items():
        named: list[str] = []
        for line in lines:
            m = _API_ENTRY.match(line)
            assert m, (title, line)
            names = [n.strip("`") for n in m.group(1).split(", ")]
            assert set(names) <= set(params), (title, line)
            named += names
            bare = re.sub(r"`[^`]*`", "", m.group(2))  # what the description says outside code
            run_on = [p for p in params if re.search(rf"\b{p}\s*,", bare)]
            assert not run_on, (title, line, run_on)
        assert len(named) == len(set(named)), (title, named)
        text = "\n".join(lines)
        undocumented = [p for p in params if p not in named and f"`{p}`" not in text]
        assert not undocumented, (title, undocumented)


def test_the_readme_stays_a_front_door():
    """Pitch, commands, quickstarts, one metric table, limits, links: a newcomer is done in five minutes."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move method, figures and tables to docs/"


def test_the_readme_answers_a_newcomers_first_questions():
    """Fabric works (say so), how long the tests take, and that the skips are the GPU tests (issue 36)."""
    text = (ROOT / "README.md").read_text()
    assert "fabric.setup(" in text and "setup_dataloaders" in text
    assert "5 minutes on 2 cores" in text and "skips are the GPU tests" in text
