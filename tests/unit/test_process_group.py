"""Process-group set-up: retries around connection errors only, collectives in a world of one."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_train import progress
from elastic_train.distributed import process_group as pg
from elastic_train.distributed.env import DistEnv
from elastic_train.precision import choose_precision
from elastic_train.progress import ProgressBar

CPU = pg.Placement(torch.device("cpu"), "gloo")


@pytest.fixture
def world_of_one() -> Iterator[None]:
    with pg.process_group(DistEnv(), CPU, timeout_s=30):
        yield
    assert not dist.is_initialized()


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> DistEnv:
    """A world of one as torchrun would describe it (env://, a real TCPStore on loopback)."""
    from tests.helpers import free_port

    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    return DistEnv(launched=True)


def test_store_connection_errors_are_retried_then_succeed(monkeypatch: pytest.MonkeyPatch, launched: DistEnv) -> None:
    calls: list[int] = []
    real_connect = pg._connect_store

    def flaky(timeout: object) -> object:
        calls.append(1)
        if len(calls) < 3:
            raise dist.DistNetworkError("Connection refused by the store")
        return real_connect(timeout)  # type: ignore[arg-type]

    monkeypatch.setattr(pg, "_connect_store", flaky)
    monkeypatch.setenv("ELASTIC_TRAIN_INIT_ATTEMPTS", "4")
    with pg.process_group(launched, CPU, timeout_s=30):
        assert dist.get_world_size() == 1
    assert len(calls) == 3


def test_store_connection_gives_up_after_the_bounded_attempts_and_reraises(
    monkeypatch: pytest.MonkeyPatch, launched: DistEnv
) -> None:
    calls: list[int] = []

    def down(timeout: object) -> object:
        calls.append(1)
        raise dist.DistNetworkError("Connection refused")

    monkeypatch.setattr(pg, "_connect_store", down)
    monkeypatch.setenv("ELASTIC_TRAIN_INIT_ATTEMPTS", "2")
    with pytest.raises(dist.DistNetworkError), pg.process_group(launched, CPU, timeout_s=30):
        pass
    assert len(calls) == 2


def test_the_group_itself_is_never_retried_alone(monkeypatch: pytest.MonkeyPatch, launched: DistEnv) -> None:
    """Creating the group is collective: a rank retrying it alone would wait for peers that moved on."""
    calls: list[int] = []

    def fails(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise dist.DistNetworkError("Connection reset by peer")

    monkeypatch.setattr(dist, "init_process_group", fails)
    with pytest.raises(dist.DistNetworkError), pg.process_group(launched, CPU, timeout_s=30):
        pass
    assert len(calls) == 1


def test_configuration_errors_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def wrong(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise ValueError("Invalid backend")

    monkeypatch.setattr(dist, "init_process_group", wrong)
    with pytest.raises(ValueError), pg.process_group(DistEnv(), CPU, timeout_s=30):
        pass
    assert len(calls) == 1


def test_collective_helpers_in_a_world_of_one(world_of_one: None) -> None:
    assert pg.all_reduce_max(3.5, CPU.device) == 3.5
    assert pg.broadcast_flag(True, CPU.device) is True
    assert pg.broadcast_error("boom") == "boom" and pg.broadcast_error(None) is None
    assert torch.equal(pg.all_reduce_sum(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 2.0]))


def test_cpu_placement_uses_gloo_and_missing_cuda_is_a_usage_error() -> None:
    assert pg.choose_placement("cpu", DistEnv()) == CPU
    if not torch.cuda.is_available():
        assert pg.choose_placement("auto", DistEnv()) == CPU
        with pytest.raises(pg.UsageError, match="CUDA is not available"):
            pg.choose_placement("cuda", DistEnv())


def test_precision_choices_on_cpu() -> None:
    full = choose_precision(False, torch.device("cpu"))
    assert full.name == "fp32" and not full.scaler.is_enabled()
    amp = choose_precision(True, torch.device("cpu"))
    assert amp.name == "bf16" and not amp.scaler.is_enabled()
    with amp.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_progress_bar_draws_on_a_terminal_and_erases_itself() -> None:
    stream = io.StringIO()
    bar = ProgressBar(enabled=True, stream=stream, refresh_s=0, terminal=True)
    bar.start("Epoch 1/2", total=4)
    for done in range(1, 5):
        bar.update(done)
    bar.close()
    text = stream.getvalue()
    assert "Epoch 1/2" in text and "4/4" in text  # tqdm's bar, removed at the end (leave=False)
    quiet = io.StringIO()
    silent = ProgressBar(enabled=False, stream=quiet, terminal=True)
    silent.start("x", 2)
    silent.update(1)
    silent.close()
    assert quiet.getvalue() == ""


def test_in_a_log_progress_is_a_line_now_and_then_not_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    stream = io.StringIO()
    bar = ProgressBar(enabled=True, stream=stream, terminal=False, line_every_s=60)
    bar.start("Epoch 3/10", total=5000, done=200)
    for done in range(201, 1201):
        clock[0] += 0.1  # 10 steps/s: 1000 steps take 100 s, one line at 60 s
        bar.update(done)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines == ["Epoch 3/10: 800/5000 steps (16%), 10.0 steps/s, 0:07:00 left"], lines
    assert "\r" not in stream.getvalue()
    in_a_log = ProgressBar.for_terminal(True)  # pytest's stderr is not a terminal: lines, not a bar
    assert in_a_log.enabled and not in_a_log.terminal


@pytest.mark.parametrize(
    ("device", "cores", "local", "omp", "launchers", "flag", "expected"),
    [
        ("cpu", 16, 1, None, None, 0, 16),  # a CPU process: its share of the cores
        ("cpu", 16, 4, None, None, 0, 4),
        ("cuda", 16, 1, None, None, 0, 2),  # a GPU process: at most GPU_PROCESS_THREADS
        ("cuda", 16, 16, None, None, 0, 1),
        ("cuda", 16, 1, "8", None, 0, 8),  # the user's OMP_NUM_THREADS and --threads still win
        ("cuda", 16, 1, None, None, 6, 6),
        ("cuda", 16, 1, "16", "16", 0, 2),  # the quorum launcher's share is a default: capped
        ("cpu", 16, 1, "16", "16", 0, 16),
        ("cuda", 16, 1, "8", "16", 0, 8),  # the user's, whatever the launcher's variable says
    ],
)
def test_threads_are_the_process_share_of_the_cores_and_at_most_two_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    cores: int,
    local: int,
    omp: str | None,
    launchers: str | None,
    flag: int,
    expected: int,
) -> None:
    from elastic_train.config import TrainConfig
    from elastic_train.quorum.names import LAUNCHER_THREADS_VAR
    from elastic_train.run import GPU_PROCESS_THREADS, configure_threads

    assert GPU_PROCESS_THREADS == 2
    before = torch.get_num_threads()
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(cores)))
    for name, value in (("OMP_NUM_THREADS", omp), (LAUNCHER_THREADS_VAR, launchers)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    placement = pg.Placement(torch.device(device, 0) if device == "cuda" else torch.device("cpu"), "gloo")
    try:
        assert configure_threads(TrainConfig(threads=flag), DistEnv(local_world_size=local), placement) == expected
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------- JSON, never pickle
VALUES = [None, "", "rank 0: no such folder", {"name": "cifar10", "files": 3, "é": ["ü", 1.5, None, True]}, [1, [2]]]


@pytest.mark.parametrize("value", VALUES)
def test_json_collectives_give_back_what_was_sent_in_a_world_of_one(world_of_one: None, value: object) -> None:
    assert pg.broadcast_json(value) == value
    assert pg.all_gather_json(value) == [value]


def test_a_length_beyond_the_bound_is_refused_before_any_byte_is_read(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg, "MAX_JSON_BYTES", 4)
    with pytest.raises(RuntimeError, match=r"rank 0 announced 7 bytes of JSON \(at most 4\): refused unread"):
        pg.all_gather_json("abcde")


def test_data_and_checkpoint_agreement_never_unpickle(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The paths that used torch's *_object collectives (which pickle) run with pickling made to
    fail: opening the data, a checkpoint's start, save, commit and resume."""
    from torch.distributed import distributed_c10d

    from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer
    from elastic_train.config import TrainConfig
    from elastic_train.data import open_task_data
    from elastic_train.image_classification import image_task
    from tests.unit.test_checkpoint_units import FINGERPRINT, snap

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("an object collective (pickle) was used")

    monkeypatch.setattr(distributed_c10d, "_object_to_tensor", refuse)
    monkeypatch.setattr(distributed_c10d, "_tensor_to_object", refuse)
    cfg = TrainConfig(dataset="synthetic", batch_size=32)
    data = open_task_data(image_task(cfg), cfg, DistEnv())
    assert data.identify()
    ck = Checkpointer(CheckpointConfig(root=tmp_path), DistEnv(run_id="unit"), FINGERPRINT)
    ck.start()
    assert ck.resume() is None
    assert ck.save(snap(2, 0, 2), sync=True) is True
    ck.close()
    again = Checkpointer(CheckpointConfig(root=tmp_path), DistEnv(run_id="unit"), FINGERPRINT)
    again.start()
    loaded = again.resume()
    assert loaded is not None and loaded.manifest.step == 2
    again.close()


OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}
# ``X.load`` / ``X.loads`` that unpickle (np.load may): any other owner's load is its own method.
UNPICKLERS = {"torch", "serialization", "pickle", "cPickle", "dill", "marshal", "np", "numpy"}


def test_the_package_calls_no_object_collective_and_no_unpickler_and_imports_no_pickle() -> None:
    import ast

    package = Path(__file__).resolve().parents[2] / "elastic_train"
    found = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(package)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute):
                owner = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
                if node.attr in OBJECT_COLLECTIVES or (node.attr in ("load", "loads") and owner in UNPICKLERS):
                    found.append(f"{where} {owner}.{node.attr}")
            if isinstance(node, ast.Name) and node.id in OBJECT_COLLECTIVES:
                found.append(f"{where} {node.id}")
            if isinstance(node, ast.ImportFrom):
                names = {a.name for a in node.names}
                if names & OBJECT_COLLECTIVES or (node.module or "").split(".")[0] in ("pickle", "dill"):
                    found.append(f"{where} from {node.module} import {sorted(names)}")
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] in ("pickle", "dill") for a in node.names):
                found.append(f"{where} imports pickle")
    assert not found, found


