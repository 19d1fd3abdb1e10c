"""Throughput and MFU read back: ``phase-timer report`` (text, JSON, the figure's panel) and ``compare`` (its table,
its gate), on real runs of a plain-PyTorch token loop (CPU) and on their files with a planted ``flops`` object.

The loop's waits are planted hours of the host clock (``HostHours``, as in ``test_compare.py``): what the
rates and the gate see is the plan, never what a busy machine adds.  The ``flops`` objects are written by hand
in the format of summary version 6 (the doors fill it on a GPU), and checked against the schema.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import phase_timer
from phase_timer.cli import main
from phase_timer.cli.compare_rows import Z, rate_relative_error
from phase_timer.cli.compare_side import load_side
from phase_timer.outputs.run_summary import FILE_NAME, schema
from phase_timer.measures.throughput import RunThroughput, format_line, split_counts
from tests.helpers import HostHours, read_scalars
from tests.cli.test_compare import OPTIMIZER_H, WaitingSGD
from tests.cli.test_report import PNG_MAGIC, png_height, write_tensorboard_run

pytestmark = pytest.mark.timeout(300)

STEPS = 60
WINDOW = 6
BATCH, SEQ, VOCAB = 4, 16, 64
FORWARD_H = 8.0
JITTER_H = 40.0

COUNTED = {"source": "counted",
           "per_step": {"forward": 1.3e12, "backward": 2.6e12, "hardware": 3.9e12, "model": 3.9e12},
           "tflops_per_s": 405.6,
           "peak": {"tflops": 989.4, "precision": "bf16", "device": "H100 SXM",
                    "source": "NVIDIA H100 Tensor Core GPU Architecture whitepaper, dense column (SXM5)"},
           "mfu": {"step": 0.41, "forward": 0.52, "backward": 0.47}, "note": None}
HEADLINE = "MFU 41% of 989 TFLOP/s (bf16 dense, H100 SXM): forward 52%, backward 47%"


class TokenModel(nn.Module):
    """An LM-shaped toy: token ids in, a wait planted in forward (seeded jitter on top for noisy runs)."""

    def __init__(self, clock: HostHours, jitter_h: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Flatten(), nn.LazyLinear(1))
        self.clock, self.jitter_h = clock, jitter_h
        self.rng = random.Random(1234)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.clock.jump(FORWARD_H + self.rng.random() * self.jitter_h)
        return self.net(ids).mean(dim=1)


def batches(varlen: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    lengths = [SEQ + (i % 3) * 4 if varlen else SEQ for i in range(STEPS + 4)]
    return [(torch.randint(0, VOCAB, (BATCH, n), generator=gen), torch.randn(BATCH, generator=gen)) for n in lengths]


def train(log_dir: Path, clock: HostHours, *, extra_optimizer_h: float = 0.0, jitter_h: float = 0.0,
          varlen: bool = False) -> Path:
    """One real run of the plain door on ``clock``; returns its run directory (TensorBoard files, summary file)."""
    model = TokenModel(clock, jitter_h)
    model(batches(False)[0][0])  # LazyLinear's shape, before the optimizer sees the parameters
    opt = WaitingSGD(model.parameters(), lr=0.01, clock=clock, wait_h=OPTIMIZER_H + extra_optimizer_h)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with phase_timer.attach(model, opt, batches(varlen), log_dir=log_dir, window=WINDOW, warmup_steps=2,
                                summary=False) as timer:
            for ids, y in timer.loader:
                nn.functional.mse_loss(model(ids) if not varlen else model(ids[:, :SEQ]), y).backward()
                opt.step()
                opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return Path(timer.log_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("throughput")
    plan = {
        "base": {},
        "same": {},
        "slow": {"extra_optimizer_h": 10.0},
        "noisy": {"jitter_h": JITTER_H},
        "noisy_small": {"jitter_h": JITTER_H, "extra_optimizer_h": 3.0},
        "noisy_large": {"jitter_h": JITTER_H, "extra_optimizer_h": 15.0},
        "varlen": {"varlen": True},
    }
    clock = HostHours()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(time, "perf_counter_ns", clock)
        return {name: train(root / name, clock, **kw) for name, kw in plan.items()}


def summary(run: Path) -> dict:
    return json.loads((run / FILE_NAME).read_text())


def edited(run: Path, dest: Path, edit, *, alone: bool = False, validate: bool = True) -> Path:
    """A copy of a real run (``alone``: its summary file only) whose summary file ``edit`` changed."""
    if alone:
        dest.mkdir()
        shutil.copy(run / FILE_NAME, dest / FILE_NAME)
    else:
        shutil.copytree(run, dest)
    data = summary(dest)
    edit(data)
    if validate:
        import jsonschema

        jsonschema.validate(data, schema())
    (dest / FILE_NAME).write_text(json.dumps(data))
    return dest


def with_flops(run: Path, dest: Path, flops: dict | None, **kw) -> Path:
    return edited(run, dest, lambda d: d.update(flops=flops), **kw)


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main([*map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *args: str | Path) -> dict:
    code, out, err = cli(capsys, *args, "--json")
    assert code in (0, 1), err
    return json.loads(out)


def line_of(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


def verdict_of(out: str, rate: str) -> str:
    """compare's verdict on a rate (its table's row starts alike, without a %)."""
    return next(line for line in out.splitlines() if line.startswith(rate + " ") and "%" in line)


# -- what the run writes for the readers ------------------------------------------------------------
def test_a_run_records_its_count_a_step_when_every_step_has_the_same(runs):
    run = RunThroughput()
    split_counts({"period": [1.0, 2.0], "samples": [4.0, 4.0], "tokens": [64.0, 64.0]}, run)
    split_counts({"period": [1.0, 2.0], "samples": [4.0, 4.0], "tokens": [64.0, 80.0]}, run)  # tokens vary here
    run.add({"samples": 16.0, "tokens": 272.0, "period_ms": 6.0, "steps": 4.0})
    assert run.as_dict()["per_step"] == {"samples": 4.0, "tokens": None}
    assert summary(runs["base"])["throughput"]["per_step"] == {"samples": BATCH, "tokens": BATCH * SEQ}
    assert summary(runs["varlen"])["throughput"]["per_step"] == {"samples": BATCH, "tokens": None}
    data = summary(runs["base"])
    assert data["schema_version"] == 10 and data["flops"] is None and data["communication"] is None


# -- report: text and JSON ----------------------------------------------------------------------------
def test_report_prints_the_runs_throughput_line_and_json_carries_the_block(runs, capsys):
    data = summary(runs["base"])
    thr = data["throughput"]
    code, out, err = cli(capsys, "report", runs["base"])
    assert code == 0, err
    rates = {k: thr[k] for k in ("tokens_per_s", "samples_per_s", "steps_per_s")}
    assert line_of(out, "throughput: ") == format_line(rates)  # the line the run printed
    assert "tokens/s" in line_of(out, "throughput: ") and "MFU" not in out  # no FLOPs on a CPU run: no MFU line
    run = cli_json(capsys, "report", runs["base"])["runs"][0]
    assert run["throughput"] == thr and run["flops"] is None


@pytest.mark.parametrize("flops, lines", [
    (COUNTED, ["FLOPs: 3.9 TFLOP a step (forward 1.3 TFLOP, backward 2.6 TFLOP; counted by FlopCounterMode): "
               "405.6 TFLOP/s", HEADLINE]),
    ({**COUNTED, "per_step": {"forward": 1e12, "backward": 2.5e12, "hardware": 3.5e12, "model": 3e12}},
     [HEADLINE + "; backward's count has 20% recompute (activation checkpointing, attention's backward): in its "
      "ratio, not in the headline"]),
    ({"source": "given", "per_step": {"forward": None, "backward": None, "hardware": 2e12, "model": 2e12},
      "tflops_per_s": 100.0, "peak": {"tflops": 312.0, "precision": None, "device": None, "source": "peak_tflops="},
      "mfu": {"step": 0.32, "forward": None, "backward": None}, "note": None},
     ["FLOPs: 2 TFLOP a step (given: flops_per_step=): 100.0 TFLOP/s",
      "MFU 32% of 312 TFLOP/s (peak_tflops=); FLOPs given (flops_per_step=)"]),
    ({**COUNTED, "peak": None, "mfu": None, "note": 'MFU: no peak known for "Radeon RX 7900" (bf16): pass peak_tflops='},
     ['MFU: no peak known for "Radeon RX 7900" (bf16): pass peak_tflops=']),
    ({"source": None, "per_step": None, "tflops_per_s": None, "peak": COUNTED["peak"], "mfu": None,
      "note": "no FLOPs counted (nothing FlopCounterMode has a formula for ran): pass flops_per_step="},
     ["MFU: no FLOPs counted (nothing FlopCounterMode has a formula for ran): pass flops_per_step="]),
])
def test_report_prints_mfu_with_its_denominator_or_why_there_is_none(runs, capsys, tmp_path, flops, lines):
    run = with_flops(runs["base"], tmp_path / "flops", flops, alone=True)
    code, out, err = cli(capsys, "report", run)
    assert code == 0, err
    for line in lines:
        assert line in out.splitlines(), out
    assert out.index("throughput: ") < out.index(lines[-1]) < out.index("verdict:")
    assert cli_json(capsys, "report", run)["runs"][0]["flops"] == flops


def test_side_by_side_shows_each_runs_rate_and_mfu(runs, capsys, tmp_path):
    run = with_flops(runs["slow"], tmp_path / "slow_flops", COUNTED, alone=True)
    code, out, err = cli(capsys, "report", runs["base"], run)
    assert code == 0, err
    side = out[out.index("side by side (2 runs)"):]
    shown = [float(v) for v in line_of(side, "tokens/s").split()[1:]]  # planted hours: a tiny rate, 3 digits
    assert shown == [pytest.approx(summary(r)["throughput"]["tokens_per_s"], rel=5e-3) for r in (runs["base"], runs["slow"])]
    assert shown[1] < shown[0]
    assert line_of(side, "MFU").split()[1:] == ["41%"]  # the run without FLOPs: blank


def test_a_tensorboard_only_run_gets_its_rates_and_mfu_from_the_windows(tmp_path, capsys):
    """Window rates are counts over that window's period: the run's is their period-weighted mean (sum over sum)."""
    from torch.utils.tensorboard import SummaryWriter

    run = write_tensorboard_run(tmp_path / "tb", peak_mb=None, steps=20, window=5)  # period 16 ms a step
    periods = {5: 10.0, 10: 30.0, 15: 10.0, 20: 30.0}  # what the planted rates are over, ms
    tokens = {5: 400.0, 10: 1200.0, 15: 800.0, 20: 1200.0}  # tokens a step, each window
    with SummaryWriter(str(run)) as w:
        for s in periods:
            for tag, v in (("tokens_per_s", tokens[s] / periods[s] * 1e3), ("samples_per_s", 4 / periods[s] * 1e3),
                           ("steps_per_s", 1e3 / periods[s]), ("mfu", 0.2 if periods[s] == 10.0 else 0.4),
                           ("mfu_forward", 0.5), ("tflops_per_s", 100.0)):
                w.add_scalar(f"throughput/{tag}", v, s)
    code, out, err = cli(capsys, "report", run, "--png", tmp_path / "tb.png")
    assert code == 0, err
    # The run's TensorBoard period is 16 ms a step in every window of 5: each window weighs the same.
    thr = cli_json(capsys, "report", run)["runs"][0]["throughput"]
    assert thr["tokens_per_s"] == pytest.approx(sum(tokens[s] / periods[s] * 1e3 for s in periods) / 4)
    assert thr["source"] == "tensorboard" and thr["windows"] == 4
    assert "(from TensorBoard's throughput/* scalars, 4 windows; no phase_timer_summary.json)" in out
    assert "MFU 30%, forward 50% (from TensorBoard's throughput/mfu* scalars" in out


def test_tensorboard_rates_weigh_each_window_by_its_period(tmp_path):
    """Unequal windows: the run's rate is total count over total period, not the windows' plain mean."""
    from phase_timer.cli.read import PhaseScalars, tensorboard_throughput

    scalars = PhaseScalars(window={"period": {"mean": [(5, 10.0), (10, 30.0)]}}, window_steps=[(5, 5.0), (10, 5.0)],
                           throughput={"samples_per_s": [(5, 400.0), (10, 400.0 / 3)]})
    # 5 steps of 4 samples in 50 ms, then 5 of 4 in 150 ms: 40 samples in 0.2 s
    assert tensorboard_throughput(scalars)["samples_per_s"] == pytest.approx(200.0)


# -- report: the figure ---------------------------------------------------------------------------
def test_png_gets_a_throughput_panel_and_an_mfu_panel_beside_it(runs, capsys, tmp_path, monkeypatch):
    from phase_timer.cli import report_plot
    from phase_timer.cli.report_runs import load_runs

    drawn: dict[str, list] = {"rates": [], "mfu": []}
    for name, key in (("draw_rates", "rates"), ("draw_mfu", "mfu")):
        real = getattr(report_plot, name)

        def spy(ax, *args, _real=real, _key=key):
            _real(ax, *args)
            drawn[_key].append(ax.get_title())

        monkeypatch.setattr(report_plot, name, spy)
    plain, alone = runs["base"], with_flops(runs["base"], tmp_path / "alone", COUNTED, alone=True)
    without = edited(runs["base"], tmp_path / "none", lambda d: d.update(throughput=None), alone=True)
    heights = {}
    for name, run in (("tensorboard", plain), ("summary", alone), ("none", without)):
        png = tmp_path / f"{name}.png"
        code, _, err = cli(capsys, "report", run, "--png", png)
        assert code == 0, err
        assert png.read_bytes()[:8] == PNG_MAGIC
        heights[name] = png_height(png)
    assert heights["tensorboard"] == heights["summary"] == heights["none"] + 330  # a 3-inch row at 110 dpi
    assert len(drawn["rates"]) == 2 and "tokens/s" in drawn["rates"][0]
    assert "TensorBoard's throughput/*" in drawn["rates"][0] and "summary file's window batches" in drawn["rates"][1]
    assert drawn["mfu"] == ["MFU over the run\n% of 989.4 TFLOP/s bf16 dense, H100 SXM"]  # the run with FLOPs only
    # The summary file's batch rates (its count a step over each batch's mean period) are TensorBoard's window rates.
    (tb,), (from_file,) = load_runs([str(plain)]), load_runs([str(alone)])
    assert [s for s, _ in from_file.rate_timeline["tokens_per_s"]] == [s for s, _ in tb.rate_timeline["tokens_per_s"]]
    for (_, a), (_, b) in zip(from_file.rate_timeline["tokens_per_s"], tb.rate_timeline["tokens_per_s"]):
        assert a == pytest.approx(b, rel=1e-5)  # TensorBoard keeps float32
    data = summary(alone)
    step = from_file.rate_timeline["step"]  # MFU per batch: the run's, scaled by its mean period over the batch's
    assert step[0][1] == pytest.approx(0.41 * data["phases"]["period"]["mean_ms"]
                                       / data["windows"]["phases"]["period"]["mean_ms"][0])


# -- compare: the table and the gate ----------------------------------------------------------------------
def test_two_runs_of_the_same_loop_pass_the_throughput_gate(runs, capsys):
    code, out, err = cli(capsys, "compare", runs["base"], runs["same"], "--fail-below-throughput", "5")
    assert code == 0, out + err
    assert "pass: tokens/s not lower by more than 5% beyond noise" in out
    table = out[out.index("throughput "):]
    assert [line.split()[0] for line in table.splitlines()[2:5]] == ["tokens/s", "samples/s", "steps/s"]


def test_a_run_whose_tokens_per_s_dropped_beyond_noise_fails_the_gate(runs, capsys):
    code, out, err = cli(capsys, "compare", runs["base"], runs["slow"], "--fail-below-throughput", "5")
    assert code == 1, out + err
    assert "FAIL: tokens/s lower by more than 5% and beyond noise" in out
    verdict = verdict_of(out, "tokens/s")
    assert "lower (beyond noise ±" in verdict
    doc = cli_json(capsys, "compare", runs["base"], runs["slow"], "--fail-below-throughput", "5")
    row = doc["throughput"]["tokens/s"]
    # 18 planted hours a step, then 28 (the real work of a step is milliseconds in hours)
    assert row["delta_pct"] == pytest.approx(100 * (18 / 28 - 1), abs=0.01)
    assert row["beyond_noise"] is True
    assert doc["gate"]["throughput"] == "tokens_per_s" and doc["gate"]["throughput_failed"] is True
    assert doc["gate"]["failed"] == []  # the phase gate was not asked for
    # A threshold above the drop passes: the gate wants both.
    assert cli(capsys, "compare", runs["base"], runs["slow"], "--fail-below-throughput", "40")[0] == 0


def test_a_drop_inside_the_noise_band_passes_and_a_larger_one_fails(runs, capsys):
    doc = cli_json(capsys, "compare", runs["noisy"], runs["noisy_small"], "--fail-below-throughput", "0")
    row = doc["throughput"]["tokens/s"]
    assert row["delta_pct"] < 0 and row["beyond_noise"] is False and row["noise_pct"] > -row["delta_pct"], row
    assert doc["gate"]["throughput_failed"] is False
    doc = cli_json(capsys, "compare", runs["noisy"], runs["noisy_large"], "--fail-below-throughput", "0")
    assert doc["throughput"]["tokens/s"]["beyond_noise"] is True and doc["gate"]["throughput_failed"] is True
    quiet = cli_json(capsys, "compare", runs["base"], runs["same"])
    assert quiet["throughput"]["tokens/s"]["noise_pct"] < doc["throughput"]["tokens/s"]["noise_pct"]


def test_a_constant_counts_band_is_its_periods(runs, capsys):
    """Every step with the same count: a rate's relative error is the mean period's, to first order, so tokens/s,
    samples/s and steps/s share one band, close to period's."""
    doc = cli_json(capsys, "compare", runs["noisy"], runs["noisy_large"])
    bands = {k: doc["throughput"][k]["noise_pct"] for k in ("tokens/s", "samples/s", "steps/s")}
    assert bands["tokens/s"] == pytest.approx(bands["samples/s"]) == pytest.approx(bands["steps/s"])
    base, cand = load_side(str(runs["noisy"])), load_side(str(runs["noisy_large"]))
    rel = [rate_relative_error(s.rate_batches["tokens_per_s"]) for s in (base, cand)]
    b, c = (s.throughput["tokens_per_s"] for s in (base, cand))
    assert bands["tokens/s"] == pytest.approx(100 * Z * ((b * rel[0]) ** 2 + (c * rel[1]) ** 2) ** 0.5 / b)
    # the period's own band, in % of a longer baseline period, is near the rate's in % of its rate
    period = doc["phases"]["period"]
    assert bands["tokens/s"] == pytest.approx(period["noise_pct"] * period["baseline_ms"] / period["candidate_ms"],
                                              rel=0.25)


