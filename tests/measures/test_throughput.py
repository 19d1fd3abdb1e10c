"""Throughput from shapes and ``period``: the counting (CPU, unit), and a real loop end to end."""

from __future__ import annotations

import pytest
import torch

from phase_timer.measures.throughput import BatchCounter, RunThroughput, check_count, format_line, rates, shape_counts, split_counts


@pytest.mark.parametrize(
    "batch, expected",
    [
        ((torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))), (8, None)),  # images: no tokens
        ((torch.randint(0, 100, (4, 128)), torch.randint(0, 100, (4, 128))), (4, 512)),  # (ids, labels)
        ({"input_ids": torch.randint(0, 100, (2, 64)), "attention_mask": torch.ones(2, 64)}, (2, 128)),
        ({"pixel_values": torch.randn(16, 3, 8, 8)}, (16, None)),
        (torch.randn(5, 7), (5, None)),
        ([[torch.randint(0, 9, (3, 10))], "meta"], (3, 30)),
        ("not a batch", (None, None)),
        (torch.tensor(3.0), (None, None)),
        (torch.ones(4, 4, dtype=torch.bool), (4, None)),  # a mask is no token
    ],
)
def test_a_batch_is_counted_from_its_shapes(batch, expected):
    assert shape_counts(batch) == expected


def test_a_users_count_or_function_wins_over_the_shapes():
    batch = {"input_ids": torch.randint(0, 100, (2, 64)), "attention_mask": torch.ones(2, 64)}
    no_padding = BatchCounter(tokens=lambda b: 100)  # e.g. the mask's sum, computed on the host by the user
    assert no_padding.count(batch) == (2, 100)
    assert BatchCounter(samples=7, tokens=0).count(batch) == (7, 0)
    got: list = []
    BatchCounter(tokens=0).add(lambda name, v: got.append((name, v)), batch)
    assert got == [("samples", 2.0)]  # zero tokens: not a token batch


@pytest.mark.parametrize("bad", [-1, 2.5, "64", True])
def test_a_bad_count_fails_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"attach\(tokens_per_batch=.*`tokens_per_batch` must be"):
        check_count("attach", "tokens_per_batch", bad)


def test_counts_leave_the_windows_columns_and_rates_are_totals_over_totals():
    columns = {"forward": [1.0, 2.0], "period": [10.0, 30.0], "samples": [8.0, 8.0], "tokens": [1024.0, 1024.0]}
    counts = split_counts(columns)
    assert "samples" not in columns and "tokens" not in columns and "forward" in columns
    assert counts == {"samples": 16.0, "tokens": 2048.0, "period_ms": 40.0, "steps": 2.0}
    r = rates(counts)
    assert r == pytest.approx({"samples_per_s": 400.0, "tokens_per_s": 51200.0, "steps_per_s": 50.0})
    run = RunThroughput()
    run.add(counts)
    run.add({"samples": 8.0, "period_ms": 20.0, "steps": 1.0})  # a window without tokens
    assert run.rates()["samples_per_s"] == pytest.approx(24 / 0.06)
    assert format_line(r) == "throughput: 51.2k tokens/s, 400.0 samples/s, 50.0 steps/s"


def test_a_count_missing_on_some_steps_gives_no_rate_rather_than_a_wrong_one():
    columns = {"period": [10.0, 10.0, 10.0], "samples": [8.0, 8.0]}
    assert split_counts(columns) == {}


# -- end to end: real loops in each door ----------------------------------------------------
def _lm_loop(tmp_path, *, accumulate: int = 1, **kw):
    import phase_timer
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Flatten(), nn.Linear(16 * 12, 64))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    loader = [(torch.randint(0, 64, (6, 12)), torch.randint(0, 64, (6,))) for _ in range(40 * accumulate)]
    with phase_timer.attach(model, opt, loader, log_dir=tmp_path, warmup_steps=2, window=10, summary=False,
                            **kw) as timer:
        for i, (x, y) in enumerate(timer.loader):
            nn.functional.cross_entropy(model(x), y).backward()
            if (i + 1) % accumulate == 0:
                opt.step()
                opt.zero_grad()
    return timer


