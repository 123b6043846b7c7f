"""elastic-train: fault-tolerant, elastic DDP training for PyTorch (torchrun and Slurm)."""

__version__ = "0.1.0"
