"""No stale docs: every command in a ```bash block of README.md or docs/*.md is run by a test.

Each documented command must match one rule below, and the rule must hold:

* ``RUN_HERE``: run verbatim by ``test_quickstart_commands_run_verbatim``
  (tests/launch/test_docs_run.py), in order, in one fresh directory (the trainer's quick run
  leaves the logs and checkpoints the later commands read).
* ``COVERED_BY``: run, in the same form, by the named test (which must exist), e.g. the sbatch
  submissions by tests/slurm/test_slurm.py and the agent script by tests/launch/test_elastic.py.
* ``CLUSTER_EXAMPLE``: GPU and multi-node examples that cannot run on a CPU machine; checked
  statically: every repository file they name exists and the trainer flags parse and validate.

Output samples and diagrams go in ```text blocks, which are not commands.
"""

from __future__ import annotations

import itertools
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from elastic_train.cli import parse_config
from tests.helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RUN_HERE = [
    "python -m elastic_train --run-dir runs/taste --epochs 2 --max-steps-per-epoch 10",
    "python -m elastic_train.launch --standalone --nproc_per_node=2 --max-restarts=3 -m elastic_train "
    "--run-dir runs/warm --epochs 2 --max-steps-per-epoch 10",
    "torchrun --standalone --nproc_per_node=2 --max-restarts=3 -m elastic_train --run-dir runs/torchrun --epochs 2 "
    "--max-steps-per-epoch 10",
    "python -m elastic_train.ckpt list runs/taste",
    "python -m elastic_train.ckpt verify runs/taste",
    "python -m elastic_train.ckpt inspect runs/taste",
    "python -m elastic_train.ckpt export runs/taste -o model.safetensors",
    "python -m elastic_train.report runs/taste",
    "python -m elastic_train.quorum.launch --nproc-per-node 2 -m elastic_train --run-dir runs/quorum --epochs 2 "
    "--max-steps-per-epoch 10",
    "python -m elastic_train.ckpt verify runs",
]
ELASTIC = "tests/launch/test_elastic.py::"
SLURM = "tests/slurm/test_slurm.py::"
COVERED_BY: dict[str, str] = {
    r"make demo": "Makefile target; .ci/run runs `make test`, tests/process/test_make_targets.py checks `demo`",
    r"make test": "Makefile target; .ci/run runs it",
    r"make bench": "Makefile target; test_make_targets_exist checks it",
    r"make gpu-check": "Makefile target (needs a GPU); test_make_targets_exist checks it, "
    "tests/launch/test_gpu_check.py runs its CPU smoke mode",
    r"sudo \.ci/local-slurm\.sh (start|stop)": ".ci/run",
    r"python -m elastic_train\.rendezvous --port 29400 &": ELASTIC
    + "test_losing_the_node_at_the_rendezvous_endpoint_with_the_standalone_store_is_survived",
    r"ET_RDZV_ENDPOINT=\S+ ET_NNODES=1:4 jobs/elastic-agent\.sh --epochs 100": ELASTIC
    + "test_a_new_node_joining_grows_the_job_back_to_two",
    # The torchrun line that jobs/elastic-agent.sh runs (the docs spell it out; the test runs the script).
    r"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:4 .*-m elastic_train .*": ELASTIC
    + "test_a_new_node_joining_grows_the_job_back_to_two",
    r"sbatch --cpus-per-task=2 jobs/train\.sbatch --epochs 2 --max-steps-per-epoch 10": SLURM
    + "test_train_sbatch_runs_to_completion",
    r"ET_FT=quorum sbatch jobs/train\.sbatch --epochs 2 --max-steps-per-epoch 10": "tests/slurm/test_slurm_quorum.py::"
    "test_a_quorum_job_is_preempted_requeued_and_resumes_with_every_sample_exactly_once",
    # One node's agent of a two-node job: the test starts both, with these flags, and etcd.
    r"python -m elastic_train\.quorum\.launch --nnodes 2 --node-rank 0 .*--lighthouse-etcd \S+ -m elastic_train .*": (
        "tests/launch/test_quorum_lighthouse_seat.py::"
        "test_the_lighthouses_node_frozen_the_other_node_takes_its_seat_and_trains_on_and_the_thawed_node_heals_back"
    ),
}
EXAMPLES = "tests/launch/test_examples.py::"
README_RUN = EXAMPLES + "test_the_readme_examples_run_verbatim"
COVERED_BY.update(
    {
        # "Train your own model": run from a scratch folder with the repository on PYTHONPATH.
        r"torchrun --standalone --nproc_per_node=2 -m elastic_train --model torchvision:mobilenet_v3_small "
        r"--dataset synthetic --epochs 2 --max-steps-per-epoch 5": README_RUN,
        r"torchrun --standalone --nproc_per_node=2 -m elastic_train --task examples\.lm_task:task "
        r"--epochs 2 --max-steps-per-epoch 5 --target-accuracy 1\.0": EXAMPLES
        + "test_the_readme_examples_run_verbatim",
        # "Sharded models": the reference run of the FSDP tests, word for word.
        r"torchrun --standalone --nproc_per_node=2 -m elastic_train --run-dir runs/fsdp --parallel fsdp "
        r"--batch-size 32 --epochs 2 --max-steps-per-epoch 6": "tests/launch/test_fsdp_torchrun.py::"
        "test_a_worker_killed_mid_epoch_under_elastic_torchrun_resumes_its_shards_bitwise",
        r"torchrun --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d "
        r"--rdzv-endpoint=localhost:29400 --rdzv-id=charlm --rdzv-conf=last_call_timeout=5 examples/char_lm\.py "
        r"--checkpoint-dir checkpoints/charlm": (
            EXAMPLES + "test_the_custom_loop_survives_a_killed_worker_and_ends_bit_for_bit_equal"
        ),
    }
)
ETCD = "tests/launch/test_etcd_rendezvous.py::test_losing_the_etcd_member_and_a_node_at_once_is_survived_exactly_once"
COVERED_BY.update(
    {
        # README "Elastic, multi-node without Slurm": the test starts three members this way (on
        # loopback ports) and the agents with ET_RDZV_BACKEND=etcd and every member's endpoint.
        r"python -m elastic_train\.etcd_member --name h0 --client h0:2379 --peer h0:2380 "
        r"--cluster h0=h0:2380,h1=h1:2380,h2=h2:2380 --data-dir /tmp/etcd-job1 &": ETCD,
        r"ET_RDZV_BACKEND=etcd ET_RDZV_ENDPOINT=h0:2379,h1:2379,h2:2379 ET_RDZV_ID=job1 "
        r"jobs/elastic-agent\.sh --epochs 100": ETCD,
    }
)
GROUPS = "tests/launch/test_quorum_groups.py::"
COVERED_BY.update(
    {
        # "Replica groups of several workers": one agent per group, as the test starts them (it adds
        # the run's size flags and its own Lighthouse's address).
        r"for g in 0 1; do": GROUPS
        + "test_a_killed_worker_takes_its_group_out_the_other_group_commits_and_the_group_heals_worker_by_worker",
        r"REPLICA_GROUP_ID=\$g torchrun --standalone --nproc-per-node=2 --max-restarts=3 examples/char_lm\.py "
        r"--ft quorum --parallel fsdp --lighthouse http://127\.0\.0\.1:29510 &": GROUPS
        + "test_a_killed_worker_takes_its_group_out_the_other_group_commits_and_the_group_heals_worker_by_worker",
        r"done; wait": GROUPS
        + "test_a_killed_worker_takes_its_group_out_the_other_group_commits_and_the_group_heals_worker_by_worker",
    }
)
COVERED_BY.update(
    {
        # The built-in trainer in replica groups of two FSDP2 workers: the test runs the same
        # launch (its run's size flags and folders instead), kills a worker and checks the heal.
        r"python -m elastic_train\.quorum\.launch --nproc-per-node 2 --procs-per-replica 2 -m elastic_train "
        r"--parallel fsdp --run-dir runs/hsdp --epochs 2 --max-steps-per-epoch 10": "tests/launch/"
        "test_quorum_trainer_groups.py::test_a_killed_worker_takes_its_group_out_the_other_group_commits_on_and_"
        "the_group_heals_worker_by_worker",
    }
)
CLUSTER_EXAMPLE = [r"--gpus", r"--nproc_per_node=4", r"apptainer", r"ET_CONTAINER="]


