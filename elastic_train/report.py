"""``python -m elastic_train.report LOG_DIR [-o report.png]``: one picture of a run, and a summary.

Reads what a run leaves in its ``--log-dir`` (``metrics.jsonl`` and the ``rank-N.jsonl`` event
logs, which every attempt appends to, so restarts and requeues are all there) and draws:

* loss and accuracy per epoch, train and validation;
* throughput per epoch (global images per second), with the world size it ran at;
* the world size over wall time, one bar per attempt, with markers for restarts (by cause),
  preemptions, injected faults and checkpoint commits; the goodput in the title. A quorum-mode
  run (``--ft quorum``: ``replica_N.jsonl`` logs) is drawn as the quorum's size over time, a
  step at every membership change, with markers where a failed attempt was discarded and where
  a worker healed from a peer.

It prints a short text summary too. matplotlib is an optional extra
(``pip install 'elastic-train[report]'``); without it the summary is still printed and the exit
code is 2 with a message saying what to install.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_train.logs import parse_timestamp
from elastic_train.outcome import ExitCode, RestartCause
from elastic_train.step_log import read_steps

EPOCH_KEYS = ("train_loss", "train_acc", "val_loss", "val_acc", "throughput", "world_size")
CAUSE_COLORS = {
    RestartCause.FAILURE.value: "tab:red",
    RestartCause.HANG.value: "tab:purple",
    RestartCause.PREEMPTION.value: "tab:orange",
    RestartCause.STOP.value: "tab:blue",
    RestartCause.INTERRUPT.value: "tab:gray",
}


def _time(event: dict[str, Any]) -> float:
    return float(event["_t"])


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines only: a line cut short by a crash is skipped, not fatal."""
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


@dataclass
class Attempt:
    """One launch of the workers: from its processes' start to rank 0's last event."""

    start: float
    end: float
    world_size: int


@dataclass
class Run:
    log_dir: Path
    epochs: list[dict[str, Any]]  # the last record of each epoch, in epoch order
    events: list[dict[str, Any]]  # every rank's events, in time order
    attempts: list[Attempt] = field(default_factory=list)
    # Quorum mode: (time, participants) at every commit that changed the membership, and the
    # replicas' own events (``_replica``: the group index), in time order.
    quorum: list[tuple[float, int]] = field(default_factory=list)
    replica_events: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # steps.jsonl: the per-step curve

    @property
    def origin(self) -> float:
        """The job's first moment in the logs: restart mode's first attempt, or quorum mode's
        first replica event (it writes no rank logs)."""
        firsts = [a.start for a in self.attempts] + [_time(e) for e in self.events[:1] + self.replica_events[:1]]
        return min(firsts or [0.0])

    def replicas_named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.replica_events if e.get("event") == name]

    def named(self, name: str, rank: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name and (rank is None or e.get("rank") == rank)]

    @property
    def done(self) -> dict[str, Any] | None:
        """The last `done` event, if it has the goodput figures."""
        done = self.named("done", rank=0) + self.replicas_named("done")  # quorum mode: every replica's
        finished = [e for e in done if {"goodput", "lost_s", "recomputed_steps"} <= e.keys()]
        return max(finished, key=_time) if finished else None

    def restart_causes(self) -> Counter[str]:
        return Counter(str(e.get("cause", RestartCause.FAILURE.value)) for e in self.named("recovery", rank=0))


def load_run(log_dir: Path) -> Run:
    metrics = log_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(
            f"no metrics.jsonl in {log_dir}: pass the --log-dir of a run that finished at least one epoch"
        )
    by_epoch: dict[int, dict[str, Any]] = {}
    for record in _read_jsonl(metrics):
        if isinstance(record.get("epoch"), int) and all(isinstance(record.get(k), (int, float)) for k in EPOCH_KEYS):
            by_epoch[record["epoch"]] = record  # a re-run epoch (after a restart) replaces its first try
    events = []
    for path in sorted(log_dir.glob("rank-*.jsonl")):
        for event in _read_jsonl(path):
            at = parse_timestamp(event.get("timestamp"))
            if at is not None:  # an event without a readable time cannot be placed: skipped
                events.append({**event, "_t": at})
    events.sort(key=_time)
    run = Run(log_dir, [by_epoch[k] for k in sorted(by_epoch)], events)
    run.attempts = _attempts(run.named("start", rank=0), [e for e in events if e.get("rank") == 0])
    for path in sorted(log_dir.glob("replica_*.jsonl")):
        group = path.stem.removeprefix("replica_")
        for event in _read_jsonl(path):
            at = parse_timestamp(event.get("timestamp"))
            if at is not None:
                run.replica_events.append({**event, "_t": at, "_replica": int(group) if group.isdigit() else -1})
    run.replica_events.sort(key=_time)
    run.quorum = _quorum_sizes(run.replica_events)
    run.steps = [s for s in read_steps(log_dir) if isinstance(s.get("time"), (int, float))]
    return run


@dataclass(frozen=True)
class Span:
    """A stretch of the job's wall time and what it was spent on."""

    start: float
    end: float
    kind: str  # "lost" (failure to the first step after it) or "redone" (recomputing lost steps)


