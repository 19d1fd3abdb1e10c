"""``patches.Patches``: what phase-timer puts on objects it does not own goes back only where it is still ours."""

from __future__ import annotations

import types

from phase_timer.patches import Patches


class Base:
    def step(self) -> str:
        return "class"


def test_an_instance_attribute_goes_back_to_the_class_s_own() -> None:
    obj, patches = Base(), Patches()
    patches.replace(obj, "step", lambda: "ours")
    assert obj.step() == "ours" and patches
    patches.put_back()
    assert "step" not in vars(obj) and obj.step() == "class" and not patches


def test_a_user_s_own_instance_attribute_is_put_back() -> None:
    obj, patches = Base(), Patches()
    obj.step = users = lambda: "user's"
    patches.replace(obj, "step", lambda: "ours")
    patches.put_back()
    assert obj.step is users


def test_what_wrapped_ours_since_stays_and_ours_stays_under_it() -> None:
    obj, patches = Base(), Patches()
    ours = lambda: "ours"  # noqa: E731
    patches.replace(obj, "step", ours)
    obj.step = theirs = lambda: ours() + " under theirs"
    patches.put_back()
    assert obj.step is theirs and obj.step() == "ours under theirs"


def test_a_class_s_and_a_module_s_attributes_newest_first() -> None:
    class Owner:
        def f(self) -> int:
            return 1

    module = types.ModuleType("m")
    module.g = original_g = lambda: 2
    original_f = Owner.__dict__["f"]
    patches = Patches()
    patches.replace(Owner, "f", lambda self: 10)
    patches.replace(module, "g", lambda: 20)
    patches.replace(Owner, "f", lambda self: 100)  # twice: the first replacement is what the second put back
    assert Owner().f() == 100 and module.g() == 20
    patches.put_back()
    assert Owner.__dict__["f"] is original_f and module.g is original_g
