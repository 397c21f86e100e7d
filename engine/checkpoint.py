"""A Hugging Face checkpoint folder: which tensor lives where, normalised once at load.

Handles sharded (`model.safetensors.index.json`) and single-file folders.
Layout differences are settled here, when the headers are read, so that the
rest of the engine sees one layout:
- names are relative to the text model's prefix (`model.` or
  `model.language_model.`); `lm_head.weight` stays top level;
- the vision tower and the multi-token-prediction head are dropped;
- an expert is a list of byte pieces (`expert_pieces`), whether the file
  stores experts per expert (`save_pretrained`) or fused (`gate_up_proj` /
  `down_proj`, the official release);
- zero-centred norms (Qwen3.5: `x_hat * (1 + w)`) are returned as `1 + w`,
  so every norm is the plain `x_hat * w` (the DeltaNet output norm already is).
Shapes are checked against the config as tensors are asked for, so a
disagreeing checkpoint fails in one line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierlab.engine import hugepages
from tierlab.engine.config import ModelConfig
from tierlab.engine.bounded_read import read_text
from tierlab.engine.errors import ModelError
from tierlab.engine.finite import float_kind, require_finite
from tierlab.engine.qlinear import QuantMatrix, RowStack, check_quant_parts, fuse_quant
from tierlab.engine.safetensors_file import DTYPES, TensorInfo, read_header, read_into, read_tensor


#: suffixes of a quantised dense matrix in a container's dense.safetensors
QWEIGHT, QSCALES = ".qweight", ".qscales"
#: stored-name prefixes of tensors the text model does not use (vision tower, MTP head)
IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
#: where the text model's tensors may sit, most specific first
MODEL_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "")
#: an expert tensor, by relative name
EXPERT_TENSOR = re.compile(r"^layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<rest>.+)$")
#: any tensor of a decoder layer, by relative name
LAYER_TENSOR = re.compile(r"^layers\.(\d+)\.")
#: the norms Qwen3.5 scales by (1 + w); the DeltaNet output norm (linear_attn.norm) is not one of them
ZERO_CENTRED_NORM = re.compile(r"(^norm|\.input_layernorm|\.post_attention_layernorm|\.self_attn\.[qk]_norm)\.weight$")


def is_ignored(stored_name: str) -> bool:
    return stored_name.startswith(IGNORED_PREFIXES)


@dataclass(frozen=True)
class ExpertPiece:
    """`count` consecutive elements of `info`'s tensor starting at absolute byte `offset`."""

    info: TensorInfo
    offset: int
    count: int


