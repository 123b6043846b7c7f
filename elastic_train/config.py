"""Run configuration: one typed, validated dataclass built from the command line.

Validation happens here, before any process group, file or checkpoint is touched, and raises
``UsageError`` with the fix in the message. Checks that depend on the world size live in
``check_world_size`` because the same config must stay valid when an elastic job changes size.

A resumed run must match its checkpoint in the settings of ``FINGERPRINT`` plus the dataset's
identity (``fingerprint``); every other setting may change between attempts (``changes_since``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from elastic_train.errors import UsageError

MODELS = ("vit", "resnet18")  # built in; any torchvision classifier as torchvision:NAME (models.py)
TORCHVISION_PREFIX = "torchvision:"
MODEL_CHOICES = "vit, resnet18 or torchvision:NAME"
DATASETS = ("synthetic", "digits", "tiny-imagenet", "imagefolder")
OPTIMIZERS = ("adamw", "sgd")
DEVICES = ("auto", "cpu", "cuda")
AMP_DTYPES = ("auto", "bf16", "fp16")
FT_MODES = ("restart", "quorum")  # docs/fault-tolerance.md, "Which mode when"
PARALLEL_MODES = ("ddp", "fsdp")  # replicated weights, or FSDP2-sharded ones (docs/api.md)
DATASETS_NEEDING_DIR = ("tiny-imagenet", "imagefolder")
# --best-metric: the epoch metrics (``metrics.EpochRecord``) a checkpoint can be kept as one of the
# best for, and which way is better. The one table: the flag's choices, its validation and
# retention's ranking (``checkpoint.storage.best_checkpoints``) all read it.
BEST_METRICS: dict[str, Literal["max", "min"]] = {
    "val_acc": "max",
    "train_acc": "max",
    "val_loss": "min",
    "train_loss": "min",
}
# Settings that define the model's shape and the order of the data (the global batch sequence):
# a checkpoint only continues a run that shares them.
FINGERPRINT = (
    "model",
    "dataset",
    "image_size",
    "batch_size",
    "optimizer",
    "seed",
    "max_steps_per_epoch",
)
# The flags a plug-in task does not use: it builds its own model from its own data. Left out of
# its fingerprint (a change cannot refuse a resume) and reported as ignored at start. The
# optimizer joins them when the task brings its own.
TASK_IGNORES = ("model", "dataset", "image_size")
# Prefix of the dataset's identity in the fingerprint (``DataBundle.identity``).
DATA_KEY = "data."


def is_model_name(model: str) -> bool:
    """A built-in model, or ``torchvision:`` and a registry-style name. Whether torchvision has
    that model is checked where torchvision is imported (``models.registry_name``)."""
    name = model.removeprefix(TORCHVISION_PREFIX)
    return model in MODELS or (name != model and name.isascii() and name.replace("_", "").isalnum())


@dataclass(frozen=True)
class TrainConfig:
    # The seed's flags, same names and meaning.
    model: str = "vit"
    dataset: str = "synthetic"
    batch_size: int = 128  # GLOBAL batch, split over W processes (data.sampler.per_process_batch)
    epochs: int = 10
    optimizer: str = "adamw"
    base_lr: float = 1e-3
    target_accuracy: float = 0.95
    patience: int = 3  # epochs without val-accuracy improvement before stopping; 0 = never
    seed: int = 42
    num_workers: int = 0
    amp: bool = False
    amp_dtype: str = "auto"  # auto: bf16 where supported, else fp16 with loss scaling
    deterministic: bool = False  # deterministic kernels (bitwise-reproducible GPU runs; slower)
    # Ours.
    task: str | None = None  # package.module:function returning an elastic_train.Task; None: images
    data_dir: Path | None = None
    device: str = "auto"
    log_dir: Path = field(default_factory=lambda: Path("logs"))
    max_steps_per_epoch: int | None = None
    # Validate on the first N validation samples only (quick runs; None: all). Not fingerprinted:
    # it changes what the epoch's metrics measure, never the training state.
    max_val_samples: int | None = None
    image_size: int | None = None  # None: the dataset's native size
    collective_timeout: float = 600.0
    # Seconds without a finished step or evaluation batch before a rank exits; 0: off. 60 s keeps a
    # frozen node's cost under 2 minutes, with twice the longest legitimate pause (a first step)
    # as margin: docs/fault-tolerance.md, "Choosing --hang-timeout".
    hang_timeout: float = 60.0
    stop_grace: float = 10.0  # seconds from a stop signal to an agreed boundary, else exit 77; 0: wait
    threads: int = 0  # 0: cores // local processes, unless OMP_NUM_THREADS is set
    weight_decay: float = 0.05
    warmup_steps: int = 0
    # Samples per forward/backward pass: a process's share of a step is split into micro-batches
    # of at most this many (gradients accumulated; DDP syncs on the last), so its memory is
    # bounded whatever the world size. 0: the whole share at once. Not fingerprinted: a resume
    # may split its steps differently (equal up to float summation order).
    micro_batch_size: int = 0
    log_every: int = 10  # steps between lines of <log-dir>/steps.jsonl (and TensorBoard); 0: off
    # Checkpoints (see docs/checkpoint-format.md).
    checkpoint_dir: Path = field(default_factory=lambda: Path("checkpoints"))
    # One folder per run: <run-dir>/logs and <run-dir>/checkpoints, unless --log-dir or
    # --checkpoint-dir is given too. The report and the checkpoint tool take it as well.
    run_dir: Path | None = None
    checkpoint_every: int = 0  # steps; 0: at epoch ends only
    checkpoint_every_seconds: float = 0.0  # 0: off
    keep_last: int = 3
    keep_best: int = 0  # also keep the K best epoch-end checkpoints by best_metric; 0: off
    best_metric: str = "val_acc"  # a key of BEST_METRICS
    resume: str = "auto"  # auto | never | PATH
    init_from: Path | None = None  # start weights (model only) for a fresh start
    async_checkpoint: bool = True
    # Fault tolerance: restart (torchrun's: a failure restarts every worker from the checkpoint)
    # or quorum (survivors keep training; elastic_train.quorum, launched by its own agent).
    ft: str = "restart"
    # How a model's state lies over the processes: ddp (replicated on each) or fsdp (FSDP2:
    # parameters, gradients and optimizer state sharded; checkpoints saved in pieces). Not
    # fingerprinted: a checkpoint of either resumes in either, at any world size.
    parallel: str = "ddp"
    lighthouse: str | None = None  # quorum: the Lighthouse's http://host:port (TORCHFT_LIGHTHOUSE)
    # quorum: how long a step's collective waits for a silent peer (a frozen node costs this); a
    # dead peer's closed socket fails it at once. The bound adds twice the slowest recent wait, so
    # a loaded host's jitter is absorbed above it (docs/fault-tolerance.md: 1 s measured against 2).
    peer_timeout: float = 1.0

    def __post_init__(self) -> None:
        if self.run_dir is not None:  # frozen: set the derived folders once, here
            if self.log_dir == Path("logs"):
                object.__setattr__(self, "log_dir", self.run_dir / "logs")
            if self.checkpoint_dir == Path("checkpoints"):
                object.__setattr__(self, "checkpoint_dir", self.run_dir / "checkpoints")
        if not is_model_name(self.model):
            raise UsageError(
                f"--model {self.model!r} is not one of {MODEL_CHOICES}",
                "pick a built-in model, or a torchvision classification model such as torchvision:mobilenet_v3_small",
            )
        self._check_choice("--dataset", self.dataset, DATASETS)
        self._check_choice("--optimizer", self.optimizer, OPTIMIZERS)
        self._check_choice("--device", self.device, DEVICES)
        self._check_choice("--amp-dtype", self.amp_dtype, AMP_DTYPES)
        self._check_choice("--ft", self.ft, FT_MODES)
        self._check_choice("--parallel", self.parallel, PARALLEL_MODES)
        if self.parallel == "fsdp" and self.amp and self.amp_dtype == "fp16":
            raise UsageError(
                "--amp-dtype fp16 with --parallel fsdp: FSDP's mixed precision here is bf16 (no loss scaling)",
                "use --amp-dtype bf16 (or auto) with --parallel fsdp",
            )
        if not self.peer_timeout > 0:
            raise UsageError(f"--peer-timeout {self.peer_timeout} must be > 0", "pass seconds, e.g. 1")
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
        if self.max_val_samples is not None and self.max_val_samples < 1:
            raise UsageError(
                f"--max-val-samples {self.max_val_samples} must be >= 1", "omit it to validate on every sample"
            )
        if self.image_size is not None and not 8 <= self.image_size <= 1024:
            raise UsageError(f"--image-size {self.image_size} is outside [8, 1024]", "omit it for the dataset's size")
        if not self.collective_timeout > 0:
            raise UsageError(f"--collective-timeout {self.collective_timeout} must be > 0", "pass seconds, e.g. 600")
        if self.hang_timeout < 0:
            raise UsageError(f"--hang-timeout {self.hang_timeout} must be >= 0", "pass seconds, or 0 to disable")
        if self.stop_grace < 0:
            raise UsageError(
                f"--stop-grace {self.stop_grace} must be >= 0",
                "pass seconds (well inside the launcher's shutdown timeout, e.g. 10), or 0 to wait for the boundary",
            )
        if self.threads < 0:
            raise UsageError(f"--threads {self.threads} must be >= 0", "pass 0 for automatic")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay {self.weight_decay} must be >= 0", "pass e.g. 0.05")
        if self.log_every < 0:
            raise UsageError(f"--log-every {self.log_every} must be >= 0", "pass 0 to log no per-step curve")
        if self.micro_batch_size < 0:
            raise UsageError(f"--micro-batch-size {self.micro_batch_size} must be >= 0", "pass 0 for whole shares")
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
        if self.keep_best < 0:
            raise UsageError(f"--keep-best {self.keep_best} must be >= 0", "pass 0 for off, or e.g. 1")
        self._check_choice("--best-metric", self.best_metric, tuple(BEST_METRICS))
        if self.dataset in DATASETS_NEEDING_DIR and self.data_dir is None:
            raise UsageError(
                f"--dataset {self.dataset} needs --data-dir",
                "pass --data-dir PATH to the extracted folder or the folder holding the .zip",
            )

    @staticmethod
    def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise UsageError(f"{flag} {value!r} is not one of {', '.join(choices)}", f"pick one of {choices}")

    def check_world_size(self, world_size: int) -> None:
        """Every process needs at least one sample of each global batch; how the batch is split
        (shares that differ by at most one) is the sampler's business."""
        if self.batch_size < world_size:
            raise UsageError(
                f"global --batch-size {self.batch_size} is smaller than the world size {world_size}: "
                "every process needs at least one sample of each global batch",
                f"use --batch-size {world_size} or more, or at most {self.batch_size} processes",
            )

    def fingerprint(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """What a resumed run must share with its checkpoint: the ``FINGERPRINT`` settings and
        the dataset's identity ``data`` (``DataBundle.identity``), under ``data.`` keys."""
        settings = asdict(self)
        return {
            **{key: settings[key] for key in FINGERPRINT},
            **{DATA_KEY + key: value for key, value in data.items()},
        }

    def changes_since(self, saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Settings that differ from ``saved`` (a checkpoint's ``to_json``), as ``{name: (old, new)}``.

        Only settings outside the fingerprint can differ on a resume (the fingerprint is
        enforced); settings the checkpoint's version did not know are left out.
        """
        now = self.to_json()
        return {
            key: (saved[key], value)
            for key, value in now.items()
            if key not in FINGERPRINT and key in saved and saved[key] != value
        }

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, Path):
                out[key] = str(value)
        return out