def _summary(timer):
    import json

    with open(timer.summary_path) as f:
        return json.load(f)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_plain_loops_rates_are_its_batches_over_its_period(tmp_path, accumulate):
    from tests.helpers import read_scalars

    timer = _lm_loop(tmp_path, accumulate=accumulate)
    data = _summary(timer)
    period_s = data["phases"]["period"]["mean_ms"] / 1e3
    thr = data["throughput"]
    samples = 6 * accumulate  # a step's micro-batches summed
    assert thr["samples"] == samples * 38 and thr["tokens"] == samples * 12 * 38 and thr["steps"] == 38
    assert thr["samples_per_s"] == pytest.approx(samples / period_s, rel=1e-9)
    assert thr["tokens_per_s"] == pytest.approx(samples * 12 / period_s, rel=1e-9)
    assert thr["steps_per_s"] == pytest.approx(1 / period_s, rel=1e-9)
    scalars = read_scalars(timer.log_dir)
    assert [s for s, _ in scalars["throughput/tokens_per_s"]] == [9, 19, 29, 39]
    assert not any("samples_ms" in tag or "tokens_ms" in tag for tag in scalars)  # counts, never phases
    assert "samples" not in timer.totals.phases and "throughput: " in timer.last_summary


def test_a_users_count_replaces_the_shapes(tmp_path):
    timer = _lm_loop(tmp_path, tokens_per_batch=lambda batch: 50, samples_per_batch=2)
    thr = _summary(timer)["throughput"]
    assert thr["samples"] == 2 * 38 and thr["tokens"] == 50 * 38


