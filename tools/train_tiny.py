"""Train the tiny Qwen3.6-architecture MoE models shipped in assets/ (dev-only tool).

Needs torch==2.13.0, transformers (5.x, for `Qwen3_5MoeForCausalLM`) and
tokenizers; none of them is a runtime dependency of tierlab. Runs on the CPU
with the transformers torch fallbacks (no flash-linear-attention).

Why train here: nothing may be downloaded at run time, yet the app must start
on a real MoE whose routing has the structure of a trained model (skewed,
sticky experts), which a randomly initialised checkpoint does not have.

Usage (see docs/model.md and the model cards for the exact commands used):

    python tools/train_tiny.py --preset main --out scratch/tiny-main --steps 2000
    python tools/train_tiny.py --preset main --out scratch/tiny-main --steps 2000 --resume
    python tools/train_tiny.py --preset main --out scratch/tiny-main --export assets/tiny-moe

The 8x2 fixture is trained with two routing terms on top of the LM loss:
`--aux-loss C` (a load balance taken in every layer on its own, so each layer
uses all its experts) and `--decorrelate C` (a penalty, in every layer, on the
router probability that consecutive positions share above 1/E, so that
neighbouring tokens do not reuse experts more than independent routing would:
the cache tables measure a cache against routing, not against the sticky
neighbours a small model learns).

Deterministic: the seed fixes the initialisation and batch i is drawn from a
generator seeded with (seed, i), so a resumed run sees the same batches as an
uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_corpus  # noqa: E402

#: Architecture presets. Hidden and intermediate sizes are multiples of 64 (the
#: quantiser's group size); layer types follow the interval rule (every 4th
#: layer is gated full attention, the rest Gated DeltaNet).
PRESETS = {
    "main": dict(
        num_hidden_layers=8, hidden_size=128, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=64, shared_expert_intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
    ),
    "8x2": dict(
        num_hidden_layers=4, hidden_size=128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    ),
}
VOCAB = 6000


def make_config(preset: str, vocab_size: int, aux_coef: float):
    from transformers import Qwen3_5MoeTextConfig

    p = dict(PRESETS[preset])
    n = p["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4,
        layer_types=layer_types,
        output_router_logits=True,
        router_aux_loss_coef=aux_coef,
        use_cache=False,
        bos_token_id=None,
        **p,
    )


def prepare_data(out: Path, vocab_size: int):
    """Tokenizer and token streams, built once and cached in the data folder."""
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok_path = out / "tokenizer.json"
    if not tok_path.exists():
        docs = tiny_corpus.train_documents()
        tiny_corpus.train_tokenizer(docs, vocab_size, tok_path)
    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id(tiny_corpus.EOS)
    streams = {}
    for name, fn in (("train", tiny_corpus.train_documents), ("heldout", tiny_corpus.heldout_documents)):
        f = out / f"{name}_ids.npy"
        if not f.exists():
            ids = []
            for enc in tok.encode_batch(fn()):
                ids.extend(enc.ids)
                ids.append(eos)
            np.save(f, np.asarray(ids, dtype=np.uint16))
        streams[name] = np.load(f).astype(np.int64)
    return tok, streams


def batch_at(stream: np.ndarray, step: int, seed: int, batch: int, seq: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s : s + seq] for s in starts]))


def lr_at(step: int, total: int, peak: float, warmup: int, decay: int) -> float:
    """Warm-up, constant, then a linear decay to 10% of the peak over the last `decay` steps.

    The rate before the decay does not depend on `total`, so a run can be
    extended with --resume and a larger --steps while still in the constant
    phase and stay identical to a run started with that --steps.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    start = max(warmup, total - decay)
    if step < start:
        return peak
    return peak * (1.0 - 0.9 * (step - start) / max(1, total - start))


