"""`tierlab make-synthetic`: a random-weight checkpoint with real per-layer shapes, at any size.

Why: the real checkpoints are 60-70 GB. A checkpoint with the exact per-layer
shapes of Qwen3.6-35B-A3B or Qwen3-30B-A3B exercises the converter, the
kernels and the expert cache at true expert sizes; with few layers and
experts in seconds, with the full 40 x 256 shape for the real-scale
benchmarks. engine/synthetic.py draws every tensor from its own seeded
generator and writes it layer by layer with numpy alone: to a Hugging Face
folder (bf16 safetensors under the names transformers' `save_pretrained`
writes, so transformers loads it) or, with `--bits`, straight to a tierlab
container (equal to `convert` of the folder with the same seed). A minimal
byte-level tokenizer.json and a ChatML template are written so the engine's
text path works too (the text is meaningless).

`synthetic_config` and `write_weights` are the transformers side, used by the
tests that check the hand-written folder against transformers' own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from tierlab.engine.config import QWEN3_5_MOE, QWEN3_MOE, load_config
from tierlab.engine.errors import ModelError
from tierlab.engine.synthetic import real_shape, write_container, write_hf_folder

#: the architecture presets make-synthetic writes
ARCHS = (QWEN3_5_MOE, QWEN3_MOE)
WEIGHTS_FILE = "model.safetensors"
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bits(text: str) -> int:
    if text not in ("0", "4", "8"):
        raise argparse.ArgumentTypeError(f"must be 4 or 8 (0: unquantised), got {text!r}")
    return int(text)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "make-synthetic",
        help="write a random-weight MoE checkpoint with real per-layer shapes",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--arch", choices=ARCHS, required=True, help="qwen3_5_moe (Qwen3.6-35B-A3B) or qwen3_moe (Qwen3-30B-A3B)")
    p.add_argument("--layers", type=int, required=True, help="number of decoder layers (the real models: 40 / 48)")
    p.add_argument("--experts", type=int, required=True, help="experts per layer (the real models: 256 / 128)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default 8, as the real models)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096; the real models: 248320 / 151936)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default the real model's, 2048)")
    p.add_argument("--moe-inter", type=int, default=None, help="expert intermediate size (default the real model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=_bits, default=0, metavar="4|8",
                   help="write a tierlab container with int4/int8 experts instead of a Hugging Face folder")
    p.add_argument("--dense-bits", type=_bits, default=0, metavar="0|4|8",
                   help="with --bits: the container's dense projections int8/int4 (default 0: bf16)")
    p.add_argument("--shard-gb", type=float, default=4.0, help="Hugging Face folder: safetensors shard size (default 4)")
    p.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    p.set_defaults(run=run)


def synthetic_config(arch: str, layers: int, experts: int, top_k: int, vocab: int):
    """A transformers config with the real model's per-layer sizes."""
    special = {"bos_token_id": None, "eos_token_id": 258, "pad_token_id": 256}
    if arch == QWEN3_5_MOE:
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            vocab_size=vocab, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=experts,
            # every 4th layer is full attention, as in the real model; with fewer than
            # 4 layers the last one is, because transformers' cache needs at least one
            num_experts_per_tok=top_k, full_attention_interval=min(4, layers), rms_norm_eps=1e-6,
            max_position_embeddings=262144, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
            **special,
        )
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        **special,
    )


def write_weights(state_dict: dict, path: Path) -> int:
    """Stream a transformers state dict into one safetensors file, experts one by one.

    transformers keeps each layer's experts fused (`gate_up_proj` [E, 2I, H],
    gate rows first, and `down_proj` [E, H, I]); they are written per expert
    (`experts.{e}.gate_proj.weight` ...), the names `save_pretrained` writes.
    """
    from tierlab.engine.safetensors_file import TensorSpec, dtype_name, write_file

    parts = []  # (name, tensor) in file order; expert slices are views, converted one at a time
    for name in sorted(state_dict):
        t = state_dict[name]
        if name.endswith(FUSED_EXPERTS[0]):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                parts += [(f"{base}{e}.gate_proj.weight", t[e, :inter]), (f"{base}{e}.up_proj.weight", t[e, inter:])]
        elif name.endswith(FUSED_EXPERTS[1]):
            base = name[: -len("down_proj")]
            parts += [(f"{base}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            parts.append((name, t))
    parts.sort(key=lambda part: part[0])
    specs = [TensorSpec(name, dtype_name(_storage(t.new_empty(0))), tuple(t.shape)) for name, t in parts]
    return write_file(path, specs, (_storage(t) for _, t in parts), {"format": "pt"})


def _storage(t) -> np.ndarray:
    """A torch tensor as a numpy array in safetensors storage form (bf16 as its uint16 bits)."""
    import torch

    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def write_tokenizer(out: Path, vocab: int) -> None:
    """Byte-level tokenizer: 256 byte tokens, the ChatML specials, filler tokens up to vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    table = {ch: i for i, ch in enumerate(alphabet)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        table[tok] = 256 + i
    for i in range(256 + len(SPECIAL_TOKENS), vocab):
        table[f"<|filler_{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 32768,
    }, indent=1) + "\n")
    (out / "chat_template.jinja").write_text(CHATML_TEMPLATE)


def read_back(out: Path) -> None:
    """Read the written folder with the engine's config parser and checkpoint reader (ModelError if not)."""
    from tierlab.engine.checkpoint import Checkpoint

    Checkpoint(out, load_config(out)).expert_pieces(0)


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's byte-to-unicode map (printable bytes map to themselves)."""
    code = ord(ch)
    if code >= 256:
        shifted = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
        return shifted[code - 256]
    return code


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    sizes = {k: v for k, v in (("hidden", args.hidden), ("moe_inter", args.moe_inter)) if v is not None}
    shape = real_shape(args.arch, args.layers, args.experts, args.top_k, args.vocab, **sizes)
    shape.check()
    if args.dense_bits and not args.bits:
        raise ModelError("--dense-bits needs --bits (it quantises a container's dense projections)")
    if not args.shard_gb > 0:
        raise ModelError(f"--shard-gb must be a positive number, got {args.shard_gb}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelError("exists and is not an empty folder", out)
    out.mkdir(parents=True, exist_ok=True)
    what = f"int{args.bits} container" if args.bits else "Hugging Face folder (bf16)"
    print(f"writing {args.arch}: {args.layers} layers x {args.experts} experts, vocab {args.vocab}, {what} ...",
          file=sys.stderr)
    started = time.monotonic()

    def progress(done: int, total: int, label: str) -> None:
        print(f"  {label} ({time.monotonic() - started:.0f} s)", file=sys.stderr)

    write_tokenizer(out, args.vocab)
    if args.bits:
        write_container(shape, args.seed, out, args.bits, args.dense_bits, progress)
        from tierlab.engine.container import ContainerExpertSource

        ContainerExpertSource(out).close()
        load_config(out)
    else:
        write_hf_folder(shape, args.seed, out, int(args.shard_gb * 2**30))
        read_back(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 2**20:.0f} MiB) in {time.monotonic() - started:.0f} s")
    return 0
