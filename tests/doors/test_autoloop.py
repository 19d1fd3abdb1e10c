"""The hand-written loop's models, as ``phase-timer run`` finds them (:mod:`phase_timer.doors.autoloop`): the
outermost modules in the loop's reach that hold the optimizers' parameters."""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from phase_timer.doors.autoloop import LoopWatch, find_models


class Holder:
    def __init__(self, model: nn.Module) -> None:
        self.model = model


def test_the_outermost_module_holding_the_parameters_is_the_model():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    compiled = torch.compile(net)  # wraps net (its _orig_mod): the same parameters, the one the loop calls
    ema = copy.deepcopy(net)  # not the optimizer's
    teacher = nn.Linear(4, 4).requires_grad_(False)
    first = net[0]  # inside net
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert find_models([opt], sys._getframe()) == [compiled]
    del compiled
    assert find_models([opt], sys._getframe()) == [net]
    assert ema is not None and teacher is not None and first is not None


def test_one_attribute_level_into_an_object_is_in_reach_two_dict_levels_are_not():
    me = Holder(nn.Linear(3, 3))
    opt = torch.optim.SGD(me.model.parameters(), lr=0.1)
    assert find_models([opt], sys._getframe()) == [me.model]
    deep = {"a": {"b": nn.Linear(3, 3)}}
    opt2 = torch.optim.SGD(deep["a"]["b"].parameters(), lr=0.1)
    assert find_models([opt2], sys._getframe()) == []


def test_two_models_and_two_optimizers():
    gen, disc = nn.Linear(2, 3), nn.Linear(3, 1)
    opts = [torch.optim.SGD(disc.parameters(), lr=0.1), torch.optim.SGD(gen.parameters(), lr=0.1)]
    assert find_models(opts, sys._getframe()) == [gen, disc]  # in the order found


def test_the_watch_attaches_after_the_second_iteration_s_last_optimizer_and_takes_its_hooks_off():
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    got: list = []
    said: list = []
    before = (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
    watch = LoopWatch(lambda models, opts: got.append((models, opts)), said.append, lambda: False)
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    for i in range(4):
        (a(torch.ones(1, 2)).sum() + b(torch.ones(1, 2)).sum()).backward()
        opt_a.step()
        assert len(got) == (0 if i < 2 else 1)  # never in the middle of an iteration
        opt_b.step()
        if i == 0:
            assert not got  # the first iteration is counted by the second
        if i == 1:
            assert got == [([a, b], [opt_a, opt_b])] and not said
    assert len(got) == 1 and watch.done
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == before


def test_the_watch_attaches_nothing_where_a_timer_is_open():
    got: list = []
    said: list = []
    LoopWatch(lambda models, opts: got.append(models), said.append, lambda: True)
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        net(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert not got and said == ["a timer was open already (the script's own attach(), or a Trainer's callback)"]


def test_another_global_post_hook_after_the_watch_s_keeps_the_step_whole():
    """torch goes through the global post-hooks while the watch's own takes its hooks off: an entry taken out
    before the last fails that iteration, so there the watch's post-hook stays, a no-op."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    got: list = []
    watch = LoopWatch(lambda models, opts: got.append(models), lambda why: None, lambda: False)
    later: list = []
    other = register_optimizer_step_post_hook(lambda opt, args, kwargs: later.append(1))
    try:
        net = nn.Linear(2, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(4):
            net(torch.ones(1, 2)).sum().backward()
            opt.step()  # no "mutated during iteration"
        assert got == [[net]] and watch.done and len(later) == 4
    finally:
        other.remove()
        watch._handles[1].remove()
