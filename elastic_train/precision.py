"""Mixed precision for ``--amp``.

* CUDA with bf16 support (Ampere and newer): bf16 autocast, no loss scaling needed.
* Older CUDA GPUs: fp16 autocast with a ``GradScaler`` (its scale is state worth checkpointing).
* CPU: bf16 autocast. It runs everywhere but is often slower than fp32 on CPUs without AMX, so
  a warning says so.

Without ``--amp`` the autocast context is disabled and the scaler is a pass-through, so the
training step has a single code path.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger(__name__)


@dataclass
class Precision:
    device_type: str
    dtype: torch.dtype | None  # None: full precision
    scaler: torch.amp.GradScaler
    # Under FSDP2 the mixed-precision policy casts the gathered parameters to ``dtype`` (and
    # reduces gradients in float32): autocast is then off, as torchtitan runs it.
    by_policy: bool = False

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    @property
    def name(self) -> str:
        if self.dtype is None:
            return "fp32"
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def autocast(self) -> AbstractContextManager[None]:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled and not self.by_policy)


def choose_precision(amp: bool, device: torch.device, dtype: str = "auto") -> Precision:
    """``dtype``: auto (bf16 where supported, else fp16), bf16 or fp16 (``--amp-dtype``)."""
    device_type = device.type
    if not amp:
        return Precision(device_type, None, torch.amp.GradScaler(device_type, enabled=False))
    if device_type == "cuda":
        if dtype == "bf16" or (dtype == "auto" and torch.cuda.is_bf16_supported()):
            return Precision(device_type, torch.bfloat16, torch.amp.GradScaler("cuda", enabled=False))
        return Precision(device_type, torch.float16, torch.amp.GradScaler("cuda", enabled=True))
    if dtype == "fp16":
        log.warning("amp_fp16_on_cpu", detail="fp16 autocast is for GPUs; using bf16 on the CPU")
    log.warning("amp_on_cpu", detail="--amp on CPU uses bf16 autocast; it is often slower than fp32 on CPUs")
    return Precision(device_type, torch.bfloat16, torch.amp.GradScaler(device_type, enabled=False))
