#!/usr/bin/env bash
# Interleaved prompt tok/s of two checkouts: `tierlab bench decode` in a fresh process per run
# (the model loaded and its kernels warmed first, as a session starts), before then after, for
# each prompt length, each round; one line per run with the load average when it ended
# (--bandwidth 20 skips the stream measurement, which only the roofline uses).
# Usage: tools/prefill_ab.sh BEFORE_PARENT MODEL [ROUNDS] [LENGTHS]
#   BEFORE_PARENT: a folder holding a checkout named `tierlab` (e.g. made with
#   `git worktree add /tmp/before/tierlab REV`); "after" is the tierlab on PYTHONPATH.
#   LENGTHS: prompt lengths, default "128 512".
set -u
before=$1 model=$2 rounds=${3:-3} lengths=${4:-128 512}
py=${PYTHON:-.venv/bin/python}
run() {  # run TREE LENGTH -> prefill tok/s
  env ${1:+PYTHONPATH=$1} "$py" -m tierlab bench decode --model "$model" --tokens 4 --prompt-tokens "$2" --bandwidth 20 --json 2>/dev/null \
    | tail -1 | "$py" -c 'import json, sys; print(json.loads(sys.stdin.read())["prefill_tok_s"])'
}
run "$before" 16 >/dev/null; run "" 16 >/dev/null  # compile and cache both trees' kernels
for round in $(seq "$rounds"); do
  for n in $lengths; do
    echo "round $round prompt $n before $(run "$before" "$n") load $(cut -d' ' -f1 /proc/loadavg)"
    echo "round $round prompt $n after  $(run "" "$n") load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
