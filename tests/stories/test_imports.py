"""No module of phase_timer imports one that imports it back, nor one in a layer above its own.

Every ``import``/``from ... import`` of a phase_timer module counts, at module level, inside
functions and under ``TYPE_CHECKING`` alike: a cycle that only a lazy import hides is still
two modules that cannot be read, tested or moved apart.  The modules of the subpackages
(``phase_timer/cli/``, ``phase_timer/diagnosis/``) count as the top level's do.  A package
facade (an ``__init__.py``) is not a target: it re-exports, and nothing in the package
needs it.  The layers are the package's folders in ``docs/design.md``'s map: ``timing/`` imports no
measure, output or door, and so on up to ``cli/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "phase_timer"


def _imports(source: str, modules: set[str], package: str = "phase_timer") -> set[str]:
    """The phase_timer modules that ``source`` (a module of ``package``) imports anywhere in it."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # `from . import x` / `from .x import y`: relative to the module's package (`..`: above it)
                base = package.rsplit(".", node.level - 1)[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            # `from phase_timer import x`, `from phase_timer.cli import x`: the module x, when x is one; the module
            # itself where a name is its own (a facade's, where facades are modules: what it re-exports)
            named = {f"{module}.{a.name}" for a in node.names} & modules
            out |= named
            if module in modules and len(named) < len(node.names):
                out.add(module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & modules
    return out


def import_graph(package: Path = PACKAGE, facades: bool = False) -> dict[str, set[str]]:
    """Every module of the package and of its subpackages (``phase_timer.cli.read``), and what each imports;
    ``facades``: each subpackage's ``__init__.py`` too, as the module of the package's name (``phase_timer.diagnosis``),
    where a name is imported from it (what it re-exports is then followed)."""
    files: dict[str, tuple[Path, str]] = {}  # module: (its file, the package its relative imports start from)
    for p in package.rglob("*.py"):
        parts = p.relative_to(package.parent).with_suffix("").parts
        if p.stem != "__init__":
            files[".".join(parts)] = (p, ".".join(parts[:-1]))
        elif facades and len(parts) > 2:  # a subpackage's face (the package's own, phase_timer/__init__.py, is the roof)
            files[".".join(parts[:-1])] = (p, ".".join(parts[:-1]))
    modules = set(files)
    return {name: _imports(path.read_text(), modules, base) - {name} for name, (path, base) in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the modules around it (the first again at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_form_of_import_counts():
    source = """
from typing import TYPE_CHECKING
import phase_timer.a as a_alias
from phase_timer.b import thing
from phase_timer import c, not_a_module
from . import d
from .e import other
if TYPE_CHECKING:
    from phase_timer.f import F
def later():
    from phase_timer import g
class K:
    def method(self):
        import phase_timer.h
import phase_timer
import torch
"""
    modules = {f"phase_timer.{m}" for m in "abcdefghz"}
    assert _imports(source, modules) == modules - {"phase_timer.z"}


def test_the_graph_sees_function_level_imports_of_the_package():
    graph = import_graph()
    assert "phase_timer.cli.report" in graph["phase_timer.cli.commands"]
    assert "phase_timer.cli.compare" in graph["phase_timer.cli.commands"]
    assert "phase_timer.runinfo" in graph["phase_timer.run.sampled"]  # imported inside a function


def test_no_module_imports_one_that_imports_it_back():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


#: The package's layers, bottom first (``docs/design.md``'s map): a module imports only from its own layer and
#: the layers below.  The top-level modules other than ``__init__`` and ``report`` are the ground.
LAYERS = ("", "timing", "distributed", "diagnosis", "outputs", "run", "measures", "doors", "cli")
#: What stands on everything: the package's face and ``python -m phase_timer.report``.
ROOF = {"phase_timer", "phase_timer.report"}


def layer(module: str) -> int:
    """The layer of ``phase_timer.<folder>.<...>`` (a top-level module: the ground, 0)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 else 0


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer to a higher one, as "importer -> imported"."""
    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() if src not in ROOF
                  for dst in dsts if layer(dst) > layer(src))


def test_the_layer_check_sees_a_planted_import_up():
    graph = {"phase_timer.timing.engine": {"phase_timer.measures.memory", "phase_timer.phases"},
             "phase_timer.doors.loop": {"phase_timer.run.core"}}
    assert upward_imports(graph) == ["phase_timer.timing.engine -> phase_timer.measures.memory"]


def test_every_folder_of_the_package_is_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS[1:])


def test_no_module_imports_from_a_layer_above_its_own():
    ups = upward_imports(import_graph())
    assert not ups, "imports up the layers (docs/design.md's map):\n" + "\n".join(ups)


def test_the_run_finds_its_measures_by_key_and_reaches_none():
    # The boundaries and the core take the memory tracker, the counters, the census and the modules measure from
    # the core's measures by their summary blocks' keys (``core.measure("memory")``): no module of run/ imports one
    # of measures/, nor anything it imports (the verdict, the files, the ranks' exchange) does: through a
    # subpackage's face too (``from phase_timer.diagnosis import diagnose``).
    graph = import_graph(facades=True)
    assert "phase_timer.diagnosis.verdict" in graph["phase_timer.diagnosis"]  # a face's re-exports are followed
    seen: set[str] = set()
    todo = [m for m in graph if m.startswith("phase_timer.run.")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    assert "phase_timer.diagnosis.time_rules" in seen  # reached through run/'s import of the diagnosis's face
    assert sorted(m for m in seen if m.startswith("phase_timer.measures.")) == []