def test_a_varying_count_gets_its_band_from_tensorboard_or_is_gated_on_the_threshold(runs, capsys, tmp_path):
    side = load_side(str(runs["varlen"]))
    assert "tokens_per_s" in side.rate_batches  # from the TensorBoard windows beside the file
    assert rate_relative_error(side.rate_batches["tokens_per_s"]) is not None
    alone = edited(runs["varlen"], tmp_path / "varlen_alone", lambda d: None, alone=True)
    assert "tokens_per_s" not in load_side(str(alone)).rate_batches
    code, out, err = cli(capsys, "compare", runs["varlen"], alone, "--fail-below-throughput", "5")
    assert code == 0, out + err
    assert "noise unknown" in verdict_of(out, "tokens/s")
    assert "pass: tokens/s not lower by more than 5% beyond noise (noise unknown, gated on the threshold alone)" in out


def test_a_tensorboard_only_side_compares_its_window_rates(runs, capsys, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(runs["slow"], old)
    (old / FILE_NAME).unlink()
    code, out, err = cli(capsys, "compare", runs["base"], old, "--fail-below-throughput", "5")
    assert code == 1, out + err
    doc = cli_json(capsys, "compare", runs["slow"], old)
    row = doc["throughput"]["tokens/s"]
    assert row["candidate"] == pytest.approx(row["baseline"], rel=1e-5) and row["noise_pct"] is not None
    scalars = read_scalars(str(runs["slow"]))
    assert len(scalars["throughput/tokens_per_s"]) == len(load_side(str(old)).rate_batches["tokens_per_s"])


def test_compare_prints_mfu_and_warns_when_the_runs_do_different_work(runs, capsys, tmp_path):
    base = with_flops(runs["base"], tmp_path / "b", COUNTED)
    other = {**COUNTED, "per_step": {**COUNTED["per_step"], "model": 7.8e12}, "mfu": {**COUNTED["mfu"], "step": 0.5}}
    cand = with_flops(runs["same"], tmp_path / "c", other)
    code, out, err = cli(capsys, "compare", base, cand)
    assert code == 0, err
    mfu = line_of(out, "MFU ").split()
    assert mfu[1:4] == ["41.0%", "50.0%", "+22.0"]
    assert line_of(out, "MFU forward").split()[2:4] == ["52.0%", "52.0%"]
    assert "warning: different FLOPs a step: baseline 3.9e+12, candidate 7.8e+12" in err
    doc = cli_json(capsys, "compare", base, cand)
    assert doc["throughput"]["MFU"]["baseline"] == 0.41 and doc["throughput"]["TFLOP/s"]["candidate"] == 405.6


def test_the_throughput_gate_needs_throughput_on_both_sides(runs, capsys, tmp_path):
    without = edited(runs["same"], tmp_path / "none", lambda d: d.update(throughput=None))
    code, out, err = cli(capsys, "compare", runs["base"], without)
    assert code == 0 and "throughput " not in out
    assert "no throughput (no batch was counted); throughput is compared only when both sides have it" in err
    code, out, err = cli(capsys, "compare", runs["base"], without, "--fail-below-throughput", "5")
    assert code == 2 and out == "" and "no throughput for --fail-below-throughput" in err
    code, _, err = cli(capsys, "compare", runs["base"], runs["same"], "--fail-below-throughput", "-1")
    assert code == 2 and "--fail-below-throughput must be a percentage >= 0" in err


def test_samples_per_s_is_gated_where_one_side_counts_no_tokens(runs, capsys, tmp_path):
    def no_tokens(d):
        thr = d["throughput"]
        thr.update(tokens=None, per_step={**thr["per_step"], "tokens": None})
        del thr["tokens_per_s"]

    cand = edited(runs["slow"], tmp_path / "no_tokens", no_tokens, alone=True)
    code, out, err = cli(capsys, "compare", runs["base"], cand, "--fail-below-throughput", "5")
    assert code == 1 and "FAIL: samples/s lower by more than 5% and beyond noise" in out
    assert "only the baseline counts tokens: samples/s is the throughput compared" in err


# -- older files ---------------------------------------------------------------------------------------
def _downgrade(data: dict, version: int) -> None:
    """A real version-6 file as an older phase-timer wrote it: each version's additions taken out."""
    data["schema_version"] = version
    data.pop("flops")
    data["throughput"].pop("per_step")  # version 5 had the rates, not the count a step
    if version <= 4:
        data.pop("throughput")
    if version <= 3:
        data.pop("memory")
    if version <= 2:
        data.pop("syncs")
    if version <= 1:
        data.pop("windows")


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_older_summary_files_still_read(runs, capsys, tmp_path, version):
    old = edited(runs["slow"], tmp_path / f"v{version}", lambda d: _downgrade(d, version), alone=True,
                 validate=False)
    code, out, err = cli(capsys, "report", old, "--png", tmp_path / "old.png")
    assert code == 0, err
    assert ("throughput: " in out) == (version == 5) and "MFU" not in out
    run = cli_json(capsys, "report", old)["runs"][0]
    assert run["flops"] is None and (run["throughput"] is not None) == (version == 5)
    code, out, err = cli(capsys, "compare", runs["base"], old, "--fail-above", "5")
    assert code == 1, out + err  # the phases still compare (and the candidate is slower)
    if version == 5:  # rates without the count a step and no TensorBoard files: shown, band unknown
        code, out, err = cli(capsys, "compare", runs["base"], old, "--fail-below-throughput", "5")
        assert code == 1 and "noise unknown" in verdict_of(out, "tokens/s")
