"""The docs point at things that exist: every test the fault matrix cites, every result file a doc cites."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_test_the_fault_matrix_cites_exists():
    text = (ROOT / "docs" / "faults.md").read_text()
    cited = re.findall(r"`(test_\w+\.py)::(test_\w+)`", text)
    assert len(cited) >= 20
    missing = [f"{f}::{t}" for f, t in cited if t not in _test_names(ROOT / "tests" / f)]
    assert not missing, missing


def test_every_result_file_the_docs_cite_exists():
    cited = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        cited |= set(re.findall(r"results/([\w.]+\.txt)", doc.read_text()))
    assert cited
    missing = sorted(name for name in cited if not (ROOT / "benchmarks" / "results" / name).exists())
    assert not missing, missing
