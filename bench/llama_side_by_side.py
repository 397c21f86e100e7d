#!/usr/bin/env python3
"""tierlab next to llama.cpp (llama-cpp-python) on one synthetic Qwen3.6 slice.

Not part of tierlab and not run by CI: it needs llama-cpp-python built from
source in its own venv, and that package's source tree (for the GGUF
converter and gguf-py). Run it with that venv's python:

    /work/llama-venv/bin/python bench/llama_side_by_side.py \
        --work /work/sbs --llama-src /work/llama-src/llama_cpp_python-0.3.36

What it does:

1. `tierlab make-synthetic --arch qwen3_5_moe` (random bf16 weights at the
   real per-layer shapes of Qwen3.6-35B-A3B), then `tierlab convert --bits 8`
   and `--bits 4`;
2. the same checkpoint to GGUF with llama.cpp's `convert_hf_to_gguf.py`,
   at matching bits: the routed experts in BF16 / Q8_0 / Q4_0 and every other
   matrix in BF16 (as tierlab's container keeps them), plus llama.cpp's own
   all-quantised files (`--outtype q8_0`, and Q4_0 from `llama_model_quantize`)
   as extra rows;
3. decode tok/s of both engines in one interleaved run (tierlab, llama.cpp,
   tierlab, llama.cpp, ...), same random prompt ids, same prompt and decode
   lengths, greedy, 2 threads each; warm (files in the page cache), a
   streaming regime (tierlab `--cache` well below the expert count, page
   cache dropped before each run of either engine: rows stream-*), a cold
   start with every slot (cold-*) and both engines inside one memory cgroup
   smaller than the model, so that both must stream experts from disk
   (squeeze-*; cgroup v1 memory controller, root);
4. a markdown table: medians, ratio, each engine's share of the roofline
   (memory bandwidth measured by `tierlab bench decode` in the same run,
   divided into the weight bytes one token reads in that engine's own file).

The converter's pre-tokenizer check does not know the synthetic tokenizer;
it is patched at run time (the pre-tokenizer is reported as "qwen2", one
dummy BPE merge is added, `--no-mtp`). Nothing of llama.cpp is copied here or
edited on disk.

llama.cpp runs with OMP_WAIT_POLICY=PASSIVE (as tierlab's own OpenMP layer):
libgomp's spinning workers lose whole time slices on a busy machine
(docs/benchmarks.md, "Side by side with llama.cpp"). A file whose run dies
with SIGILL (the native build's AMX path, on 2-D Q8_0/Q4_0 matrices) is
rerun with use_extra_bufts=false.

Internal subcommands (run in a fresh process each): `_gguf` converts,
`_llama` runs one llama.cpp decode measurement and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
DEFAULT_TIERLAB = REPO / ".venv" / "bin" / "tierlab"


# --------------------------------------------------------------------------- helpers

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm_files(*paths: Path) -> None:
    """Read files once so that both engines find them in the page cache."""
    buf = bytearray(16 << 20)
    for p in paths:
        files = [p] if p.is_file() else sorted(q for q in p.iterdir() if q.is_file())
        for q in files:
            with open(q, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def random_prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    # the same ids as `tierlab bench decode` (tierlab.app.lab.bench_decode.run_decode_bench)
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


# --------------------------------------------------------------------------- GGUF conversion

def _setup_llama_paths(llama_src: Path) -> Path:
    vendor = llama_src / "vendor" / "llama.cpp"
    if not (vendor / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{vendor}/convert_hf_to_gguf.py not found: pass --llama-src")
    for p in (vendor / "gguf-py", vendor):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    return vendor


def cmd_gguf(args: argparse.Namespace) -> None:
    """Convert args.model to args.out; experts at args.experts_type, other matrices at args.outtype."""
    _setup_llama_paths(Path(args.llama_src))
    import gguf
    import convert_hf_to_gguf as conv  # noqa: E402  (llama.cpp's converter, imported, not copied)

    expert_qtype = None
    if args.experts_type:
        expert_qtype = getattr(gguf.GGMLQuantizationType, args.experts_type.upper())
    real_get_model_class = conv.get_model_class

    def get_model_class(name, mmproj=False):
        base = real_get_model_class(name, mmproj=mmproj)

        class Patched(base):  # type: ignore[misc, valid-type]
            model_arch = base.model_arch

            def get_vocab_base_pre(self, tokenizer) -> str:
                return "qwen2"  # the synthetic tokenizer's hash is unknown to the converter

            def set_vocab(self):
                super().set_vocab()
                # the synthetic byte-level BPE has no merges, and llama.cpp refuses a BPE vocab without
                # any: one harmless merge (we feed token ids, never text)
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

    conv.get_model_class = get_model_class
    # --no-mtp: the synthetic slice has no multi-token-prediction block
    sys.argv = ["convert_hf_to_gguf.py", str(args.model), "--outtype", args.outtype, "--outfile", str(args.out),
                "--no-mtp"]
    conv.main()


def quantize_q4_0(src: Path, dst: Path, threads: int) -> None:
    """llama.cpp's own Q4_0 (llama_model_quantize, default mixture: output in Q6_K)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed with {rc}")


