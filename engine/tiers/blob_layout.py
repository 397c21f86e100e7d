"""Where gate, up and down sit inside one expert blob, for each of the four kinds.

The engine keeps one expert as one contiguous uint8 blob so a single read (or
a single upload) moves it. Matrices are gate [I,H], up [I,H], down [H,I]
(out x in, row-major); H = hidden, I = moe_intermediate.

- fp32: gate | up | down as little-endian float32.
- bf16: gate | up | down as bf16 bit patterns (the high half of a float32).
- int8 / int4, group 64: section 1 = quantised weights of gate, up, down
  (int8: one signed byte each; int4: per row, per 64-column group, 32 bytes,
  byte j = (q[j]+8) | (q[j+32]+8) << 4); section 2 = float32 scales of gate,
  up, down, each rows x cols/64. Weight = q * scale.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("fp32", "bf16", "int8", "int4")
GROUP = 64
BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4}


@dataclass(frozen=True)
class BlobLayout:
    kind: str
    hidden: int
    inter: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown expert kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.hidden <= 0 or self.inter <= 0:
            raise ValueError(f"expert dims must be positive, got hidden={self.hidden} inter={self.inter}")
        if self.quantised and (self.hidden % GROUP or self.inter % GROUP):
            raise ValueError(
                f"{self.kind} needs hidden and inter divisible by {GROUP}, got {self.hidden} and {self.inter}"
            )

    @property
    def quantised(self) -> bool:
        return self.kind in ("int8", "int4")

    @property
    def weights_per_matrix(self) -> int:
        return self.hidden * self.inter

    @property
    def weight_bytes(self) -> int:
        """Bytes of one matrix's weights (section 1 share for quantised kinds)."""
        return self.weights_per_matrix * BITS[self.kind] // 8

    @property
    def scale_bytes(self) -> int:
        """Bytes of one matrix's float32 scales (0 for fp32/bf16)."""
        return self.weights_per_matrix // GROUP * 4 if self.quantised else 0

    @property
    def nbytes(self) -> int:
        return 3 * (self.weight_bytes + self.scale_bytes)

    def weight_offset(self, matrix: int) -> int:
        """Byte offset of matrix 0=gate, 1=up, 2=down."""
        return matrix * self.weight_bytes

    def scale_offset(self, matrix: int) -> int:
        """Byte offset of the matrix's scales (section 2); 0 for unquantised kinds."""
        return 3 * self.weight_bytes + matrix * self.scale_bytes if self.quantised else 0


def blob_nbytes(kind: str, hidden: int, inter: int) -> int:
    return BlobLayout(kind, hidden, inter).nbytes
