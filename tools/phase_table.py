#!/usr/bin/env python3
"""`bench decode`'s ms/token per phase for several models, each beside its memory time.

Why: a phase that takes much longer than its bytes need at the measured stream
bandwidth is where decode loses its share of the roofline. One fresh `tierlab
bench decode --json` per model (warm, as it runs by default); the bytes each
phase reads come from the loaded model: DeltaNet, its layers' projections and
their recurrent state and conv inputs read and written back; attention, its
projections (the KV cache, a few hundred KiB here, is left out); routed
experts, top-k blobs per MoE layer; router + shared expert, the fused router
block and the shared expert's down projection; lm_head. Markdown table, ms
(memory time in brackets):

    .venv/bin/python tools/phase_table.py DIR... [--tokens 128] [--prompt-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from tierlab.engine.options import EngineOptions

PHASES = (("DeltaNet", ("deltanet",)), ("attention", ("attention",)), ('routed experts ("compute")', ("compute",)),
          ("router + shared expert", ("router", "shared")), ("lm_head", ("lm_head",)), ("other", ("other",)))


def phase_bytes(model: str) -> dict[str, float]:
    """Bytes a decoded token reads (and, for DeltaNet's state, writes) per phase of PHASES."""
    engine = EngineOptions(model=model).open(with_tokenizer=False)
    try:
        cfg = engine.config
        out = dict.fromkeys((name for name, _ in PHASES), 0.0)
        for layer in engine.layers:
            mixer, mlp = layer.mixer, layer.mlp
            if layer.kind == "linear_attention":
                state = mixer.new_state()
                out["DeltaNet"] += mixer.w_in.nbytes + mixer.w_out.nbytes + 2 * (state.recurrent.nbytes + state.conv.nbytes)
            else:
                out["attention"] += mixer.w_qkv.nbytes + mixer.wo.nbytes
            if hasattr(mlp, "w_in"):
                out["router + shared expert"] += mlp.w_in.nbytes + (mlp.shared_down.nbytes if mlp.shared_down is not None else 0)
        out['routed experts ("compute")'] = sum(cfg.moe_layers) * cfg.top_k * engine.store_stats().blob_nbytes
        out["lm_head"] = engine.lm_head.nbytes
        return out
    finally:
        engine.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=16)
    a = p.parse_args()
    columns = []
    for model in a.models:
        run = subprocess.run([sys.executable, "-m", "tierlab", "bench", "decode", "--model", model, "--tokens",
                              str(a.tokens), "--prompt-tokens", str(a.prompt_tokens), "--json"],
                             capture_output=True, text=True, check=True)
        report = json.loads(run.stdout.strip().splitlines()[-1])
        columns.append((model, report, phase_bytes(model)))
    print("| phase | " + " | ".join(m.rstrip("/").rsplit("/", 1)[-1] for m, _, _ in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, keys in PHASES:
        cells = []
        for _, report, nbytes in columns:
            ms = sum(report["ms_per_token"].get(k, 0.0) for k in keys)
            memory = nbytes[name] / (report["bandwidth_gbs"] * 1e9) * 1e3
            cells.append(f"{ms:.2f} ({memory:.2f})" if nbytes[name] else f"{ms:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = [f"{r['decode_tok_s']:.1f}, {100 * r['roofline_share']:.0f}%, {r['bandwidth_gbs']:.1f} GB/s"
             for _, r, _ in columns]
    print("| decode tok/s, % of the weights' roofline, stream | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