def test_a_rank_writes_and_loads_only_where_the_run_may(world_of_one: None, tmp_path: Path) -> None:
    """What rank 0 announces is checked on receipt: the save's folder is a plain name in the
    checkpoint folder, and the checkpoint to load lies there or under ``--resume PATH``."""
    from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer, SaveTarget, _may_resume_from
    from tests.unit.test_checkpoint_units import FINGERPRINT, snap

    root = tmp_path / "ckpt"
    ck = Checkpointer(CheckpointConfig(root=root), DistEnv(run_id="unit"), FINGERPRINT)
    ck.start()
    try:
        for bad in ("../elsewhere", "/tmp/elsewhere", "..", ""):
            ck._target = lambda _snap, bad=bad: SaveTarget("write", bad)  # type: ignore[method-assign,misc]
            with pytest.raises(RuntimeError, match="as the save's folder: not a folder name in"):
                ck.save(snap(2, 0, 2), sync=True)
        assert not (tmp_path / "elsewhere").exists()
    finally:
        ck.close()
    auto = CheckpointConfig(root=root)
    assert _may_resume_from(auto, root / "step-00000002")
    assert not _may_resume_from(auto, tmp_path / "other" / "step-00000002")
    assert not _may_resume_from(auto, root / ".." / "other")
    named = CheckpointConfig(root=root, resume=str(tmp_path / "other"))
    assert _may_resume_from(named, tmp_path / "other" / "step-00000002")
