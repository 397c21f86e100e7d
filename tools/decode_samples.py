"""Where a decode token's wall time goes, line by line, by sampling the decoding thread.

Why: the engine's phase timers say which layer part is slow, not whether the time is
spent in the compiled kernels or in the Python between them. This runs greedy decode
in a child process under py-spy (`pip install py-spy`; not a tierlab dependency),
keeps the samples taken inside the timed loop, and splits them into kernel calls (a
sample whose line calls a numba-compiled function: the kernel's time, its launch and
its argument checks) and everything else (the Python and numpy between the kernels).

    python tools/decode_samples.py --model DIR [--seconds 20] [--rate 2000] [--top 30]
"""

from __future__ import annotations

import argparse
import importlib
import linecache
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

LOOP_MARK = "decode_samples_loop"

CHILD = f"""
import sys, time
from tierlab.engine.options import EngineOptions
import numpy as np
engine = EngineOptions(model=sys.argv[1]).open(with_tokenizer=False)
prompt = [int(t) for t in np.random.default_rng(0).integers(0, engine.config.vocab_size, 16)]
def warm():
    logits = engine.prefill(prompt)
    for _ in range(16):  # warm slots, as in a chat
        logits = engine.step(int(np.argmax(logits)))
    return logits
def {LOOP_MARK}(logits, n):  # only decode steps are sampled: the prompts are outside
    for _ in range(n):
        logits = engine.step(int(np.argmax(logits)))
    return logits
start, decoding, n = time.perf_counter(), 0.0, 0
while time.perf_counter() - start < float(sys.argv[2]):
    engine.reset()
    logits = warm()
    t0 = time.perf_counter()
    {LOOP_MARK}(logits, 128)
    decoding += time.perf_counter() - t0
    n += 128
print("ms/token %.2f" % (1000 * decoding / n))
"""

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*):(?P<line>\d+)\)$")


def _module_of(path: str):
    """The imported tierlab module whose file is `path` (py-spy shortens paths), or None."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name.startswith("tierlab") and file and file.endswith(path.split("/", 1)[-1]):
            return module
    return None


def _calls_a_kernel(path: str, line: int) -> bool:
    """Whether the source line calls a name its module binds to a numba dispatcher, directly
    or through a local alias (`kernel = a if exact else b` ... `kernel(`)."""
    module = _module_of(path)
    if module is None:
        return False
    from numba.core.dispatcher import Dispatcher

    def is_kernel(name: str) -> bool:
        return isinstance(getattr(module, name, None), Dispatcher)

    source = Path(module.__file__).read_text()
    for name in re.findall(r"(\w+)\s*\(", linecache.getline(module.__file__, line)):
        if is_kernel(name):
            return True
        for value in re.findall(rf"^\s*{name}\s*=\s*(.+)$", source, re.M):
            if any(is_kernel(n) for n in re.findall(r"\w+", value)):
                return True
    return False


def summarise(raw: Path, top: int) -> list[str]:
    leaves: Counter = Counter()
    for entry in raw.read_text().splitlines():
        stack, _, count = entry.rpartition(" ")
        frames = stack.split(";")
        if any(LOOP_MARK in f for f in frames):
            leaves[frames[-1]] += int(count)
    total = sum(leaves.values())
    if not total:
        return ["no samples inside the decode loop"]
    for name in ("tierlab.engine.model", "tierlab.engine.kernels.qmatvec", "tierlab.engine.kernels.dense",
                 "tierlab.engine.moe", "tierlab.engine.models.deltanet", "tierlab.engine.models.attention",
                 "tierlab.engine.qlinear", "tierlab.engine.expert_store", "tierlab.engine.routing"):
        importlib.import_module(name)
    kernel = 0
    rows = []
    for leaf, n in leaves.most_common():
        m = _FRAME.match(leaf)
        is_kernel = bool(m) and _calls_a_kernel(m["file"], int(m["line"]))
        kernel += n if is_kernel else 0
        if len(rows) < top:
            module = _module_of(m["file"]) if m else None
            text = linecache.getline(module.__file__, int(m["line"])).strip() if module else ""
            rows.append(f"{100 * n / total:6.2f}%  {'kernel' if is_kernel else 'python':6}  {leaf[:60]:60}  {text[:70]}")
    return [f"{total} samples in the decode loop: kernel calls {100 * kernel / total:.1f}%, "
            f"Python and numpy between them {100 * (total - kernel) / total:.1f}%"] + rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=2000, help="samples per second")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("decode_samples: py-spy is not on PATH (pip install py-spy)")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "samples.txt"
        child = Path(tmp) / "decode_loop.py"
        child.write_text(CHILD)
        # --nonblocking: sampling does not stop the process, so the decode runs at its own speed
        run = subprocess.run([spy, "record", "--nonblocking", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--",
                              sys.executable, str(child), args.model, str(args.seconds)],
                             capture_output=True, text=True)
        print("\n".join(line for line in run.stdout.splitlines() if line.startswith("ms/token")))
        if run.returncode != 0 or not raw.exists():
            sys.exit(f"decode_samples: py-spy failed: {run.stderr.strip().splitlines()[-1:]}")
        print("\n".join(summarise(raw, args.top)))


if __name__ == "__main__":
    main()