def per_layer_balance_loss(router_logits, n_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style load balance taken in every layer on its own, then averaged over layers.

    transformers' `router_aux_loss_coef` balances the usage summed over all
    layers, which lets single layers route most tokens to a few experts; this
    term is E * sum_i f_i * P_i per layer (f_i: share of the layer's top-k
    slots given to expert i, P_i: its mean router probability), 1.0 when the
    layer is balanced.
    """
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        share = torch.zeros(n_experts, dtype=probs.dtype).scatter_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=probs.dtype)) / chosen.numel()
        losses.append(n_experts * (share * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def consecutive_overlap_loss(router_logits, batch: int, seq: int, n_experts: int) -> torch.Tensor:
    """How much consecutive positions share router probability, per layer, above independent routing.

    A balanced router can still send neighbouring tokens to the same experts,
    which an LRU cache exploits; this term is, in every layer, the mean over
    consecutive positions of sum_e p_t(e) * p_{t-1}(e) minus 1/E (its value
    for independent, balanced routing), averaged over layers. It is not
    clipped at 0, so it also rewards sharing less than chance.
    """
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1).reshape(batch, seq, n_experts)
        losses.append((probs[:, 1:] * probs[:, :-1]).sum(dim=-1).mean() - 1.0 / n_experts)
    return torch.stack(losses).mean()


@torch.no_grad()
def topk_reuse(router_logits, batch: int, seq: int, top_k: int) -> float:
    """Share of a position's top-k experts that the previous position also chose, averaged over layers.

    k/E for independent, balanced routing; logged to watch the decorrelation term.
    """
    shares = []
    for logits in router_logits:
        chosen = torch.topk(logits.float(), top_k, dim=-1).indices.reshape(batch, seq, top_k)
        same = (chosen[:, 1:, :, None] == chosen[:, :-1, None, :]).any(dim=-1)
        shares.append(same.float().mean())
    return float(torch.stack(shares).mean())


@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, seq: int, n: int = 16) -> float:
    """Mean next-token loss over n fixed, evenly spaced held-out windows."""
    model.eval()
    starts = np.linspace(0, len(stream) - seq - 1, n).astype(np.int64)
    x = torch.from_numpy(np.stack([stream[s : s + seq] for s in starts]))
    out = model(input_ids=x, labels=x, output_router_logits=False)
    model.train()
    return float(out.loss)


def make_summary(preset, step, log, a: dict, n_params, vocab, streams, command) -> dict:
    """training.json: settings, token counts, final losses and the loss curve."""
    import transformers

    last = [r for r in log if "heldout" in r][-1] if log else {}
    return {
        "preset": preset, "config": PRESETS[preset], "vocab_size": vocab,
        "params": n_params, "steps": step, "batch": a["batch"], "seq": a["seq"],
        "tokens_seen": step * a["batch"] * a["seq"], "train_stream_tokens": int(len(streams["train"])),
        "heldout_stream_tokens": int(len(streams["heldout"])), "lr": a["lr"], "warmup": a["warmup"],
        "decay_steps": a["decay_steps"], "weight_decay": a["wd"], "router_aux_loss_coef": a["aux_coef"],
        "per_layer_aux_loss": a.get("aux_loss", 0.0), "decorrelate": a.get("decorrelate", 0.0),
        "resumed": bool(a.get("resumed")),
        "seed": a["seed"], "threads": a["threads"],
        "final_train_loss_ema": log[-1]["loss_ema"] if log else None, "final_heldout_loss": last.get("heldout"),
        "command": command, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": sys.version.split()[0], "log": log,
    }


def save_ckpt(path: Path, model, opt, step: int, log: list, args):
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                "args": vars(args)}, tmp)
    os.replace(tmp, path)


def export(args):
    """Write the Hugging Face folder: bf16 safetensors, tokenizer, generation config."""
    from transformers import GenerationConfig, Qwen3_5MoeForCausalLM

    out = Path(args.out)
    ck = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=False)
    tok, _ = prepare_data(Path(ck["args"]["data"]), ck["args"]["vocab"])
    cfg = make_config(ck["args"]["preset"], tok.get_vocab_size(), ck["args"]["aux_coef"])
    eos_chat, eos_doc = tok.token_to_id("<|im_end|>"), tok.token_to_id(tiny_corpus.EOS)
    cfg.eos_token_id = eos_chat
    cfg.pad_token_id = eos_doc
    cfg.output_router_logits = False
    cfg.use_cache = True
    model = Qwen3_5MoeForCausalLM(cfg)
    model.load_state_dict(ck["model"])
    model.generation_config = GenerationConfig(
        eos_token_id=[eos_chat, eos_doc], pad_token_id=eos_doc, do_sample=True, temperature=0.7, top_k=40,
        top_p=0.95, max_new_tokens=256,
    )
    dst = Path(args.export)
    dst.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(dst)
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(tiny_corpus.tokenizer_config(4096), indent=2) + "\n")
    if (out / "training.json").exists():
        summary = json.loads((out / "training.json").read_text())
    else:  # a checkpoint of an unfinished run (for trying the export)
        _, streams = prepare_data(Path(ck["args"]["data"]), ck["args"]["vocab"])
        summary = make_summary(ck["args"]["preset"], ck["step"], ck["log"], ck["args"],
                               sum(p.numel() for p in model.parameters()), tok.get_vocab_size(), streams,
                               "(unfinished run)")
    (dst / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"exported {dst}")


def train(args):
    from transformers import Qwen3_5MoeForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    tok, streams = prepare_data(Path(args.data), args.vocab)
    cfg = make_config(args.preset, tok.get_vocab_size(), args.aux_coef)
    torch.manual_seed(args.seed)
    # grouped_mm computes the same experts as the eager loop (checked to 1e-8 on
    # gradients) and is several times faster on the CPU.
    model = Qwen3_5MoeForCausalLM._from_config(cfg, experts_implementation="grouped_mm")
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step, log = 0, []
    ck_path = out / "ckpt.pt"
    if args.resume and ck_path.exists():
        ck = torch.load(ck_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, log = ck["step"], ck["log"]
        print(f"resumed at step {step}", flush=True)
        args.resumed = True
    n_params = sum(p.numel() for p in model.parameters())
    print(f"preset={args.preset} params={n_params} train_tokens={len(streams['train'])} "
          f"heldout_tokens={len(streams['heldout'])} layer_types={cfg.layer_types}", flush=True)
    # Wall time and the loss EMA carry over a resume.
    t0 = time.time() - (log[-1]["sec"] if log else 0.0)
    ema = log[-1]["loss_ema"] if log else None
    while step < args.steps:
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.decay_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch_at(streams["train"], step, args.seed, args.batch, args.seq)
        res = model(input_ids=x, labels=x, output_router_logits=True)
        loss = res.loss
        if args.aux_loss:
            balance = per_layer_balance_loss(res.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
            loss = loss + args.aux_loss * balance
        if args.decorrelate:
            overlap = consecutive_overlap_loss(res.router_logits, args.batch, args.seq, cfg.num_experts)
            loss = loss + args.decorrelate * overlap
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lm = res.loss.item() - args.aux_coef * res.aux_loss.item()
        ema = lm if ema is None else 0.95 * ema + 0.05 * lm
        if step % args.log_every == 0 or step == args.steps:
            dt = time.time() - t0
            rec = {"step": step, "lr": lr, "loss": lm, "loss_ema": ema, "aux": res.aux_loss.item(),
                   **({"layer_balance": balance.item()} if args.aux_loss else {}),
                   **({"overlap": overlap.item()} if args.decorrelate else {}),
                   "topk_reuse": topk_reuse(res.router_logits, args.batch, args.seq, cfg.num_experts_per_tok),
                   "grad_norm": float(gn), "sec": round(dt, 1)}
            if step % args.eval_every == 0 or step == args.steps:
                rec["heldout"] = heldout_loss(model, streams["heldout"], args.seq)
            log.append(rec)
            print(json.dumps(rec), flush=True)
        if step % args.ckpt_every == 0 or step == args.steps:
            save_ckpt(ck_path, model, opt, step, log, args)
    summary = make_summary(args.preset, step, log, vars(args), n_params, tok.get_vocab_size(), streams,
                           "python tools/train_tiny.py " + " ".join(
                               shlex.quote(a) for a in sys.argv[1:] if a != "--resume"))
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("done", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="main")
    ap.add_argument("--out", required=True, help="run folder (checkpoints, tokenizer, token streams)")
    ap.add_argument("--data", default="scratch/tiny-data", help="tokenizer and token streams (shared by presets)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--decay-steps", type=int, default=400)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--aux-coef", type=float, default=0.02, help="transformers' load balance over all layers together")
    ap.add_argument("--aux-loss", type=float, default=0.0,
                    help="weight of a load-balancing loss taken in each layer on its own (0 = off)")
    ap.add_argument("--decorrelate", type=float, default=0.0,
                    help="weight of a per-layer penalty on router probability shared by consecutive positions (0 = off)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export", help="write the trained model as a Hugging Face folder here and exit")
    args = ap.parse_args(argv)
    if args.export:
        export(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
