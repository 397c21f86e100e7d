#!/usr/bin/env bash
# `tierlab bench decode` (warm, 16-token prompt, 128 tokens) of two checkouts, alternated with the
# order flipped every round, one line per run with the phases a change is read against.
# Why: in `decode_ab.sh` the "before" tree always runs first, and on a VM whose stream read
# swings from minute to minute an ordering bias is not ruled out.
# Usage: tools/decode_ab_flip.sh MODEL ROUNDS TREE_A TREE_B   (TREE_*: folders holding `tierlab`,
# e.g. from `git archive REV --prefix=tierlab/ | tar x -C TREE`)
set -u
model=$1 rounds=$2 a=$3 b=$4
py=${PYTHON:-.venv/bin/python}
run() {
  PYTHONPATH=$1 "$py" -m tierlab bench decode --model "$model" --tokens 128 --prompt-tokens 16 --json 2>/dev/null |
    tail -1 | "$py" -c "
import json, sys
d = json.loads(sys.stdin.read()); m = d['ms_per_token']
print(f\"{d['decode_tok_s']:.1f} tok/s compute {m['compute']:.2f} lm_head {m['lm_head']:.2f} deltanet {m['deltanet']:.2f} attention {m['attention']:.2f}\")"
}
run "$a" >/dev/null; run "$b" >/dev/null  # compile and warm both
for i in $(seq "$rounds"); do
  if [ $((i % 2)) = 1 ]; then echo "A $(run "$a")"; echo "B $(run "$b")"
  else echo "B $(run "$b")"; echo "A $(run "$a")"; fi
done
