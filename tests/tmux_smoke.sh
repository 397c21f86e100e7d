#!/usr/bin/env bash
# Smoke test in a real terminal: start the app in tmux, type a prompt, move a
# knob, and check what the screen shows. Usage: tmux_smoke.sh MODEL_DIR [WORK_DIR]
# (PYTHON selects the interpreter; exit status 0 = every check passed).
set -euo pipefail

MODEL=${1:?usage: tmux_smoke.sh MODEL_DIR [WORK_DIR]}
if ! command -v tmux >/dev/null; then
    echo "FAIL: tmux is needed for the terminal smoke test: apt-get install tmux" >&2
    exit 1
fi
WORK=${2:-$(mktemp -d)}
mkdir -p "$WORK"
PY=${PYTHON:-python3}
SESSION="tierlab-smoke-$$"

cleanup() { tmux kill-session -t "$SESSION" 2>/dev/null || true; }
trap cleanup EXIT

screen() { tmux capture-pane -p -t "$SESSION"; }

seen_within() {  # seen_within PATTERN SECONDS: 0 if the screen matches in time, 1 if not
    local pattern=$1 deadline=$((SECONDS + $2))
    while ((SECONDS < deadline)); do
        if screen | grep -Eq -- "$pattern"; then return 0; fi
        sleep 0.2
    done
    return 1
}

wait_for() {  # wait_for PATTERN SECONDS: until the screen matches the extended regex
    if seen_within "$1" "$2"; then return 0; fi
    echo "FAIL: screen never showed /$1/ within $2 s:" >&2
    screen >&2
    exit 1
}

wait_gone() {  # wait_gone PATTERN SECONDS: until the screen no longer matches
    local pattern=$1 deadline=$((SECONDS + $2))
    while ((SECONDS < deadline)); do
        if ! screen | grep -Eq -- "$pattern"; then return 0; fi
        sleep 0.2
    done
    echo "FAIL: screen still showed /$pattern/ after $2 s:" >&2
    screen >&2
    exit 1
}

tmux new-session -d -s "$SESSION" -x 100 -y 30 \
    "cd '$WORK' && '$PY' -m tierlab app --model '$MODEL' --cache 6 --max-tokens 4 --sessions '$WORK/sessions'; echo EXITED \$?; sleep 30"

wait_for "tierlab — .* 0 tok" 90                       # engine loaded, header shows the model
tmux send-keys -t "$SESSION" "hello smoke" Enter
wait_for "hello smoke" 15                              # the prompt is in the conversation
wait_for "· [1-9][0-9]* tok" 60                        # tokens went through the engine
wait_gone "generating" 120                             # the reply finished
wait_for "RAM hit +[0-9.]+%" 5                          # meters filled in

# Focus the knobs (F8: CACHE_ROUTE first) and toggle it. Under a loaded machine a
# keypress can arrive while the app is still busy; the screen decides whether to
# press again, so a late keypress is never doubled.
for attempt in 1 2 3; do
    tmux send-keys -t "$SESSION" F8
    tmux send-keys -t "$SESSION" Space
    if seen_within "CACHE_ROUTE +on" 10; then break; fi
done
wait_for "CACHE_ROUTE +on" 5
tmux send-keys -t "$SESSION" Tab Tab Tab               # ROUTE_AGREE, ROUTE_MODE, ROUTE_J
tmux send-keys -t "$SESSION" Left
wait_for "ROUTE_J +[━─●┊]+ +1 " 10

tmux send-keys -t "$SESSION" C-q
wait_for "EXITED 0" 20
echo "tmux smoke: ok"
