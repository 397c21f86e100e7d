"""`tierlab ref`: write a reference file by greedy decoding."""

from __future__ import annotations

from tierlab.app.cli.engine_options import add_model_args, open_engine, print_notices
from tierlab.app.cli.signals import sigterm_exits
from tierlab.engine.errors import ModelError
from tierlab.app.lab.evaluate import greedy_decode, write_ref


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("ref", help="write ref.json: a prompt and its greedy continuation")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("-n", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("-o", "--out", required=True, help="output file (ref.json)")
    p.set_defaults(run=run)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ModelError(f"--prompt-ids: {text!r} is not a comma-separated list of integers") from None
    if not ids:
        raise ModelError("--prompt-ids is empty")
    return ids


def run(args) -> int:
    if args.n < 1:
        raise ModelError("-n must be at least 1")
    with sigterm_exits():
        engine = open_engine(args, with_tokenizer=args.prompt is not None)
        try:
            if args.prompt is not None:
                if engine.tokenizer is None:
                    raise ModelError("no tokenizer.json: use --prompt-ids", args.model)
                prompt = engine.tokenizer.encode(args.prompt)
            else:
                prompt = parse_ids(args.prompt_ids)
            generated, _ = greedy_decode(engine, prompt, args.n)
            write_ref(args.out, prompt, prompt + generated)
        finally:
            engine.close()  # writes HEAT_FILE on every way out: done, an error, ctrl+c, SIGTERM
    print_notices(engine)
    print(f"wrote {args.out}: {len(prompt)} prompt + {len(generated)} generated tokens")
    return 0
