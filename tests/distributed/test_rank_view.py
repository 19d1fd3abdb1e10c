"""Every rank in ``report`` and ``compare`` (issue 48): two real 2-rank runs (gloo), read back from their files."""

from __future__ import annotations

import json

import pytest

from phase_timer.distributed.rank_view import RankRow, rank_verdicts

pytestmark = pytest.mark.timeout(300)


def test_a_rank_that_moved_where_rank_zero_did_not_is_named() -> None:
    rows = [RankRow("forward", 1.04, 1, 11.36, 1, 1.03, 1.02), RankRow("backward", 2.0, 0, 12.0, 0, 2.0, 12.0),
            RankRow("optimizer", 0.5, 0, 0.52, 1, 0.5, 0.51)]
    (said,) = rank_verdicts(rows)  # backward: a wait phase; optimizer: within the material change
    assert said.startswith("forward: rank 1 slower") and "1.040 ms (rank 1) -> 11.360 ms" in said
    assert "rank 0's own moved -1.0%" in said
    assert rank_verdicts([RankRow("forward", 1.0, 0, 2.0, 0, 1.0, 2.0)]) == []  # rank 0 shows it itself


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[str, str]:
    from tests.distributed.test_distributed import torchrun

    base = tmp_path_factory.mktemp("base")
    cand = tmp_path_factory.mktemp("cand")
    _, b = torchrun("--log-dir", str(base), "--steps", "23")
    _, c = torchrun("--log-dir", str(cand), "--steps", "23", "--slow-forward", "0.01", "--planted-hours")
    return b["log_dir"], c["log_dir"]


def test_compare_names_the_rank_that_regressed(two_runs, capsys) -> None:
    from phase_timer.cli import main

    base, cand = two_runs
    assert main(["compare", base, cand]) == 0
    out = capsys.readouterr().out
    assert "every rank: each phase's slowest rank" in out
    line = next(l for l in out.splitlines() if l.startswith("forward: rank 1 slower"))
    assert "a regression rank 0's figures do not show" in line
    assert main(["compare", base, cand, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ranks"]["forward"]["candidate_rank"] == 1
    assert doc["ranks"]["forward"]["candidate_ms"] > 100 * doc["ranks"]["forward"]["baseline_ms"]


def test_report_prints_every_ranks_means(two_runs, capsys) -> None:
    from phase_timer.cli import main

    _, cand = two_runs
    assert main(["report", cand]) == 0
    out = capsys.readouterr().out
    assert "per rank (2 of 2)" in out
    slowest = next(l for l in out.splitlines() if l.startswith("slowest"))
    head = next(l for l in out.splitlines() if l.startswith("rank ") and "forward" in l)
    assert slowest.split()[head.split().index("forward")] == "1"
