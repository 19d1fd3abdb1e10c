#!/usr/bin/env bash
# The GPU-bound overhead of an older phase_timer beside this one, alternating processes on one machine:
# did a change move it, or did the lease?  OLD_DIR holds the older tree's phase_timer/, setup.py and
# benchmarks/ (e.g. `git archive COMMIT phase_timer setup.py benchmarks | tar -x -C OLD_DIR`).
#
#     benchmarks/ab_overhead.sh OLD_DIR [ROUNDS] > table.txt
#
# Each round runs `suite.py --only overhead --no-competitors --doors plain` from the old tree, then from
# this one (each its own process, each importing its own tree's phase_timer); one line per run.
set -uo pipefail
old=$(cd "$1" && pwd); rounds=${2:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
for tree in "$old" "$here"; do (cd "$tree" && python setup.py build_ext --inplace -q > "$work/build.log" 2>&1); done
for r in $(seq "$rounds"); do
  for side in old new; do
    tree=$([ "$side" = old ] && echo "$old" || echo "$here")
    (cd "$tree" && PYTHONPATH=. timeout 300 python benchmarks/suite.py --only overhead --no-competitors \
      --doors plain --out "$work/$side$r" > "$work/$side$r.log" 2>&1)
    line=$(grep -h "^overhead " "$work/$side$r.log" | tail -1)
    echo "round $r $side  ${line:-failed: $(tail -1 "$work/$side$r.log")}"
  done
done
