"""The memory budget: how many RAM expert-cache slots per layer fit in `--ram-gb` / TIER_RAM_GB.

Why: a 35B-class MoE does not fit in a laptop's RAM, and a cache that asks for
every expert would be killed or swap. The budget covers what the engine holds
for the whole session: the dense weights (as loaded: bf16 stays bf16, fp16
and the small vectors widen to fp32), the attention KV cache and DeltaNet
state at the context length used, the interpreter and compiled kernels (a
fixed allowance), and the RAM expert cache, which gets what is left in whole
slots per MoE layer. Everything here reads file headers only, never weights.

`auto` is the memory this process may use (MemAvailable, or the cgroup v1/v2
limit when that is lower) minus AUTO_MARGIN of it (at least AUTO_MARGIN_MIN),
left for the page cache, the tokenizer and the rest of the system.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from tierlab.engine.config import ModelConfig
from tierlab.engine.errors import ModelError, SettingError

GIB = 1 << 30
ENV_NAME = "TIER_RAM_GB"
AUTO = "auto"
AUTO_MARGIN = 0.10  # auto keeps 10% of the available memory free ...
AUTO_MARGIN_MIN = 512 << 20  # ... and at least 512 MiB
RUNTIME_BYTES = 400 << 20  # the interpreter, numpy, numba and the compiled kernels (docs/benchmarks.md)
DEFAULT_CONTEXT = 4096  # tokens the KV cache is budgeted for unless a command says otherwise
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63
MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_ram_gb(text: str | float | None, origin: str = "--ram-gb") -> float | None:
    """A budget in GB from a flag or TIER_RAM_GB: None for auto; SettingError for anything
    negative, zero, not a number, nan or infinite."""
    if text is None:
        return None
    if isinstance(text, str):
        if text.strip().lower() in ("", AUTO):
            return None
        try:
            value = float(text)
        except ValueError:
            raise SettingError(f"{origin} must be a number of GB or auto, got {text!r}") from None
    else:
        value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise SettingError(f"{origin} must be a positive number of GB or auto, got {text!r}")
    return value


def ram_gb_setting(flag: str | None, env=None) -> tuple[float | None, str]:
    """The budget the flag (over TIER_RAM_GB, over auto) asks for, and where it came from."""
    env = os.environ if env is None else env
    if flag is not None:
        value = parse_ram_gb(flag, "--ram-gb")
        return value, AUTO if value is None else "--ram-gb"
    if env.get(ENV_NAME, "").strip():
        return parse_ram_gb(env[ENV_NAME], ENV_NAME), ENV_NAME
    return None, AUTO


# --- what the machine offers ---------------------------------------------------------------------


def mem_available(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable in bytes, None where /proc/meminfo does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_limit_files(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> list[Path]:
    """The memory limit files of this process's cgroup (v1 memory.limit_in_bytes, v2 memory.max)
    and of the cgroup root, most specific first."""
    found: list[Path] = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, rel = parts[1].split(","), parts[2].lstrip("/")
        if "memory" in controllers:
            found.append(root / "memory" / rel / "memory.limit_in_bytes")
        elif parts[1] == "":
            found += [root / rel / "memory.max", root / "unified" / rel / "memory.max"]
    found += [root / "memory" / "memory.limit_in_bytes", root / "memory.max"]
    return found


def cgroup_limit(files: list[Path] | None = None) -> int | None:
    """The lowest memory limit among `files` (default: this process's cgroup), None without one."""
    limits = []
    for path in cgroup_limit_files() if files is None else files:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text and text != "max":
            try:
                value = int(text)
            except ValueError:
                continue
            if 0 < value < NO_LIMIT:
                limits.append(value)
    return min(limits) if limits else None


def auto_budget(meminfo: Path = MEMINFO, cgroup_files: list[Path] | None = None) -> int | None:
    """What `auto` means: available memory (or the cgroup limit, if lower) minus the margin;
    None where the system says neither (no /proc/meminfo, no cgroup)."""
    candidates = [v for v in (mem_available(meminfo), cgroup_limit(cgroup_files)) if v]
    if not candidates:
        return None
    usable = min(candidates)
    return max(0, usable - max(AUTO_MARGIN_MIN, int(usable * AUTO_MARGIN)))


# --- what the model needs --------------------------------------------------------------------------


@dataclass(frozen=True)
class Footprint:
    """What a model folder will hold in RAM apart from the cache, from its headers."""

    dense_bytes: int  # every non-expert tensor, as loaded
    blob_nbytes: int  # one RAM cache slot
    n_moe_layers: int


def loaded_nbytes(dtype: str, shape: tuple[int, ...], nbytes: int) -> int:
    """A dense tensor's bytes once loaded: fp16 and every vector widen to fp32."""
    if dtype == "F16" or (len(shape) <= 1 and dtype in ("BF16", "F16")):
        return 2 * nbytes
    return nbytes


def footprint(model_dir: str | Path, cfg: ModelConfig) -> Footprint:
    """The footprint of a container or Hugging Face folder (headers only)."""
    from tierlab.engine.checkpoint import EXPERT_TENSOR, Checkpoint
    from tierlab.engine.container import DENSE_FILE, check_against_config, is_container, read_container_info

    model_dir = Path(model_dir)
    if is_container(model_dir):
        info = read_container_info(model_dir)
        check_against_config(info, cfg, model_dir)  # the manifest first, as loading checks it
        ckpt = Checkpoint(model_dir, cfg, weight_files=[DENSE_FILE])
        blob = info.blob_nbytes
    else:
        from tierlab.engine.expert_source import RawExpertSource

        ckpt = Checkpoint(model_dir, cfg)
        source = RawExpertSource(ckpt)
        blob = source.blob_nbytes
        source.close()
    dense = sum(loaded_nbytes(i.dtype, i.shape, i.nbytes) for rel, i in ckpt.tensors.items()
                if not EXPERT_TENSOR.match(rel))
    return Footprint(dense, blob, sum(cfg.moe_layers))


def state_bytes(cfg: ModelConfig, context: int) -> int:
    """KV cache and DeltaNet state for `context` tokens. The KV cache grows by doubling, so it is
    budgeted at the next power of two, and at 1.5 times that while the old copy is alive; the
    DeltaNet state counts once live and once for each snapshot a chat keeps to come back to."""
    from tierlab.engine.conversation import KEEP_SNAPSHOTS

    capacity = 256
    while capacity < context:
        capacity *= 2
    full = sum(t == "full_attention" for t in cfg.layer_types)
    kv = full * 2 * cfg.n_kv_heads * capacity * cfg.head_dim * 4 * 3 // 2
    linear = cfg.n_layers - full
    channels = 2 * cfg.lin_k_heads * cfg.lin_k_dim + cfg.lin_v_heads * cfg.lin_v_dim
    deltanet = linear * 4 * (cfg.lin_v_heads * cfg.lin_k_dim * cfg.lin_v_dim + max(cfg.conv_kernel - 1, 0) * channels)
    return kv + deltanet * (1 + KEEP_SNAPSHOTS)


@dataclass(frozen=True)
class BudgetPlan:
    """A budget split into its parts; `slots` is the RAM cache per MoE layer."""

    budget: int
    origin: str  # --ram-gb, TIER_RAM_GB or auto
    dense: int
    state: int
    runtime: int
    context: int
    slot_bytes: int  # one slot in every MoE layer
    slots: int
    n_experts: int

    @property
    def cache(self) -> int:
        return self.slots * self.slot_bytes

    def lines(self) -> list[str]:
        """The breakdown, one part a line (inspect and --verbose print it)."""
        def gib(n: int) -> str:
            return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"

        left = self.budget - self.dense - self.state - self.runtime
        return [
            f"memory budget {gib(self.budget)} ({self.origin})",
            f"  dense weights      {gib(self.dense)}",
            f"  KV/DeltaNet state  {gib(self.state)} ({self.context} tokens)",
            f"  runtime allowance  {gib(self.runtime)}",
            f"  expert cache       {gib(self.cache)} of {gib(max(left, 0))} left: {self.slots} of {self.n_experts} "
            f"slots per layer ({self.slot_bytes / 2**20:.1f} MiB a slot across the MoE layers)",
        ]


def plan_budget(cfg: ModelConfig, fp: Footprint, budget: int, origin: str = AUTO,
                context: int = DEFAULT_CONTEXT, runtime: int = RUNTIME_BYTES) -> BudgetPlan:
    """Slots per layer for `budget` bytes: what dense weights, state and runtime leave, in whole
    slots, at most every expert. ModelError (one line) when not even one slot fits."""
    state = state_bytes(cfg, context)
    fixed = fp.dense_bytes + state + runtime
    slot_bytes = fp.blob_nbytes * max(fp.n_moe_layers, 1)
    if fp.dense_bytes + runtime > budget:
        raise ModelError(f"memory budget {budget / GIB:.2f} GiB ({origin}) is below the dense weights "
                         f"({fp.dense_bytes / GIB:.2f} GiB) and the runtime ({runtime / GIB:.2f} GiB); "
                         "raise --ram-gb or use a container with --dense-bits 4")
    left = budget - fixed
    slots = min(cfg.n_experts, left // slot_bytes) if left > 0 else 0
    if slots < 1:
        raise ModelError(f"memory budget {budget / GIB:.2f} GiB ({origin}) leaves "
                         f"{max(left, 0) / 2**20:.0f} MiB after the dense weights, state and runtime, "
                         f"less than one expert slot per layer ({slot_bytes / 2**20:.0f} MiB); raise --ram-gb")
    return BudgetPlan(budget, origin, fp.dense_bytes, state, runtime, context, slot_bytes, int(slots), cfg.n_experts)


def plan_for(model_dir: str | Path, cfg: ModelConfig, ram_gb: float | None, origin: str = AUTO,
             context: int = DEFAULT_CONTEXT) -> BudgetPlan | None:
    """The plan for a folder: `ram_gb` GB, or auto when None; None when auto cannot tell how much
    memory there is (the cache is then every expert, as without a budget)."""
    budget = auto_budget() if ram_gb is None else int(ram_gb * GIB)
    if budget is None:
        return None
    return plan_budget(cfg, footprint(model_dir, cfg), budget, origin, context)
