"""The model fingerprint: stable for a folder, different for another model, cheap (headers only)."""

import json
import shutil
from pathlib import Path

import pytest

from tierlab.engine.errors import ModelError
from tierlab.engine.fingerprint import fingerprint_document, model_fingerprint
from tierlab.engine.safetensors_file import read_header

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_same_folder_same_fingerprint_anywhere(tmp_path):
    moved = _copy(ASSETS / "tiny-moe-8x2", tmp_path / "elsewhere")
    first = model_fingerprint(ASSETS / "tiny-moe-8x2")
    assert first.startswith("sha256:") and len(first) == len("sha256:") + 64
    assert model_fingerprint(moved) == first == model_fingerprint(ASSETS / "tiny-moe-8x2")


def test_the_shipped_models_differ():
    assert model_fingerprint(ASSETS / "tiny-moe") != model_fingerprint(ASSETS / "tiny-moe-8x2")


def test_a_config_value_changes_it_but_bookkeeping_keys_do_not(tmp_path):
    folder = _copy(ASSETS / "tiny-moe-8x2", tmp_path / "m")
    base = model_fingerprint(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "transformers_version": "9.9", "_name_or_path": "/x"}))
    assert model_fingerprint(folder) == base
    (folder / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    assert model_fingerprint(folder) != base


def test_the_tensor_index_is_hashed_not_the_weights(tmp_path):
    folder = _copy(ASSETS / "tiny-moe-8x2", tmp_path / "m")
    base = model_fingerprint(folder)
    weights = folder / "model.safetensors"
    infos = read_header(weights)
    first = min(infos.values(), key=lambda i: i.offset)
    data = bytearray(weights.read_bytes())
    data[first.offset] ^= 0xFF  # a weight value: same index
    weights.write_bytes(bytes(data))
    assert model_fingerprint(folder) == base
    names = [entry[0] for entry in fingerprint_document(folder)["tensors"]]
    assert names == sorted(infos)


def test_an_unreadable_folder_is_one_line(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        model_fingerprint(tmp_path)
