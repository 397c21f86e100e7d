#!/usr/bin/env python3
"""One llama.cpp (llama-cpp-python) decode measurement on a GGUF, as one JSON line.

Not part of tierlab and not run by CI; run it with the llama.cpp venv's python
(bench/real_scale.sh does, with LLAMA_PY). llama.cpp keeps its defaults: mmap
on, its own weight repacking, its OpenMP pool as it configures it; only the
thread count is given (tierlab's numba uses every core, so llama.cpp gets the
same, where llama-cpp-python would take half).

The prompt is the one `tierlab bench decode` prefills (numpy's default_rng(seed),
uniform ids), decoding is greedy on the last logits, so the ids printed are
comparable with tierlab's on the same weights. Disk traffic is the process's
own read_bytes from /proc/self/io (page faults of the mmapped file included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def dense_kind(path: str) -> str:
    """The type the GGUF stores its lm_head (output.weight) in: the dense column of a table row."""
    import gguf

    types = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(path).tensors}
    return types.get("output.weight", "?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens (default 32)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0, help="the prompt's seed (tierlab bench decode uses 0)")
    ap.add_argument("--prompt-ids", default=None, help="comma-separated prompt ids instead of the random prompt")
    ap.add_argument("--no-repack", action="store_true",
                    help="use_extra_bufts=false: no repacked copy of the weights in anonymous memory, mmap only")
    ap.add_argument("--save-logits", default=None, help="write the logits after the prompt to this .npy file")
    a = ap.parse_args()

    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    if a.no_repack:  # not a constructor argument of llama-cpp-python: the defaults it starts from
        defaults = llama_cpp.llama_model_default_params

        def without_repack():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_model_default_params = without_repack
        llama_cpp.llama.llama_cpp.llama_model_default_params = without_repack
    t0 = time.perf_counter()
    llm = Llama(model_path=a.gguf, n_threads=a.threads, n_threads_batch=a.threads,
                n_ctx=a.prompt_tokens + a.tokens + 16, n_batch=max(32, a.prompt_tokens), verbose=False)
    load_s = time.perf_counter() - t0
    vocab = llm.n_vocab()
    if a.prompt_ids:
        prompt = [int(t) for t in a.prompt_ids.split(",")]
    else:
        prompt = [int(t) for t in np.random.default_rng(a.seed).integers(0, vocab, a.prompt_tokens)]

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).copy()

    io0 = read_bytes()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t0
    first = last_logits()
    if a.save_logits:
        np.save(a.save_logits, first)
    ids = [int(np.argmax(first))]
    io1 = read_bytes()
    t0 = time.perf_counter()
    for _ in range(a.tokens):
        llm.eval([ids[-1]])
        ids.append(int(np.argmax(last_logits())))
    decode_s = time.perf_counter() - t0
    io2 = read_bytes()
    print(json.dumps({
        "engine": "llama.cpp", "load_s": round(load_s, 2), "prompt_tokens": len(prompt), "decode_tokens": a.tokens,
        "prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": a.tokens / decode_s,
        "disk_mb_per_token": (io2 - io1) / a.tokens / 2**20, "prefill_disk_mb": (io1 - io0) / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "threads": a.threads, "repack": bool(llm.model_params.use_extra_bufts), "ids": ids,
        "dense_kind": dense_kind(a.gguf),
        "first_logits_head": [round(float(x), 4) for x in first[:8]],
    }))


if __name__ == "__main__":
    main()
