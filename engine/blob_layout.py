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

The quantiser, the container, the CPU kernels and the OpenCL tier all take
their sizes and offsets from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

KINDS = ("fp32", "bf16", "int8", "int4")
GROUP = 64  # columns per quantisation group (one float32 scale each)
BLOB_ALIGN = 4096  # distance between blobs in a container's experts.bin is a multiple of this
BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4}


def quant_kind(bits: int) -> str:
    """The kind of a quantised blob with `bits` bits per weight (8 or 4)."""
    return f"int{bits}"


def check_dims(hidden: int, inter: int, group: int = GROUP) -> None:
    """Refuse shapes the kernels cannot group (one-line ValueError)."""
    if group != GROUP:
        raise ValueError(f"only group size {GROUP} is supported, got {group}")
    if hidden % group or inter % group or hidden <= 0 or inter <= 0:
        raise ValueError(
            f"hidden ({hidden}) and moe_intermediate_size ({inter}) must be positive multiples of {group}"
        )


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
    def bits(self) -> int:
        return BITS[self.kind]

    @property
    def weights_per_matrix(self) -> int:
        return self.hidden * self.inter

    @property
    def weight_bytes(self) -> int:
        """Bytes of one matrix's weights (section 1 share for quantised kinds)."""
        return self.weights_per_matrix * self.bits // 8

    @property
    def scale_bytes(self) -> int:
        """Bytes of one matrix's float32 scales (0 for fp32/bf16)."""
        return self.weights_per_matrix // GROUP * 4 if self.quantised else 0

    @property
    def nbytes(self) -> int:
        return 3 * (self.weight_bytes + self.scale_bytes)

    @property
    def stride(self) -> int:
        """Distance between consecutive blobs in experts.bin (BLOB_ALIGN-aligned)."""
        return -(-self.nbytes // BLOB_ALIGN) * BLOB_ALIGN

    def weight_offset(self, matrix: int) -> int:
        """Byte offset of matrix 0=gate, 1=up, 2=down."""
        return matrix * self.weight_bytes

    def scale_offset(self, matrix: int) -> int:
        """Byte offset of the matrix's scales (section 2); 0 for unquantised kinds."""
        return 3 * self.weight_bytes + matrix * self.scale_bytes if self.quantised else 0

    def shape(self, matrix: int) -> tuple[int, int]:
        """(rows, cols) of matrix 0=gate, 1=up, 2=down."""
        return (self.inter, self.hidden) if matrix < 2 else (self.hidden, self.inter)


@lru_cache(maxsize=None)
def blob_nbytes(kind: str, hidden: int, inter: int) -> int:
    """Bytes of one expert blob (cached: the kernels check it on every expert call)."""
    return BlobLayout(kind, hidden, inter).nbytes
