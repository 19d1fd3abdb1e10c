#!/usr/bin/env bash
# The host time inside phase-timer's hooks, an older phase_timer beside this one, alternating processes on
# one machine (issue 28's before/after).  OLD_DIR holds the older tree's phase_timer/, setup.py and its own
# benchmarks/, which import its own layout (`git archive COMMIT phase_timer setup.py pyproject.toml benchmarks |
# tar -x -C OLD_DIR`).
#
#     benchmarks/ab_inside.sh OLD_DIR [ROUNDS] [STEPS] > table.txt
#
# Each round runs `launch_bound.py --rounds 0 --parts --calibrate` (the plain door) and `lightning_launch_bound.py
# --rounds 0 --parts --calibrate` (Lightning) from the old tree, then from this one: each its own process, importing its own
# tree's phase_timer.  Every run's full breakdown is printed; a table of the rounds' totals comes last.
set -uo pipefail
old=$(cd "$1" && pwd); rounds=${2:-3}; steps=${3:-3000}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
for tree in "$old" "$here"; do (cd "$tree" && python setup.py build_ext --inplace -q > "$work/build.log" 2>&1); done
for r in $(seq "$rounds"); do
  for side in old new; do
    tree=$([ "$side" = old ] && echo "$old" || echo "$here")
    (cd "$tree" && PYTHONPATH=. timeout 300 python benchmarks/launch_bound.py --rounds 0 --variants attach \
      --inside-steps "$steps" --parts --calibrate --out "$work/plain-$side$r.txt" > "$work/plain-$side$r.log" 2>&1)
    (cd "$tree" && PYTHONPATH=. timeout 300 python benchmarks/lightning_launch_bound.py --rounds 0 \
      --inside-steps "$steps" --parts --calibrate --out "$work/light-$side$r.txt" > "$work/light-$side$r.log" 2>&1)
    for door in plain light; do
      echo "== round $r $side $door"
      grep -A 40 "^host time inside" "$work/$door-$side$r.txt" || tail -3 "$work/$door-$side$r.log"
    done
  done
done
for what in "^host time inside" "^the hooks less the timing wrapper"; do
  echo "== in-hook host time per step (us), each round: ${what#^}"
  for door in plain light; do
    for side in old new; do
      vals=$(for r in $(seq "$rounds"); do grep -h "$what" "$work/$door-$side$r.txt" 2>/dev/null \
        | sed -E 's/.*: ([0-9.]+) us$/\1/'; done | tr '\n' ' ')
      echo "$door $side: $vals"
    done
  done
done