def recovery_spans(run: Run) -> list[Span]:
    """For each restart: the time lost (from the last step logged before it to the first step
    after it) and the time spent redoing steps (until the step reached before it is reached
    again), from the per-step curve and the ``recovery`` events."""
    spans = []
    times = [(float(s["time"]), int(s["step"])) for s in run.steps]
    for e in run.named("recovery", rank=0):
        at = _time(e)
        before = [t for t, _ in times if t < at]
        after = [(t, step) for t, step in times if t >= at]
        if not before or not after:
            continue
        spans.append(Span(before[-1], after[0][0], "lost"))
        reached = e.get("reached_step")
        if isinstance(reached, int):
            back = next((t for t, step in after if step >= reached), None)
            if back is not None and back > after[0][0]:
                spans.append(Span(after[0][0], back, "redone"))
    return spans


def _quorum_sizes(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """The quorum's size over time: every replica logs its first commit after a membership
    change (``quorum_changed``); the participants of one change log it at about the same time,
    so only changes of the size are kept."""
    points: list[tuple[float, int]] = []
    for e in events:
        changed = e.get("event") == "quorum_changed" and isinstance(e.get("world"), int)
        if changed and (not points or points[-1][1] != e["world"]):
            points.append((_time(e), int(e["world"])))
    return points


def _attempts(starts: list[dict[str, Any]], rank0: list[dict[str, Any]]) -> list[Attempt]:
    """One attempt per `start` event of rank 0, ending at rank 0's last event before the next."""
    times = [_time(e) for e in rank0]  # sorted, as the events are
    out = []
    for i, start in enumerate(starts):
        begin = start.get("process_started")
        begin = float(begin) if isinstance(begin, (int, float)) else _time(start)
        until = _time(starts[i + 1]) if i + 1 < len(starts) else float("inf")
        last = bisect.bisect_left(times, until) - 1
        end = times[last] if last >= 0 and times[last] >= _time(start) else _time(start)
        size = start.get("world_size")
        out.append(Attempt(begin, end, size if isinstance(size, int) else 0))
    return out


def summary_lines(run: Run) -> list[str]:
    lines = [f"Run: {run.log_dir}"]
    if run.epochs:
        last, best = run.epochs[-1], max(r["val_acc"] for r in run.epochs)
        lines.append(f"Epochs: {len(run.epochs)} (last val_acc {last['val_acc']:.4f}, best {best:.4f})")
        lines.append(f"Throughput: median {statistics.median(r['throughput'] for r in run.epochs):.1f} img/s")
    if run.quorum:
        sizes = [size for _, size in run.quorum]
        lines.append(f"Quorum size: {' -> '.join(map(str, sizes))} ({len(sizes) - 1} membership change(s))")
        heals = run.replicas_named("healed")
        lines.append(
            f"Attempts discarded: {len(run.replicas_named('discarded'))}; workers healed from a peer: {len(heals)}"
        )
    else:
        sizes = [a.world_size for a in run.attempts]
        changes = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
        lines.append(f"World size: {' -> '.join(map(str, changes)) or 'unknown'} over {len(run.attempts)} attempt(s)")
    causes = run.restart_causes()
    detail = ", ".join(f"{cause}: {n}" for cause, n in sorted(causes.items()))
    lines.append(f"Restarts: {sum(causes.values())}" + (f" ({detail})" if detail else ""))
    commits = run.named("checkpoint_committed", rank=0) + run.replicas_named("checkpoint_committed")
    lines.append(f"Checkpoints committed: {len(commits)}")
    done = run.done
    if done is not None:
        lines.append(
            f"Goodput: {done['goodput']:.2f} (time lost to recovery {done['lost_s']:.1f} s, "
            f"steps recomputed {done['recomputed_steps']})"
        )
    else:
        lines.append("Goodput: n/a (the run has not finished)")
    return lines


def draw(run: Run, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a compute node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    (loss_ax, acc_ax), (tput_ax, ws_ax) = axes
    epochs = [r["epoch"] for r in run.epochs]
    pairs = [(acc_ax, "acc", "Accuracy")]
    if run.steps:
        _draw_loss_over_time(run, loss_ax)
    else:
        pairs.insert(0, (loss_ax, "loss", "Loss"))
    for ax, key, label in pairs:
        ax.plot(epochs, [r[f"train_{key}"] for r in run.epochs], "o-", label="train")
        ax.plot(epochs, [r[f"val_{key}"] for r in run.epochs], "s-", label="validation")
        ax.set(title=f"{label} per epoch", xlabel="epoch", ylabel=label.lower())
        ax.legend()
        ax.grid(alpha=0.3)
    bars = tput_ax.bar(epochs, [r["throughput"] for r in run.epochs], color="tab:blue")
    tput_ax.bar_label(bars, labels=[f"ws {r['world_size']}" for r in run.epochs], fontsize=8)
    tput_ax.set(title="Throughput per epoch", xlabel="epoch", ylabel="images / s")
    tput_ax.grid(alpha=0.3, axis="y")
    _draw_timeline(run, ws_ax)
    done = run.done
    goodput = f"goodput {done['goodput']:.2f}" if done is not None else "not finished"
    name = "/".join(run.log_dir.resolve().parts[-2:])
    fig.suptitle(f"elastic-train run {name}: {goodput}")
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)


def _draw_loss_over_time(run: Run, ax: Any) -> None:
    """The training loss of every logged step against wall-clock time since the job started,
    the time shaded by what it was spent on, failures, restarts and commits where they happened."""
    t0 = run.origin
    xs = [float(s["time"]) - t0 for s in run.steps]
    ax.plot(xs, [s["loss"] for s in run.steps], ".", markersize=3, color="tab:blue", label="training loss")
    for a in run.attempts:
        ax.axvspan(a.start - t0, a.end - t0, color="tab:green", alpha=0.08, lw=0)
    colors = {"lost": "tab:red", "redone": "tab:orange"}
    labels = {"lost": "lost (failure to restart)", "redone": "redone (recomputed steps)"}
    seen: set[str] = set()
    for span in recovery_spans(run):
        label = None if span.kind in seen else labels[span.kind]
        seen.add(span.kind)
        ax.axvspan(span.start - t0, span.end - t0, color=colors[span.kind], alpha=0.25, lw=0, label=label)
    for e in run.named("fault_injected") + run.named("crashed"):
        ax.axvline(_time(e) - t0, color="black", linestyle=":", lw=1)
    for e in run.named("recovery", rank=0):
        cause = str(e.get("cause", RestartCause.FAILURE.value))
        ax.axvline(_time(e) - t0, color=CAUSE_COLORS.get(cause, "tab:red"), linestyle="--", lw=1)
    commits = [_time(e) - t0 for e in run.named("checkpoint_committed", rank=0)]
    if commits:
        low = min(float(s["loss"]) for s in run.steps)
        ax.plot(commits, [low] * len(commits), "|", color="tab:gray", markersize=10, label="checkpoint commit")
    ax.set(
        title="Training loss over the job's wall time (green: attempts)",
        xlabel="seconds since the job started",
        ylabel="loss",
        xlim=(0, max([*xs, *(a.end - t0 for a in run.attempts), 1.0]) * 1.02),
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _draw_timeline(run: Run, ax: Any) -> None:
    t0 = run.origin
    for a in run.attempts:
        ax.broken_barh([(a.start - t0, max(a.end - a.start, 0.1))], (0, a.world_size), color="tab:green", alpha=0.5)
    seen: set[str] = set()

    def mark(event: dict[str, Any], color: str, label: str, style: str = "--") -> None:
        ax.axvline(_time(event) - t0, color=color, linestyle=style, label=None if label in seen else label)
        seen.add(label)

    for e in run.named("recovery", rank=0):
        cause = str(e.get("cause", RestartCause.FAILURE.value))
        mark(e, CAUSE_COLORS.get(cause, "tab:red"), f"restart ({cause})")
    for e in run.named("preempted", rank=0):
        mark(e, "tab:orange", "preemption signal", ":")
    for e in run.named("fault_injected"):
        mark(e, "black", "injected fault", ":")
    if run.quorum:
        end = max(_time(e) for e in run.replica_events)
        xs = [t - t0 for t, _ in run.quorum] + [end - t0]
        ys = [size for _, size in run.quorum] + [run.quorum[-1][1]]
        ax.step(xs, ys, where="post", color="tab:green", label="quorum size")
        for e in run.replicas_named("discarded"):
            mark(e, "tab:red", "attempt discarded (a peer failed)", ":")
        for e in run.replicas_named("healed"):
            mark(e, "tab:cyan", "worker healed from a peer")
    saved = run.named("checkpoint_committed", rank=0) + run.replicas_named("checkpoint_committed")
    commits = [_time(e) - t0 for e in saved]
    if commits:
        ax.plot(commits, [0.05] * len(commits), "|", color="tab:blue", markersize=12, label="checkpoint commit")
    top = max([a.world_size for a in run.attempts] + [size for _, size in run.quorum] + [1])
    ax.set(
        title="World size over time",
        xlabel="seconds since the job started",
        ylabel="processes",
        ylim=(0, top + 0.5),
    )
    ax.set_yticks(range(top + 1))
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_train.report", description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", type=Path, help="the --log-dir of a run, or its --run-dir")
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG to write (default LOG_DIR/report.png)")
    args = parser.parse_args(argv)
    default_output = args.log_dir / "report.png"
    if not (args.log_dir / "metrics.jsonl").is_file() and (args.log_dir / "logs" / "metrics.jsonl").is_file():
        args.log_dir = args.log_dir / "logs"  # a --run-dir: its report goes beside logs/ and checkpoints/
    try:
        run = load_run(args.log_dir)
    except FileNotFoundError as exc:
        print(f"elastic-train report: error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    for line in summary_lines(run):
        print(line)
    output = args.output or default_output
    try:
        draw(run, output)
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib" and not str(exc.name).startswith("matplotlib."):
            raise
        print(
            "elastic-train report: error: the plot needs matplotlib: pip install 'elastic-train[report]' "
            "(the summary above needs nothing)",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    print(f"Report: {output}")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
