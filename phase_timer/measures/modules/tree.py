"""Which module's tree: the rows a sample hooks (a module, or repeated blocks summed), their groups, and the
``modules=`` argument's check; the rows' names as every sink takes them."""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

#: A sample hooks one *group* of the tree's rows, the groups in turn: the rows, in the tree's order, packed into groups
#: of at most GROUP_MODULES module objects (a row is never split, since its modules are summed on one step; a row of
#: more is a group alone).  A sample costs about its group's share of hooking them all, and the table is full after
#: one sample of each group (a 12-layer GPT-2's default tree: 5 groups).
GROUP_MODULES = 16
#: A Linear head with at least this many outputs is a vocabulary head (the advice differs).
VOCAB_OUTPUTS = 8192
#: How deep the default tree looks for repeated blocks under a top-level child.
DEFAULT_SEARCH = 4


def tag_key(key: str) -> str:
    """A row's name as every sink takes it (MLflow allows no brackets): ``h[0-11]`` -> ``h.0-11``, ``[*]`` -> ``.all``."""
    return re.sub(r"\[(\d+)-(\d+)\]", r".\1-\2", key).replace("[*]", ".all")


def check_modules(owner: str, name: str, value: Any) -> None:
    """``modules``: True (the default tree), False (off), an int depth >= 1, or a list of module names."""
    from phase_timer.config import _fail

    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if value < 1:
            _fail(owner, name, value, "True, False, a depth (an int >= 1) or a list of module names")
        return
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return
    _fail(owner, name, value, "True, False, a depth (an int >= 1) or a list of module names (non-empty strings)")


# -- the tree ---------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One row of the tree: a module, or repeated blocks (``h[0-11]``) or their like children summed."""

    key: str
    parent: str | None
    kind: str  # what the advice is for: attention, vocab_head, embedding, conv, norm, mlp, block, other
    modules: int = 0  # module objects summed in this row


@dataclass
class Tree:
    """What a sampled step hooks: each module object (weakly: the run never keeps a model alive, nor through it the
    door that hooks it) and the row it adds to, and the rows in display order."""

    entries: dict[str, Entry] = field(default_factory=dict)
    targets: list[tuple[weakref.ref[nn.Module], str]] = field(default_factory=list)
    #: Modules left out because they are compiled (their names), and whether the whole model is.
    compiled: list[str] = field(default_factory=list)
    whole_compiled: bool = False

    def add(self, module: nn.Module, key: str, parent: str | None, name: str) -> None:
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = Entry(key, parent, module_kind(module, name))
        entry.modules += 1
        self.targets.append((weakref.ref(module), key))

    def modules(self, keys: Iterable[str] | None = None) -> list[tuple[nn.Module, str]]:
        """The hooked modules still alive, with their rows (those of ``keys``' rows only, when given)."""
        if keys is not None and not isinstance(keys, (set, frozenset)):
            keys = set(keys)
        return [(m, key) for ref, key in self.targets if (keys is None or key in keys) and (m := ref()) is not None]

    def groups(self, budget: int | None = None) -> list[frozenset[str]]:
        """The rows, in the tree's order, packed into groups of at most ``budget`` module objects
        (:data:`GROUP_MODULES`); a row is never split, and a row of more modules is a group alone."""
        budget = GROUP_MODULES if budget is None else budget
        out: list[list[str]] = []
        n = 0
        for key, entry in self.entries.items():
            if out and n + entry.modules <= budget:
                out[-1].append(key)
                n += entry.modules
            else:
                out.append([key])
                n = entry.modules
        return [frozenset(g) for g in out]


def module_kind(module: nn.Module, name: str) -> str:
    """What kind of module this is, for the advice: from its class and its name."""
    cls = type(module).__name__.lower()
    low = name.lower().rsplit(".", 1)[-1]
    if isinstance(module, nn.Embedding) or isinstance(module, nn.EmbeddingBag):
        return "embedding"
    if isinstance(module, nn.Linear) and module.out_features >= VOCAB_OUTPUTS:
        return "vocab_head"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if "attn" in cls or "attention" in cls or "attn" in low or "attention" in low:
        return "attention"
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)) or "norm" in cls:
        return "norm"
    if "mlp" in cls or "mlp" in low or "feedforward" in cls or low in ("ffn", "ff", "feed_forward"):
        return "mlp"
    if "embed" in cls or low in ("wte", "wpe"):
        return "embedding"
    return "other"


def compiled_module(module: nn.Module) -> bool:
    """The module runs compiled: ``torch.compile(module)`` (an ``OptimizedModule``) or ``module.compile()``."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def _repeated(module: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """A container's children when they are two or more blocks of one class (a ModuleList of layers), else None."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        return None
    kids = list(module.named_children())
    if len(kids) < 2 or len({type(m) for _, m in kids}) != 1 or not any(True for _ in kids[0][1].children()):
        return None
    return kids


