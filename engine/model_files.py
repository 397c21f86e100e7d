"""Open a model folder's files and check them against each other: the one validator.

`load_engine` and `tierlab inspect` both call `open_model_files`, so inspect
refuses exactly what loading refuses: config.json parsed and range-checked,
the safetensors headers (the tensor index), and for a quantised container its
manifest against config.json, experts.bin's size and the checksum file. No
weight is read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierlab.engine.checkpoint import Checkpoint
from tierlab.engine.config import ModelConfig, load_config
from tierlab.engine.container import DENSE_FILE, ContainerExpertSource, ContainerInfo, check_against_config, \
    is_container, read_container_info
from tierlab.engine.errors import ModelError
from tierlab.engine.expert_source import RawExpertSource


@dataclass
class ModelFiles:
    """A model folder whose files passed every load-time check."""

    folder: Path
    config: ModelConfig
    checkpoint: Checkpoint
    source: ContainerExpertSource | RawExpertSource
    container: ContainerInfo | None  # None: a Hugging Face checkpoint

    def close(self) -> None:
        self.source.close()


def open_model_files(folder: str | Path) -> ModelFiles:
    """Parse and cross-check a checkpoint folder or container; ModelError (one line) otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError("not a folder", folder)
    cfg = load_config(folder)
    if not is_container(folder):
        ckpt = Checkpoint(folder, cfg)
        return ModelFiles(folder, cfg, ckpt, RawExpertSource(ckpt), None)
    info = read_container_info(folder)
    check_against_config(info, cfg, folder)
    source = ContainerExpertSource(folder)
    try:
        ckpt = Checkpoint(folder, cfg, weight_files=[DENSE_FILE])
    except BaseException:
        source.close()
        raise
    return ModelFiles(folder, cfg, ckpt, source, info)
