#!/usr/bin/env bash
# The real-scale benchmark: a full-shape Qwen3.6-35B-A3B container (40 layers x 256 experts)
# decoding in memory cgroups of 4, 8 and 16 GB and unconstrained, with the routing lever off
# and on (CACHE_ROUTE=1 with ROUTE_J=2, then ROUTE_J=1), and llama.cpp on a GGUF Q4_0 of the
# same seeded weights in the same cgroups. Prints one table row per run: prefill and decode
# tok/s, RAM hit, MiB read from disk per token, peak RSS, the cache slots the budget (auto: the
# cgroup limit less its margin) gave, ms per token and what the reads alone would take.
#
#   make the container once (about 12 minutes, 22.9 GB):
#     tierlab make-synthetic --arch qwen3_5_moe --layers 40 --experts 256 --vocab 248320 --bits 4 --out DIR
#   and the GGUF of the same seed, with the llama.cpp venv's python (about 45 minutes, 23 GB):
#     PYTHONPATH=<folder above tierlab> LLAMA_PY bench/synthetic_gguf.py --model DIR --seed 0 --out FILE.gguf
#   then, as root (cgroup v1 memory controller):
#     GGUF=FILE.gguf LLAMA_PY=<llama venv>/bin/python bench/real_scale.sh DIR [DIR ...]
#
# Environment: PY (python with tierlab importable; default python3), TOKENS (decode tokens per
# run, default 32), PROMPT (prompt tokens, default 32), LIMITS (default "4 8 16 none"),
# ARMS (default "off j2 j1"); GGUF and LLAMA_PY (a python with llama-cpp-python and gguf-py)
# add llama.cpp rows after tierlab's in each cgroup, so that the engines interleave;
# LLAMA_ARMS (default "default norepack": llama.cpp's defaults, then without its repacked
# copy of the weights), LLAMA_TOKENS (llama.cpp decode tokens, default TOKENS), LLAMA_TIMEOUT
# (seconds a llama.cpp run may take before it is stopped and its row says so; default: no limit),
# DROP_CACHES=1 (empty the page cache before every run, so that neither engine finds the other's
# or the writer's pages there: each run starts from the disk).
set -u
PY=${PY:-python3}
TOKENS=${TOKENS:-32}
PROMPT=${PROMPT:-32}
LIMITS=${LIMITS:-"4 8 16 none"}
ARMS=${ARMS:-"off j2 j1"}
GGUF=${GGUF:-}
LLAMA_PY=${LLAMA_PY:-}
LLAMA_ARMS=${LLAMA_ARMS:-"default norepack"}
LLAMA_TOKENS=${LLAMA_TOKENS:-$TOKENS}
LLAMA_TIMEOUT=${LLAMA_TIMEOUT:-0}
DROP_CACHES=${DROP_CACHES:-0}
HERE=$(cd "$(dirname "$0")" && pwd)
CG=/sys/fs/cgroup/memory
[ $# -ge 1 ] || { echo "usage: $0 CONTAINER [CONTAINER ...]" >&2; exit 2; }

# the memory and disk bandwidths, measured once outside any cgroup, so that no run allocates buffers for them
BW=$("$PY" -c 'from tierlab.app.lab.bench_kernels import measure_bandwidth; print(round(measure_bandwidth(256 * 2**20, 5)[0], 1))')
DISK=$("$PY" "$HERE/real_scale_row.py" disk "$1")
GGUF_BYTES=0
[ -n "$GGUF" ] && GGUF_BYTES=$("$LLAMA_PY" "$HERE/real_scale_row.py" gguf-bytes "$GGUF")
export BW DISK GGUF_BYTES

arm_env() {
    case $1 in
        off) echo "CACHE_ROUTE=0" ;;
        j2) echo "CACHE_ROUTE=1 ROUTE_J=2" ;;
        j1) echo "CACHE_ROUTE=1 ROUTE_J=1" ;;
    esac
}

drop_caches() {  # the page cache emptied before a run when DROP_CACHES=1 (needs root)
    [ "$DROP_CACHES" = 1 ] && sync && echo 3 > /proc/sys/vm/drop_caches
    return 0
}

group_for() {  # limit -> the path of a cgroup with that limit ("" when unconstrained)
    [ "$1" = none ] && return 0
    local group=$CG/tierlab_real_$1
    mkdir -p "$group" && echo "${1}G" > "$group/memory.limit_in_bytes" && echo "$group"
}

run_one() {  # model limit arm -> one JSON line (or an error line)
    local model=$1 limit=$2 arm=$3 group
    group=$(group_for "$limit") || { echo '{"error": "no cgroup"}'; return; }
    drop_caches
    (
        [ -n "$group" ] && echo $BASHPID > "$group/cgroup.procs"
        # shellcheck disable=SC2046
        exec env $(arm_env "$arm") "$PY" -m tierlab bench decode --cold --model "$model" --tokens "$TOKENS" \
            --prompt-tokens "$PROMPT" --bandwidth "$BW" --json 2>/tmp/real_scale.err
    ) || echo "{\"error\": \"$(tail -n 1 /tmp/real_scale.err | tr -d '"')\"}"
    [ -n "$group" ] && rmdir "$group" 2>/dev/null
}

run_llama() {  # limit arm -> one JSON line from bench/llama_decode.py (or an error line)
    local limit=$1 arm=$2 group flags=""
    group=$(group_for "$limit") || { echo '{"error": "no cgroup"}'; return; }
    [ "$arm" = norepack ] && flags=--no-repack
    drop_caches
    (
        [ -n "$group" ] && echo $BASHPID > "$group/cgroup.procs"
        exec timeout "$LLAMA_TIMEOUT" "$LLAMA_PY" "$HERE/llama_decode.py" --gguf "$GGUF" --tokens "$LLAMA_TOKENS" \
            --prompt-tokens "$PROMPT" $flags 2>/tmp/real_scale.err
    )
    local rc=$?
    if [ $rc = 124 ]; then
        echo "{\"error\": \"did not finish the prompt and $LLAMA_TOKENS tokens in $LLAMA_TIMEOUT s (stopped)\"}"
    elif [ $rc != 0 ]; then
        echo "{\"error\": \"llama.cpp exit $rc $(tail -n 1 /tmp/real_scale.err | tr -d '"')\"}"
    fi
    [ -n "$group" ] && rmdir "$group" 2>/dev/null
}

row() {  # engine model limit arm json -> one table row
    LINE=$5 "$PY" "$HERE/real_scale_row.py" row "$1" "$2" "$3" "$4"
}

echo "# $(date -u +%FT%TZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), memory $BW GB/s, disk $DISK GB/s," \
    "$PROMPT prompt tokens, $TOKENS decode tokens per tierlab run, $LLAMA_TOKENS per llama.cpp run" \
    "$([ "$DROP_CACHES" = 1 ] && echo ', page cache emptied before every run')"
echo "| engine | model | dense | cgroup | lever | prefill tok/s | decode tok/s | RAM hit | disk MiB/token | peak RSS | slots | ms/token | reads alone, ms |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for limit in $LIMITS; do
    for model in "$@"; do
        for arm in $ARMS; do
            row tierlab "$model" "$limit" "$arm" "$(run_one "$model" "$limit" "$arm" | tail -n 1)"
        done
    done
    if [ -n "$GGUF" ]; then
        for arm in $LLAMA_ARMS; do
            row llama.cpp "$GGUF" "$limit" "$arm" "$(run_llama "$limit" "$arm" | tail -n 1)"
        done
    fi
done
