"""Container integrity: per-blob checksums verified on first read, `inspect --verify`,
inspect refusing what loading refuses, and the manifest checked against config.json.

Every container here is the shipped tiny model converted by `tierlab convert`.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import run_cli
from tierlab import ASSETS_DIR
from tierlab.engine.blob_layout import BlobLayout
from tierlab.engine.container import (
    CHECKSUM_FILE, CONTAINER_JSON, DENSE_FILE, EXPERTS_BIN, ChecksumMismatch, ContainerExpertSource, ContainerInfo,
    ExpertBlobWriter, convert, read_container_info, verify_container, write_manifest,
)
from tierlab.engine.errors import ModelError
from tierlab.engine.model import load_engine

MODEL = ASSETS_DIR / "tiny-moe"
PROMPT_TEXT = "Once upon a time there was a little"


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "c"
    convert(MODEL, out, bits=4)
    return out


@pytest.fixture()
def copy(container, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(container, dst)
    return dst


def _greedy(folder, n: int = 12) -> tuple[list[int], np.ndarray]:
    """Greedy ids for PROMPT_TEXT and the heat (which experts were read) of the run."""
    engine = load_engine(folder)
    try:
        ids = list(engine.generate(engine.tokenizer.encode(PROMPT_TEXT), n))
        return ids, engine.heat.copy()
    finally:
        engine.close()


def _flip(folder, offset: int) -> None:
    with open(folder / EXPERTS_BIN, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _error_lines(proc) -> list[str]:
    """stderr without the kernel-compile progress lines a cold numba cache prints."""
    return [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("tierlab: compiling kernels")]


def _assert_one_line_error(proc, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = _error_lines(proc)
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _as_version_1(folder) -> None:
    """Turn a container into what the version 1 writer left: no checksums anywhere."""
    meta = json.loads((folder / CONTAINER_JSON).read_text())
    del meta["checksums"]
    meta["version"] = 1
    (folder / CONTAINER_JSON).write_text(json.dumps(meta))
    (folder / CHECKSUM_FILE).unlink()


def test_convert_writes_a_checksum_per_blob(container):
    info = read_container_info(container)
    meta = json.loads((container / CONTAINER_JSON).read_text())
    assert meta["version"] == 2 and meta["checksums"]["kind"] == "xxh3_64" and info.has_checksums
    sums = np.fromfile(container / CHECKSUM_FILE, dtype="<u8").reshape(info.n_layers, info.n_experts)
    import xxhash

    with open(container / EXPERTS_BIN, "rb") as f:
        for layer, expert in [(0, 0), (3, 17), (info.n_layers - 1, info.n_experts - 1)]:
            f.seek(info.blob_offset(layer, expert))
            assert xxhash.xxh3_64_intdigest(f.read(info.blob_nbytes)) == int(sums[layer, expert])
    assert (container / EXPERTS_BIN).stat().st_size == info.n_layers * info.n_experts * info.blob_stride


def test_clean_container_verifies(container):
    proc = run_cli("inspect", str(container), "--verify")
    assert proc.returncode == 0, proc.stderr
    assert "xxh3_64 per blob" in proc.stdout
    assert f"256 expert blobs and {DENSE_FILE} match their checksums" in proc.stdout


def test_flipped_byte_stops_generate_naming_layer_and_expert(copy):
    ids, heat = _greedy(copy)
    layer = 3
    expert = int(np.argmax(heat[layer]))  # certainly read by this prompt
    assert heat[layer, expert] > 0
    info = read_container_info(copy)
    _flip(copy, info.blob_offset(layer, expert) + 200)
    proc = run_cli("generate", "--model", str(copy), "--prompt", PROMPT_TEXT, "-n", "12")
    _assert_one_line_error(proc, EXPERTS_BIN, f"layer {layer} expert {expert}:", "checksum")

    proc = run_cli("inspect", str(copy), "--verify")
    line = _assert_one_line_error(proc, "1 of 256 expert blobs do not match")
    assert str(copy) in line
    damaged = [ln for ln in proc.stdout.splitlines() if "checksum mismatch" in ln]
    assert damaged == [f"{copy / EXPERTS_BIN}: layer {layer} expert {expert}: checksum mismatch"]


def test_flipped_byte_is_found_with_prefetch_and_a_small_cache(copy):
    """PILOT's background reads and a cache that evicts: the damaged blob still stops the run."""
    _, heat = _greedy(copy)
    layer, expert = 5, int(np.argmax(heat[5]))
    _flip(copy, read_container_info(copy).blob_offset(layer, expert) + 3)
    proc = run_cli("generate", "--model", str(copy), "--prompt", PROMPT_TEXT, "-n", "12", "--cache", "4",
                   "--pilot", "1")
    _assert_one_line_error(proc, f"layer {layer} expert {expert}:", "checksum")


