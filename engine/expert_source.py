"""Where an expert's bytes come from, and how a blob of them is computed.

An ExpertSource reads one expert of one layer into a RAM slot (a uint8
"blob") with positional reads, and runs the SwiGLU expert on a blob. The
unquantised source here reads straight from the checkpoint's safetensors
files; the quantised container (`tierlab.engine.container`) provides the
same interface. Blob layout for unquantised kinds: gate [I,H] | up [I,H] |
down [H,I], elements fp32 or bf16 (uint16), row-major.
"""

from __future__ import annotations

import numpy as np

from tierlab.engine.checkpoint import Checkpoint
from tierlab.engine.errors import ModelError
from tierlab.engine.kernels.dense import widen
from tierlab.engine.kernels.qmatvec import EXPERT_FORWARD
from tierlab.engine.safetensors_file import DTYPES, FileHandles, TensorInfo

_KIND_OF_DTYPE = {"F32": "fp32", "BF16": "bf16"}


class RawExpertSource:
    """Experts of an unquantised Hugging Face checkpoint (per-expert or fused layout)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        cfg = ckpt.config
        self.ckpt = ckpt
        self.hidden = cfg.hidden_size
        self.inter = cfg.moe_inter
        self.n_experts = cfg.n_experts
        self._files = FileHandles()
        self._plans: dict[int, list[list[tuple[TensorInfo, int, int]]]] = {}
        dtypes = {self._layer_tensors(layer)[0].dtype for layer, moe in enumerate(cfg.moe_layers) if moe}
        if len(dtypes) == 1 and next(iter(dtypes)) in _KIND_OF_DTYPE:
            self.kind = _KIND_OF_DTYPE[next(iter(dtypes))]
            self._convert = False
        else:
            self.kind = "fp32"  # fp16 or mixed sources are widened on read
            self._convert = True
        self.elem = 4 if self.kind == "fp32" else 2
        self.n_weights = 3 * self.inter * self.hidden
        self.blob_nbytes = self.n_weights * self.elem

    def _layer_tensors(self, layer: int) -> list[TensorInfo]:
        cfg = self.ckpt.config
        base = f"layers.{layer}.mlp.experts."
        H, I, E = cfg.hidden_size, cfg.moe_inter, cfg.n_experts
        if self.ckpt.fused_experts:
            return [
                self.ckpt.info(base + "gate_up_proj", (E, 2 * I, H)),
                self.ckpt.info(base + "down_proj", (E, H, I)),
            ]
        return [self.ckpt.info(f"{base}0.gate_proj.weight", (I, H))]

    def _plan(self, layer: int) -> list[list[tuple[TensorInfo, int, int]]]:
        """Per expert: the (tensor, byte offset, element count) pieces, in blob order."""
        plan = self._plans.get(layer)
        if plan is not None:
            return plan
        cfg = self.ckpt.config
        H, I, E = cfg.hidden_size, cfg.moe_inter, cfg.n_experts
        base = f"layers.{layer}.mlp.experts."
        plan = []
        if self.ckpt.fused_experts:
            gate_up, down = self._layer_tensors(layer)
            if gate_up.dtype != down.dtype:
                self._convert = True
            gu_bytes = gate_up.nbytes // E
            d_bytes = down.nbytes // E
            for e in range(E):
                plan.append([(gate_up, gate_up.offset + e * gu_bytes, 2 * I * H), (down, down.offset + e * d_bytes, H * I)])
        else:
            for e in range(E):
                plan.append([
                    (self.ckpt.info(f"{base}{e}.gate_proj.weight", (I, H)), -1, I * H),
                    (self.ckpt.info(f"{base}{e}.up_proj.weight", (I, H)), -1, I * H),
                    (self.ckpt.info(f"{base}{e}.down_proj.weight", (H, I)), -1, H * I),
                ])
            plan = [[(info, info.offset, n) for info, _, n in pieces] for pieces in plan]
        self._plans[layer] = plan
        return plan

    def read(self, layer: int, expert: int, out: np.ndarray) -> None:
        """Fill `out` (uint8[blob_nbytes]) with the expert's gate | up | down."""
        pieces = self._plan(layer)[expert]
        pos = 0
        for info, offset, count in pieces:
            if not self._convert and _KIND_OF_DTYPE.get(info.dtype) == self.kind:
                nbytes = count * self.elem
                self._files.pread_into(info.path, offset, memoryview(out[pos:pos + nbytes]))
            else:
                np_dtype, size = DTYPES[info.dtype]
                staging = np.empty(count, dtype=np_dtype)
                self._files.pread_into(info.path, offset, memoryview(staging.view(np.uint8)))
                values = widen(staging) if info.dtype == "BF16" else staging.astype(np.float32)
                nbytes = count * 4
                out[pos:pos + nbytes] = values.astype(np.float32).view(np.uint8)
            pos += nbytes
        if pos != self.blob_nbytes:
            raise ModelError(f"layer {layer} expert {expert}: read {pos} bytes, expected {self.blob_nbytes}", self.ckpt.dir)

    def forward(self, blob: np.ndarray, x: np.ndarray, y: np.ndarray, w: float) -> None:
        """y += w * down(silu(gate x) * up x)."""
        EXPERT_FORWARD[self.kind](blob, self.hidden, self.inter, x, y, w)

    def close(self) -> None:
        self._files.close()
