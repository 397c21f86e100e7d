"""OpenCL C source of the fused SwiGLU expert, one program per blob kind.

Two launches compute any number of experts of one token:
``gate_up`` writes ``h = silu(gate x) * (up x)`` for [n_experts x I] rows into
a device buffer, ``down`` reads it and writes [n_experts x H] outputs. Each
expert's blob is found in the pool buffer through a table of byte offsets.

Two row strategies, chosen at build time with ``-DWG=``:
- WG=0 (CPU devices): one work-item per output row, a plain scalar loop over
  the row. PoCL vectorises across work-items; wide explicit int-to-float
  vector conversions are avoided on purpose (they abort PoCL 3.0's LLVM).
- WG=n (GPUs): one work-group of n items per row, strided coalesced reads and
  a local-memory tree reduction.
Accumulation is float32 throughout.
"""

from __future__ import annotations

from tierlab.engine.blob_layout import GROUP, BlobLayout

KIND_CODES = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}

BUILD_FLAGS = ("-cl-fast-relaxed-math",)

SOURCE = r"""
typedef __global const uchar* blob_t;

#if KIND == 0
/* fp32 */
float row_dot(blob_t blob, ulong w_off, ulong s_off, uint row, uint cols, __global const float* x)
{
    __global const float* w = (__global const float*)(blob + w_off) + (size_t)row * cols;
    float acc = 0.0f;
    for (uint k = 0; k < cols; k++) acc += w[k] * x[k];
    return acc;
}
/* gate and up rows in one loop: two streams per work-item vectorise better on PoCL than two loops */
float2 row_dot2(blob_t blob, uint row, __global const float* x)
{
    __global const float* wg = (__global const float*)(blob + GATE_W) + (size_t)row * HID;
    __global const float* wu = (__global const float*)(blob + UP_W) + (size_t)row * HID;
    float a = 0.0f, b = 0.0f;
    for (uint k = 0; k < HID; k++) { a += wg[k] * x[k]; b += wu[k] * x[k]; }
    return (float2)(a, b);
}
float row_part(blob_t blob, ulong w_off, ulong s_off, uint row, uint cols, __global const float* x, uint lid)
{
    __global const float* w = (__global const float*)(blob + w_off) + (size_t)row * cols;
    float acc = 0.0f;
    for (uint k = lid; k < cols; k += WG) acc += w[k] * x[k];
    return acc;
}
#elif KIND == 1
/* bf16: the 16 bits are the high half of a float32 */
float bf16f(ushort b) { return as_float(((uint)b) << 16); }
float row_dot(blob_t blob, ulong w_off, ulong s_off, uint row, uint cols, __global const float* x)
{
    __global const ushort* w = (__global const ushort*)(blob + w_off) + (size_t)row * cols;
    float acc = 0.0f;
    for (uint k = 0; k < cols; k++) acc += bf16f(w[k]) * x[k];
    return acc;
}
float2 row_dot2(blob_t blob, uint row, __global const float* x)
{
    __global const ushort* wg = (__global const ushort*)(blob + GATE_W) + (size_t)row * HID;
    __global const ushort* wu = (__global const ushort*)(blob + UP_W) + (size_t)row * HID;
    float a = 0.0f, b = 0.0f;
    for (uint k = 0; k < HID; k++) { a += bf16f(wg[k]) * x[k]; b += bf16f(wu[k]) * x[k]; }
    return (float2)(a, b);
}
float row_part(blob_t blob, ulong w_off, ulong s_off, uint row, uint cols, __global const float* x, uint lid)
{
    __global const ushort* w = (__global const ushort*)(blob + w_off) + (size_t)row * cols;
    float acc = 0.0f;
    for (uint k = lid; k < cols; k += WG) acc += bf16f(w[k]) * x[k];
    return acc;
}
#elif KIND == 2
/* int8, one float32 scale per 64 columns */
float row_dot(blob_t blob, ulong w_off, ulong s_off, uint row, uint cols, __global const float* x)
{
    __global const char* w = (__global const char*)(blob + w_off) + (size_t)row * cols;
    __global const float* s = (__global const float*)(blob + s_off) + (size_t)row * (cols / GROUP);
    float acc = 0.0f;
    for (uint g = 0; g < cols / GROUP; g++) {
        float part = 0.0f;
        for (uint j = 0; j < GROUP; j++) part += (float)w[g * GROUP + j] * x[g * GROUP + j];
        acc += s[g] * part;
    }
    return acc;
}
float2 row_dot2(blob_t blob, uint row, __global const float* x)
{
    __global const char* wg = (__global const char*)(blob + GATE_W) + (size_t)row * HID;
    __global const char* wu = (__global const char*)(blob + UP_W) + (size_t)row * HID;
    __global const float* sg = (__global const float*)(blob + GATE_S) + (size_t)row * (HID / GROUP);
    __global const float* su = (__global const float*)(blob + UP_S) + (size_t)row * (HID / GROUP);
    float a = 0.0f, b = 0.0f;
    for (uint g = 0; g < HID / GROUP; g++) {
        float pa = 0.0f, pb = 0.0f;
        for (uint j = 0; j < GROUP; j++) {
            float xv = x[g * GROUP + j];
            pa += (float)wg[g * GROUP + j] * xv;
            pb += (float)wu[g * GROUP + j] * xv;
        }
        a += sg[g] * pa;
        b += su[g] * pb;
    }
    return (float2)(a, b);
}
float row_part(blob_t blob, ulong w_off, ulong s_off, uint row, uint cols, __global const float* x, uint lid)
{
    __global const char* w = (__global const char*)(blob + w_off) + (size_t)row * cols;
    __global const float* s = (__global const float*)(blob + s_off) + (size_t)row * (cols / GROUP);
    float acc = 0.0f;
    for (uint k = lid; k < cols; k += WG) acc += (float)w[k] * s[k / GROUP] * x[k];
    return acc;
}
#else
/* int4 planar: per 64-column group 32 bytes, low nibble = column j, high = column j+32 */
float row_dot(blob_t blob, ulong w_off, ulong s_off, uint row, uint cols, __global const float* x)
{
    __global const uchar* w = blob + w_off + (size_t)row * (cols / 2);
    __global const float* s = (__global const float*)(blob + s_off) + (size_t)row * (cols / GROUP);
    float acc = 0.0f;
    for (uint g = 0; g < cols / GROUP; g++) {
        __global const uchar* b = w + g * (GROUP / 2);
        __global const float* xg = x + g * GROUP;
        float part = 0.0f;
        for (uint j = 0; j < GROUP / 2; j++) {
            int v = b[j];
            part += (float)((v & 15) - 8) * xg[j] + (float)((v >> 4) - 8) * xg[j + GROUP / 2];
        }
        acc += s[g] * part;
    }
    return acc;
}
float2 row_dot2(blob_t blob, uint row, __global const float* x)
{
    __global const uchar* wg = blob + GATE_W + (size_t)row * (HID / 2);
    __global const uchar* wu = blob + UP_W + (size_t)row * (HID / 2);
    __global const float* sg = (__global const float*)(blob + GATE_S) + (size_t)row * (HID / GROUP);
    __global const float* su = (__global const float*)(blob + UP_S) + (size_t)row * (HID / GROUP);
    float a = 0.0f, b = 0.0f;
    for (uint g = 0; g < HID / GROUP; g++) {
        __global const float* xg = x + g * GROUP;
        float pa = 0.0f, pb = 0.0f;
        for (uint j = 0; j < GROUP / 2; j++) {
            int va = wg[g * (GROUP / 2) + j], vb = wu[g * (GROUP / 2) + j];
            float lo = xg[j], hi = xg[j + GROUP / 2];
            pa += (float)((va & 15) - 8) * lo + (float)((va >> 4) - 8) * hi;
            pb += (float)((vb & 15) - 8) * lo + (float)((vb >> 4) - 8) * hi;
        }
        a += sg[g] * pa;
        b += su[g] * pb;
    }
    return (float2)(a, b);
}
float row_part(blob_t blob, ulong w_off, ulong s_off, uint row, uint cols, __global const float* x, uint lid)
{
    __global const uchar* w = blob + w_off + (size_t)row * (cols / 2);
    __global const float* s = (__global const float*)(blob + s_off) + (size_t)row * (cols / GROUP);
    float acc = 0.0f;
    for (uint k = lid; k < cols / 2; k += WG) {
        uint g = k / (GROUP / 2), j = k % (GROUP / 2);
        int v = w[k];
        __global const float* xg = x + g * GROUP;
        acc += s[g] * ((float)((v & 15) - 8) * xg[j] + (float)((v >> 4) - 8) * xg[j + GROUP / 2]);
    }
    return acc;
}
#endif

float silu_mul(float g, float u) { return g / (1.0f + exp(-g)) * u; }

#if WG == 0
__kernel void gate_up(__global const uchar* pool, __global const ulong* slot_off, uint first,
                      __global const float* x, __global float* h)
{
    size_t r = get_global_id(0);
    uint e = first + (uint)(r / INTER), row = (uint)(r % INTER);
    blob_t blob = pool + slot_off[e];
    float2 gu = row_dot2(blob, row, x);
    h[(size_t)e * INTER + row] = silu_mul(gu.x, gu.y);
}

__kernel void down(__global const uchar* pool, __global const ulong* slot_off, uint first,
                   __global const float* h, __global float* out)
{
    size_t r = get_global_id(0);
    uint e = first + (uint)(r / HID), row = (uint)(r % HID);
    blob_t blob = pool + slot_off[e];
    out[(size_t)e * HID + row] = row_dot(blob, DOWN_W, DOWN_S, row, INTER, h + (size_t)e * INTER);
}
#else
float reduce_local(__local float* buf, uint lid)
{
    for (uint s = WG / 2; s > 0; s >>= 1) {
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < s) buf[lid] += buf[lid + s];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    return buf[0];
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void gate_up(__global const uchar* pool, __global const ulong* slot_off, uint first,
             __global const float* x, __global float* h)
{
    __local float sg[WG];
    __local float su[WG];
    size_t r = get_group_id(0);
    uint lid = (uint)get_local_id(0);
    uint e = first + (uint)(r / INTER), row = (uint)(r % INTER);
    blob_t blob = pool + slot_off[e];
    sg[lid] = row_part(blob, GATE_W, GATE_S, row, HID, x, lid);
    su[lid] = row_part(blob, UP_W, UP_S, row, HID, x, lid);
    float g = reduce_local(sg, lid);
    float u = reduce_local(su, lid);
    if (lid == 0) h[(size_t)e * INTER + row] = silu_mul(g, u);
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void down(__global const uchar* pool, __global const ulong* slot_off, uint first,
          __global const float* h, __global float* out)
{
    __local float sd[WG];
    size_t r = get_group_id(0);
    uint lid = (uint)get_local_id(0);
    uint e = first + (uint)(r / HID), row = (uint)(r % HID);
    blob_t blob = pool + slot_off[e];
    sd[lid] = row_part(blob, DOWN_W, DOWN_S, row, INTER, h + (size_t)e * INTER, lid);
    float d = reduce_local(sd, lid);
    if (lid == 0) out[(size_t)e * HID + row] = d;
}
#endif
"""


def build_options(layout: BlobLayout, work_group: int) -> list[str]:
    """Shapes and offsets become compile-time constants so loops have fixed bounds."""
    defines = {
        "KIND": KIND_CODES[layout.kind],
        "HID": layout.hidden,
        "INTER": layout.inter,
        "GROUP": GROUP,
        "WG": work_group,
        "GATE_W": f"{layout.weight_offset(0)}UL",
        "UP_W": f"{layout.weight_offset(1)}UL",
        "DOWN_W": f"{layout.weight_offset(2)}UL",
        "GATE_S": f"{layout.scale_offset(0)}UL",
        "UP_S": f"{layout.scale_offset(1)}UL",
        "DOWN_S": f"{layout.scale_offset(2)}UL",
    }
    return [*BUILD_FLAGS, *(f"-D{k}={v}" for k, v in defines.items())]
