"""What the chat template budget costs: compile and render of the shipped model's template,
in the plain jinja2 sandbox and in the budgeted one (engine/template_budget.py)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment

from tierlab.engine.tokenizer import ChatTemplate

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "tiny-moe"


def best_ms(action, repeats: int) -> float:
    action()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            action()
        best = min(best, (time.perf_counter() - start) / repeats * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=200)
    args = parser.parse_args()
    source = json.loads((SHIPPED / "tokenizer_config.json").read_text())["chat_template"]
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20}
            for i in range(args.messages)]

    def plain_compile():
        return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)

    plain = plain_compile()
    budgeted = ChatTemplate(source, Path("chat_template"), {})
    rows = [
        ("compile", best_ms(plain_compile, 20), best_ms(lambda: ChatTemplate(source, Path("t"), {}), 20)),
        (f"render {args.messages} messages", best_ms(lambda: plain.render(messages=chat, add_generation_prompt=True), 20),
         best_ms(lambda: budgeted.render(chat), 20)),
    ]
    print("| step | plain sandbox | budgeted |\n|---|---:|---:|")
    for name, a, b in rows:
        print(f"| {name} | {a:.2f} ms | {b:.2f} ms |")


if __name__ == "__main__":
    main()
