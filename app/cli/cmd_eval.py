"""`tierlab eval`: replay a reference; exit 0 only when every token matches."""

from __future__ import annotations

import json
import sys

from tierlab.app.cli.log_args import add_log_args, check_log_target
from tierlab.app.cli.signals import sigterm_exits
from tierlab.app.cli.engine_options import (add_knobs_at_arg, add_model_args, knob_steps_from_args, open_engine,
                                            print_notices)
from tierlab.app.lab.evaluate import check_ref_fits, format_report, read_ref, run_eval
from tierlab.engine.meters import meters_json
from tierlab.engine.session import EngineLog


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="greedy-decode a reference and report matches, TF-NLL and meters")
    add_model_args(p)
    p.add_argument("--ref", required=True, help="reference file (ref.json)")
    p.add_argument("--ppl", action="store_true", help="also teacher-force the reference for TF-NLL")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    add_log_args(p, help="record a session log (JSON lines) of the generation")
    add_knobs_at_arg(p)
    p.set_defaults(run=run)


def run(args) -> int:
    steps = knob_steps_from_args(args)
    check_log_target(args)
    prompt, full = read_ref(args.ref)
    with sigterm_exits():
        engine = open_engine(args, with_tokenizer=False)
        try:
            check_ref_fits(args.ref, prompt, full, engine)
            log = EngineLog(engine, args.log, append=args.append) if args.log else None
            try:
                result = run_eval(engine, prompt, full, ppl=args.ppl, on_generated=log.detach if log else None,
                                  steps=steps)
            finally:
                if log is not None:
                    done = "result" in locals()
                    log.close({"ids_match": f"{result['matching']}/{result['total']}", "tf_nll": result["tf_nll"]}
                              if done else {"aborted": True},
                              stream=(prompt, result["generated"]) if done else None)
        finally:
            engine.close()  # writes HEAT_FILE on every way out: done, an error, ctrl+c, SIGTERM
    print_notices(engine)
    if args.json:
        print(json.dumps(meters_json(result)))
    else:
        print("\n".join(format_report(engine, result)))
    if result["matching"] != result["total"]:
        print(f"tierlab: exit 1: {result['matching']} of {result['total']} greedy ids match the reference "
              "(a routing lever changes them; the figures above are still valid)", file=sys.stderr)
        return 1
    return 0
