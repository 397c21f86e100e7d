"""A prompt's routed experts, the per-expert path against the batched one, interleaved.

"before" is one expert per call of `qmatmat.expert_matmat` (what a prompt's experts ran before
the batches); "after" is what `ExpertStore.forward_batch` does: an expert of at most
`few_token_limit(kind, ...)` tokens (or `--limit`) by the one-token kernel's dots, all such experts in
one launch pair (`experts_tokens`), the others by `qmatmat.experts_matmat`, one expert per
launch ("after 1") or eight ("after 8"); "one-token" is `qmatvec.expert_forward_tokens` at
every T (where the limit comes from). 64 different real blobs (random weights through the
quantiser) in rotation, so the weights come from memory as a prompt's do; each round times
every variant once; prints the medians (wall and process CPU time) per expert.
`--layer` instead times one layer of a prompt: `--prompt` tokens routed top-8 over `--experts`
(default 64; the real models 256) with skewed popularity, all of them in one call ("after")
or one expert per call ("before"); `--limit` and `--per-expert` (the few-token experts one
launch pair each, as before `experts_tokens`) time the choices `forward_batch` made earlier.

    python tools/prompt_experts_bench.py [--kind int4] [--tokens 1,2,6,16,32]
    python tools/prompt_experts_bench.py --layer [--prompt 128] [--experts 256] [--limit N] [--per-expert]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tierlab.engine import quant as Q
from tierlab.engine.kernels.experts_tokens import experts_tokens, few_token_limit
from tierlab.engine.kernels.qmatmat import expert_matmat, experts_matmat
from tierlab.engine.kernels.qmatvec import expert_forward_tokens

H, I, K = 2048, 512, 8


def blobs_of(kind: str, n: int, rng) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        g, u, d = (rng.standard_normal(s).astype(np.float32) * 0.02 for s in ((I, H), (I, H), (H, I)))
        if kind in ("int8", "int4"):
            out.append(Q.build_blob(g, u, d, 8 if kind == "int8" else 4))
        elif kind == "bf16":
            out.append(np.concatenate([(m.view(np.uint32) >> 16).astype(np.uint16).reshape(-1)
                                       for m in (g, u, d)]).view(np.uint8))
        else:
            out.append(np.concatenate([m.reshape(-1) for m in (g, u, d)]).view(np.uint8))
    return out


def after(kind, blobs, x, token_rows, out, out_rows, limit: int, batched: bool = True) -> None:
    """forward_batch's choice of kernel for each expert of a batch (`batched`: the few-token
    experts in one launch pair, else a pair each)."""
    wide = [i for i, r in enumerate(token_rows) if len(r) > limit]
    if wide:
        experts_matmat(kind, [blobs[i] for i in wide], H, I, x, [token_rows[i] for i in wide], out,
                       [out_rows[i] for i in wide])
    few = [i for i, r in enumerate(token_rows) if len(r) <= limit]
    if few and batched:
        experts_tokens(kind, [blobs[i] for i in few], H, I, x, [token_rows[i] for i in few], out,
                       [out_rows[i] for i in few])
    elif few:
        for i in few:
            out[out_rows[i]] = expert_forward_tokens(kind, blobs[i], H, I, x[token_rows[i]])


def timed(variants: dict, rounds: int, per: int) -> dict:
    for f in variants.values():
        f()
    got = {k: [] for k in variants}
    for _ in range(rounds):
        for k, f in variants.items():
            w, c = time.perf_counter(), time.process_time()
            f()
            got[k].append(((time.perf_counter() - w) * 1e3 / per, (time.process_time() - c) * 1e3 / per))
    return {k: (float(np.median([a for a, _ in v])), float(np.median([b for _, b in v]))) for k, v in got.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="int4", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--tokens", default="1,2,6,16,32", help="tokens per expert, comma-separated")
    p.add_argument("--layer", action="store_true", help="one layer of a prompt instead")
    p.add_argument("--prompt", type=int, default=128, help="--layer: the prompt's tokens")
    p.add_argument("--experts", type=int, default=64, help="--layer: experts per layer (the real models: 256)")
    p.add_argument("--limit", type=int, default=None, help="most tokens of a few-token expert (default: the engine's)")
    p.add_argument("--per-expert", action="store_true", help="the few-token experts a launch pair each")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    E = args.experts if args.layer else 64
    limit = few_token_limit(args.kind, H, I) if args.limit is None else args.limit
    batched = not args.per_expert
    blobs = blobs_of(args.kind, E, rng)
    if args.layer:
        T = args.prompt
        x = rng.standard_normal((T, H)).astype(np.float32)
        popularity = rng.dirichlet(np.full(E, 0.7))
        users: dict[int, list[tuple[int, int]]] = {}
        for t in range(T):
            for s, e in enumerate(rng.choice(E, K, replace=False, p=popularity)):
                users.setdefault(int(e), []).append((t, s))
        experts = sorted(users)
        out = np.zeros((T * K, H), np.float32)
        rows = [[t for t, _ in users[e]] for e in experts]
        dest = [[t * K + s for t, s in users[e]] for e in experts]

        def before():
            for e, r, d in zip(experts, rows, dest):
                out[d] = expert_matmat(args.kind, blobs[e], H, I, x[r])

        res = timed({"before": before, "after": lambda: after(args.kind, [blobs[e] for e in experts], x, rows,
                                                               out, dest, limit, batched)}, args.rounds, 1)
        counts = sorted(len(r) for r in rows)
        print(f"{args.kind}, {T} tokens, {len(experts)} experts, tokens per expert: median {counts[len(counts) // 2]}, "
              f"{sum(c <= limit for c in counts)} with <= {limit}" + ("" if batched else ", a launch pair each"))
        for k, (wall, cpu) in res.items():
            print(f"{k}: wall {wall:.1f} ms, cpu {cpu:.1f} ms, {3 * H * I * T * K / wall / 1e6:.1f} G MAC/s")
        return
    print("| T | before ms | after 1 ms | after 8 ms | one-token ms | before cpu ms | after 8 cpu ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for T in (int(v) for v in args.tokens.split(",")):
        x = rng.standard_normal((T, H)).astype(np.float32)
        out = np.empty((8 * T, H), np.float32)
        one = [list(range(T))]
        eight = [list(range(i * T, (i + 1) * T)) for i in range(8)]
        res = timed({
            "before": lambda: [expert_matmat(args.kind, b, H, I, x) for b in blobs],
            "after1": lambda: [after(args.kind, [b], x, one, out, one, limit, batched) for b in blobs],
            "after8": lambda: [after(args.kind, blobs[i:i + 8], x, one * 8, out, eight, limit, batched)
                               for i in range(0, E, 8)],
            "one": lambda: [expert_forward_tokens(args.kind, b, H, I, x) for b in blobs],
        }, args.rounds, E)
        print(f"| {T} | {res['before'][0]:.2f} | {res['after1'][0]:.2f} | {res['after8'][0]:.2f} | {res['one'][0]:.2f} | "
              f"{res['before'][1]:.2f} | {res['after8'][1]:.2f} |")


if __name__ == "__main__":
    main()
