"""Run configuration: one typed, validated dataclass built from the command line.

Validation happens here, before any process group, file or checkpoint is touched, and raises
``UsageError`` with the fix in the message. Checks that depend on the world size live in
``check_world_size`` because the same config must stay valid when an elastic job changes size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastic_train.errors import UsageError

MODELS = ("vit", "resnet18")
DATASETS = ("synthetic", "digits", "tiny-imagenet", "imagefolder")
OPTIMIZERS = ("adamw", "sgd")
DEVICES = ("auto", "cpu", "cuda")
DATASETS_NEEDING_DIR = ("tiny-imagenet", "imagefolder")


@dataclass(frozen=True)
class TrainConfig:
    # The seed's flags, same names and meaning.
    model: str = "vit"
    dataset: str = "synthetic"
    batch_size: int = 128  # GLOBAL batch; each of W processes takes batch_size // W
    epochs: int = 10
    optimizer: str = "adamw"
    base_lr: float = 1e-3
    target_accuracy: float = 0.95
    patience: int = 3  # epochs without val-accuracy improvement before stopping; 0 = never
    seed: int = 42
    num_workers: int = 0
    amp: bool = False
    # Ours.
    data_dir: Path | None = None
    device: str = "auto"
    log_dir: Path = field(default_factory=lambda: Path("logs"))
    max_steps_per_epoch: int | None = None
    image_size: int | None = None  # None: the dataset's native size
    collective_timeout: float = 600.0
    hang_timeout: float = 300.0  # seconds without a finished step before a rank exits; 0: off
    threads: int = 0  # 0: cores // local processes, unless OMP_NUM_THREADS is set
    weight_decay: float = 0.05
    warmup_steps: int = 0
    # Checkpoints (see docs/checkpoint-format.md).
    checkpoint_dir: Path = field(default_factory=lambda: Path("checkpoints"))
    checkpoint_every: int = 0  # steps; 0: at epoch ends only
    checkpoint_every_seconds: float = 0.0  # 0: off
    keep_last: int = 3
    resume: str = "auto"  # auto | never | PATH
    async_checkpoint: bool = True

    def __post_init__(self) -> None:
        self._check_choice("--model", self.model, MODELS)
        self._check_choice("--dataset", self.dataset, DATASETS)
        self._check_choice("--optimizer", self.optimizer, OPTIMIZERS)
        self._check_choice("--device", self.device, DEVICES)
        if self.batch_size < 1:
            raise UsageError(f"--batch-size {self.batch_size} must be >= 1", "pass the global batch, e.g. 256")
        if self.epochs < 1:
            raise UsageError(f"--epochs {self.epochs} must be >= 1", "pass e.g. --epochs 10")
        if not self.base_lr > 0:
            raise UsageError(f"--base-lr {self.base_lr} must be > 0", "pass e.g. --base-lr 0.001")
        if not 0 < self.target_accuracy <= 1:
            raise UsageError(
                f"--target-accuracy {self.target_accuracy} is outside (0, 1]",
                "pass a fraction such as 0.95 (1.0 never stops early on accuracy)",
            )
        if self.patience < 0:
            raise UsageError(f"--patience {self.patience} must be >= 0", "pass 0 to disable, or e.g. 3")
        if self.num_workers < 0:
            raise UsageError(f"--num-workers {self.num_workers} must be >= 0", "pass 0 to load in-process")
        if self.max_steps_per_epoch is not None and self.max_steps_per_epoch < 1:
            raise UsageError(
                f"--max-steps-per-epoch {self.max_steps_per_epoch} must be >= 1", "omit it for full epochs"
            )
        if self.image_size is not None and not 8 <= self.image_size <= 1024:
            raise UsageError(f"--image-size {self.image_size} is outside [8, 1024]", "omit it for the dataset's size")
        if not self.collective_timeout > 0:
            raise UsageError(f"--collective-timeout {self.collective_timeout} must be > 0", "pass seconds, e.g. 600")
        if self.hang_timeout < 0:
            raise UsageError(f"--hang-timeout {self.hang_timeout} must be >= 0", "pass seconds, or 0 to disable")
        if self.threads < 0:
            raise UsageError(f"--threads {self.threads} must be >= 0", "pass 0 for automatic")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay {self.weight_decay} must be >= 0", "pass e.g. 0.05")
        if self.warmup_steps < 0:
            raise UsageError(f"--warmup-steps {self.warmup_steps} must be >= 0", "pass 0 for no warm-up")
        if self.checkpoint_every < 0:
            raise UsageError(f"--checkpoint-every {self.checkpoint_every} must be >= 0", "pass steps, or 0")
        if self.checkpoint_every_seconds < 0:
            raise UsageError(
                f"--checkpoint-every-seconds {self.checkpoint_every_seconds} must be >= 0", "pass seconds, or 0"
            )
        if self.keep_last < 2:
            raise UsageError(
                f"--keep-last {self.keep_last} must be >= 2",
                "keep at least 2 so a corrupt newest checkpoint still leaves one to fall back on",
            )
        if self.dataset in DATASETS_NEEDING_DIR and self.data_dir is None:
            raise UsageError(
                f"--dataset {self.dataset} needs --data-dir",
                "pass --data-dir PATH to the extracted folder or the folder holding the .zip",
            )

    @staticmethod
    def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise UsageError(f"{flag} {value!r} is not one of {', '.join(choices)}", f"pick one of {choices}")

    def check_world_size(self, world_size: int) -> int:
        """Return the per-process batch; the global batch must split evenly over the ranks."""
        if self.batch_size < world_size:
            raise UsageError(
                f"global --batch-size {self.batch_size} is smaller than the world size {world_size}",
                f"use a global batch of at least {world_size} (a multiple of it), or fewer processes",
            )
        if self.batch_size % world_size:
            lower = self.batch_size - self.batch_size % world_size
            raise UsageError(
                f"global --batch-size {self.batch_size} is not divisible by the world size {world_size}",
                f"use a multiple of {world_size}, e.g. {lower} or {lower + world_size}",
            )
        return self.batch_size // world_size

    def fingerprint(self) -> dict[str, Any]:
        """Settings a resumed run must share with its checkpoint: they define the model's shape
        and the order of the data (the global batch sequence)."""
        return {
            "model": self.model,
            "dataset": self.dataset,
            "image_size": self.image_size,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "seed": self.seed,
            "max_steps_per_epoch": self.max_steps_per_epoch,
        }

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, Path):
                out[key] = str(value)
        return out
