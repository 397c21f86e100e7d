#!/usr/bin/env bash
# The real-scale benchmark: a full-shape Qwen3.6-35B-A3B container (40 layers x 256 experts)
# decoding in memory cgroups of 4, 8 and 16 GB and unconstrained, with the routing lever off
# and on (CACHE_ROUTE=1 with ROUTE_J=2, then ROUTE_J=1). Prints one table row per run:
# prefill and decode tok/s, RAM hit, MiB read from disk per token, peak RSS, the cache slots
# the budget (auto: the cgroup limit less its margin) gave.
#
#   make the container once (about 10 minutes, 17 GiB):
#     tierlab make-synthetic --arch qwen3_5_moe --layers 40 --experts 256 --vocab 248320 --bits 4 --out DIR
#   then, as root (cgroup v1 memory controller):
#     bench/real_scale.sh DIR [DIR ...]
#
# Environment: PY (python with tierlab importable; default python3), TOKENS (decode tokens per
# run, default 32), PROMPT (prompt tokens, default 32), LIMITS (default "4 8 16 none"),
# ARMS (default "off j2 j1").
set -u
PY=${PY:-python3}
TOKENS=${TOKENS:-32}
PROMPT=${PROMPT:-32}
LIMITS=${LIMITS:-"4 8 16 none"}
ARMS=${ARMS:-"off j2 j1"}
CG=/sys/fs/cgroup/memory
[ $# -ge 1 ] || { echo "usage: $0 CONTAINER [CONTAINER ...]" >&2; exit 2; }

# the memory bandwidth, measured once outside any cgroup, so that no run allocates buffers for it
BW=$("$PY" -c 'from tierlab.app.lab.bench_kernels import measure_bandwidth; print(round(measure_bandwidth(256 * 2**20, 5)[0], 1))')

arm_env() {
    case $1 in
        off) echo "CACHE_ROUTE=0" ;;
        j2) echo "CACHE_ROUTE=1 ROUTE_J=2" ;;
        j1) echo "CACHE_ROUTE=1 ROUTE_J=1" ;;
    esac
}

run_one() {  # model limit arm -> one JSON line (or an error line)
    local model=$1 limit=$2 arm=$3 group=""
    if [ "$limit" != none ]; then
        group=$CG/tierlab_real_$limit
        mkdir -p "$group" && echo "${limit}G" > "$group/memory.limit_in_bytes" || { echo '{"error": "no cgroup"}'; return; }
    fi
    (
        [ -n "$group" ] && echo $BASHPID > "$group/cgroup.procs"
        # shellcheck disable=SC2046
        exec env $(arm_env "$arm") "$PY" -m tierlab bench decode --cold --model "$model" --tokens "$TOKENS" \
            --prompt-tokens "$PROMPT" --bandwidth "$BW" --json 2>/tmp/real_scale.err
    ) || echo "{\"error\": \"$(tail -n 1 /tmp/real_scale.err | tr -d '"')\"}"
    [ -n "$group" ] && rmdir "$group" 2>/dev/null
}

echo "# $(date -u +%FT%TZ) $(nproc) cores, bandwidth $BW GB/s, $PROMPT prompt + $TOKENS decode tokens per run"
echo "| container | dense | cgroup | lever | prefill tok/s | decode tok/s | RAM hit | disk MiB/token | peak RSS | slots |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for model in "$@"; do
    for limit in $LIMITS; do
        for arm in $ARMS; do
            line=$(run_one "$model" "$limit" "$arm" | tail -n 1)
            LINE=$line MODEL=$model LIMIT=$limit ARM=$arm "$PY" - <<'EOF'
import json, os
r = json.loads(os.environ["LINE"])
name, limit, arm = os.path.basename(os.environ["MODEL"].rstrip("/")), os.environ["LIMIT"], os.environ["ARM"]
cg = "none" if limit == "none" else f"{limit} GB"
lever = {"off": "off", "j2": "on J=2", "j1": "on J=1"}[arm]
if "error" in r:
    print(f"| {name} | | {cg} | {lever} | {r['error']} | | | | | |")
else:
    print(f"| {name} | {r['dense_kind']} | {cg} | {lever} | {r['prefill_tok_s']:.2f} | {r['decode_tok_s']:.2f} | "
          f"{r['ram_hit']:.1f}% | {r['disk_mb_per_token']:.0f} | {r['peak_rss_mb']:.0f} MiB | "
          f"{r['cache_slots']}/{r['n_experts']} |")
EOF
        done
    done
done
