"""What int8 and int4 expert containers cost in quality, for docs/benchmarks.md.

    python tools/quant_quality.py MODEL_DIR [MODEL_DIR ...] [--tokens 512]

For each model: convert it to int8 and int4 containers, experts only (dense
weights stay as they are) and with `--dense-bits` at the same bits (the
dense projections quantised too), then teacher-force the same text through
all five and print the TF-NLL and its relative change. The text is the model's
`heldout.txt` when it has one, else random token ids (for synthetic slices).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from tierlab.engine.container import convert
from tierlab.app.lab.evaluate import teacher_forced_nll
from tierlab.engine.model import load_engine


def reference(model: Path, n: int) -> tuple[list[int], list[int], str]:
    heldout = model / "heldout.txt"
    if heldout.exists():
        from tierlab.engine.tokenizer import Tokenizer

        ids = Tokenizer.from_folder(model).encode(heldout.read_text(encoding="utf-8"))[: 32 + n]
        return ids[:32], ids, "heldout.txt"
    engine = load_engine(model, with_tokenizer=False)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, engine.config.vocab_size, 32 + n)]
    return ids[:32], ids, "random ids"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    variants = ((8, 0), (4, 0), (8, 8), (4, 4))
    names = ["int8", "int4", "int8 + dense int8", "int4 + dense int4"]
    print("| model | text | tokens | source | TF-NLL | " + " | ".join(f"{n} | change" for n in names) + " |")
    print("|---|---|---|---|---:|" + "---:|---:|" * len(variants))
    for model in args.models:
        prompt, full, text = reference(model, args.tokens)
        base_engine = load_engine(model, with_tokenizer=False)
        kind = base_engine.store_stats().expert_kind
        base, n = teacher_forced_nll(base_engine, prompt, full)
        cells = []
        with tempfile.TemporaryDirectory() as tmp:
            for bits, dense_bits in variants:
                out = Path(tmp) / f"int{bits}-dense{dense_bits}"
                convert(model, out, bits=bits, dense_bits=dense_bits)
                nll, _ = teacher_forced_nll(load_engine(out, with_tokenizer=False), prompt, full)
                cells += [f"{nll:.4f}", f"{100 * (nll - base) / base:+.2f}%"]
        print(f"| {model.name} | {text} | {n} | {kind} | {base:.4f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
