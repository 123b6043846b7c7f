"""capture/restore (the checkpointer's public front) and the typed payload of format versions 3 and 4."""

from __future__ import annotations

import json
import random
import threading
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import elastic_train as et
from elastic_train.checkpoint.format import (
    VERSION,
    CheckpointInvalid,
    CheckpointTooNew,
    Manifest,
    Payload,
    read_manifest,
)
from elastic_train.checkpoint.snapshot import EXTRA

FINGERPRINT = {"test": "snapshot"}
CPU = torch.device("cpu")


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2))


def trained(model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(6, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt, sched


def test_a_checkpoint_restores_every_piece_and_continues_bit_for_bit(world_of_one: None, tmp_path: Path) -> None:
    model = net()
    opt, sched = trained(model, 3)
    ema = {"w": torch.arange(6.0)}
    random.seed(5)
    np.random.seed(5)
    ck = et.Checkpointer(et.CheckpointConfig(root=tmp_path), et.DistEnv(), FINGERPRINT)
    ck.start()
    snap = et.capture(
        et.Position(step=3, epoch=0, batch_in_epoch=3),
        model,
        opt,
        device=CPU,
        scheduler=sched,
        extra=ema,
        per_rank={"sums": torch.tensor([1.0, 2.0])},
        app={"anything": [1, "two"]},
    )
    assert ck.save(snap, sync=True) is True
    ck.close()
    expected_next = [model(torch.ones(2, 4)).detach(), torch.rand(3), random.random(), np.random.rand()]
    opt.step()  # the originals move on: the restored copy must not

    model2 = net()
    opt2, sched2 = trained(model2, 0)
    ck2 = et.Checkpointer(et.CheckpointConfig(root=tmp_path), et.DistEnv(), FINGERPRINT)
    ck2.start()
    loaded = ck2.resume()
    ck2.close()
    assert loaded is not None
    done = et.restore(loaded, model2, opt2, rank=0, world_size=1, device=CPU, scheduler=sched2)
    assert done.position == et.Position(3, 0, 3) and done.rng_restored and done.same_world_size
    assert torch.equal(done.extra["w"], ema["w"])
    assert torch.equal(done.old_ranks[0]["sums"], torch.tensor([1.0, 2.0])) and "rng.torch" not in done.old_ranks[0]
    assert done.payload.app == {"anything": [1, "two"]}
    assert sched2.state_dict() == sched.state_dict()
    # The restored RNG streams and weights give the very values the original would have.
    got = [model2(torch.ones(2, 4)).detach(), torch.rand(3), random.random(), np.random.rand()]
    assert torch.equal(got[0], expected_next[0]) and torch.equal(got[1], expected_next[1])
    assert got[2:] == expected_next[2:]


def test_buffers_are_cloned_at_capture_and_extras_are_namespaced() -> None:
    model = net()
    opt, _ = trained(model, 1)
    snap = et.capture(et.Position(1), model, opt, device=CPU, extra={"ema": torch.ones(1)})
    mean = model[1].running_mean
    assert snap.replicated["model.1.running_mean"].data_ptr() != mean.data_ptr()
    assert "model.1.running_mean" in snap.from_rank0
    assert EXTRA + "ema" in snap.replicated
    with pytest.raises(ValueError, match=r"rng\. prefix is reserved"):
        et.capture(et.Position(1), model, opt, device=CPU, per_rank={"rng.mine": mean})


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_extra_and_per_rank_tensors_are_saved_as_they_were_at_capture(
    world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    """A loop that adds its next batch to its running sums in place before ``wait_staged``
    (async) or between ``capture`` and ``save`` (sync) must not get that batch saved: a resumed
    run would count it twice."""
    model = net()
    opt, _ = trained(model, 1)
    ema, sums = torch.arange(4.0), torch.tensor([3.0, 7.0])
    at_capture = ema.clone(), sums.clone()
    release = threading.Event()
    real_stage = et.Checkpointer._stage

    def held_stage(self: et.Checkpointer, key: str, value: torch.Tensor) -> torch.Tensor:
        release.wait(10)  # the writer copies only once the loop has moved on
        return real_stage(self, key, value)

    monkeypatch.setattr(et.Checkpointer, "_stage", held_stage)
    ck = et.Checkpointer(et.CheckpointConfig(root=tmp_path), et.DistEnv(), FINGERPRINT)
    ck.start()
    snap = et.capture(et.Position(1), model, opt, device=CPU, extra={"ema": ema}, per_rank={"sums": sums})

    def next_batch() -> None:  # in place, as a loop keeps its running state
        ema.mul_(0.5)
        sums.add_(1.0)

    if sync:
        next_batch()
        assert ck.save(snap, sync=True) is True
    else:
        assert ck.save(snap, sync=False) is None
        next_batch()
        release.set()
        ck.wait_staged()
        assert ck.commit_pending() is True
    ck.close()

    model2 = net()
    opt2, _ = trained(model2, 0)
    ck2 = et.Checkpointer(et.CheckpointConfig(root=tmp_path), et.DistEnv(), FINGERPRINT)
    ck2.start()
    loaded = ck2.resume()
    ck2.close()
    assert loaded is not None
    done = et.restore(loaded, model2, opt2, rank=0, world_size=1, device=CPU)
    saved = done.extra["ema"], done.old_ranks[0]["sums"]
    assert all(torch.equal(got, want) for got, want in zip(saved, at_capture, strict=True)), saved


def test_another_world_size_restores_weights_but_not_rng_streams(world_of_one: None, tmp_path: Path) -> None:
    model = net()
    opt, _ = trained(model, 2)
    ck = et.Checkpointer(et.CheckpointConfig(root=tmp_path), et.DistEnv(), FINGERPRINT)
    ck.start()
    ck.save(et.capture(et.Position(2), model, opt, device=CPU), sync=True)
    loaded = ck.resume()
    ck.close()
    assert loaded is not None
    model2 = net()
    opt2, _ = trained(model2, 0)
    done = et.restore(loaded, model2, opt2, rank=1, world_size=3, device=CPU)
    assert not done.rng_restored and done.saved_world_size == 1
    pairs = zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_the_manifest_is_format_4_with_a_typed_payload_and_no_pieces_for_ddp_state(
    world_of_one: None, tmp_path: Path
) -> None:
    model = net()
    opt, sched = trained(model, 1)
    ck = et.Checkpointer(et.CheckpointConfig(root=tmp_path), et.DistEnv(), FINGERPRINT)
    ck.start()
    ck.save(et.capture(et.Position(1), model, opt, device=CPU, scheduler=sched), sync=True)
    ck.close()
    raw = json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())
    assert VERSION == 4 and raw["version"] == 4 and "trainer" not in raw
    assert raw["sharded"] == {} and raw["tensors"]  # a replicated (DDP) state is saved whole
    assert set(raw["payload"]) == {"optimizer", "scheduler", "scaler", "accounting", "app"}
    manifest = read_manifest(tmp_path / "step-00000001")
    assert isinstance(manifest.payload, Payload) and manifest.payload.scheduler == sched.state_dict()


def _v2_manifest() -> dict[str, object]:
    return {
        "format": "elastic-train-checkpoint",
        "version": 2,
        "step": 4,
        "epoch": 1,
        "batch_in_epoch": 0,
        "world_size": 2,
        "files": {},
        "tensors": {},
        "fingerprint": {},
        "config": {},
        "versions": {},
        "trainer": {
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
            "optim_extra": {},
            "scheduler": {"last_epoch": 4},
            "scaler": {},
            "early_stop": {"best_accuracy": 0.5},
            "history": [{"epoch": 1}],
            "accounting": {"job_start": 1.0},
        },
        "timeline": "abc",
        "parent": "",
    }


def test_a_version_2_manifest_reads_into_the_typed_payload() -> None:
    manifest = Manifest.from_json(json.dumps(_v2_manifest()), Path("step-00000004/manifest.json"))
    assert manifest.payload == Payload(
        optimizer={"param_groups": [{"lr": 0.1, "params": ["w"]}], "optim_extra": {}},
        scheduler={"last_epoch": 4},
        scaler=None,
        accounting={"job_start": 1.0},
        app={"early_stop": {"best_accuracy": 0.5}, "history": [{"epoch": 1}]},
    )
    assert json.loads(manifest.to_json())["payload"] == asdict(manifest.payload)


def test_a_version_3_manifest_reads_with_no_sharded_tensors() -> None:
    raw = {**_v2_manifest(), "version": 3, "payload": asdict(Payload())}
    del raw["trainer"]
    manifest = Manifest.from_json(json.dumps(raw), Path("step-00000004/manifest.json"))
    assert manifest.version == 3 and manifest.sharded == {}


def test_a_newer_format_version_is_refused_naming_both_versions() -> None:
    raw = {**_v2_manifest(), "version": 5}
    with pytest.raises(CheckpointTooNew, match=r"format version 5 \(this build reads 1, 2, 3, 4\).*Fix: upgrade"):
        Manifest.from_json(json.dumps(raw), Path("m.json"))
    with pytest.raises(CheckpointInvalid, match="format version 0") as err:
        Manifest.from_json(json.dumps({**raw, "version": 0}), Path("m.json"))
    assert not isinstance(err.value, CheckpointTooNew)


def test_a_newer_builds_checkpoint_stops_the_run_and_is_never_set_aside(world_of_one: None, tmp_path: Path) -> None:
    model = net()
    opt, _ = trained(model, 1)
    ck = et.Checkpointer(et.CheckpointConfig(root=tmp_path), et.DistEnv(), FINGERPRINT)
    ck.start()
    for step in (1, 2):
        ck.save(et.capture(et.Position(step), model, opt, device=CPU), sync=True)
    ck.close()
    newest = tmp_path / "step-00000002" / "manifest.json"
    newest.write_text(newest.read_text().replace('"version": 4', '"version": 5'))
    ck = et.Checkpointer(et.CheckpointConfig(root=tmp_path), et.DistEnv(), FINGERPRINT)
    ck.start()
    try:
        with pytest.raises(et.UsageError, match="written by a newer elastic-train"):
            ck.resume()  # not a silent fallback to step 1
    finally:
        ck.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-00000001",
        "step-00000002",
    ]


def test_loop_json_state_is_copied_at_capture() -> None:
    """An async save writes the manifest at its commit, steps later: a history the loop appends
    to meanwhile must not reach it."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = [{"epoch": 1}]
    snap = et.capture(et.Position(1), model, opt, device=CPU, app={"history": history}, config={"tags": ["a"]})
    history.append({"epoch": 2})
    history[0]["epoch"] = 99
    assert snap.payload.app == {"history": [{"epoch": 1}]} and snap.config == {"tags": ["a"]}


def test_loop_state_that_json_cannot_hold_is_refused_at_capture() -> None:
    model = net()
    opt, _ = trained(model, 1)
    with pytest.raises(ValueError, match=r"capture\(\): app\.when: object .* is not a JSON value"):
        et.capture(et.Position(1), model, opt, device=CPU, app={"when": object()})


def test_a_nan_loss_in_the_loops_state_is_kept_but_a_nan_fingerprint_is_refused(
    world_of_one: None, tmp_path: Path
) -> None:
    """An epoch can end with a NaN loss (its history is saved); a NaN never equals itself, so a
    fingerprint holding one could never be resumed."""
    model = net()
    opt, _ = trained(model, 1)
    snap = et.capture(et.Position(1), model, opt, device=CPU, app={"history": [{"train_loss": float("nan")}]})
    ck = et.Checkpointer(et.CheckpointConfig(root=tmp_path), et.DistEnv(), FINGERPRINT)
    ck.start()
    assert ck.save(snap, sync=True) is True
    ck.close()
    loss = read_manifest(tmp_path / "step-00000001").payload.app["history"][0]["train_loss"]
    assert loss != loss
    with pytest.raises(et.UsageError, match=r"fingerprint\.lr: nan is not a finite number"):
        et.Checkpointer(et.CheckpointConfig(root=tmp_path), et.DistEnv(), {"lr": float("nan")})


def test_an_optimizer_of_another_modules_parameters_is_refused_naming_the_fsdp_fix() -> None:
    with pytest.raises(ValueError, match=r"not the module's .*reshard_all\(model\) before capture"):
        et.capture(et.Position(1), net(), torch.optim.SGD(net().parameters(), lr=0.1), device=CPU)
