#!/usr/bin/env bash
# Interleaved `tierlab bench decode` of two checkouts on one container: is a change slower?
# Usage: [WARM=1] [TOKENS=32] [PROMPT_TOKENS=32] tools/decode_ab.sh BEFORE_PARENT MODEL [ROUNDS]
#   BEFORE_PARENT: a folder holding a checkout named `tierlab` (e.g. made with
#   `git worktree add /tmp/before/tierlab REV`); "after" is the installed tierlab.
#   Cold RAM slots, unless WARM=1 (then both as `bench decode` runs by default).
set -u
before=$1 model=$2 rounds=${3:-5}
py=${PYTHON:-.venv/bin/python}
tokens=${TOKENS:-32} prompt=${PROMPT_TOKENS:-32}
# Empty RAM slots in both trees: trees whose `bench decode` knows --drop-page-cache are warm by
# default and need --cold; older trees started cold without it.
cold_flag() { env ${1:+PYTHONPATH=$1} "$py" -m tierlab bench decode --help 2>/dev/null | grep -q -- --drop-page-cache && echo --cold; }
flag_before=$(cold_flag "$before") flag_after=$(cold_flag "")
if [ -n "${WARM:-}" ]; then flag_before="" flag_after=""; fi
run() {
  local flag=$flag_after; [ -n "$1" ] && flag=$flag_before
  env ${1:+PYTHONPATH=$1} "$py" -m tierlab bench decode --model "$model" --tokens "$tokens" --prompt-tokens "$prompt" $flag --json 2>/dev/null | tail -1
}
run "$before" >/dev/null; run "" >/dev/null  # compile and warm both
for _ in $(seq "$rounds"); do
  echo "before $(run "$before")"
  echo "after  $(run "")"
done
