"""Write docs/api.md from the docstrings: the one place the API is described is the code.

    python docs/make_api.py            # rewrite docs/api.md
    python docs/make_api.py --check    # exit 1 if docs/api.md is stale (tests/stories/test_docs.py does this)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"
sys.path.insert(0, str(ROOT))

_SECTION = re.compile(r"^(Args|Attributes)( \(.*\))?:$")
_ENTRY = re.compile(r"^    (\S[^:]*?): (.*)$")
#: An entry's names that go on, at the entry's own indent, on the next line (Google style wraps a long list
#: of names there: "    warmup_steps, max_pending, ...," then "    rank_timeout_s, memory: as for ...").
_NAMES_GO_ON = re.compile(r"^    \w+(?:\s*[,/]\s*\w+)*\s*[,/]$")


def _markdown(doc: str) -> str:
    """A docstring as Markdown: ``Args:``/``Attributes:`` sections become lists, the rest paragraphs."""
    out: list[str] = []
    lines = inspect.cleandoc(doc).splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if _SECTION.match(line):
            out += [f"**{line[:-1]}**", ""]
            i += 1
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                if _NAMES_GO_ON.match(lines[i]) and (_ENTRY.match(nxt) or _NAMES_GO_ON.match(nxt)):
                    lines[i + 1] = f"{lines[i].rstrip()} {lines[i + 1].strip()}"  # one entry, its names rejoined
                    i += 1
                    continue
                m = _ENTRY.match(lines[i])
                if m:
                    names = ", ".join(f"`{n.strip()}`" for n in re.split(r"\s*[,/]\s*", m.group(1)))
                    out.append(f"- {names}: {m.group(2)}")
                elif lines[i].strip():
                    out[-1] += " " + lines[i].strip()
                i += 1
            out.append("")
            continue
        if line.startswith("    ") and out and out[-1].startswith("    "):  # an example block goes on
            out.append(line)
        elif line.startswith("    "):
            out += ["", line]
        else:
            out.append(line)
        i += 1
    return _roles("\n".join(out).strip()) + "\n"


def _unquote(annotation: object) -> str:
    """An annotation as written in the source (they are strings under ``from __future__ import annotations``)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _param(p: inspect.Parameter) -> str:
    text = p.name if p.annotation is p.empty else f"{p.name}: {_unquote(p.annotation)}"
    return text if p.default is p.empty else f"{text} = {p.default!r}"


def _roles(text: str) -> str:
    """Sphinx roles and double backticks as Markdown code."""
    text = re.sub(r":(?:class|func|meth|attr):`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _signature(name: str, obj: object) -> str:
    sig = inspect.signature(obj)
    # a door's **unknown only turns a wrong keyword into a clear TypeError: no argument of the API
    params = [_param(p) for p in sig.parameters.values() if p.name != "self" and p.kind is not p.VAR_KEYWORD]
    marker = [i for i, p in enumerate(sig.parameters.values()) if p.kind is p.KEYWORD_ONLY]
    if marker:  # the bare * before the first keyword-only parameter
        first = marker[0] - (1 if "self" in sig.parameters else 0)
        params.insert(first, "*")
    ret = "" if sig.return_annotation is inspect.Signature.empty else f" -> {_unquote(sig.return_annotation)}"
    body = ",\n".join(f"    {p}" for p in params)
    return f"```python\n{name}(\n{body},\n){ret}\n```\n" if params else f"```python\n{name}(){ret}\n```\n"


def _cli(parser: argparse.ArgumentParser, command: str) -> str:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return f"```text\n{sub.choices[command].format_help().rstrip()}\n```\n"


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps its help to the terminal: one width for the file
    import phase_timer
    from phase_timer import Diagnosis, LoopTimer, attach
    from phase_timer._env import NATIVE_ENV
    from phase_timer.config import DISABLE_ENV
    from phase_timer.doors.lightning import PhaseTimer
    from phase_timer.cli import build_parser
    from phase_timer.timing.stats import PhaseTotals, RunTotals

    parts = [
        "# API reference\n",
        "Generated from the docstrings by `python docs/make_api.py`; `tests/stories/test_docs.py` fails when "
        "this file and the code disagree. What each metric means is in the README; how each door "
        "places each boundary in [`design.md`](design.md).\n",
        "## `phase_timer.PhaseTimer`: the Lightning callback\n",
        _signature("PhaseTimer", PhaseTimer.__init__),
        _markdown(PhaseTimer.__doc__ or ""),
        "## `phase_timer.attach`: a hand-written loop\n",
        _signature("attach", attach),
        _markdown(attach.__doc__ or ""),
        "## `phase_timer.LoopTimer`: what `attach` returns\n",
        _markdown(LoopTimer.__doc__ or ""),
    ]
    for name in ("phase", "end_step", "detach", "close"):
        method = getattr(LoopTimer, name)
        parts += [f"### `timer.{name}`\n", _signature(f"timer.{name}", method), _markdown(method.__doc__ or "")]
    from phase_timer.doors.hf_trainer import PhaseTimerCallback

    parts += [
        "## `phase_timer.PhaseTimerCallback`: the 🤗 Trainer callback\n",
        _signature("PhaseTimerCallback", PhaseTimerCallback.__init__),
        _markdown(PhaseTimerCallback.__doc__ or ""),
    ]
    parts += [
        "## Results in code\n",
        "### `RunTotals` (`timer.totals`)\n",
        _markdown(RunTotals.__doc__ or ""),
        "### `PhaseTotals` (`timer.totals.phases[name]`)\n",
        _markdown(PhaseTotals.__doc__ or ""),
        "### `phase_timer.Diagnosis` (`timer.diagnosis`)\n",
        _markdown(Diagnosis.__doc__ or ""),
        "Fields: " + ", ".join(f"`{f.name}`" for f in dataclasses.fields(Diagnosis))
        + "; `as_dict()` gives what `phase_timer_summary.json` holds, `Diagnosis.from_dict()` reads it back.\n",
        "## Environment\n",
        f"- `{DISABLE_ENV}=1`: both doors attach nothing (as `enabled=False`).\n"
        f"- `{NATIVE_ENV}=0`: torch's CUDA events instead of the driver-API clock (the same results, "
        "more host time a step).\n",
        "## Command line\n",
        "`phase-timer` is installed with the package; `python -m phase_timer.cli.report LOGDIR ...` is the "
        "report alone.\n",
        "### `phase-timer report`\n",
        _cli(build_parser(), "report"),
        "### `phase-timer compare`\n",
        _cli(build_parser(), "compare"),
    ]
    assert phase_timer.__all__  # the names above are the package's own
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/api.md is stale")
    args = ap.parse_args()
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is stale: run python docs/make_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
