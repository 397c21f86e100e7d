#!/usr/bin/env bash
# GPU expert tier on a machine with a real GPU: install, run the tier tests on
# that GPU, print the device and a micro-benchmark of the fused expert
# (experts/s and GB/s per blob kind at H=2048, I=512).
#
#   bench/gpu_tier.sh [DEVICE]     DEVICE = a substring of "platform / device"
#                                  (default: $TIER_DEVICE, else the first GPU)
# Environment: VENV (default .venv-gpu), LIGHT=1 installs only the package and
# pytest instead of the full test extra (which pulls torch), SECONDS_PER_KIND.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -ge 1 ]; then export TIER_DEVICE="$1"; fi
VENV=${VENV:-.venv-gpu}
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then python3 -m venv "$VENV"; fi
if [ "${LIGHT:-0}" = 1 ]; then
    "$PY" -m pip install -q --disable-pip-version-check -e . "pytest>=8,<9"
else
    "$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
fi

echo "== OpenCL devices"
"$PY" - <<'PYEOF'
import pyopencl as cl
try:
    platforms = cl.get_platforms()
except cl.Error as exc:
    raise SystemExit(f"no OpenCL platform: {exc}")
for p in platforms:
    for d in p.get_devices():
        print(f"  {p.name.strip()} / {d.name.strip()}: {cl.device_type.to_string(d.type)}, "
              f"{d.global_mem_size / 2**30:.1f} GiB, max buffer {d.max_mem_alloc_size / 2**30:.1f} GiB, "
              f"{d.max_compute_units} CUs")
PYEOF
echo "TIER_DEVICE=${TIER_DEVICE:-<unset: first GPU, else any device>}"

echo "== tier tests"
"$PY" -m pytest -q -p no:cacheprovider tests/test_opencl_tier.py

echo "== fused expert micro-benchmark (default kernel for the device)"
"$PY" -m tierlab.app.lab.bench_tier --hidden 2048 --inter 512 --per-call 8 --resident 64 \
    --seconds "${SECONDS_PER_KIND:-2}"
echo "== same, the other row strategy (group <-> row), for comparison"
"$PY" -m tierlab.app.lab.bench_tier --hidden 2048 --inter 512 --per-call 8 --resident 64 \
    --seconds "${SECONDS_PER_KIND:-2}" --row-mode other
echo "== default kernel, 64 experts per call (device throughput rather than per-call overhead)"
"$PY" -m tierlab.app.lab.bench_tier --hidden 2048 --inter 512 --per-call 64 --resident 64 \
    --seconds "${SECONDS_PER_KIND:-2}"

echo "== engine A/B: tier off vs on, on a synthetic real-shape Qwen3.6 slice"
# 4 layers x 32 experts (SLICE_LAYERS, SLICE_EXPERTS) at the real per-layer
# shapes, int4 container; the RAM cache holds a quarter of the experts and the
# tier budget about a quarter, so residency matters. The
# heat profile is written by a first lever-off run and then made read-only,
# so every tier row plans from the same bytes.
WORK=${WORK:-/tmp/tierlab-gpu}
mkdir -p "$WORK"
if [ ! -d "$WORK/slice4" ]; then
    "$VENV/bin/tierlab" make-synthetic --arch qwen3_5_moe --layers "${SLICE_LAYERS:-4}" \
        --experts "${SLICE_EXPERTS:-32}" --out "$WORK/slice"
    "$VENV/bin/tierlab" convert --model "$WORK/slice" --out "$WORK/slice4" --bits 4 --force
fi
"$VENV/bin/tierlab" ref --model "$WORK/slice4" --prompt-ids 11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26 \
    -n 48 -o "$WORK/ref.json"
rm -f "$WORK/heat.bin"
"$VENV/bin/tierlab" eval --model "$WORK/slice4" --ref "$WORK/ref.json" --cache "${SLICE_CACHE:-8}" --heat "$WORK/heat.bin" > /dev/null
chmod a-w "$WORK/heat.bin"
"$VENV/bin/tierlab" ab --model "$WORK/slice4" --ref "$WORK/ref.json" --cache "${SLICE_CACHE:-8}" --repeat 3 --markdown \
    --row "off" \
    --row "TIER=1 TIER_GB=${TIER_GB_ROW:-0.05}" \
    --row "TIER=1 TIER_GB=${TIER_GB_ROW:-0.05} HEAT_FILE=$WORK/heat.bin" \
    --row "TIER=1 TIER_GB=${TIER_GB_ROW:-0.05} HEAT_FILE=$WORK/heat.bin CACHE_ROUTE=1" \
    --row "TIER=1 TIER_GB=${TIER_GB_ROW:-0.05} HEAT_FILE=$WORK/heat.bin CACHE_ROUTE=1 ROUTE_J=4"