def _span(names: Sequence[str]) -> str:
    """``[0-11]`` for indices in a row, else ``[*]``."""
    if all(n.isdigit() for n in names):
        idx = [int(n) for n in names]
        if idx == list(range(idx[0], idx[0] + len(idx))):
            return f"[{idx[0]}-{idx[-1]}]"
    return "[*]"


def _holds_blocks(module: nn.Module, depth: int) -> bool:
    if depth <= 0:
        return False
    return any(_repeated(c) is not None or _holds_blocks(c, depth - 1) for c in module.children())


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's model under DDP's or DataParallel's wrapper."""
    for _ in range(4):
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
            model = inner
        else:
            break
    return model


def build_tree(models: Sequence[nn.Module], spec: Any, owner: str = "attach") -> Tree:
    """The rows a sampled step measures, for ``modules=spec`` (True, an int depth, or names).

    Default (True): each model's top-level children; a child that holds repeated blocks is opened (``transformer``
    -> ``transformer.wte``, ``transformer.h[0-11]``...), and repeated blocks are one row with each of their children
    summed over the blocks (``transformer.h[0-11].attn``).  Several models: each one's rows under ``<i>.``."""
    tree = Tree()
    roots = [_unwrap(m) for m in models]
    for i, root in enumerate(roots):
        prefix = f"{i}." if len(roots) > 1 else ""
        if compiled_module(root):
            tree.whole_compiled = True
            tree.compiled.append(prefix.rstrip(".") or type(root).__name__)
            continue
        if isinstance(spec, (list, tuple)):
            _named(tree, root, list(spec), prefix, owner)
        elif spec is True:
            _default(tree, root, prefix.rstrip("."), None, DEFAULT_SEARCH)
        else:
            _depth(tree, root, prefix.rstrip("."), None, int(spec))
    return tree


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _children(tree: Tree, module: nn.Module, prefix: str) -> Iterable[tuple[str, nn.Module]]:
    """A module's children with their paths; a compiled one is left out, named in ``tree.compiled``."""
    for name, child in module.named_children():
        path = _join(prefix, name)
        if compiled_module(child):
            tree.compiled.append(path)
        else:
            yield path, child


def _default(tree: Tree, module: nn.Module, prefix: str, parent: str | None, search: int) -> None:
    for path, child in _children(tree, module, prefix):
        blocks = _repeated(child)
        if blocks is not None:
            _blocks(tree, path, blocks, parent, sub=1)
        elif _holds_blocks(child, search):
            tree.add(child, path, parent, path)
            _default(tree, child, path, path, search - 1)
        else:
            tree.add(child, path, parent, path)


def _blocks(tree: Tree, path: str, blocks: list[tuple[str, nn.Module]], parent: str | None, sub: int) -> None:
    """Repeated blocks as one row, and ``sub`` levels of their children summed across them."""
    key = path + _span([n for n, _ in blocks])
    for _, block in blocks:
        if compiled_module(block):
            tree.compiled.append(key)
            return
    for _, block in blocks:
        tree.add(block, key, parent, key)
    if sub > 0:
        for _, block in blocks:
            for cname, child in block.named_children():
                if compiled_module(child):
                    if _join(key, cname) not in tree.compiled:
                        tree.compiled.append(_join(key, cname))
                    continue
                tree.add(child, _join(key, cname), key, _join(key, cname))


def _depth(tree: Tree, module: nn.Module, prefix: str, parent: str | None, depth: int) -> None:
    if depth <= 0:
        return
    for path, child in _children(tree, module, prefix):
        blocks = _repeated(child)
        if blocks is not None:
            key = path + _span([n for n, _ in blocks])
            _blocks(tree, path, blocks, parent, sub=0)
            for _, block in blocks if depth > 1 else ():  # each block's children under the blocks' row, summed
                _depth(tree, block, key, key, depth - 1)
        else:
            tree.add(child, path, parent, path)
            _depth(tree, child, path, path, depth - 1)


def _named(tree: Tree, root: nn.Module, names: list[str], prefix: str, owner: str) -> None:
    from phase_timer.config import _fail

    known = dict(root.named_modules())
    for name in names:
        module = known.get(name)
        if module is None or name == "":
            import difflib

            close = difflib.get_close_matches(name, [n for n in known if n], n=3)
            hint = f"; close: {', '.join(close)}" if close else f"; e.g. {', '.join(list(known)[1:4])}"
            _fail(owner, "modules", names, f"names of the model's modules (model.named_modules()){hint}",
                  f": {name!r} is not one")
        if compiled_module(module):
            tree.compiled.append(prefix + name)
            continue
        parent = next((p for p in sorted(names, key=len, reverse=True) if p != name and name.startswith(p + ".")), None)
        tree.add(module, prefix + name, prefix + parent if parent else None, name)
