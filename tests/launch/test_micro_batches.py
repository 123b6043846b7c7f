"""``--micro-batch-size``: a process's share of a step in micro-batches (gradient accumulation,
DDP synced on the last), so memory is bounded whatever the world size. The step's math and the
samples are unchanged: equal to whole shares up to float summation order, and bitwise equal to
itself across a kill at the same world size and micro-batch size."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import RESUME_RUN, assert_bitwise_equal, dirs, epoch_metrics, final_state, reference_run, torchrun

pytestmark = pytest.mark.timeout(300)
STANDALONE_2 = ["--standalone", "--nproc_per_node=2"]
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
MICRO = ["--micro-batch-size", "5"]  # a share of 16: 5 + 5 + 5 + 1
# SGD: AdamW divides by each weight's gradient scale, which turns a last-bit difference of the
# summation order into ~1e-5 after a few steps; SGD keeps it where the sums put it.
RUN = [*RESUME_RUN, "--optimizer", "sgd"]


def test_micro_batches_keep_the_steps_math_and_resume_bitwise_across_a_kill(tmp_path: Path) -> None:
    # The fault-free runs by forked ranks (``reference_run``), the killed one under torchrun.
    reference_run(2, [*RUN, *dirs(tmp_path / "whole")])
    reference_run(2, [*RUN, *MICRO, *dirs(tmp_path / "micro")])
    killed = torchrun(
        [*STANDALONE_2, "--max-restarts=1"],
        [*RUN, *MICRO, *dirs(tmp_path / "killed")],
        env={**AGENT_ENV, "ELASTIC_TRAIN_FAULTS": "kill:rank=1:step=6"},
    )
    assert killed.returncode == 0 and "Resumed from" in killed.stdout, killed.output
    assert_bitwise_equal(final_state(tmp_path / "killed"), final_state(tmp_path / "micro"))
    a, b = final_state(tmp_path / "micro"), final_state(tmp_path / "whole")
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a if k.startswith("model."))
    assert worst < 1e-5, f"micro-batches changed the step's math by {worst}"
    keys = ("samples_seen", "sample_digest")
    assert [[m[k] for k in keys] for m in epoch_metrics(tmp_path / "micro")] == [
        [m[k] for k in keys] for m in epoch_metrics(tmp_path / "whole")
    ]