def test_a_blob_is_hashed_on_its_first_read_only(copy):
    info = read_container_info(copy)
    slot = np.empty(info.blob_nbytes, dtype=np.uint8)
    with ContainerExpertSource(copy) as src:
        src.read(2, 5, slot)  # intact: verified and remembered
        assert src.verified[2, 5] and src.verified.sum() == 1
        _flip(copy, info.blob_offset(2, 5) + 7)
        _flip(copy, info.blob_offset(2, 6) + 7)
        src.read(2, 5, slot)  # not hashed again: the damage after the first read goes unseen
        with pytest.raises(ChecksumMismatch) as exc:
            src.read(2, 6, slot)
        assert (exc.value.layer, exc.value.expert) == (2, 6) and not src.verified[2, 6]
        with pytest.raises(ChecksumMismatch):  # a damaged blob never counts as verified
            src.read(2, 6, slot)
    report = verify_container(copy)
    assert report.damaged == [(2, 5), (2, 6)] and report.dense_ok


def test_damaged_dense_file_is_found_by_verify(copy):
    data = bytearray((copy / DENSE_FILE).read_bytes())
    data[-3] ^= 0x40
    (copy / DENSE_FILE).write_bytes(bytes(data))
    proc = run_cli("inspect", str(copy), "--verify")
    _assert_one_line_error(proc, "0 of 256 expert blobs and dense.safetensors do not match")
    assert f"{copy / DENSE_FILE}: checksum mismatch" in proc.stdout


def test_damaged_checksum_file_is_refused_at_open(copy):
    data = bytearray((copy / CHECKSUM_FILE).read_bytes())
    data[40] ^= 0x01
    (copy / CHECKSUM_FILE).write_bytes(bytes(data))
    with pytest.raises(ModelError, match="does not match its checksum") as exc:
        ContainerExpertSource(copy)
    assert CHECKSUM_FILE in str(exc.value) and "\n" not in str(exc.value)
    (copy / CHECKSUM_FILE).write_bytes(bytes(data[:-8]))
    _assert_one_line_error(run_cli("inspect", str(copy)), CHECKSUM_FILE, "the manifest implies")
    (copy / CHECKSUM_FILE).unlink()
    _assert_one_line_error(run_cli("inspect", str(copy)), CHECKSUM_FILE, "missing")


def test_version_1_container_loads_and_generates_the_same_ids(container, copy):
    want, _ = _greedy(container)
    _as_version_1(copy)
    info = read_container_info(copy)
    assert info.version == 1 and not info.has_checksums
    got, _ = _greedy(copy)
    assert got == want
    proc = run_cli("inspect", str(copy), "--verify")
    assert proc.returncode == 0, proc.stderr
    assert "no checksums (container version 1)" in proc.stdout and "nothing to verify" in proc.stdout


def test_version_2_without_checksums_is_refused(copy):
    meta = json.loads((copy / CONTAINER_JSON).read_text())
    del meta["checksums"]
    (copy / CONTAINER_JSON).write_text(json.dumps(meta))
    _assert_one_line_error(run_cli("inspect", str(copy)), CONTAINER_JSON, "checksums")


