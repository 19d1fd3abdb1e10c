"""Which code a result came from: the git tree hash of ``phase_timer/``, computed from the files.

A GPU run happens on a copy of the working tree that may have no ``.git``, so the hash is computed
as git computes a tree (``git rev-parse HEAD:phase_timer`` gives the same for a clean checkout):
anyone can compare a results file's line with main's.  Where git is at hand, the line also says
whether the files are HEAD's or differ from it ("dirty").
"""

from __future__ import annotations

import hashlib
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What git does not track under phase_timer/ (.gitignore): build outputs and caches.
_IGNORED_SUFFIXES = (".so", ".pyc", ".pyd")
_IGNORED_DIRS = {"__pycache__"}


def _blob(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


def tree_hash(path: str) -> str:
    """Git's tree hash of ``path`` (files and folders that git would track), as hex."""
    entries = []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isdir(full):
            if name in _IGNORED_DIRS:
                continue
            entries.append((name + "/", b"40000 " + name.encode() + b"\0" + bytes.fromhex(tree_hash(full))))
        elif not name.endswith(_IGNORED_SUFFIXES):
            mode = b"100755" if os.access(full, os.X_OK) else b"100644"
            entries.append((name, mode + b" " + name.encode() + b"\0" + _blob(full)))
    body = b"".join(e for _, e in sorted(entries))  # git sorts a folder's name as if it ended in "/"
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


#: Where the run's copy of the tree has no current ``.git`` (a GPU machine gets the files, not the
#: history): the caller says which commit it sent, ``PHASE_TIMER_COMMIT=$(git rev-parse --short HEAD)``
#: and ``PHASE_TIMER_TREE=$(git rev-parse HEAD:phase_timer)``.
COMMIT_ENV, TREE_ENV = "PHASE_TIMER_COMMIT", "PHASE_TIMER_TREE"


def code_line() -> str:
    """``phase_timer tree <hash> (...)``: the code a run used, and whether it is HEAD's."""
    mine = tree_hash(os.path.join(ROOT, "phase_timer"))
    if os.environ.get(TREE_ENV):
        head, commit, said = os.environ[TREE_ENV], os.environ.get(COMMIT_ENV, "?"), ", as the caller sent it"
    else:
        head, commit, said = _git("rev-parse", "HEAD:phase_timer"), _git("rev-parse", "--short", "HEAD"), ""
    if head is None:
        state = "no git here: compare with `git rev-parse HEAD:phase_timer`"
    elif head == mine or (len(head) >= 7 and mine.startswith(head)):  # the full hash, or an abbreviation
        state = f"= HEAD:phase_timer of commit {commit}{said}"
    else:
        state = f"dirty: HEAD:phase_timer of commit {commit}{said} is {head}"
    return f"phase_timer tree {mine} ({state})"


if __name__ == "__main__":
    print(code_line())