class _NanoLM(torch.nn.Module):
    """nanoGPT's calling convention: ``model(idx, targets)`` returns (logits, loss); or ``model(input_ids=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def forward(self, idx=None, targets=None, input_ids=None):  # noqa: ANN001, ANN201
        idx = idx if idx is not None else input_ids
        logits = self.head(self.emb(idx))
        target = targets if targets is not None else idx
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _own_batches_loop(tmp_path, *, micro: int, keywords: bool = False, steps: int = 30, **kw):
    """A loop that makes its own batches (nanoGPT's ``get_batch()``), no ``timer.loader``: ``micro`` micro-batches
    of 4 x 12 tokens a step."""
    import phase_timer

    torch.manual_seed(0)
    model = _NanoLM()
    opt = torch.optim.SGD(model.parameters(), 0.01)

    def get_batch():  # noqa: ANN202
        x = torch.randint(0, 64, (4, 12))
        return x, torch.roll(x, -1, 1)

    with phase_timer.attach(model, opt, log_dir=tmp_path, warmup_steps=2, window=7, summary=False, **kw) as timer:
        for _ in range(steps):
            for _ in range(micro):
                x, y = get_batch()
                _, loss = model(input_ids=x) if keywords else model(x, y)
                (loss / micro).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():  # an evaluation in eval mode between steps: no batch of the step's
                model.eval()
                model(x, y)
                model.train()
    return timer


@pytest.mark.parametrize("micro, keywords", [(1, False), (3, False), (2, True)])
def test_a_loop_that_makes_its_own_batches_counts_what_it_hands_the_model(tmp_path, micro, keywords):
    """Issue 48: no ``timer.loader`` (nanoGPT's loop): the training forwards' inputs are the step's batches, its
    micro-batches summed; an evaluation's forward is not counted."""
    timer = _own_batches_loop(tmp_path, micro=micro, keywords=keywords)
    thr = _summary(timer)["throughput"]
    period_s = _summary(timer)["phases"]["period"]["mean_ms"] / 1e3
    steps = thr["steps"]
    assert steps == 28
    assert thr["samples"] == 4 * micro * steps and thr["tokens"] == 4 * 12 * micro * steps
    assert thr["tokens_per_s"] == pytest.approx(4 * 12 * micro / period_s, rel=1e-9)
    assert "tokens/s" in timer.last_summary and "not counted" not in timer.last_summary


def test_a_batch_evaluated_twice_in_a_step_is_counted_once(tmp_path):
    """SAM's second pass and LBFGS's re-evaluations hand the model the same batch again: one batch, not two."""
    import phase_timer

    torch.manual_seed(0)
    model = _NanoLM()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with phase_timer.attach(model, opt, log_dir=tmp_path, warmup_steps=2, window=7, summary=False) as timer:
        for _ in range(30):
            x = torch.randint(0, 64, (4, 12))
            model(x, x)[1].backward()  # SAM: the first pass, then the same batch again at the perturbed weights
            model(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
    thr = _summary(timer)["throughput"]
    assert thr["samples"] == 4 * thr["steps"] and thr["tokens"] == 4 * 12 * thr["steps"]


def test_a_loop_that_makes_its_own_batches_takes_the_users_counts(tmp_path):
    timer = _own_batches_loop(tmp_path, micro=2, tokens_per_batch=512, samples_per_batch=8)
    thr = _summary(timer)["throughput"]
    assert thr["tokens"] == 512 * 2 * thr["steps"] and thr["samples"] == 8 * 2 * thr["steps"]


def test_a_model_whose_inputs_hold_no_batch_says_how_to_count_it(tmp_path):
    import phase_timer

    class Scalar(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, scale: float) -> torch.Tensor:
            return (self.w * scale).sum()

    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with phase_timer.attach(model, opt, log_dir=tmp_path, warmup_steps=1, window=4, summary=False) as timer:
        for _ in range(10):
            model(0.5).backward()
            opt.step()
            opt.zero_grad()
    assert _summary(timer)["throughput"] is None
    assert timer.last_summary.count("throughput: not counted") == 1
    assert "samples_per_batch=" in timer.last_summary


def test_a_phase_may_not_take_a_counts_name(tmp_path):
    import phase_timer
    from torch import nn

    model = nn.Linear(2, 2)
    timer = phase_timer.attach(model, torch.optim.SGD(model.parameters(), 0.1), [torch.randn(1, 2)], log_dir=tmp_path,
                               summary=False)
    with pytest.raises(ValueError, match="name"):
        timer.phase("tokens")
    timer.close()


def test_lightning_and_the_hf_trainer_count_their_batches(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    pytest.importorskip("transformers")
    import json

    import phase_timer
    from tests.helpers import loader, module_class
    from tests.doors.test_hf_trainer import trainer as hf_trainer

    timer = phase_timer.PhaseTimer(warmup_steps=2, summary=False, log_dir=tmp_path / "pl")
    pl.Trainer(max_steps=22, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, accumulate_grad_batches=2,
               callbacks=[timer]).fit(module_class("lightning.pytorch")(), loader(batch_size=8))
    with open(timer.summary_path) as f:
        thr = json.load(f)["throughput"]
    assert thr["samples"] == 16 * 20 and thr["tokens"] is None  # float features: no tokens

    cb = phase_timer.PhaseTimerCallback(warmup_steps=2, summary=False)
    hf_trainer(tmp_path / "hf", cb, steps=22, gradient_accumulation_steps=2).train()
    with open(cb.summary_path) as f:
        data = json.load(f)
    thr = data["throughput"]
    assert thr["samples"] == 8 * 20 and thr["tokens"] == 8 * 16 * 20  # the Trainer's input_ids, 16 a sample
    assert thr["tokens_per_s"] == pytest.approx(128 / (data["phases"]["period"]["mean_ms"] / 1e3), rel=1e-9)


def test_a_count_that_raises_warns_once_and_training_goes_on(tmp_path):
    def broken(batch):
        raise KeyError("no such field")

    with pytest.warns(RuntimeWarning, match="could not be counted for throughput") as said:
        timer = _lm_loop(tmp_path, tokens_per_batch=broken)
    assert len([w for w in said if "counted for throughput" in str(w.message)]) == 1
    assert timer.totals.steps == 38 and _summary(timer)["throughput"] is None  # no rate rather than a wrong one
