"""Checkpoint tool: ``python -m elastic_train.ckpt list|verify|inspect|export DIR``.

* ``list CHECKPOINT_DIR``: every step folder (versions ``step-N-vK`` included), its state, where
  ``latest`` points, and the folders set aside (``.corrupt-*``, ``.abandoned-*``: never deleted).
* ``verify DIR``: a step folder, or a checkpoint directory (then every committed checkpoint and
  ``latest``); checks sizes and sha256 of every file. Exit 1 (``ExitCode.CHECKPOINT_INVALID``) if anything is invalid.
* ``inspect DIR``: step, epoch, world size, versions, tensors and bytes per file.
* ``export DIR -o model.safetensors``: the model weights alone, consolidated into one file with
  plain parameter names, for inference (``model.load_state_dict(load_file(...))``).
* ``export DIR --format dcp -o FOLDER``: the model and optimizer tensors as a stock
  ``torch.distributed.checkpoint`` folder (``{"model": {fqn: t}, "optim": {"state": {fqn: {name: t}}}}``),
  which ``dcp.load`` reads at any world size, into FSDP or plain modules.

A checkpoint directory argument may also be given where a step folder is expected: its
``latest`` is used. A run folder (``--run-dir``) stands for its ``checkpoints``; ``list`` and
``verify`` also take a folder of runs (each run's checkpoints, in turn), where ``inspect`` and
``export`` ask for one of them.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from elastic_train.checkpoint.format import (
    MANIFEST,
    CheckpointInvalid,
    aside_folders,
    aside_reason,
    latest_target,
    read_manifest,
    step_folders,
    verify,
)
from elastic_train.outcome import ExitCode


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / MANIFEST).exists() or bool(step_folders(path)) or latest_target(path) is not None


def checkpoint_roots(path: Path) -> list[Path]:
    """``path`` as the tools read it: a checkpoint directory or step folder as it is; a run
    folder (``--run-dir``) as its ``checkpoints``; a folder of runs as every checkpoint directory
    found one or two levels under it (``runs/NAME/checkpoints``, ``old/NAME``)."""
    if _is_checkpoint_dir(path) or aside_folders(path):
        return [path]
    if (path / "checkpoints").is_dir():
        return [path / "checkpoints"]
    below = [c for c in (*path.glob("*/checkpoints"), *path.glob("*")) if c.is_dir() and _is_checkpoint_dir(c)]
    return sorted(set(below)) or [path]


def _one_root(path: Path) -> Path | None:
    roots = checkpoint_roots(path)
    if len(roots) > 1:
        names = ", ".join(str(r) for r in roots)
        print(f"error: {path} holds several runs' checkpoints ({names}): name one of them", file=sys.stderr)
        return None
    return roots[0]


def _step_folder(path: Path) -> Path:
    target = latest_target(path)
    return target if target is not None else path


ASIDE_MEANING = {
    "corrupt": "failed verification; a run fell back to an older checkpoint",
    "abandoned": "a future discarded when a run resumed from an older checkpoint",
}


def cmd_list(root: Path) -> int:
    folders = step_folders(root)
    latest = latest_target(root)
    aside = aside_folders(root)
    if not folders and not aside:
        print(f"no checkpoints in {root}")
        return ExitCode.OK
    for folder in folders:
        mark = " <- latest" if latest is not None and folder.resolve() == latest.resolve() else ""
        if not (folder / MANIFEST).exists():
            state = "incomplete (no manifest: ignored, cleaned up later)"
        else:
            try:
                m = verify(folder)
                # Epochs as the console numbers them (from 1): the manifest's `epoch` counts those done.
                where = (
                    f"end of epoch {m.epoch}"
                    if m.batch_in_epoch == 0 and m.epoch > 0
                    else f"epoch {m.epoch + 1}, {m.batch_in_epoch} batch(es) in"
                )
                state = f"ok: step {m.step}, {where}, world size {m.world_size}" + (", finished" if m.finished else "")
            except CheckpointInvalid as exc:
                state = f"INVALID: {exc}"
        print(f"{folder.name}  {state}{mark}")
    for folder in aside:
        reason = aside_reason(folder) or "?"
        meaning = ASIDE_MEANING.get(reason, "")
        print(f"{folder.name}  set aside ({reason}: {meaning}); ignored by resume and retention, delete by hand")
    if latest is not None and not latest.exists():
        print(f"latest -> {latest.name}: DANGLING")
    return ExitCode.OK


def cmd_verify(path: Path) -> int:
    if (path / MANIFEST).exists() or (latest_target(path) is None and not step_folders(path)):
        targets = [path]
    else:
        targets = [f for f in step_folders(path) if (f / MANIFEST).exists()]
        latest = latest_target(path)
        if latest is not None and latest not in targets:
            targets.insert(0, latest)
    bad = 0
    for folder in targets:
        try:
            m = verify(folder, sha256=True)
            print(f"OK       {folder} (step {m.step}, {len(m.files)} file(s), sizes, xxh3 and sha256 match)")
        except CheckpointInvalid as exc:
            bad += 1
            print(f"INVALID  {folder}: {exc}")
    return ExitCode.CHECKPOINT_INVALID if bad else ExitCode.OK


def cmd_inspect(path: Path) -> int:
    folder = _step_folder(path)
    try:
        m = read_manifest(folder)
    except CheckpointInvalid as exc:
        print(f"INVALID  {exc}", file=sys.stderr)
        return ExitCode.CHECKPOINT_INVALID
    print(f"checkpoint   {folder}")
    print(f"step         {m.step} (epoch {m.epoch} done, {m.batch_in_epoch} batch(es) into the next)")
    print(f"world size   {m.world_size}")
    print(f"finished     {m.finished}")
    print(f"run id       {m.run_id}")
    print(f"timeline     {m.timeline or '(format 1: none)'}" + (f", resumed from {m.parent}" if m.parent else ""))
    print(f"versions     {', '.join(f'{k} {v}' for k, v in sorted(m.versions.items()))}")
    print(f"fingerprint  {', '.join(f'{k}={v}' for k, v in sorted(m.fingerprint.items()))}")
    groups: dict[str, int] = {}
    for key in [*m.tensors, *m.sharded]:
        group = key.split(".")[0]
        groups[group] = groups.get(group, 0) + 1
    pieces = sum(len(entry.pieces) for entry in m.sharded.values())
    sharded = f"; {len(m.sharded)} of them sharded, in {pieces} pieces" if m.sharded else ""
    by_group = ", ".join(f"{g}: {n}" for g, n in sorted(groups.items()))
    print(f"tensors      {len(m.tensors) + len(m.sharded)} ({by_group}{sharded})")
    total = sum(e.size for e in m.files.values())
    print(f"bytes        {total}")
    for name, entry in sorted(m.files.items()):
        count = sum(1 for f in m.tensors.values() if f == name)
        count += sum(1 for entry in m.sharded.values() for p in entry.pieces if p.file == name)
        print(f"  {name}  {entry.size} bytes, {count} tensors, sha256 {entry.sha256[:16]}...")
    return ExitCode.OK


def cmd_export(path: Path, output: Path) -> int:
    import safetensors.torch  # torch is only needed here

    from elastic_train.checkpoint.manager import load
    from elastic_train.checkpoint.state import MODEL

    folder = _step_folder(path)
    try:
        loaded = load(folder)
    except CheckpointInvalid as exc:
        print(f"INVALID  {exc}", file=sys.stderr)
        return ExitCode.CHECKPOINT_INVALID
    # Pieces of a sharded (FSDP) checkpoint are assembled: one consolidated file.
    weights = {k[len(MODEL) :]: v.contiguous() for k, v in loaded.whole(MODEL).items()}
    fp = loaded.manifest.fingerprint
    metadata = {"source": str(folder), "step": str(loaded.manifest.step)}
    metadata.update({k: str(v) for k, v in fp.items()})
    history = loaded.payload.app.get("history")  # the built-in trainer's (a custom loop may have none)
    if history:
        metadata["val_acc"] = str(history[-1]["val_acc"])
    output.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(weights, str(output), metadata=metadata)
    print(f"wrote {output}: {len(weights)} tensors from {folder}")
    return ExitCode.OK


def cmd_export_dcp(path: Path, output: Path) -> int:
    """The checkpoint's model and optimizer tensors, whole, as a stock DCP folder (one process:
    the host needs memory for the whole model and optimizer state while it writes)."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from elastic_train.checkpoint.manager import load
    from elastic_train.checkpoint.state import MODEL, OPTIM

    if output.exists():
        print(f"error: {output} exists; export into a new folder (nothing was overwritten)", file=sys.stderr)
        return ExitCode.USAGE
    folder = _step_folder(path)
    try:
        loaded = load(folder)
        model = {k[len(MODEL) :]: v for k, v in loaded.whole(MODEL).items()}
        state: dict[str, dict[str, object]] = {}
        for key, value in loaded.whole(OPTIM).items():
            fqn, _, name = key[len(OPTIM) :].rpartition(".")
            state.setdefault(fqn, {})[name] = value
    except CheckpointInvalid as exc:
        print(f"INVALID  {exc}", file=sys.stderr)
        return ExitCode.CHECKPOINT_INVALID
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp_save({"model": model, "optim": {"state": state}}, checkpoint_id=str(output), no_dist=True)
    print(f"wrote {output}: {len(model)} model tensors, optimizer state of {len(state)} parameters, from {folder}")
    return ExitCode.OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_train.ckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "verify", "inspect"):
        sub.add_parser(name).add_argument("dir", type=Path)
    export = sub.add_parser("export")
    export.add_argument("dir", type=Path)
    export.add_argument("-o", "--output", type=Path, default=None, help="default: model.safetensors, or model.dcp/")
    export.add_argument(
        "--format",
        choices=("safetensors", "dcp"),
        default="safetensors",
        help="safetensors: the weights in one file (inference, Hugging Face); dcp: model and optimizer state as "
        "a torch.distributed.checkpoint folder (dcp.load at any world size)",
    )
    args = parser.parse_args(argv)
    if not args.dir.exists():
        print(f"error: {args.dir} does not exist", file=sys.stderr)
        return ExitCode.USAGE
    if args.command in ("list", "verify"):
        command = cmd_list if args.command == "list" else cmd_verify
        roots = checkpoint_roots(args.dir)
        codes = []
        for root in roots:
            if len(roots) > 1:
                print(f"== {root}")
            codes.append(command(root))
        return max(codes)
    one = _one_root(args.dir)
    if one is None:
        return ExitCode.USAGE
    if args.command == "inspect":
        return cmd_inspect(one)
    if args.format == "dcp":
        return cmd_export_dcp(one, args.output or Path("model.dcp"))
    return cmd_export(one, args.output or Path("model.safetensors"))


if __name__ == "__main__":
    sys.exit(main())
