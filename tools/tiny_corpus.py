"""Corpus and tokenizer for the shipped tiny MoE models (dev-only: needs `tokenizers`).

The corpus is the Python standard library's own source (PSF License) of the
interpreter that runs this script: real text that is on every machine and may
be shipped with a model trained on it. Files are split into train and
held-out *by file* with a hash of the relative path, so the split does not
depend on directory listing order and training never sees a held-out file.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|endoftext|>"

#: Qwen-style ChatML template; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Folders that are tests, third-party code, bundled wheels or machine-generated
# tables (the codec maps in encodings/ are thousands of hex literals).
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "encodings", "ensurepip", "__pycache__"}
HELDOUT_BUCKETS = 20  # 1 file in 20 (by hash) is held out


def stdlib_dir() -> Path:
    """The running interpreter's pure-Python library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """All stdlib .py files used, in a deterministic (sorted relative path) order."""
    root = root or stdlib_dir()
    out = []
    for p in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root)
        if _SKIP_PARTS.intersection(rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        out.append(p)
    return out


def is_heldout(rel: str) -> bool:
    """Deterministic file-level split: held out when the path hashes into bucket 0."""
    h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16)
    return h % HELDOUT_BUCKETS == 0


def split_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    root = root or stdlib_dir()
    train, held = [], []
    for p in corpus_files(root):
        (held if is_heldout(p.relative_to(root).as_posix()) else train).append(p)
    return train, held


def read_text(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def docstring_chats(p: Path, root: Path) -> list[str]:
    """ChatML exchanges built from a file's docstrings ("What does mod.f do?" -> docstring).

    They teach the model the chat format that the app uses, with answers taken
    from the same licensed text; held-out files are never passed here.
    """
    try:
        tree = ast.parse(read_text(p))
    except (SyntaxError, ValueError):
        return []
    mod = p.relative_to(root).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
    out = []
    nodes = [(mod, tree)] + [
        (f"{mod}.{n.name}", n)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")
    ]
    for name, node in nodes:
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        doc = doc.strip()[:1200]
        kind = "module" if node is tree else ("class" if isinstance(node, ast.ClassDef) else "function")
        out.append(
            f"<|im_start|>user\nWhat does the {kind} {name} do?<|im_end|>\n"
            f"<|im_start|>assistant\n{doc}<|im_end|>\n"
        )
    return out


def train_documents(root: Path | None = None) -> list[str]:
    """Training documents: every training file's source, then the docstring chats."""
    root = root or stdlib_dir()
    train, _ = split_files(root)
    docs = [read_text(p) for p in train]
    for p in train:
        docs.extend(docstring_chats(p, root))
    return docs


def heldout_documents(root: Path | None = None) -> list[str]:
    root = root or stdlib_dir()
    _, held = split_files(root)
    return [read_text(p) for p in held]


def train_tokenizer(docs: list[str], vocab_size: int, out_path: Path):
    """Byte-level BPE trained on the training split only; saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json contents: special tokens and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": EOS,
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


if __name__ == "__main__":
    tr, he = split_files()
    print(json.dumps({"root": str(stdlib_dir()), "python": sys.version.split()[0], "train_files": len(tr),
                      "heldout_files": len(he), "train_chars": sum(p.stat().st_size for p in tr),
                      "heldout": [p.relative_to(stdlib_dir()).as_posix() for p in he]}, indent=1))
