"""The sync census: torch's sync check on one warm-up step, each sync placed in its phase and its line.

torch's check needs a CUDA build, so here a stand-in for its switch raises the same warning torch
raises (``called a synchronizing CUDA operation``) from a fake device read while the switch is on,
from the caller's frame, as torch does.  The GPU test (``test_gpu.py``) runs the real check.
"""

from __future__ import annotations

import json
import threading
import warnings

import pytest

import phase_timer.measures.syncs as syncs
from phase_timer.run.boundaries import FORWARD, Boundaries
from phase_timer.run.core import TimingCore
from phase_timer.diagnosis import Signals, diagnose
from phase_timer.measures.syncs import MESSAGE, SyncCensus, Syncs
from tests.fakes import FakeClock


class Switch:
    """torch's ``(get_sync_debug_mode, set_sync_debug_mode)``, and a device read that warns while it is on."""

    def __init__(self, mode: int = 0) -> None:
        self.mode = mode
        self.sets: list[int] = []

    def pair(self):
        return (lambda: self.mode), self._set

    def _set(self, mode: int) -> None:
        self.sets.append(mode)
        self.mode = mode

    def item(self, value: float = 1.0) -> float:
        if self.mode:
            warnings.warn(MESSAGE, UserWarning, stacklevel=2)  # as torch: from the caller's frame
        return value


def read_loss(switch: Switch) -> float:
    return switch.item()


def test_each_sync_is_counted_at_its_line_in_the_phase_that_runs():
    switch = Switch()
    phase = ["forward"]
    census = SyncCensus(lambda: phase[0], switch.pair())
    assert census.start() and switch.mode == 1
    read_loss(switch)
    read_loss(switch)
    phase[0] = "between_steps"
    switch.item()
    census.stop()
    assert switch.mode == 0 and census.status == "done" and census.count == 3
    first, second = census.sites
    assert (first.phase, first.count, second.phase, second.count) == ("forward", 2, "between_steps", 1)
    assert first.frames[0].startswith("measures/test_syncs.py:") and first.frames[0].endswith("in read_loss")
    assert first.code == "return switch.item()" and first.cause is None
    assert "in test_each_sync_is_counted" in first.frames[1]  # the caller's frame next
    read_loss(switch)  # after stop(): nothing heard
    assert census.count == 3


def test_other_warnings_still_reach_the_user_and_the_warnings_machinery_comes_back():
    switch = Switch()
    filters, shown = list(warnings.filters), warnings.showwarning
    census = SyncCensus(lambda: "forward", switch.pair())
    heard = []
    census.start()
    assert warnings.showwarning != shown and len(warnings.filters) == len(filters) + 2
    census._shown = lambda message, *a: heard.append(str(message))  # stands for the user's showwarning
    warnings.warn("the user's own warning", UserWarning)
    warnings.filterwarnings("ignore", message="added by the user meanwhile")
    switch.item()
    census._shown = shown
    census.stop()
    assert heard == ["the user's own warning"] and census.count == 1
    # the census's own two filters are gone, the user's one stays; showwarning is theirs again
    assert warnings.filters[1:] == filters and warnings.filters[0][1].pattern == "added by the user meanwhile"
    assert warnings.showwarning == shown
    warnings.filters.pop(0)
    switch.item()  # the check is off again: torch would not warn, nor does the stand-in
    assert census.count == 1


def test_a_level_the_user_set_during_the_census_stays():
    switch = Switch()
    census = SyncCensus(lambda: "forward", switch.pair())
    census.start()
    switch.mode = 2  # the user: set_sync_debug_mode("error"), mid-step
    census.stop()
    assert switch.mode == 2 and census.status == "done"


def test_a_census_left_on_stops_itself(monkeypatch):
    """A loop that raised and never closed its timer: the next sync after MAX_SECONDS puts it all back."""
    switch = Switch()
    shown = warnings.showwarning
    census = SyncCensus(lambda: "forward", switch.pair())
    census.start()
    monkeypatch.setattr(syncs, "MAX_SECONDS", 0.0)
    switch.item()
    assert not census.running and switch.mode == 0 and warnings.showwarning == shown and census.count == 0


