"""What quorum mode relies on from the Checkpointer, held by the Checkpointer (issue 17, 2, 3).

The staging contract: while an async save copies the model and optimizer, nothing changes them
in place, whoever calls. A quorum heal is torchft calling ``load_state_dict`` on the registered
state from inside ``start_quorum``; before, only the trainer's own call sites waited, and a heal
landing mid-copy committed a checkpoint holding two steps' weights under valid checksums. The
one settler: a quorum's settle never abandons what another replica of the job committed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer
from elastic_train.checkpoint.snapshot import Position, capture
from elastic_train.distributed.env import DistEnv

pytestmark = pytest.mark.usefixtures("world_of_one")


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _saved_model(root: Path) -> dict[str, torch.Tensor]:
    folder = (root / "latest").resolve()
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("shard-*.safetensors")):
        tensors.update(load_file(shard))
    return {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}


def _save_while_a_heal_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guarded: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Start an async save whose copy stalls on its first tensor, apply a heal (a peer's weights
    through ``load_state_dict``, as torchft does), let the copy go on, commit. Returns the state
    at the save's step and what the checkpoint holds."""
    model, optimizer = _model()
    ck = Checkpointer(CheckpointConfig(root=tmp_path, keep_last=10), DistEnv(run_id="unit"), {"m": 1})
    ck.start()
    if guarded:
        ck.guard(model, optimizer)
    copying, release = threading.Event(), threading.Event()
    real_stage = Checkpointer._stage

    def slow_stage(self: Checkpointer, key: str, value: torch.Tensor) -> torch.Tensor:
        copying.set()
        release.wait(10)  # a slow host copy (a large model, a busy PCIe bus)
        return real_stage(self, key, value)

    monkeypatch.setattr(Checkpointer, "_stage", slow_stage)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    assert ck.save(capture(Position(1, 0, 1, False), model, optimizer, device=torch.device("cpu")), sync=False) is None
    assert copying.wait(10)
    peer = {k: v + 1.0 for k, v in at_save.items()}  # the healing peer's (later) weights
    timer = threading.Timer(0.3, release.set)  # the copy resumes later, whatever the main thread does
    timer.start()
    model.load_state_dict(peer)  # the heal
    timer.join()
    monkeypatch.setattr(Checkpointer, "_stage", real_stage)
    while not ck.local_done():
        release.wait(0.01)
    assert ck.commit_pending()
    ck.close()
    assert all(torch.equal(v, peer[k]) for k, v in model.state_dict().items()), "the heal must still apply"
    return at_save, _saved_model(tmp_path)


def test_a_heal_that_lands_while_a_save_copies_waits_and_the_checkpoint_holds_one_steps_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at_save, saved = _save_while_a_heal_lands(tmp_path, monkeypatch, guarded=True)
    assert saved.keys() == at_save.keys()
    assert all(torch.equal(saved[k], at_save[k]) for k in at_save), "the checkpoint mixes two steps"


def test_without_the_guard_the_same_sequence_commits_a_mixed_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: the injected heal really lands mid-copy (the test above can fail)."""
    at_save, saved = _save_while_a_heal_lands(tmp_path, monkeypatch, guarded=False)
    assert any(not torch.equal(saved[k], at_save[k]) for k in at_save)


def test_the_guard_also_holds_the_optimizer_step_and_any_guarded_load(tmp_path: Path) -> None:
    model, optimizer = _model()
    ck = Checkpointer(CheckpointConfig(root=tmp_path, keep_last=10), DistEnv(run_id="unit"), {"m": 1})
    ck.guard(model, optimizer)
    waited: list[str] = []
    staged = threading.Event()
    ck._staged = staged  # an async save's copy in flight

    def finish(what: str) -> None:
        waited.append(what)
        staged.set()

    for what, act in (
        ("step", lambda: optimizer.step()),
        ("optimizer", lambda: optimizer.load_state_dict(optimizer.state_dict())),
        ("extra", lambda: ck.guarded(lambda state: None)({})),
    ):
        staged.clear()
        ck._staged = staged
        timer = threading.Timer(0.2, finish, args=(what,))
        timer.start()
        act()
        assert waited and waited[-1] == what, f"{what} did not wait for the copy"
        timer.join()


def test_a_quorum_settler_never_abandons_a_checkpoint_another_replica_committed_while_it_loaded(
    tmp_path: Path,
) -> None:
    """Issue 17, 3: a slow loader (participant 0 of a quorum at step 0) chose step 2; while it
    loaded, another replica of the job committed step 4. Restart mode's settle would move step 4
    aside as an abandoned future and point ``latest`` back at step 2; quorum mode's refuses to
    settle (``NewerCommitted``) with nothing on disk changed, and the next choice is step 4."""
    from elastic_train.checkpoint.manager import NewerCommitted, choose_checkpoint

    model, optimizer = _model()
    cfg = CheckpointConfig(root=tmp_path, keep_last=10)
    saver = Checkpointer(cfg, DistEnv(run_id="unit"), {"m": 1})
    saver.start()
    assert saver.save(capture(Position(2, 0, 2, False), model, optimizer, device=torch.device("cpu")), sync=True)
    slow = Checkpointer(cfg, DistEnv(run_id="unit"), {"m": 1})
    chosen = choose_checkpoint(cfg, slow.fingerprint)  # the slow replica chooses step 2 ...
    assert chosen.folder is not None and chosen.folder.name == "step-00000002"
    assert saver.save(capture(Position(4, 0, 4, False), model, optimizer, device=torch.device("cpu")), sync=True)
    before = sorted(p.name for p in tmp_path.iterdir()), (tmp_path / "latest").resolve()
    with pytest.raises(NewerCommitted, match="step-00000004"):  # ... and settles after step 4's commit
        slow.settle(chosen, keep_newer=True)
    assert (sorted(p.name for p in tmp_path.iterdir()), (tmp_path / "latest").resolve()) == before
    again = choose_checkpoint(cfg, slow.fingerprint)
    assert again.folder is not None and again.folder.name == "step-00000004"
    assert slow.settle(again, keep_newer=True) == saver.timeline
    saver.close()