class Checkpoint:
    def __init__(self, model_dir: str | Path, config: ModelConfig, weight_files: list[str] | None = None) -> None:
        self.dir = Path(model_dir)
        self.config = config
        stored: dict[str, TensorInfo] = {}
        self._weight_map: dict[str, str] | None = None
        for path in self._weight_files(weight_files):
            header = read_header(path)
            for name in header.keys() & stored.keys():
                raise ModelError(f"tensor {name} is defined in both {stored[name].path.name} and {path.name}", self.dir)
            stored.update(header)
        self._check_weight_map(stored)
        if not stored:
            raise ModelError("no tensors found in the safetensors files", self.dir)
        stored = {name: info for name, info in stored.items() if not is_ignored(name)}
        self.prefix = self._detect_prefix(stored)
        #: relative name -> tensor (TensorInfo.name is the stored name)
        self.tensors: dict[str, TensorInfo] = {self._relative(name): info for name, info in stored.items()}
        self.fused_experts = self._detect_expert_layout()
        self._expert_plans: dict[int, list[list[ExpertPiece]]] = {}
        self._check_layers()
        self._checked_experts: set[tuple[int, int]] = set()

    def _weight_files(self, names: list[str] | None) -> list[Path]:
        if names is not None:
            return [self.dir / n for n in names]
        index = self.dir / "model.safetensors.index.json"
        if index.exists() or index.is_symlink():
            text = read_text(index, "safetensors index", ModelError)
            try:
                weight_map = json.loads(text)["weight_map"]
                files = sorted(set(weight_map.values()))
                if not all(isinstance(k, str) for k in weight_map):
                    raise TypeError
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                raise ModelError("malformed index (expected a weight_map of tensor name -> file name)", index) from None
            for f in files:
                if not f or "/" in f or f in (".", ".."):
                    raise ModelError(f"index names {f!r}, which is not a file in the model folder", index)
            self._weight_map = weight_map
            paths = [self.dir / f for f in files]
            for p in paths:
                if not p.exists():
                    raise ModelError(f"index names {p.name}, which is missing", index)
            return paths
        paths = sorted(self.dir.glob("*.safetensors"))
        if not paths:
            raise ModelError("no *.safetensors files", self.dir)
        return paths

    def _check_weight_map(self, stored: dict[str, TensorInfo]) -> None:
        """Each tensor the index names must be defined in the shard it names."""
        if self._weight_map is None:
            return
        index = self.dir / "model.safetensors.index.json"
        for name, file in self._weight_map.items():
            info = stored.get(name)
            if info is None or info.path.name != file:
                where = "in no shard" if info is None else f"in {info.path.name}"
                raise ModelError(f"index puts tensor {name} in {file}, but it is defined {where}", index)

    def _check_layers(self) -> None:
        """The checkpoint's layers and embedding must be the ones config.json describes,
        before anything is sized from the config."""
        cfg = self.config
        layers = {int(m.group(1)) for m in map(LAYER_TENSOR.match, self.tensors) if m}
        if layers and max(layers) >= cfg.n_layers:
            raise ModelError(f"the checkpoint has layers 0..{max(layers)} but config.json says "
                             f"num_hidden_layers={cfg.n_layers}", self._where())
        if "embed_tokens.weight" in self.tensors:
            self.info("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))

    def _detect_prefix(self, stored: dict[str, TensorInfo]) -> str:
        """The prefix of the embedding, else of the decoder layers (a container's experts-only source)."""
        for prefix in MODEL_PREFIXES:
            if f"{prefix}embed_tokens.weight" in stored:
                return prefix
        for prefix in MODEL_PREFIXES:
            if any(name.startswith(f"{prefix}layers.") for name in stored):
                return prefix
        raise ModelError("missing tensor embed_tokens.weight (under model. or model.language_model.)", self.dir)

    def _relative(self, stored_name: str) -> str:
        if stored_name.startswith("lm_head.") or not stored_name.startswith(self.prefix):
            return stored_name
        return stored_name[len(self.prefix):]

    def stored_name(self, name: str) -> str:
        """The name a relative tensor name has in the files."""
        return name if name.startswith("lm_head.") else self.prefix + name

    def _detect_expert_layout(self) -> bool:
        for layer, is_moe in enumerate(self.config.moe_layers):
            if is_moe:
                return self._fused_name(layer, "gate_up_proj") is not None
        return False

    # -- lookup -------------------------------------------------------------
    def info(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        """The tensor `name` (relative to the model prefix; lm_head is top level)."""
        info = self.tensors.get(name)
        if info is None:
            full = self.stored_name(name)
            raise ModelError(f"missing tensor {full}", self._where())
        if shape is not None and info.shape != tuple(shape):
            raise ModelError(
                f"tensor {info.name} has shape {list(info.shape)} but config.json implies {list(shape)}", info.path
            )
        return info

    def has(self, name: str) -> bool:
        return name in self.tensors or name + QWEIGHT in self.tensors

    def _where(self) -> Path:
        files = sorted({i.path for i in self.tensors.values()})
        return files[0] if len(files) == 1 else self.dir

    def load(self, name: str, shape: tuple[int, ...] | None = None):
        """A dense weight, kept in memory: fp32 and bf16 (as uint16) as stored, fp16 widened to fp32,
        a zero-centred norm as float32 1 + w, and a QuantMatrix where a container stores the
        matrix quantised (`--dense-bits`)."""
        if name not in self.tensors and name + QWEIGHT in self.tensors:
            return self._load_quant(name, shape)
        info = self.info(name, shape)
        arr = read_tensor(info)
        if info.dtype == "F16" or info.dtype == "F64":
            with np.errstate(over="ignore"):
                arr = arr.astype(np.float32)
            if info.dtype == "F64":  # finite in float64 may still overflow float32
                require_finite(arr, "F32", f"tensor {info.name} (as float32)", info.path)
        elif info.dtype not in ("F32", "BF16"):
            raise ModelError(f"tensor {info.name}: dtype {info.dtype} is not a float type", info.path)
        if self.config.zero_centred_norm and ZERO_CENTRED_NORM.search(name):
            arr = to_f32(arr) + np.float32(1.0)
        return arr

    def load_f32(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A small weight (norms, biases, gates) widened to float32."""
        arr = self.load(name, shape)
        return arr.dequantize() if isinstance(arr, QuantMatrix) else to_f32(arr)

    def _load_quant(self, name: str, shape: tuple[int, ...] | None) -> QuantMatrix:
        """`<name>.qweight` (I8 / U8) + `<name>.qscales` (F32): see docs/formats.md."""
        full = self.stored_name(name)
        qinfo = self.tensors[name + QWEIGHT]
        sinfo = self.tensors.get(name + QSCALES)
        if sinfo is None:
            raise ModelError(f"tensor {full}{QWEIGHT} has no {full}{QSCALES}", qinfo.path)
        if qinfo.dtype not in ("I8", "U8") or sinfo.dtype != "F32":
            raise ModelError(f"quantised tensor {full}: qweight must be I8/U8 and qscales F32, "
                             f"got {qinfo.dtype} and {sinfo.dtype}", qinfo.path)
        q, scales = read_tensor(qinfo), read_tensor(sinfo)
        problem = check_quant_parts(q, scales, shape)
        if problem:
            raise ModelError(f"quantised tensor {full} {problem}", qinfo.path)
        return QuantMatrix(q, scales, 8 if qinfo.dtype == "I8" else 4)

    # -- experts ------------------------------------------------------------
    def _fused_name(self, layer: int, what: str) -> str | None:
        for name in (f"layers.{layer}.mlp.experts.{what}", f"layers.{layer}.mlp.experts.{what}.weight"):
            if name in self.tensors:
                return name
        return None

    def expert_pieces(self, layer: int) -> list[list[ExpertPiece]]:
        """Per expert of `layer`: the pieces of gate [I,H] | up [I,H] | down [H,I], in that order."""
        plan = self._expert_plans.get(layer)
        if plan is not None:
            return plan
        cfg = self.config
        H, I, E = cfg.hidden_size, cfg.moe_inter, cfg.n_experts
        base = f"layers.{layer}.mlp.experts."
        if self.fused_experts:
            gate_up = self.info(self._fused_name(layer, "gate_up_proj") or base + "gate_up_proj", (E, 2 * I, H))
            down = self.info(self._fused_name(layer, "down_proj") or base + "down_proj", (E, H, I))
            gu_bytes, d_bytes = gate_up.nbytes // E, down.nbytes // E
            plan = [[ExpertPiece(gate_up, gate_up.offset + e * gu_bytes, 2 * I * H),
                     ExpertPiece(down, down.offset + e * d_bytes, H * I)] for e in range(E)]
        else:
            plan = []
            for e in range(E):
                pieces = []
                for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                    info = self.info(f"{base}{e}.{proj}.weight", shape)
                    pieces.append(ExpertPiece(info, info.offset, info.nbytes // DTYPES[info.dtype][1]))
                plan.append(pieces)
        self._expert_plans[layer] = plan
        return plan

    def read_expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """gate [I,H], up [I,H], down [H,I] of one expert as float32 (float64 for F64 sources)."""
        cfg = self.config
        H, I = cfg.hidden_size, cfg.moe_inter
        pieces = self.expert_pieces(layer)[expert]
        wide = np.float64 if any(p.info.dtype == "F64" for p in pieces) else np.float32
        flat = np.empty(3 * I * H, dtype=wide)
        pos = 0
        for piece in pieces:
            staging = np.empty(piece.count, dtype=DTYPES[piece.info.dtype][0])
            read_into(piece.info.path, piece.offset, staging.view(np.uint8))
            flat[pos:pos + piece.count] = staging if piece.info.dtype == "F64" else to_f32(staging)
            pos += piece.count
        self.check_expert_finite(layer, expert, flat)
        n = I * H
        return flat[:n].reshape(I, H), flat[n:2 * n].reshape(I, H), flat[2 * n:].reshape(H, I)


    def check_expert_finite(self, layer: int, expert: int, values: np.ndarray, kind: str | None = None) -> None:
        """Refuse an expert holding NaN or infinity (in float32 terms); each expert is checked once.

        `values` are the expert's elements in storage form (`kind` "BF16" for uint16 bits).
        """
        if (layer, expert) in self._checked_experts:
            return
        kind = kind or float_kind(values)
        if kind == "F64":
            with np.errstate(over="ignore"):
                values, kind = values.astype(np.float32), "F32"
        flat, pos = values.reshape(-1), 0
        for piece in self.expert_pieces(layer)[expert]:  # the pieces lie in order: name the one at fault
            require_finite(flat[pos:pos + piece.count], kind, f"layer {layer} expert {expert} ({piece.info.name})",
                           piece.info.path)
            pos += piece.count
        self._checked_experts.add((layer, expert))


def to_f32(arr: np.ndarray) -> np.ndarray:
    """Widen bf16 (uint16 storage) exactly; pass float32 through."""
    if arr.dtype == np.uint16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(arr, dtype=np.float32)


def fuse_rows(mats: list):
    """Stack weight matrices that multiply the same input, keeping bf16 as bf16 when all are.

    Quantised matrices of one kind fuse into one QuantMatrix; a mix of
    quantised and plain matrices (the bf16 router beside the quantised shared
    expert) becomes a RowStack of runs of one kind each.
    """
    def kind(m) -> str:
        return m.kind if isinstance(m, QuantMatrix) else "plain"

    runs: list[list] = []
    for m in mats:
        if runs and kind(runs[-1][-1]) == kind(m):
            runs[-1].append(m)
        else:
            runs.append([m])
    fused = [fuse_quant(run) if isinstance(run[0], QuantMatrix) else _fuse_plain(run) for run in runs]
    return fused[0] if len(fused) == 1 else RowStack(fused)


def _fuse_plain(mats: list[np.ndarray]) -> np.ndarray:
    if len(mats) == 1:
        return np.ascontiguousarray(mats[0])
    if len({m.dtype for m in mats}) != 1:
        mats = [to_f32(m) for m in mats]
    return hugepages.concat_rows(mats)