def test_syncs_in_a_pause_are_no_steps():
    switch = Switch()
    phase = ["paused"]
    census = SyncCensus(lambda: phase[0], switch.pair())
    census.start()
    for _ in range(100):  # a validation loop's .item() calls
        switch.item()
    phase[0] = "forward"
    switch.item()
    census.stop()
    assert census.count == 1 and census.paused == 100 and [s.phase for s in census.sites] == ["forward"]


def test_a_sync_in_backward_on_autograds_thread_is_the_steps():
    """A custom Function's backward, a gradient hook: Python that autograd runs on its own thread."""
    switch = Switch()
    phase = ["backward"]
    census = SyncCensus(lambda: phase[0], switch.pair())
    census.start()

    def hook() -> None:
        switch.item()

    t = threading.Thread(target=hook)
    t.start()
    t.join()
    census.stop()
    assert census.count == 1 and census.other_threads == 0 and census.sites[0].phase == "backward"
    assert census.sites[0].frames[0].endswith("in hook")


def test_syncs_of_other_threads_outside_backward_are_not_the_loops():
    switch = Switch()
    census = SyncCensus(lambda: "forward", switch.pair())
    census.start()
    t = threading.Thread(target=switch.item)
    t.start()
    t.join()
    census.stop()
    assert census.count == 0 and census.other_threads == 1 and census.sites == []


def test_the_users_own_sync_check_is_left_alone():
    switch = Switch(mode=2)  # the user runs with set_sync_debug_mode("error")
    census = SyncCensus(lambda: "forward", switch.pair())
    assert not census.start()
    census.stop()
    assert switch.sets == [] and switch.mode == 2 and "already on" in census.status


def test_a_census_that_cannot_start_never_breaks_training():
    def broken():
        raise RuntimeError("no CUDA here")

    census = SyncCensus(lambda: "forward", (broken, broken))
    assert not census.start() and "no CUDA here" in census.status
    census.stop()
    assert census.status.startswith("not run") and not census.running


def test_a_known_site_is_named_with_the_setting_that_causes_it(tmp_path):
    """The 🤗 Trainer's nan/inf check, from a file laid out as an installed transformers."""
    path = tmp_path / "site-packages" / "transformers" / "trainer.py"
    path.parent.mkdir(parents=True)
    path.write_text("def _run_epoch(switch, tr_loss_step):\n"
                    "    if switch.item() and (isnan(tr_loss_step) or switch.item()):\n"
                    "        pass\n")
    namespace: dict = {"isnan": lambda x: False}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    switch = Switch()
    census = SyncCensus(lambda: "optimizer", switch.pair())
    census.start()
    namespace["_run_epoch"](switch, 1.0)
    census.stop()
    (site,) = census.sites
    assert site.count == 2 and site.frames[0] == "transformers/trainer.py:2 in _run_epoch"
    assert site.cause is not None and "logging_nan_inf_filter=False" in site.cause


# -- the census inside a run: the last warm-up step, through the real boundaries ------------------
class DeviceClock(FakeClock):
    kind = "cuda"  # a device's clock, as far as the census and the summary file can tell


def _run(monkeypatch, *, warmup: int, steps: int, read_in: str = "between_steps", micro: int = 1,
         census: bool = True):
    switch = Switch()
    monkeypatch.setattr(syncs, "_torch_mode", switch.pair)
    core = TimingCore(DeviceClock(), [], window=10, warmup_steps=warmup, max_pending=64,
                      measures=[syncs.Syncs()] if census else [])  # as a door's assembly registers it
    bounds = Boundaries(core)
    modes = []
    for _ in range(steps):
        for m in range(micro):
            bounds.fetch()
            if read_in == "fetch":
                read_loss(switch)  # e.g. Lightning's per-batch broadcast, read with .item()
            bounds.batch(first=FORWARD)
            if m < micro - 1:
                bounds.backward_start()
                bounds.backward_end()
        modes.append(switch.mode)
        if read_in == "forward":
            read_loss(switch)  # e.g. a metric read on the host inside the step
        bounds.backward_start()
        bounds.backward_end()
        bounds.optimizer_start()
        bounds.step_end()
        if read_in == "between_steps":
            read_loss(switch)  # nanoGPT's `loss.item()` after the step
    bounds.finish()
    core.finish()
    return core, switch, modes