def _edit_config(folder, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("change, needle", [
    ("layers", "layers 8 but config.json says 4"),
    ("experts", "experts per layer 32 but config.json says 16"),
])
def test_manifest_disagreeing_with_config_is_refused(copy, change, needle):
    cfg = json.loads((copy / "config.json").read_text())
    if change == "layers":
        _edit_config(copy, num_hidden_layers=4, layer_types=cfg["layer_types"][:4])
    else:
        _edit_config(copy, num_experts=16)
    with pytest.raises(ModelError, match=needle) as exc:
        load_engine(copy, with_tokenizer=False, warmup=False)
    assert CONTAINER_JSON in str(exc.value)
    _assert_one_line_error(run_cli("inspect", str(copy)), CONTAINER_JSON, needle)
    _assert_one_line_error(run_cli("generate", "--model", str(copy), "--prompt", "hi", "-n", "2"), needle)


def test_experts_bin_cut_mid_expert_is_refused_at_open(copy):
    info = read_container_info(copy)
    with open(copy / EXPERTS_BIN, "r+b") as f:
        f.truncate(info.blob_offset(5, 9) + info.blob_nbytes // 2)
    with pytest.raises(ModelError, match="truncated"):
        ContainerExpertSource(copy)
    _assert_one_line_error(run_cli("inspect", str(copy)), EXPERTS_BIN, "truncated")
    _assert_one_line_error(run_cli("generate", "--model", str(copy), "--prompt", "hi", "-n", "2"), EXPERTS_BIN,
                           "truncated")


def test_experts_bin_longer_than_the_manifest_is_refused(copy):
    with open(copy / EXPERTS_BIN, "ab") as f:
        f.write(b"\0" * 4096)
    _assert_one_line_error(run_cli("inspect", str(copy)), EXPERTS_BIN, "more than")


def test_inspect_refuses_what_load_refuses(copy):
    (copy / DENSE_FILE).unlink()
    with pytest.raises(ModelError) as exc:
        load_engine(copy, with_tokenizer=False, warmup=False)
    line = _assert_one_line_error(run_cli("inspect", str(copy)))
    assert line == f"tierlab: error: {exc.value}"


def test_blob_writer_refuses_wrong_sizes_and_missing_blobs(tmp_path):
    layout = BlobLayout("int8", 64, 64)
    info = ContainerInfo(8, 64, 1, 2, 64, 64, layout.nbytes, layout.stride, [0], "test", "")
    blob = np.arange(layout.nbytes, dtype=np.uint8)
    writer = ExpertBlobWriter(tmp_path, info)
    with pytest.raises(ValueError, match="blob of"):
        writer.add(0, 0, blob[:-1])
    with pytest.raises(IndexError):
        writer.add(0, 2, blob)
    writer.add(0, 1, blob)
    with pytest.raises(ModelError, match="1 blobs were never written"):
        writer.finish()
    with ExpertBlobWriter(tmp_path, info) as w:
        w.add(1 - 1, 1, blob)
        w.add(0, 0, blob[::-1].copy())
    (tmp_path / DENSE_FILE).write_bytes(b"dense")
    info = write_manifest(tmp_path, w.info)
    assert read_container_info(tmp_path) == info
    slot = np.empty(layout.nbytes, dtype=np.uint8)
    with ContainerExpertSource(tmp_path) as src:
        src.read(0, 1, slot)
        assert (slot == blob).all()
    assert verify_container(tmp_path).damaged == []


def _flip_every_blob(folder) -> None:
    info = read_container_info(folder)
    for layer in range(info.n_layers):
        for expert in range(info.n_experts):
            _flip(folder, info.blob_offset(layer, expert) + 11)


def test_damaged_container_is_refused_when_the_warm_up_reads_it(copy):
    _flip_every_blob(copy)
    with pytest.raises(ChecksumMismatch) as exc:
        load_engine(copy, with_tokenizer=False)
    assert str(exc.value).startswith(f"{copy / EXPERTS_BIN}: layer ")


from test_app import ask, make_app, ready, tiny_model, wait_for  # noqa: E402,F401 (the app fixtures)


async def test_app_shows_a_damaged_container_as_a_notification(make_app, copy):
    _flip_every_blob(copy)
    app = make_app(model_dir=copy)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.sub_title == "no model")
        assert app.is_running
        assert any(EXPERTS_BIN in text and "checksum" in text and severity == "error"
                   for text, severity in app.notes), app.notes


async def test_app_shows_a_blob_damaged_mid_session_as_a_notification(make_app, copy):
    app = make_app(model_dir=copy)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        _flip_every_blob(copy)  # after loading: only blobs this process has not read yet are checked
        await ask(pilot, "tell me a story", max_tokens=8)
        assert app.is_running and not app.generating
        assert any(EXPERTS_BIN in text and "does not match its checksum" in text and severity == "error"
                   for text, severity in app.notes), app.notes
