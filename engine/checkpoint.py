"""A Hugging Face checkpoint folder: which tensor lives where.

Handles sharded (`model.safetensors.index.json`) and single-file folders,
the `model.` and `model.language_model.` prefixes, and the two expert
layouts (per-expert tensors from `save_pretrained`, fused `gate_up_proj` /
`down_proj` in the official release). Shapes are checked against the config
as tensors are asked for, so a disagreeing checkpoint fails in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tierlab.engine import hugepages
from tierlab.engine.config import ModelConfig
from tierlab.engine.errors import ModelError
from tierlab.engine.qlinear import QuantMatrix, RowStack, check_quant_parts, fuse_quant
from tierlab.engine.safetensors_file import TensorInfo, read_header, read_tensor


#: suffixes of a quantised dense matrix in a container's dense.safetensors
QWEIGHT, QSCALES = ".qweight", ".qscales"


class Checkpoint:
    def __init__(self, model_dir: str | Path, config: ModelConfig, weight_files: list[str] | None = None) -> None:
        self.dir = Path(model_dir)
        self.config = config
        self.tensors: dict[str, TensorInfo] = {}
        for path in self._weight_files(weight_files):
            self.tensors.update(read_header(path))
        if not self.tensors:
            raise ModelError("no tensors found in the safetensors files", self.dir)
        self.prefix = self._detect_prefix()
        self.fused_experts = self._detect_expert_layout()

    def _weight_files(self, names: list[str] | None) -> list[Path]:
        if names is not None:
            return [self.dir / n for n in names]
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise ModelError("malformed index (expected a weight_map)", index) from None
            paths = [self.dir / f for f in files]
            for p in paths:
                if not p.exists():
                    raise ModelError(f"index names {p.name}, which is missing", index)
            return paths
        paths = sorted(self.dir.glob("*.safetensors"))
        if not paths:
            raise ModelError("no *.safetensors files", self.dir)
        return paths

    def _detect_prefix(self) -> str:
        for prefix in ("model.language_model.", "model.", "language_model.model.", ""):
            if f"{prefix}embed_tokens.weight" in self.tensors:
                return prefix
        raise ModelError("missing tensor embed_tokens.weight (under model. or model.language_model.)", self.dir)

    def _detect_expert_layout(self) -> bool:
        for layer, is_moe in enumerate(self.config.moe_layers):
            if is_moe:
                return f"{self.prefix}layers.{layer}.mlp.experts.gate_up_proj" in self.tensors
        return False

    # -- lookup -------------------------------------------------------------
    def info(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        """The tensor `name` (relative to the model prefix, or absolute for lm_head)."""
        full = name if name.startswith("lm_head.") else self.prefix + name
        info = self.tensors.get(full)
        if info is None:
            raise ModelError(f"missing tensor {full}", self._where(full))
        if shape is not None and info.shape != tuple(shape):
            raise ModelError(
                f"tensor {full} has shape {list(info.shape)} but config.json implies {list(shape)}", info.path
            )
        return info

    def has(self, name: str) -> bool:
        full = name if name.startswith("lm_head.") else self.prefix + name
        return full in self.tensors or full + QWEIGHT in self.tensors

    def _where(self, full: str) -> Path:
        files = sorted({i.path for i in self.tensors.values()})
        return files[0] if len(files) == 1 else self.dir

    def load(self, name: str, shape: tuple[int, ...] | None = None):
        """A dense weight, kept in memory: fp32 and bf16 (as uint16) as stored, fp16 widened to fp32,
        and a QuantMatrix where a container stores the matrix quantised (`--dense-bits`)."""
        full = name if name.startswith("lm_head.") else self.prefix + name
        if full not in self.tensors and full + QWEIGHT in self.tensors:
            return self._load_quant(name, full, shape)
        info = self.info(name, shape)
        arr = read_tensor(info)
        if info.dtype == "F16" or info.dtype == "F64":
            arr = arr.astype(np.float32)
        elif info.dtype not in ("F32", "BF16"):
            raise ModelError(f"tensor {info.name}: dtype {info.dtype} is not a float type", info.path)
        return arr

    def load_f32(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A small weight (norms, biases, gates) widened to float32."""
        arr = self.load(name, shape)
        return arr.dequantize() if isinstance(arr, QuantMatrix) else to_f32(arr)

    def _load_quant(self, name: str, full: str, shape: tuple[int, ...] | None) -> QuantMatrix:
        """`<name>.qweight` (I8 / U8) + `<name>.qscales` (F32): see docs/formats.md."""
        qinfo = self.tensors[full + QWEIGHT]
        sinfo = self.tensors.get(full + QSCALES)
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