def test_the_census_runs_on_the_last_warm_up_step_only(monkeypatch):
    core, switch, modes = _run(monkeypatch, warmup=5, steps=12)
    assert modes == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0] and switch.sets == [1, 0]
    census = core.measure("syncs")
    assert census.status == "done" and census.warmup_step == 5 and census.count == 1
    (site,) = census.sites
    assert site.phase == "between_steps" and site.frames[0].endswith("in read_loss")
    assert core.totals.steps == 7  # the census step is a warm-up step: nothing timed is touched


def test_the_census_places_a_sync_inside_the_step_in_its_phase(monkeypatch):
    core, _, _ = _run(monkeypatch, warmup=3, steps=6, read_in="forward")
    assert [(s.phase, s.count) for s in core.measure("syncs").sites] == [("forward", 1)]


def test_every_micro_batchs_fetch_is_data_wait(monkeypatch):
    core, _, _ = _run(monkeypatch, warmup=3, steps=6, read_in="fetch", micro=2)
    assert [(s.phase, s.count) for s in core.measure("syncs").sites] == [("data_wait", 2)]


@pytest.mark.parametrize(("warmup", "steps", "why"), [(1, 10, "warmup_steps=1 < 2"), (5, 3, "ended before"),
                                                      (5, 4, "ended before")])
def test_when_the_census_cannot_run_the_summary_says_why(monkeypatch, warmup, steps, why):
    core, switch, _ = _run(monkeypatch, warmup=warmup, steps=steps)
    assert switch.sets == [] and why in core.measure("syncs").status


def test_a_run_that_ends_during_the_census_turns_the_check_off(monkeypatch):
    core, switch, _ = _run(monkeypatch, warmup=5, steps=5)  # the 5th step is the census's, and the last
    assert switch.sets == [1, 0] and switch.mode == 0 and core.measure("syncs").status == "done"


def test_the_summary_file_and_table_carry_the_census(monkeypatch, tmp_path):
    import jsonschema

    from phase_timer.outputs.run_summary import SCHEMA_VERSION, schema, write_summary

    core, _, _ = _run(monkeypatch, warmup=2, steps=25)
    path = write_summary(core, tmp_path)
    with open(path) as f:
        data = json.load(f)
    jsonschema.validate(data, schema())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["syncs"]["census"] == "done" and data["syncs"]["step"] == 2 and data["syncs"]["count"] == 1
    assert data["syncs"]["sites"][0]["phase"] == "between_steps"
    assert data["syncs"]["other_threads"] == data["syncs"]["paused"] == 0
    assert "host-device syncs (torch's check, on warm-up step 2): 1 a step: 1x between_steps at measures/test_syncs.py:" in \
        core.summary_table()
    lines = core.summary_table().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("host-device syncs"))
    assert lines[at - 1].startswith("phase-timer's own host time")  # under the run's own lines, not the measures'


def test_a_core_no_census_listens_to_runs_none(monkeypatch, tmp_path):
    """The census runs for the measure that listens: a core made without one never turns torch's check on, and its
    summary file says the census did not run (the schema's ``syncs`` is a block, never null)."""
    import jsonschema

    from phase_timer.outputs.run_summary import schema, write_summary

    core, switch, _ = _run(monkeypatch, warmup=2, steps=4, census=False)
    assert switch.sets == [] and core.measure("syncs") is None and core.totals.steps == 2
    with open(write_summary(core, tmp_path)) as f:
        data = json.load(f)
    jsonschema.validate(data, schema())
    assert data["syncs"]["census"] == "not run" and data["syncs"]["sites"] == []


