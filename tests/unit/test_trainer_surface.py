"""The built-in trainer is built from the public library: a custom loop can do all it does.

Every name the trainer imports from elastic_train must be exported by the package, or belong to
the trainer's own presentation and policy (console lines, progress bar, early stop, mixed
precision choice, epoch records), listed here with the reason. A new private hook into the
runtime (a checkpoint, data, stop or fault internal) fails this test: export it and document it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import elastic_train

TRAINER = Path(elastic_train.__file__).parent / "trainer.py"
# module -> names the trainer may import without them being public, and why.
OWN = {
    "elastic_train.config": {"TrainConfig"},  # public too; listed for clarity
    "elastic_train.logs": {"Console", "MetricsFile", "file_only"},  # the seed's console and metrics file
    "elastic_train.progress": {"ProgressBar"},  # a terminal progress bar
    "elastic_train.step_log": {"StepLog"},  # the per-step curve
    "elastic_train.early_stop": {"EarlyStopper", "decide_stop"},  # the seed's early-stop policy
    "elastic_train.precision": {"Precision", "choose_precision"},  # the --amp/--amp-dtype choice
    "elastic_train.metrics": {"EpochRecord"},  # one line of metrics.jsonl
    # Thin collective helpers (a MAX of a float, a SUM of a tensor): torch.distributed one-liners.
    "elastic_train.distributed.process_group": {"all_reduce_max", "all_reduce_sum"},
    # Builds the two DataLoaders from the public GlobalBatchSampler, EvalBatchSampler and Indexed.
    "elastic_train.data": {"make_loaders"},
    # The seed's arithmetic: an epoch's global batches, the per-process batch it prints.
    "elastic_train.data.sampler": {"num_global_batches", "per_process_batch"},
}


def _imports(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("elastic_train")
        for alias in node.names
    ]


def test_the_trainer_imports_only_public_pieces_or_its_own_presentation() -> None:
    private = [
        f"{module}.{name}"
        for module, name in _imports(TRAINER)
        if name not in elastic_train.__all__ and name not in OWN.get(module, set())
    ]
    assert not private, f"trainer.py uses private runtime pieces: {private}; export and document them"


def test_the_runtime_pieces_the_trainer_uses_are_exported() -> None:
    used = {name for _, name in _imports(TRAINER)}
    for piece in ("StepBoundary", "capture", "restore", "Task", "TaskData", "StepWatchdog", "ProgressTracker"):
        assert piece in used and piece in elastic_train.__all__, piece
