"""Choosing the OpenCL device and turning a budget knob into bytes.

Devices are chosen by name, never by index: Debian's pocl-opencl-icd can put
a second PoCL platform ahead of the pip one, so indices move between hosts.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

GiB = 2**30
CPU_AUTO_SHARE = 0.25  # PoCL reports host RAM as device memory: take a quarter of it
CPU_AUTO_CAP = 4 * GiB
GPU_MARGIN_MIN = 512 * 2**20  # room for the driver, scratch buffers and other programs
GPU_MARGIN_SHARE = 0.10


class NoDevice(Exception):
    """No usable OpenCL device; the message is one line saying why."""


@dataclass(frozen=True)
class DeviceChoice:
    platform: object  # pyopencl.Platform
    device: object  # pyopencl.Device
    label: str  # "platform / device"
    is_cpu: bool


def _type_rank(cl, device) -> int:
    """Lower is preferred: GPU, then accelerator, then anything else (CPU)."""
    if device.type & cl.device_type.GPU:
        return 0
    if device.type & cl.device_type.ACCELERATOR:
        return 1
    return 2


def list_devices(cl) -> list[DeviceChoice]:
    """Every device of every platform; raises NoDevice when there is no platform at all."""
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:  # PLATFORM_NOT_FOUND_KHR when no ICD is installed
        raise NoDevice(f"no OpenCL platform ({_short(exc)})") from None
    found = []
    for platform in sorted(platforms, key=lambda p: p.name):
        try:
            devices = platform.get_devices()
        except cl.Error:  # a platform without devices raises DEVICE_NOT_FOUND
            continue
        for device in devices:
            is_cpu = bool(device.type & cl.device_type.CPU)
            found.append(DeviceChoice(platform, device, f"{platform.name.strip()} / {device.name.strip()}", is_cpu))
    if not found:
        raise NoDevice("OpenCL platforms found but no devices")
    return found


def pick_device(cl, name: str | None) -> DeviceChoice:
    """The first device whose 'platform / device' label contains `name` (case-insensitive);
    with no name, a GPU if there is one, else any device."""
    devices = list_devices(cl)
    if name:
        matches = [d for d in devices if name.lower() in d.label.lower()]
        if not matches:
            labels = "; ".join(d.label for d in devices)
            raise NoDevice(f"no OpenCL device matches {name!r} (have: {labels})")
        return matches[0]
    return sorted(devices, key=lambda d: _type_rank(cl, d.device))[0]


def usable_bytes(global_mem: int) -> int:
    """Device memory minus a margin for everything that is not the tier."""
    return max(0, global_mem - max(GPU_MARGIN_MIN, int(global_mem * GPU_MARGIN_SHARE)))


def auto_bytes(global_mem: int, is_cpu: bool) -> int:
    if is_cpu:
        return min(int(global_mem * CPU_AUTO_SHARE), CPU_AUTO_CAP)
    return usable_bytes(global_mem)


def parse_budget(budget: str | float | None) -> float | None:
    """None for auto, else GiB as a finite positive float; ValueError with one line otherwise."""
    if budget is None:
        return None
    if isinstance(budget, str):
        text = budget.strip().lower()
        if text in ("", "auto"):
            return None
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"TIER_GB: cannot read {budget!r}; use 'auto' or a number of GiB") from None
    else:
        value = float(budget)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"TIER_GB: {budget!r} must be a finite positive number of GiB (or 'auto')")
    return value


def resolve_budget(budget: str | float | None, global_mem: int, is_cpu: bool) -> tuple[int, str | None]:
    """Budget in bytes, and a one-line notice when a requested budget had to be clamped."""
    gib = parse_budget(budget)
    if gib is None:
        return auto_bytes(global_mem, is_cpu), None
    wanted = int(gib * GiB)
    limit = usable_bytes(global_mem)
    if wanted > limit:
        return limit, (
            f"TIER_GB={gib:g} is more than the device can hold; "
            f"clamped to {limit / GiB:.2f} GiB ({global_mem / GiB:.2f} GiB on the device minus a margin)"
        )
    return wanted, None


def _short(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
