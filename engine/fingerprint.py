"""A model's fingerprint: which model a session log was recorded on, without hashing weights.

The fingerprint is the SHA-256 of one canonical JSON document made of:

- the normalised config.json: parsed, keys sorted, with the keys that say
  where or by which tool it was written dropped (``_name_or_path``,
  ``transformers_version`` and every key starting with ``_``);
- the tensor index: for every ``*.safetensors`` file of the folder, every
  tensor's stored name, dtype and shape (not its bytes, not the file names,
  so resharding the same tensors keeps the fingerprint);
- for a tierlab container, its manifest (tierlab_container.json) without
  ``source``, the path of the folder it was converted from.

It reads headers only (milliseconds on a release checkpoint), is the same
for the same folder on any machine, and changes with any config value or
any tensor's name, dtype or shape. Two checkpoints that differ only in
weight values (a retrained model of the same shape) share it. A container
and its source folder have different fingerprints: the container holds
other tensors (dense.safetensors, quantised experts), and its outputs are
not the source's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tierlab.engine.errors import ModelError
from tierlab.engine.safetensors_file import read_header

CONTAINER_MANIFEST = "tierlab_container.json"
PREFIX = "sha256:"
_DROPPED_CONFIG_KEYS = ("_name_or_path", "transformers_version")


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError("missing", path) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelError(f"unreadable JSON ({str(exc).splitlines()[0]})", path) from None
    if not isinstance(data, dict):
        raise ModelError("not a JSON object", path)
    return data


def normalised_config(model_dir: str | Path) -> dict:
    """config.json without the keys that record where or by what it was written."""
    raw = _json_file(Path(model_dir) / "config.json")
    return {k: v for k, v in raw.items() if not k.startswith("_") and k not in _DROPPED_CONFIG_KEYS}


def tensor_index(model_dir: str | Path) -> list[list]:
    """[name, dtype, shape] of every tensor in the folder's safetensors files, sorted by name."""
    entries = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, info in read_header(path).items():
            entries.append([name, info.dtype, list(info.shape)])
    if not entries:
        raise ModelError("no *.safetensors files to fingerprint", model_dir)
    return sorted(entries)


def fingerprint_document(model_dir: str | Path) -> dict:
    """What the fingerprint hashes (see the module docstring)."""
    folder = Path(model_dir)
    document: dict = {"config": normalised_config(folder), "tensors": tensor_index(folder)}
    manifest = folder / CONTAINER_MANIFEST
    if manifest.exists():
        document["container"] = {k: v for k, v in _json_file(manifest).items() if k != "source"}
    return document


def model_fingerprint(model_dir: str | Path) -> str:
    """'sha256:' and 64 hex digits; ModelError (one line, names the file) for an unreadable folder."""
    text = json.dumps(fingerprint_document(model_dir), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return PREFIX + hashlib.sha256(text.encode("ascii")).hexdigest()


def short(fingerprint: str | None) -> str:
    """The first 12 hex digits, for one-line messages."""
    if not fingerprint:
        return "none"
    return fingerprint.removeprefix(PREFIX)[:12]