def commands(path: Path) -> list[str]:
    """The commands of the ```bash blocks: continuations joined, comments and blank lines dropped."""
    found, in_bash, pending = [], False, ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("```"):  # fences may be indented (inside a list item)
            in_bash = not in_bash and line.strip() == "```bash"
            continue
        if not in_bash:
            continue
        text = re.sub(r"\s{2,}#.*$", "", line).strip()  # a trailing "   # comment"
        if not text or text.startswith("#"):
            continue
        pending += text
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        found.append(pending)
        pending = ""
    return found


ALL = [(path, cmd) for path in DOCS for cmd in commands(path)]


def rule_for(cmd: str) -> str:
    if cmd in RUN_HERE:
        return "run here"
    for pattern, by in COVERED_BY.items():
        if re.fullmatch(pattern, cmd):  # the whole command: no extra or changed arguments
            return f"covered by {by}"
    if any(re.search(p, cmd) for p in CLUSTER_EXAMPLE):
        return "cluster example"
    return "none"


def test_the_docs_have_commands_and_every_rule_is_still_used() -> None:
    documented = {cmd for _, cmd in ALL}
    assert len(documented) >= 15
    assert not [cmd for cmd in RUN_HERE if cmd not in documented], "RUN_HERE lists commands no doc shows"
    unused = [p for p in COVERED_BY if not any(re.fullmatch(p, cmd) for cmd in documented)]
    assert not unused, f"COVERED_BY rules that match no documented command: {unused}"