def gguf_bytes_per_token(path: Path) -> dict:
    """Weight bytes one decode token reads from a GGUF: experts at top_k/E, one embedding row, rest whole."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field(key):
        f = r.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else None

    n_exp, top_k = field("expert_count"), field("expert_used_count")
    dense = experts = lm_head = embd = 0
    for t in r.tensors:
        nb = int(t.n_bytes)
        if "_exps." in t.name:
            experts += nb * top_k // n_exp
        elif t.name == "token_embd.weight":
            embd = nb // int(t.shape[-1])  # one row (shape is ggml order: [n_embd, n_vocab])
        elif t.name == "output.weight":
            lm_head = nb
        else:
            dense += nb
    return {"dense": dense + embd, "experts": experts, "lm_head": lm_head,
            "total": dense + embd + experts + lm_head, "file_bytes": path.stat().st_size}


# --------------------------------------------------------------------------- one llama.cpp measurement

def cmd_llama(args: argparse.Namespace) -> None:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    # use_extra_bufts (weight repacking, AMX) is not a constructor argument of llama-cpp-python 0.3.36
    real_defaults = llama_cpp.llama_model_default_params

    def model_defaults():
        params = real_defaults()
        params.use_extra_bufts = bool(args.extra_bufts)
        return params

    llama_cpp.llama_model_default_params = model_defaults
    llama_cpp.llama.llama_cpp.llama_model_default_params = model_defaults
    n_ctx = args.prompt_tokens + args.tokens + 16
    llm = Llama(model_path=str(args.gguf), n_threads=args.threads, n_threads_batch=args.threads,
                n_ctx=n_ctx, n_batch=max(32, args.prompt_tokens), use_mmap=True, verbose=False)
    vocab = llm.n_vocab()

    def last_argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(vocab,))))

    prompt = random_prompt(args.vocab or vocab, args.prompt_tokens, args.seed)
    # warm-up as tierlab's bench does: 4 prompt tokens and one decode step
    llm.eval(prompt[:4])
    llm.eval([last_argmax()])
    llm.reset()
    dropped = drop_page_cache() if args.cold else False
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t0
    out = []
    t0 = time.perf_counter()
    for _ in range(args.tokens):
        tok = last_argmax()
        out.append(tok)
        llm.eval([tok])
    decode_s = time.perf_counter() - t0
    import resource

    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                      "prefill_tok_s": args.prompt_tokens / prefill_s, "decode_tok_s": args.tokens / decode_s,
                      "cold": dropped, "extra_bufts": bool(llm.model_params.use_extra_bufts),
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""), "tokens": out[:8]}))


# --------------------------------------------------------------------------- the run

def run_json(cmd: list[str], timeout: float = 900) -> dict:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


CGROUP = Path("/sys/fs/cgroup/memory/tierlab-sbs")


def cgroup_prefix(limit_mib: int) -> list[str]:
    """A memory cgroup (v1) holding both engines in the squeezed rows: anonymous memory and page cache
    together may not exceed limit_mib, so a model larger than that streams from disk in either engine."""
    if not limit_mib:
        return []
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(limit_mib << 20))
    return ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh"]


def tierlab_run(a, model: Path, cache: int | None, cold: bool, prompt_tokens: int, prefix=()) -> dict:
    cmd = [a.tierlab, "bench", "decode", "--model", str(model), "--tokens", str(a.tokens),
           "--prompt-tokens", str(prompt_tokens), "--json"]
    if cache:
        cmd += ["--cache", str(cache)]
    # empty RAM slots, as the tables in docs/benchmarks.md were measured
    cmd += ["--cold"]
    if cold:
        cmd += ["--drop-page-cache"]
    env_cmd = list(prefix) + ["env", f"NUMBA_NUM_THREADS={a.threads}"] + cmd
    return run_json(env_cmd)


def llama_run(a, gguf_path: Path, cold: bool, vocab: int, prompt_tokens: int, prefix=()) -> dict:
    # OpenMP workers that spin (libgomp's default) lose whole time slices at every graph barrier on a
    # busy machine (docs/benchmarks.md, "Side by side with llama.cpp"); tierlab sets PASSIVE for its
    # own OpenMP layer, so llama.cpp gets the same.
    env = ["env", f"OMP_WAIT_POLICY={a.llama_omp_wait}"] if a.llama_omp_wait else []
    cmd = list(prefix) + env + [sys.executable, str(HERE), "_llama", "--gguf", str(gguf_path), "--tokens", str(a.tokens),
                 "--prompt-tokens", str(prompt_tokens), "--threads", str(a.threads), "--vocab", str(vocab)]
    if cold:
        # weights stay mmapped (no repacked copy in anonymous memory), so the page-cache drop matters
        cmd += ["--cold", "--extra-bufts", "0"]
    try:
        return run_json(cmd)
    except RuntimeError as exc:
        # the native build's AMX path can die with SIGILL: rerun without extra buffers
        if "--extra-bufts" in cmd or "(-4)" not in str(exc):
            raise
        log("llama.cpp died with SIGILL; rerunning with use_extra_bufts=0")
        res = run_json(cmd + ["--extra-bufts", "0"])
        res["sigill_retry"] = True
        return res


def prepare(a) -> dict:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    bf16 = work / "bf16"
    if not (bf16 / "config.json").is_file():
        log(f"make-synthetic {a.layers} layers x {a.experts} experts -> {bf16}")
        subprocess.run([a.tierlab, "make-synthetic", "--arch", "qwen3_5_moe", "--layers", str(a.layers),
                        "--experts", str(a.experts), "--out", str(bf16)], check=True)
    paths = {"bf16": bf16}
    for bits, dense_bits in ((8, 0), (4, 0), (8, 8), (4, 4)):
        # int8 / int4: experts only (dense bf16, as the "experts" GGUFs); int8-d8 / int4-d4:
        # the dense projections quantised too (as llama.cpp's all-quantised files)
        name = f"int{bits}" + (f"-d{dense_bits}" if dense_bits else "")
        out = work / name
        if not (out / "tierlab_container.json").is_file():
            log(f"tierlab convert --bits {bits} --dense-bits {dense_bits or '-'}")
            subprocess.run([a.tierlab, "convert", "--model", str(bf16), "--out", str(out), "--bits", str(bits)]
                           + (["--dense-bits", str(dense_bits)] if dense_bits else []), check=True)
        paths[name] = out
    ggufs = {
        # name: (outtype for non-expert matrices, expert type or "")
        "BF16": ("bf16", ""),
        "Q8_0-experts": ("bf16", "q8_0"),
        "Q4_0-experts": ("bf16", "q4_0"),
        "Q8_0-all": ("q8_0", ""),
    }
    for name, (outtype, etype) in ggufs.items():
        out = work / f"slice-{name}.gguf"
        if not out.is_file():
            log(f"convert_hf_to_gguf -> {out.name}")
            tmp = out.with_suffix(".partial")
            cmd = [sys.executable, str(HERE), "_gguf", "--llama-src", a.llama_src, "--model", str(bf16),
                   "--out", str(tmp), "--outtype", outtype] + (["--experts-type", etype] if etype else [])
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            tmp.rename(out)
        paths[name] = out
    q4 = work / "slice-Q4_0-all.gguf"
    if not q4.is_file():
        log("llama_model_quantize BF16 -> Q4_0")
        quantize_q4_0(paths["BF16"], q4.with_suffix(".partial"), a.threads)
        q4.with_suffix(".partial").rename(q4)
    paths["Q4_0-all"] = q4
    return paths


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    g = sub.add_parser("_gguf")
    g.add_argument("--llama-src", required=True)
    g.add_argument("--model", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--outtype", default="bf16")
    g.add_argument("--experts-type", default="")
    ll = sub.add_parser("_llama")
    ll.add_argument("--gguf", required=True)
    ll.add_argument("--tokens", type=int, default=32)
    ll.add_argument("--prompt-tokens", type=int, default=32)
    ll.add_argument("--threads", type=int, default=2)
    ll.add_argument("--vocab", type=int, default=0)
    ll.add_argument("--seed", type=int, default=0)
    ll.add_argument("--cold", action="store_true")
    ll.add_argument("--extra-bufts", type=int, default=1, help="llama.cpp's extra buffer types (repack, AMX)")
    p.add_argument("--work", default="/work/sbs", help="folder for the slice and its conversions (outside the repo)")
    p.add_argument("--llama-src", default="/work/llama-src/llama_cpp_python-0.3.36",
                   help="extracted llama-cpp-python sdist (holds vendor/llama.cpp)")
    p.add_argument("--tierlab", default=str(DEFAULT_TIERLAB))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream-cache", type=int, default=8, help="tierlab --cache in the streaming rows")
    p.add_argument("--stream-prompt-tokens", type=int, default=4,
                   help="prompt length in the streaming rows (short, so that decode itself meets the cold experts)")
    p.add_argument("--rows", default="bf16,int8,int4,int8-all,int4-all,stream-int4,stream-bf16",
                   help="comma list of rows to run")
    p.add_argument("--mem-limit-mib", type=int, default=1280,
                   help="memory cgroup limit (anonymous + page cache) in the squeeze-* rows")
    p.add_argument("--squeeze-cache", type=int, default=16, help="tierlab --cache in the squeeze-* rows")
    p.add_argument("--json-out", default="", help="write every raw measurement here")
    p.add_argument("--llama-omp-wait", default="PASSIVE", help="OMP_WAIT_POLICY for llama.cpp ('' = libgomp default)")
    a = p.parse_args()
    if a.cmd == "_gguf":
        return cmd_gguf(a)
    if a.cmd == "_llama":
        return cmd_llama(a)

    _setup_llama_paths(Path(a.llama_src))
    import llama_cpp

    paths = prepare(a)
    vocab = json.loads((paths["bf16"] / "config.json").read_text())["vocab_size"]
    # row: (label, tierlab model, gguf, tierlab cache, cold)
    spec = {
        "bf16": ("bf16 / BF16", "bf16", "BF16", None, False),
        "int8": ("int8 / Q8_0 experts", "int8", "Q8_0-experts", None, False),
        "int4": ("int4 / Q4_0 experts", "int4", "Q4_0-experts", None, False),
        "int8-all": ("int8 + dense int8 / Q8_0 everything", "int8-d8", "Q8_0-all", None, False),
        "int4-all": ("int4 + dense int4 / Q4_0 everything", "int4-d4", "Q4_0-all", None, False),
        # the container without --dense-bits against the all-quantised files (unequal bits: tierlab
        # reads its dense weights in bf16)
        "int8-all-experts-only": ("int8 / Q8_0 everything", "int8", "Q8_0-all", None, False),
        "int4-all-experts-only": ("int4 / Q4_0 everything", "int4", "Q4_0-all", None, False),
        "stream-int4": (f"streaming int4 / Q4_0 experts, cache {a.stream_cache}/{a.experts}, cold",
                        "int4", "Q4_0-experts", a.stream_cache, True),
        "stream-bf16": (f"streaming bf16 / BF16, cache {a.stream_cache}/{a.experts}, cold",
                        "bf16", "BF16", a.stream_cache, True),
        "stream-int8": (f"streaming int8 / Q8_0 experts, cache {a.stream_cache}/{a.experts}, cold",
                        "int8", "Q8_0-experts", a.stream_cache, True),
        # page cache dropped, but tierlab's RAM cache holds every expert, as llama.cpp's mapping does
        "cold-int4": (f"cold int4 / Q4_0 experts, cache {a.experts}/{a.experts}", "int4", "Q4_0-experts", None, True),
        "cold-bf16": (f"cold bf16 / BF16, cache {a.experts}/{a.experts}", "bf16", "BF16", None, True),
        # both engines in one memory cgroup smaller than the model: experts really stream from disk
        "squeeze-int4": (f"squeezed int4 / Q4_0 experts, {a.mem_limit_mib} MiB cgroup, cache "
                         f"{a.squeeze_cache}/{a.experts}, cold", "int4", "Q4_0-experts", a.squeeze_cache, True, True),
        "squeeze-int8": (f"squeezed int8 / Q8_0 experts, {a.mem_limit_mib} MiB cgroup, cache "
                         f"{a.squeeze_cache}/{a.experts}, cold", "int8", "Q8_0-experts", a.squeeze_cache, True, True),
        "squeeze-int4-all": (f"squeezed int4 + dense int4 / Q4_0 everything, {a.mem_limit_mib} MiB cgroup, cache "
                             f"{a.squeeze_cache}/{a.experts}, cold", "int4-d4", "Q4_0-all", a.squeeze_cache, True, True),
    }
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    log(f"llama-cpp-python {llama_cpp.__version__}; load {loadavg()}")
    raw = []
    table = []
    loads = [os.getloadavg()[0]]
    for key in rows:
        label, tmodel, gname, cache, cold, *squeeze = spec[key]
        tpath, gpath = paths[tmodel], paths[gname]
        prefix = cgroup_prefix(a.mem_limit_mib) if squeeze else []
        bpt = gguf_bytes_per_token(gpath)
        if not cold:
            warm_files(tpath, gpath)
        ts, ls = [], []
        for rep in range(a.repeats):
            npr = a.stream_prompt_tokens if cold else a.prompt_tokens
            t = tierlab_run(a, tpath, cache, cold, npr, prefix)
            ts.append(t)
            log(f"{key} #{rep} tierlab {t['decode_tok_s']:.2f} tok/s (bw {t['bandwidth_gbs']:.1f} GB/s) load {loadavg()}")
            lres = llama_run(a, gpath, cold, vocab, npr, prefix)
            ls.append(lres)
            log(f"{key} #{rep} llama.cpp {lres['decode_tok_s']:.2f} tok/s load {loadavg()}")
            loads.append(os.getloadavg()[0])
        bw = med([t["bandwidth_gbs"] for t in ts])
        t_dec, l_dec = med([t["decode_tok_s"] for t in ts]), med([x["decode_tok_s"] for x in ls])
        t_pre, l_pre = med([t["prefill_tok_s"] for t in ts]), med([x["prefill_tok_s"] for x in ls])
        t_bytes = ts[0]["weight_bytes"]["total"]
        row = {
            "row": key, "label": label, "tierlab_decode": t_dec, "llama_decode": l_dec, "ratio": t_dec / l_dec,
            "pair_ratio": med([t["decode_tok_s"] / x["decode_tok_s"] for t, x in zip(ts, ls)]),
            "tierlab_prefill": t_pre, "llama_prefill": l_pre, "bandwidth_gbs": bw,
            "tierlab_mib_per_token": t_bytes / 2**20, "llama_mib_per_token": bpt["total"] / 2**20,
            "tierlab_roofline_share": t_dec * t_bytes / (bw * 1e9),
            "llama_roofline_share": l_dec * bpt["total"] / (bw * 1e9),
            "tierlab_ms_per_token": {k: med([t["ms_per_token"][k] for t in ts]) for k in ts[0]["ms_per_token"]},
            "tierlab_ram_hit": med([t["ram_hit"] for t in ts]),
            "tierlab_disk_mib_per_token": med([t["disk_mb_per_token"] for t in ts]),
            "tierlab_all": [t["decode_tok_s"] for t in ts], "llama_all": [x["decode_tok_s"] for x in ls],
        }
        table.append(row)
        raw.append({"row": key, "tierlab": ts, "llama": ls, "gguf_bytes": bpt})
        if a.json_out:
            Path(a.json_out).write_text(json.dumps({"rows": table, "raw": raw}, indent=1))

    print(f"\nllama-cpp-python {llama_cpp.__version__}, {a.threads} threads each; slice {a.layers} layers x "
          f"{a.experts} experts; prompt {a.prompt_tokens} (streaming/cold rows: {a.stream_prompt_tokens}), decode "
          f"{a.tokens} tokens; {a.repeats} interleaved "
          f"repeats, medians; 1-min load average {min(loads):.1f}-{max(loads):.1f}\n")
    print("| tierlab / llama.cpp | tierlab tok/s | llama.cpp tok/s | ratio (of medians; median of pairs) "
          "| tierlab MiB/tok, roofline share "
          "| llama.cpp MiB/tok, roofline share | prefill tok/s tierlab / llama.cpp | bandwidth GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['label']} | {r['tierlab_decode']:.2f} | {r['llama_decode']:.2f} | {r['ratio']:.2f}x; "
              f"{r['pair_ratio']:.2f}x "
              f"| {r['tierlab_mib_per_token']:.0f}, {100 * r['tierlab_roofline_share']:.0f}% "
              f"| {r['llama_mib_per_token']:.0f}, {100 * r['llama_roofline_share']:.0f}% "
              f"| {r['tierlab_prefill']:.1f} / {r['llama_prefill']:.1f} | {r['bandwidth_gbs']:.1f} |")
    if CGROUP.is_dir():
        try:
            CGROUP.rmdir()  # empty once the runs have exited
        except OSError:
            pass
    print("\ntierlab ms/token per phase (medians):")
    for r in table:
        ms = r["tierlab_ms_per_token"]
        print(f"- {r['label']}: " + " ".join(f"{k} {v:.1f}" for k, v in ms.items() if v >= 0.05)
              + f" | RAM hit {r['tierlab_ram_hit']:.0f}%, disk {r['tierlab_disk_mib_per_token']:.1f} MiB/token")


if __name__ == "__main__":
    main()
