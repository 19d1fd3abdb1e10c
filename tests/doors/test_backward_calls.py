"""The torch.autograd.backward wrapper: one for all timers, put back, robust to listeners and to other wrappers."""

from __future__ import annotations

import warnings

import torch

from phase_timer.doors import backward_calls


class Recording:
    def __init__(self, fail_at: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail_at = fail_at

    def _backward_began(self) -> bool:
        self.calls.append("began")
        if self.fail_at == "began":
            raise RuntimeWarning("a warning turned into an error")
        return True

    def _backward_ended(self, failed: bool) -> None:
        self.calls.append(f"ended failed={failed}")
        if self.fail_at == "ended":
            raise ValueError("broken listener")


def backward_once() -> None:
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()


def test_a_listener_that_raises_never_breaks_backward_nor_leaves_state(recwarn):
    bad, good = Recording(fail_at="began"), Recording()
    backward_calls.listen(bad)
    backward_calls.listen(good)
    try:
        backward_once()
        backward_once()
    finally:
        backward_calls.unlisten(bad)
        backward_calls.unlisten(good)
    assert good.calls == ["began", "ended failed=False"] * 2  # the second call was seen: no depth left behind
    later = Recording(fail_at="ended")
    backward_calls.listen(later)
    try:
        backward_once()
        backward_once()
    finally:
        backward_calls.unlisten(later)
    assert later.calls == ["began", "ended failed=False"] * 2


def test_another_tools_wrapper_is_kept_and_ours_goes_on_working_under_it():
    original = torch.autograd.backward
    seen: list[int] = []
    a = Recording()
    backward_calls.listen(a)
    ours = torch.autograd.backward
    torch.autograd.backward = lambda *args, **kw: (seen.append(1), ours(*args, **kw))[1]  # another tool wraps ours
    theirs = torch.autograd.backward
    try:
        backward_calls.unlisten(a)
        assert torch.autograd.backward is theirs  # not taken away from under them
        b = Recording()
        backward_calls.listen(b)  # ours is still in the chain: no second wrapper, no recursion
        backward_once()
        backward_calls.unlisten(b)
        assert b.calls == ["began", "ended failed=False"] and seen == [1]
    finally:
        torch.autograd.backward = ours
        backward_calls.unlisten(a)
    backward_calls.listen(a)
    backward_calls.unlisten(a)
    assert torch.autograd.backward is original


def test_a_failing_backward_is_reported_as_failed():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("inside backward")

    rec = Recording()
    backward_calls.listen(rec)
    try:
        x = torch.ones(2, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                Boom.apply(x).sum().backward()
            except RuntimeError:
                pass
    finally:
        backward_calls.unlisten(rec)
    assert rec.calls == ["began", "ended failed=True"]
