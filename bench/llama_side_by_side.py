#!/usr/bin/env python3
"""tierlab next to llama.cpp (llama-cpp-python), each at its default and at its best.

Not part of tierlab, not run by CI, and no test depends on it: it needs
llama-cpp-python built from source in a venv of its own, and that package's
source tree (for the GGUF converter and gguf-py).

Build llama.cpp (subcommand `build`, run with that venv's python):

    python3 -m venv /work/llama-venv
    /work/llama-venv/bin/python bench/llama_side_by_side.py build --venv /work/llama-venv
    /work/llama-venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /work/llama-src
    tar xzf /work/llama-src/llama_cpp_python-0.3.36.tar.gz -C /work/llama-src

`build` runs `pip install llama-cpp-python==0.3.36` from source (native,
OpenMP) plus gguf, numpy and what bench/synthetic_gguf.py needs to draw the weights there (numba, ml_dtypes, xxhash, safetensors). Where the CPU lists AMX it adds
`CFLAGS/CXXFLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`: the native
build's AMX path dies with SIGILL on some VMs, and `GGML_AMX_*=OFF` alone
does not remove it while `GGML_NATIVE=ON`; that build still repacks weights.
`--amx` keeps AMX, `--dry-run` prints the command only.

Run (the slice and every conversion are made on the first run, in --work):

    /work/llama-venv/bin/python bench/llama_side_by_side.py --work /work/big/sbs \\
        --tierlab-python .venv/bin/python --convert-python .venv/bin/python

What a run does:

1. `tierlab make-synthetic --arch qwen3_5_moe` (random bf16 weights at the
   real per-layer shapes of Qwen3.6-35B-A3B: hidden 2048, 4 layers = 3 Gated
   DeltaNet + 1 gated attention, 64 experts x 512, top-8, vocab 32768), then
   `tierlab convert` to int4 + dense int4, int8 + dense int8 and int4 experts;
   the same checkpoint to GGUF with llama.cpp's `convert_hf_to_gguf.py`
   (imported, not copied, in --convert-python, which needs torch): BF16,
   Q8_0 everything, Q4_0 experts with the rest BF16, and Q4_0 everything
   (`llama_model_quantize`, pure: every matrix Q4_0);
2. per row, in fresh processes, interleaved (the order of the cells rotates
   from round to round): llama.cpp under every OMP_WAIT_POLICY (unset =
   libgomp's default, ACTIVE, PASSIVE) with weight repacking on
   (`use_extra_bufts`, llama.cpp's default) and off, each with flash
   attention off (llama-cpp-python's default) and on (`--flash-attn off`
   leaves the second half out); tierlab `bench decode`
   (warm slots, its default thread pool) as shipped and with
   `OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=infinite`;
3. tables of medians: decode tok/s (a 16-token prompt, then 128 greedy
   tokens) and prefill tok/s (--prefill-tokens), each engine at its default
   and at its best setting of this run, the ratio at defaults and at best,
   decode as a share of the roofline (the stream bandwidth `bench decode`
   measures in the same runs, divided into the weight bytes one token reads
   from that engine's own file), and every setting's medians.

The converter's pre-tokenizer check does not know the synthetic tokenizer;
it is patched at run time (the pre-tokenizer is reported as "qwen2", one
dummy BPE merge is added, `--no-mtp`). Nothing of llama.cpp is edited on disk.

Internal subcommands (each in a fresh process): `_gguf` converts, `_llama`
runs one llama.cpp measurement and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
LLAMA_VERSION = "0.3.36"
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


@dataclass(frozen=True)
class Row:
    label: str
    tierlab_model: str
    gguf: str


ROWS = {
    "int4-all": Row("int4 + dense int4 / Q4_0 everything", "int4-d4", "Q4_0-all"),
    "int8-all": Row("int8 + dense int8 / Q8_0 everything", "int8-d8", "Q8_0-all"),
    "bf16": Row("bf16 / BF16", "bf16", "BF16"),
    "int4": Row("int4 experts, bf16 dense / Q4_0 experts, rest BF16", "int4", "Q4_0-experts"),
}

# tierlab containers: name -> (expert bits, dense bits or 0)
CONTAINERS = {"int4-d4": (4, 4), "int8-d8": (8, 8), "int4": (4, 0)}
# GGUFs from the converter: name -> (outtype of other matrices, expert type or "")
GGUFS = {"BF16": ("bf16", ""), "Q8_0-all": ("q8_0", ""), "Q4_0-experts": ("bf16", "q4_0")}


@dataclass(frozen=True)
class Setting:
    engine: str  # "tierlab" or "llama.cpp"
    name: str
    env: tuple = ()
    repack: bool = True
    flash_attn: bool = False

    def env_args(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.env]


def llama_settings(flash: str) -> list[Setting]:
    """The llama.cpp settings a run tries, its default first: every OMP_WAIT_POLICY, repacking on
    and off, and (`flash` "both") flash attention off, llama-cpp-python's default, and on
    (`flash_attn=True`; llama.cpp's own default is "auto", which llama-cpp-python overrides)."""
    return [Setting("llama.cpp", f"{wait or 'OMP default'}, repack {'on' if repack else 'off'}"
                    + (", flash attention" if flash_attn else ""),
                    (("OMP_WAIT_POLICY", wait),) if wait else (), repack, flash_attn)
            for flash_attn in ((False, True) if flash == "both" else (False,))
            for wait in ("", "ACTIVE", "PASSIVE") for repack in (True, False)]


TIERLAB_SETTINGS = [
    Setting("tierlab", "default"),
    Setting("tierlab", "OMP ACTIVE, spin infinite", (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "infinite"))),
    Setting("tierlab", "OMP PASSIVE", (("OMP_WAIT_POLICY", "PASSIVE"),)),
]