@pytest.mark.parametrize(("path", "cmd"), ALL, ids=[f"{p.name}:{c[:60]}" for p, c in ALL])
def test_every_documented_command_is_covered(path: Path, cmd: str) -> None:
    rule = rule_for(cmd)
    assert rule != "none", f"{path.name}: `{cmd}` is run by no test: add it to RUN_HERE/COVERED_BY or fix the doc"
    if rule.startswith("covered by tests/"):
        file, _, name = rule.removeprefix("covered by ").partition("::")
        assert f"def {name}(" in (ROOT / file).read_text(), f"{rule}: no such test"
    if rule == "cluster example":
        check_cluster_example(cmd)


def check_cluster_example(cmd: str) -> None:
    words = shlex.split(cmd.replace("$USER", "someone"))
    for word in words:
        if word.startswith(("jobs/", "benchmarks/", "elastic_train/")):
            assert (ROOT / word).exists(), f"`{cmd}` names {word}, which does not exist"
    if "-m" in words and "elastic_train" in words:
        trainer = words[words.index("elastic_train") + 1 :]
    else:
        script = next(i for i, w in enumerate(words) if w.endswith(".sbatch") or w.endswith(".sh"))
        trainer = words[script + 1 :]
    parse_config(trainer)  # raises UsageError on an unknown flag or a bad value


def test_the_readme_names_every_flag_of_the_trainer() -> None:
    from elastic_train.cli import build_parser

    readme = (ROOT / "README.md").read_text()
    flags = [o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert [f for f in flags if f"`{f}" not in readme] == [], "add them to the README's flag table"


def test_what_the_documented_commands_write_is_ignored_by_git() -> None:
    """A newcomer runs the README's commands in a clone: `git status` must not fill up with runs.

    Every `--run-dir DIR`, `-o FILE` and the default folders (logs/, checkpoints/) that a
    documented command or `make demo` writes must be matched by .gitignore.
    """
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    written = {"logs/x.log", "checkpoints/step-00000001/manifest.json", "runs/demo/logs/x.log", "data/x"}
    for _, cmd in ALL:
        words = shlex.split(cmd.replace("$USER", "someone"))
        for flag, value in itertools.pairwise(words):
            if flag in ("--run-dir", "-o", "--output", "--log-dir", "--checkpoint-dir"):
                inside = {"--run-dir": "/logs/x.log", "--log-dir": "/x.log", "--checkpoint-dir": "/latest"}
                written.add(value.rstrip("/") + inside.get(flag, ""))  # a folder's: a file in it
    assert len(written) > 5
    found = subprocess.run(
        [git, "check-ignore", "--no-index", *sorted(written)], cwd=ROOT, capture_output=True, text=True
    )
    assert found.returncode in (0, 1), found.stderr  # 128: git itself failed, not an unignored path
    ignored = set(found.stdout.split())
    assert sorted(written - ignored) == [], "add these paths to .gitignore: the docs' commands write them"
