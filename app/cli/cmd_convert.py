"""`tierlab convert`: a Hugging Face MoE checkpoint -> a quantised expert container."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="quantise a checkpoint's experts to int4/int8 (one blob per expert)",
        description="Convert a Hugging Face MoE checkpoint into a tierlab quantised expert container, layer by layer.",
    )
    p.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="container folder to write")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4, help="bits per expert weight (default 4)")
    p.add_argument("--dense-bits", type=int, choices=(4, 8), default=None,
                   help="also quantise the dense projections (attention, DeltaNet, shared expert, lm_head) "
                        "to this many bits; the router, embedding and norms stay as they are (default: keep them)")
    p.add_argument("--group", type=int, default=64, help="quantisation group size (only 64 is supported)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    p.set_defaults(run=run)


class TextProgressBar:
    """A one-line progress bar on stderr, redrawn in place; plain lines when not a terminal."""

    def __init__(self, stream=None, width: int = 30) -> None:
        # sys.stderr is looked up per bar, not once at import: it may be replaced (tests, redirection)
        self.stream = stream if stream is not None else sys.stderr
        self.width, self.start = width, time.monotonic()
        self.tty = self.stream.isatty()

    def __call__(self, done: int, total: int, what: str) -> None:
        frac = done / max(1, total)
        filled = int(frac * self.width)
        elapsed = time.monotonic() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {100 * frac:5.1f}% {what}  {elapsed:.0f}s, eta {eta:.0f}s"
        if self.tty:
            self.stream.write("\r" + line.ljust(90) + ("\n" if done >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    from tierlab.engine.container import convert

    info = convert(Path(args.model), Path(args.out), bits=args.bits, group=args.group, force=args.force,
                   progress=TextProgressBar(), dense_bits=args.dense_bits or 0)
    total = info.n_layers * info.n_experts * info.blob_stride
    dense = f"dense projections int{info.dense_bits}" if info.dense_bits else "dense tensors as in the source"
    print(f"wrote {args.out}: {info.n_layers} layers x {info.n_experts} experts, int{info.bits}, "
          f"{info.blob_nbytes / 2**20:.2f} MiB per expert, {total / 2**30:.2f} GiB of experts; {dense}; "
          f"{info.checksum} checksums (`tierlab inspect --verify` checks them)")
    return 0