# --------------------------------------------------------------------------- helpers

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def warm_files(*paths: Path) -> None:
    """Read files once so that both engines find them in the page cache."""
    buf = bytearray(16 << 20)
    for p in paths:
        files = [p] if p.is_file() else sorted(q for q in p.iterdir() if q.is_file())
        for q in files:
            with open(q, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def random_prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    """The ids `tierlab bench decode` feeds (app/lab/bench_decode.py)."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def cpu_line() -> str:
    """CPU model, vCPUs and the vector extensions that matter to both engines."""
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    ext = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} vCPUs, {' '.join(ext)}"


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------- build

# what bench/synthetic_gguf.py needs of tierlab's own dependencies to draw the weights in this venv
GGUF_WRITER_DEPS = ("numba", "ml_dtypes", "xxhash", "safetensors")


def cmd_build(args: argparse.Namespace) -> None:
    """Build llama-cpp-python from source into --venv; without AMX where the CPU lists it."""
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON")
    if not args.amx and "amx_tile" in Path("/proc/cpuinfo").read_text():
        env["CFLAGS"] = env["CXXFLAGS"] = NO_AMX_FLAGS
    pip = Path(args.venv) / "bin" / "pip"
    cmd = [str(pip), "install", "--no-cache-dir", "--no-binary", "llama-cpp-python",
           f"llama-cpp-python=={LLAMA_VERSION}", "gguf", "numpy", *GGUF_WRITER_DEPS]
    shown = " ".join(f"{k}={shlex.quote(env[k])}" for k in ("CMAKE_ARGS", "CFLAGS", "CXXFLAGS") if k in env)
    print(f"{shown} {shlex.join(cmd)}")
    if not args.dry_run:
        subprocess.run(cmd, env=env, check=True)


# --------------------------------------------------------------------------- GGUF conversion

def setup_llama_paths(llama_src: Path) -> Path:
    vendor = llama_src / "vendor" / "llama.cpp"
    if not (vendor / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"--llama-src: {vendor}/convert_hf_to_gguf.py not found")
    for p in (vendor / "gguf-py", vendor):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    return vendor


def patched_model_class(real_get_model_class, gguf, expert_qtype):
    """The converter's model class, told the synthetic tokenizer's pre-tokenizer and the expert type."""

    def get_model_class(name, mmproj=False):
        base = real_get_model_class(name, mmproj=mmproj)

        class Patched(base):  # type: ignore[misc, valid-type]
            model_arch = base.model_arch

            def get_vocab_base_pre(self, tokenizer) -> str:
                return "qwen2"  # the synthetic tokenizer's hash is unknown to the converter

            def set_vocab(self):
                super().set_vocab()
                # llama.cpp refuses a BPE vocab without merges; ids are fed, never text
                key = gguf.Keys.Tokenizer.MERGES
                if not any(key in kv for kv in self.gguf_writer.kv_data):
                    self.gguf_writer.add_token_merges(["\u0120 \u0120"])

            def tensor_force_quant(self, name, new_name, bid, n_dims):
                if expert_qtype is not None and "_exps." in new_name and n_dims >= 2:
                    return expert_qtype
                return super().tensor_force_quant(name, new_name, bid, n_dims)

        Patched.__name__ = base.__name__
        Patched.__qualname__ = base.__qualname__
        return Patched

    return get_model_class


def cmd_gguf(args: argparse.Namespace) -> None:
    """Convert args.model to args.out: experts at args.experts_type, other matrices at args.outtype."""
    setup_llama_paths(Path(args.llama_src))
    import convert_hf_to_gguf as conv
    import gguf

    expert_qtype = getattr(gguf.GGMLQuantizationType, args.experts_type.upper()) if args.experts_type else None
    conv.get_model_class = patched_model_class(conv.get_model_class, gguf, expert_qtype)
    sys.argv = ["convert_hf_to_gguf.py", str(args.model), "--outtype", args.outtype, "--outfile", str(args.out),
                "--no-mtp"]
    conv.main()


def quantize_q4_0(src: Path, dst: Path, threads: int) -> None:
    """llama.cpp's Q4_0 of every matrix (llama_model_quantize, pure), as tierlab's int4 + dense int4."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.pure = True
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed with {rc}")


def gguf_bytes_per_token(path: Path) -> int:
    """Weight bytes one decode token reads from a GGUF: experts at top_k/E, one embedding row, rest whole."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field_int(key):
        return int(r.fields[f"{arch}.{key}"].parts[-1][0])

    n_exp, top_k = field_int("expert_count"), field_int("expert_used_count")
    total = 0
    for t in r.tensors:
        nb = int(t.n_bytes)
        if "_exps." in t.name:
            total += nb * top_k // n_exp
        elif t.name == "token_embd.weight":
            total += nb // int(t.shape[-1])  # one row (ggml order: [n_embd, n_vocab])
        else:
            total += nb
    return total


# --------------------------------------------------------------------------- one llama.cpp measurement

def open_llama(args: argparse.Namespace):
    """A Llama with use_extra_bufts (repacking) as asked: not a constructor argument in 0.3.36."""
    import llama_cpp
    from llama_cpp import Llama

    real_defaults = llama_cpp.llama_model_default_params

    def model_defaults():
        params = real_defaults()
        params.use_extra_bufts = bool(args.extra_bufts)
        return params

    llama_cpp.llama_model_default_params = model_defaults
    llama_cpp.llama.llama_cpp.llama_model_default_params = model_defaults
    longest = max([args.prompt_tokens] + args.prefill)
    return Llama(model_path=str(args.gguf), n_threads=args.threads, n_threads_batch=args.threads,
                 n_ctx=longest + args.tokens + 16, n_batch=longest, use_mmap=True, flash_attn=bool(args.flash_attn),
                 verbose=False)


def timed_prefill(llm, args: argparse.Namespace, n: int) -> float:
    """tok/s of an n-token prompt from an empty context."""
    llm.reset()
    ids = random_prompt(args.vocab or llm.n_vocab(), n, args.seed)
    t0 = time.perf_counter()
    llm.eval(ids)
    return n / (time.perf_counter() - t0)


def cmd_llama(args: argparse.Namespace) -> None:
    import llama_cpp
    import numpy as np

    llm = open_llama(args)
    vocab = llm.n_vocab()

    def last_argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(vocab,))))

    ids = random_prompt(args.vocab or vocab, max([args.prompt_tokens] + args.prefill), args.seed)
    llm.eval(ids[:4])  # warm-up as tierlab's bench does: 4 prompt tokens and one decode step
    llm.eval([last_argmax()])
    prefill = {str(n): timed_prefill(llm, args, n) for n in args.prefill if n != args.prompt_tokens}
    # the decode's own prompt is timed too: a prefill length equal to it needs no run of its own
    prefill[str(args.prompt_tokens)] = timed_prefill(llm, args, args.prompt_tokens)
    t0 = time.perf_counter()
    done = 0
    while done < args.tokens and (done < 8 or time.perf_counter() - t0 < args.max_decode_s):
        llm.eval([last_argmax()])
        done += 1
    decode_s = time.perf_counter() - t0
    print(json.dumps({"decode_tok_s": done / decode_s, "decode_tokens": done, "prefill_tok_s": prefill,
                      "extra_bufts": bool(llm.model_params.use_extra_bufts), "flash_attn": bool(args.flash_attn),
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}))


# --------------------------------------------------------------------------- preparing the files

def tierlab_cmd(a: argparse.Namespace, *args: str) -> list[str]:
    """This checkout's tierlab CLI in --tierlab-python."""
    return ["env", f"PYTHONPATH={REPO.parent}", a.tierlab_python, "-m", "tierlab", *args]


def make_slice(a: argparse.Namespace, work: Path) -> Path:
    bf16 = work / "bf16"
    if not (bf16 / "config.json").is_file():
        log(f"make-synthetic {a.layers} layers x {a.experts} experts, vocab {a.vocab} -> {bf16}")
        subprocess.run(tierlab_cmd(a, "make-synthetic", "--arch", "qwen3_5_moe", "--layers", str(a.layers),
                                   "--experts", str(a.experts), "--vocab", str(a.vocab), "--out", str(bf16)),
                       check=True)
    return bf16


def make_container(a: argparse.Namespace, bf16: Path, out: Path, bits: int, dense_bits: int) -> None:
    if (out / "tierlab_container.json").is_file():
        return
    log(f"tierlab convert --bits {bits} --dense-bits {dense_bits or '-'} -> {out}")
    extra = ["--dense-bits", str(dense_bits)] if dense_bits else []
    subprocess.run(tierlab_cmd(a, "convert", "--model", str(bf16), "--out", str(out), "--bits", str(bits), *extra),
                   check=True)


def make_gguf(a: argparse.Namespace, bf16: Path, out: Path, outtype: str, etype: str) -> None:
    if out.is_file():
        return
    log(f"convert_hf_to_gguf -> {out.name}")
    tmp = out.with_suffix(".partial")
    cmd = [a.convert_python, str(HERE), "_gguf", "--llama-src", a.llama_src, "--model", str(bf16),
           "--out", str(tmp), "--outtype", outtype] + (["--experts-type", etype] if etype else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    tmp.rename(out)


def prepare(a: argparse.Namespace) -> dict[str, Path]:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    bf16 = make_slice(a, work)
    paths = {"bf16": bf16}
    for name, (bits, dense_bits) in CONTAINERS.items():
        paths[name] = work / name
        make_container(a, bf16, paths[name], bits, dense_bits)
    for name, (outtype, etype) in GGUFS.items():
        paths[name] = work / f"slice-{name}.gguf"
        make_gguf(a, bf16, paths[name], outtype, etype)
    q4 = paths["Q4_0-all"] = work / "slice-Q4_0-all.gguf"
    if not q4.is_file():
        log("llama_model_quantize BF16 -> Q4_0 (pure)")
        quantize_q4_0(paths["BF16"], q4.with_suffix(".partial"), a.threads)
        q4.with_suffix(".partial").rename(q4)
    return paths


# --------------------------------------------------------------------------- the cells

def run_json(cmd: list[str], timeout: float) -> dict:
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def tierlab_bench(a: argparse.Namespace, s: Setting, model: Path, prompt: int, tokens: int) -> dict:
    cmd = tierlab_cmd(a, "bench", "decode", "--model", str(model), "--tokens", str(tokens),
                      "--prompt-tokens", str(prompt), "--json")
    return run_json(["env", f"NUMBA_NUM_THREADS={a.threads}", *s.env_args(), *cmd], a.cell_timeout)


def tierlab_cell(a: argparse.Namespace, s: Setting, model: Path) -> dict:
    """Decode after --prompt-tokens in one process, each other prefill length in one more."""
    dec = tierlab_bench(a, s, model, a.prompt_tokens, a.tokens)
    prefill = {str(n): dec["prefill_tok_s"] if n == a.prompt_tokens else
               tierlab_bench(a, s, model, n, 1)["prefill_tok_s"] for n in a.prefill_tokens}
    # the threading line says whether the load follower gave a thread up during decode
    return {"decode_tok_s": dec["decode_tok_s"], "prefill_tok_s": prefill, "bandwidth_gbs": dec["bandwidth_gbs"],
            "bytes_per_token": dec["weight_bytes"]["total"], "ms_per_token": dec["ms_per_token"],
            "threading": dec.get("threading", "")}


def llama_cell(a: argparse.Namespace, s: Setting, gguf_path: Path) -> dict:
    cmd = [sys.executable, str(HERE), "_llama", "--gguf", str(gguf_path), "--tokens", str(a.tokens),
           "--prompt-tokens", str(a.prompt_tokens), "--threads", str(a.threads), "--vocab", str(a.vocab),
           "--extra-bufts", str(int(s.repack)), "--flash-attn", str(int(s.flash_attn)),
           "--max-decode-s", str(a.max_decode_s),
           "--prefill", *map(str, a.prefill_tokens)]
    # "env -u" so that a wait policy set in the caller's shell does not leak into the default cells
    return run_json(["env", "-u", "OMP_WAIT_POLICY", "-u", "GOMP_SPINCOUNT", *s.env_args(), *cmd], a.cell_timeout)


@dataclass
class Cells:
    """Every measurement of one row, by setting."""
    row: str
    runs: dict = field(default_factory=dict)  # Setting -> list of result dicts

    def add(self, s: Setting, res: dict) -> None:
        self.runs.setdefault(s, []).append(res)

    def decode(self, s: Setting) -> float:
        return med([r["decode_tok_s"] for r in self.runs.get(s, [])])

    def prefill(self, s: Setting, n: int) -> float:
        return med([r["prefill_tok_s"][str(n)] for r in self.runs.get(s, [])])

    def best(self, settings: list[Setting], metric) -> Setting:
        have = [s for s in settings if self.runs.get(s)]
        return max(have, key=metric) if have else settings[0]

    def tierlab_runs(self) -> list[dict]:
        return [r for s in TIERLAB_SETTINGS for r in self.runs.get(s, [])]


def measure_round(a: argparse.Namespace, rnd: int, key: str, paths: dict, cells: Cells) -> None:
    row = ROWS[key]
    tpath, gpath = paths[row.tierlab_model], paths[row.gguf]
    warm_files(tpath, gpath)
    llama = a.llama_settings
    order = [s for pair in zip(llama, TIERLAB_SETTINGS + [None] * len(llama)) for s in pair if s]
    shift = rnd % len(order)
    for s in order[shift:] + order[:shift]:
        try:
            res = tierlab_cell(a, s, tpath) if s.engine == "tierlab" else llama_cell(a, s, gpath)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            log(f"{key} #{rnd} {s.engine} [{s.name}] failed: {str(exc)[-300:]}")
            continue
        cells.add(s, res)
        pre = " ".join(f"{n}: {v:.0f}" for n, v in res["prefill_tok_s"].items())
        short = f" ({res['decode_tokens']} tokens)" if res.get("decode_tokens", a.tokens) < a.tokens else ""
        follow = res.get("threading", "").partition("threads follow the load")[2].strip()
        log(f"{key} #{rnd} {s.engine} [{s.name}] decode {res['decode_tok_s']:.2f} tok/s{short}, prefill {pre}; "
            f"load {os.getloadavg()[0]:.2f}" + (f"; threads {follow}" if follow else ""))


# --------------------------------------------------------------------------- the tables

def share(tok_s: float, nbytes: int, bw: float) -> str:
    return f"{100 * tok_s * nbytes / (bw * 1e9):.0f}%"


def decode_line(row: Row, c: Cells, gguf_bytes: int, llama: list[Setting]) -> str:
    tr = c.tierlab_runs()
    if not tr or not any(c.runs.get(s) for s in llama):
        return f"| {row.label} | (no complete measurement) ||||||"
    bw, tb = med([r["bandwidth_gbs"] for r in tr]), tr[0]["bytes_per_token"]
    ld, td = llama[0], TIERLAB_SETTINGS[0]
    lb, tbest = c.best(llama, c.decode), c.best(TIERLAB_SETTINGS, c.decode)
    return (f"| {row.label} | {c.decode(ld):.1f} ({share(c.decode(ld), gguf_bytes, bw)}) "
            f"| {c.decode(lb):.1f} ({share(c.decode(lb), gguf_bytes, bw)}; {lb.name}) "
            f"| {c.decode(td):.1f} ({share(c.decode(td), tb, bw)}) "
            f"| {c.decode(tbest):.1f} ({share(c.decode(tbest), tb, bw)}; {tbest.name}) "
            f"| **{c.decode(td) / c.decode(ld):.2f}x** | **{c.decode(tbest) / c.decode(lb):.2f}x** "
            f"| {tb / 2**20:.0f} / {gguf_bytes / 2**20:.0f} | {bw:.1f} |")


def prefill_line(row: Row, c: Cells, n: int, llama: list[Setting]) -> str:
    if not c.tierlab_runs() or not any(c.runs.get(s) for s in llama):
        return f"| {row.label} | (no complete measurement) |||||"
    ld, td = llama[0], TIERLAB_SETTINGS[0]
    lb = c.best(llama, lambda s: c.prefill(s, n))
    tbest = c.best(TIERLAB_SETTINGS, lambda s: c.prefill(s, n))
    return (f"| {row.label} | {c.prefill(ld, n):.0f} | {c.prefill(lb, n):.0f} ({lb.name}) | {c.prefill(td, n):.0f} "
            f"| {c.prefill(tbest, n):.0f} ({tbest.name}) | **{c.prefill(td, n) / c.prefill(ld, n):.2f}x** "
            f"| **{c.prefill(tbest, n) / c.prefill(lb, n):.2f}x** |")


def settings_lines(a: argparse.Namespace, rows: list[str], cells: dict) -> list[str]:
    """Every setting's medians, decode and prefill, with the number of runs behind them."""
    settings = TIERLAB_SETTINGS + a.llama_settings
    cols = [f"{s.engine}: {s.name}" for s in settings]
    out = ["| row | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for key in rows:
        c = cells[key]
        vals = []
        for s in settings:
            pre = " / ".join(f"{c.prefill(s, n):.0f}" for n in a.prefill_tokens)
            runs = c.runs.get(s, [])
            capped = "*" if any(r.get("decode_tokens", a.tokens) < a.tokens for r in runs) else ""
            vals.append(f"{c.decode(s):.1f}{capped}; {pre} (n={len(runs)})")
        out.append(f"| {ROWS[key].label} | " + " | ".join(vals) + " |")
    return out


def print_report(a: argparse.Namespace, rows: list[str], cells: dict, gbytes: dict, loads: list, started: str) -> None:
    import llama_cpp

    bws = [r["bandwidth_gbs"] for key in rows for r in cells[key].tierlab_runs()]
    print(f"\n{started} to {time.strftime('%H:%M UTC', time.gmtime())}; {cpu_line()}; llama-cpp-python "
          f"{llama_cpp.__version__}; {a.threads} threads each; 1-min load average {min(loads):.2f}-{max(loads):.2f}; "
          f"stream bandwidth {min(bws, default=0):.1f}-{max(bws, default=0):.1f} GB/s")
    print(f"command: {shlex.join([sys.executable] + sys.argv)}")
    print(f"slice: {a.layers} layers x {a.experts} experts, vocab {a.vocab}; {a.rounds} rounds of fresh "
          f"processes per cell, interleaved; medians. llama.cpp settings tried: "
          + "; ".join(s.name for s in a.llama_settings) + ". tierlab settings tried: "
          + "; ".join(s.name for s in TIERLAB_SETTINGS) + ".\n")
    print(f"Decode tok/s ({a.prompt_tokens}-token prompt, {a.tokens} greedy tokens; % of roofline)\n")
    print("| row | llama.cpp default | llama.cpp best | tierlab default | tierlab best | defaults ratio "
          "| best ratio | MiB/token tierlab / llama.cpp | bandwidth GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in rows:
        print(decode_line(ROWS[key], cells[key], gbytes[key], a.llama_settings))
    for n in a.prefill_tokens:
        print(f"\nPrefill tok/s ({n}-token prompt)\n")
        print("| row | llama.cpp default | llama.cpp best | tierlab default | tierlab best | defaults ratio "
              "| best ratio |")
        print("|---|---|---|---|---|---|---|")
        for key in rows:
            print(prefill_line(ROWS[key], cells[key], n, a.llama_settings))
    pre = " / ".join(str(n) for n in a.prefill_tokens)
    print(f"\nEvery setting: decode; prefill {pre} tok/s (medians)\n")
    print("\n".join(settings_lines(a, rows, cells)))
    if any(r.get("decode_tokens", a.tokens) < a.tokens for c in cells.values() for v in c.runs.values() for r in v):
        print(f"\n* some runs stopped decoding after --max-decode-s {a.max_decode_s:.0f} s (tok/s over the tokens done)")


# --------------------------------------------------------------------------- the command line

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("build", help="build llama-cpp-python from source (without AMX where the CPU lists it)")
    b.add_argument("--venv", required=True)
    b.add_argument("--amx", action="store_true", help="keep AMX in a native build")
    b.add_argument("--dry-run", action="store_true", help="print the command only")
    g = sub.add_parser("_gguf")
    g.add_argument("--llama-src", required=True)
    g.add_argument("--model", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--outtype", default="bf16")
    g.add_argument("--experts-type", default="")
    ll = sub.add_parser("_llama")
    ll.add_argument("--gguf", required=True)
    ll.add_argument("--tokens", type=int, default=128)
    ll.add_argument("--prompt-tokens", type=int, default=16)
    ll.add_argument("--prefill", type=int, nargs="*", default=[])
    ll.add_argument("--threads", type=int, default=2)
    ll.add_argument("--vocab", type=int, default=0)
    ll.add_argument("--seed", type=int, default=0)
    ll.add_argument("--extra-bufts", type=int, default=1, help="llama.cpp's extra buffer types (repacking)")
    ll.add_argument("--flash-attn", type=int, default=0, help="llama.cpp's flash attention (llama-cpp-python: off)")
    ll.add_argument("--max-decode-s", type=float, default=60.0)
    p.add_argument("--work", default="/work/big/sbs", help="folder for the slice and conversions (outside the repo)")
    p.add_argument("--llama-src", default=f"/work/llama-src/llama_cpp_python-{LLAMA_VERSION}",
                   help="extracted llama-cpp-python sdist (holds vendor/llama.cpp)")
    p.add_argument("--tierlab-python", default=str(REPO / ".venv" / "bin" / "python"),
                   help="a python with tierlab's dependencies; runs this checkout's tierlab")
    p.add_argument("--convert-python", default=sys.executable, help="a python with torch, for convert_hf_to_gguf")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--tokens", type=int, default=128, help="decode tokens")
    p.add_argument("--prompt-tokens", type=int, default=16,
                   help="prompt before the timed decode (timed as prefill too when it is a --prefill-tokens length)")
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=[128], help="timed prompt lengths")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per cell")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of: {', '.join(ROWS)}")
    p.add_argument("--max-decode-s", type=float, default=60.0,
                   help="llama.cpp stops decoding after this long (at least 8 tokens): spinning OpenMP waits on a "
                        "busy machine can take seconds per token")
    p.add_argument("--cell-timeout", type=float, default=400.0, help="seconds before one process counts as failed")
    p.add_argument("--flash-attn", choices=("both", "off"), default="both",
                   help="llama.cpp with flash attention off (llama-cpp-python's default) and on, or off only")
    p.add_argument("--json-out", default="", help="write every raw measurement here")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    a.llama_settings = llama_settings(getattr(a, "flash_attn", "both")) if not a.cmd else []
    if a.cmd:
        return {"build": cmd_build, "_gguf": cmd_gguf, "_llama": cmd_llama}[a.cmd](a)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {', '.join(unknown)} (known: {', '.join(ROWS)})")
    setup_llama_paths(Path(a.llama_src))
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    paths = prepare(a)
    gbytes = {key: gguf_bytes_per_token(paths[ROWS[key].gguf]) for key in rows}
    cells = {key: Cells(key) for key in rows}
    loads = [os.getloadavg()[0]]
    for rnd in range(a.rounds):
        for key in rows:
            measure_round(a, rnd, key, paths, cells[key])
            loads.append(os.getloadavg()[0])
            if a.json_out:
                raw = {k: {f"{s.engine}: {s.name}": v for s, v in c.runs.items()} for k, c in cells.items()}
                Path(a.json_out).write_text(json.dumps(raw, indent=1))
        if rnd + 1 < a.rounds:
            print(f"\n## after round {rnd + 1} of {a.rounds}", flush=True)
            print_report(a, rows, cells, gbytes, loads, started)
    print_report(a, rows, cells, gbytes, loads, started)


if __name__ == "__main__":
    main()
