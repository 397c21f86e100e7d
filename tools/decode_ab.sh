#!/usr/bin/env bash
# Interleaved `tierlab bench decode` of two checkouts on one container: is a change slower?
# Usage: tools/decode_ab.sh BEFORE_PARENT MODEL [ROUNDS]
#   BEFORE_PARENT: a folder holding a checkout named `tierlab` (e.g. made with
#   `git worktree add /tmp/before/tierlab REV`); "after" is the installed tierlab.
set -u
before=$1 model=$2 rounds=${3:-5}
py=${PYTHON:-.venv/bin/python}
run() { env ${1:+PYTHONPATH=$1} "$py" -m tierlab bench decode --model "$model" --tokens 32 --prompt-tokens 32 --json 2>/dev/null | tail -1; }
run "$before" >/dev/null; run "" >/dev/null  # compile and warm both
for _ in $(seq "$rounds"); do
  echo "before $(run "$before")"
  echo "after  $(run "")"
done
