"""Where an expert's bytes come from, and how a blob of them is computed.

An ExpertSource reads one expert of one layer into a RAM slot (a uint8
"blob") with positional reads, and runs the SwiGLU expert on a blob. The
unquantised source here reads straight from the checkpoint's safetensors
files, at the byte pieces the checkpoint gives for each expert (either
expert layout); the quantised container (`tierlab.engine.container`)
provides the same interface. Blob layout for unquantised kinds: gate [I,H] |
up [I,H] | down [H,I], elements fp32 or bf16 (uint16), row-major.
"""

from __future__ import annotations

import numpy as np

from tierlab.engine.blob_layout import BlobLayout
from tierlab.engine.checkpoint import Checkpoint, to_f32
from tierlab.engine.errors import ModelError
from tierlab.engine.kernels.qmatvec import EXPERT_FORWARD
from tierlab.engine.readahead import FileRange
from tierlab.engine.safetensors_file import DTYPES, FileHandles

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
        dtypes = {piece.info.dtype for layer, moe in enumerate(cfg.moe_layers) if moe
                  for pieces in ckpt.expert_pieces(layer) for piece in pieces}
        if len(dtypes) == 1 and next(iter(dtypes)) in _KIND_OF_DTYPE:
            self.kind = _KIND_OF_DTYPE[next(iter(dtypes))]
            self._convert = False
        else:
            self.kind = "fp32"  # fp16 or mixed sources are widened on read
            self._convert = True
        self.elem = 4 if self.kind == "fp32" else 2
        self.blob_nbytes = BlobLayout(self.kind, self.hidden, self.inter).nbytes

    def read(self, layer: int, expert: int, out: np.ndarray) -> None:
        """Fill `out` (uint8[blob_nbytes]) with the expert's gate | up | down."""
        pieces = self.ckpt.expert_pieces(layer)[expert]
        pos = 0
        for piece in pieces:
            info = piece.info
            nbytes = piece.count * self.elem
            if not self._convert:
                self._files.pread_into(info.path, piece.offset, memoryview(out[pos:pos + nbytes]))
            else:
                staging = np.empty(piece.count, dtype=DTYPES[info.dtype][0])
                self._files.pread_into(info.path, piece.offset, memoryview(staging.view(np.uint8)))
                out[pos:pos + nbytes] = to_f32(staging).view(np.uint8)
            pos += nbytes
        if pos != self.blob_nbytes:
            raise ModelError(f"layer {layer} expert {expert}: read {pos} bytes, expected {self.blob_nbytes}", self.ckpt.dir)
        self.ckpt.check_expert_finite(layer, expert, out[:pos].view(np.float32 if self.elem == 4 else np.uint16),
                                      "F32" if self.elem == 4 else "BF16")

    def expert_ranges(self) -> list[FileRange]:
        """Where in the shards every expert's bytes lie (for the read-ahead at load)."""
        return [FileRange(piece.info.path, piece.offset, piece.count * DTYPES[piece.info.dtype][1])
                for layer, moe in enumerate(self.ckpt.config.moe_layers) if moe
                for pieces in self.ckpt.expert_pieces(layer) for piece in pieces]

    def forward(self, blob: np.ndarray, x: np.ndarray, y: np.ndarray, w: float) -> None:
        """y += w * down(silu(gate x) * up x)."""
        EXPERT_FORWARD[self.kind](blob, self.hidden, self.inter, x, y, w)

    def close(self) -> None:
        self._files.close()