# -- what the verdict says with it ----------------------------------------------------------------
def _signals(*sites: tuple[str, str, str | None], census: str = "done") -> tuple[Signals, syncs.Syncs]:
    s = Signals()
    s.flight.update({0: 10})
    s.tail_checked, s.tail_busy = 10, 0
    c = syncs.Syncs()
    c.status, c.warmup_step = census, 4
    c.sites = [syncs.SyncSite(phase, (where,), "x.item()", 2, cause) for phase, where, cause in sites]
    c.count = 2 * len(sites)
    return s, c


def _totals():
    from tests.diagnosis.test_diagnosis import GPU_STEP, totals

    return totals(**GPU_STEP)


def test_a_host_bound_verdict_names_the_syncs_and_what_turns_them_off():
    s, c = _signals(("optimizer", "transformers/trainer.py:1847 in _run_epoch", "logging_nan_inf_filter=False turns it off"),
                 ("forward", "train.py:40 in step", None))
    s.host_step_ms = [31.0] * 10
    d = diagnose(_totals(), s, clock="cuda", syncs=c)
    assert d.kind == "HOST_BOUND"
    assert "waits for the device 4 time(s) inside each step (census of warm-up step 4" in d.why
    assert d.next[0] == "logging_nan_inf_filter=False turns it off"
    assert d.next[1].startswith("left when those are off: 2x in forward: `x.item()` at train.py:40 in step")
    assert d.evidence["sync_census"] == "done" and len(d.evidence["syncs"]) == 2


def test_a_gpu_bound_verdict_says_the_host_is_held_between_steps():
    s, c = _signals(("between_steps", "train.py:88 in main", None))
    s.host_step_ms = [10.0] * 10  # the device's step (32.5 ms) far longer: GPU-bound
    d = diagnose(_totals(), s, clock="cuda", syncs=c)
    assert d.kind == "GPU_BOUND"
    assert "never got a step ahead" in d.why and "2 time(s) outside it" in d.why and "train.py:88" in d.why
    assert "set_sync_debug_mode" not in " ".join(d.next)


def test_with_no_sync_flagged_the_verdict_says_so():
    s, c = _signals()
    s.host_step_ms = [31.0] * 10
    d = diagnose(_totals(), s, clock="cuda", syncs=c)
    assert d.kind == "HOST_BOUND" and "torch flags no host-device sync in a whole step" in d.why
    assert not any("set_sync_debug_mode" in tip for tip in d.next)


def test_without_a_census_the_advice_is_to_look_for_syncs():
    s, c = _signals(census="not run: no device (host clock)")
    s.host_step_ms = [31.0] * 10
    d = diagnose(_totals(), s, clock="cuda", syncs=c)
    assert d.kind == "HOST_BOUND" and "set_sync_debug_mode" in d.next[0]


def test_the_report_prints_the_census_as_the_run_did(monkeypatch, tmp_path):
    """`phase-timer report` reads the summary file's census back: the same line the run printed."""
    import json

    from phase_timer.cli.report_text import summary_lines
    from phase_timer.outputs.run_summary import write_summary

    core, _, _ = _run(monkeypatch, warmup=2, steps=25, read_in="forward")
    with open(write_summary(core, tmp_path)) as f:
        data = json.load(f)
    line = next(line for line in core.summary_table().splitlines() if line.startswith("host-device syncs"))
    assert line in summary_lines(data) and "1x forward at measures/test_syncs.py:" in line
    del data["syncs"]  # a version 2 file: no census, no line
    assert not any(x.startswith("host-device syncs") for x in summary_lines(data))


def test_a_run_without_the_census_measure_writes_what_a_census_not_run_says():
    from phase_timer.outputs.run_summary import NO_CENSUS

    assert Syncs().summary() == NO_CENSUS
