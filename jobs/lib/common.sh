# shellcheck shell=bash
# Shared helpers for the elastic-train job scripts. Source it; it defines functions only.
#
# Knobs (environment):
#   ET_RUNTIME    venv (default) | module | container: where python, torch and torchrun come from
#   ET_VENV       the virtual environment of "venv" (default: $ET_PROJECT_DIR/.venv, made by `make demo`)
#   ET_MODULES    space-separated modules for "module", e.g. "PyTorch/2.1.2-foss-2023a-CUDA-12.1.1
#                 torchvision/0.16.0-foss-2023a-CUDA-12.1.1" (EESSI/EasyBuild ship torchvision apart)
#   ET_CONTAINER  Apptainer image for "container", e.g. /cluster/work/support/container/pytorch_nvidia_25.05_arm64.sif
#   ET_PIP_ARGS   extra pip arguments for building a runtime venv (below), split at spaces, e.g.
#                 "--no-index --find-links /cluster/projects/nnXXXXk/wheels" where nodes have no internet
#   ET_FT         restart (default) | quorum: what a worker failure costs (et_setup_ft below)
#   ET_GPU_LOG    nvidia-smi CSV log (default: $ET_LOG_DIR/gpu-$SLURM_JOB_ID.csv)

et_log() { printf '[elastic-train %(%F %T)T] %s\n' -1 "$*" >&2; }
et_die() { et_log "ERROR: $*"; exit 2; }

# Runtimes. "venv" uses a venv that holds everything (pip install -e '.[dev]'). "module" runs
# `module load $ET_MODULES` (ET_MODULES is required); "container" runs every command through
# `apptainer exec --nv --bind $ET_PROJECT_DIR --pwd $ET_PROJECT_DIR $ET_CONTAINER`. Modules and
# images bring python, torch and torchvision, but not structlog, tenacity, xxhash or a recent
# safetensors, so for these two a RUNTIME VENV is added on top:
# - where: $ET_PROJECT_DIR/.venv-module-<hash> or .venv-container-<hash>. The hash covers the
#   modules (ET_MODULES, the python they put on PATH, their PYTHONPATH) or the image (path, size,
#   mtime), plus pyproject.toml and jobs/lib/runtime_venv.py: change any of them and the next job
#   builds a new venv (old ones can be deleted while no job uses them).
# - first job: `python3 -m venv --without-pip --system-site-packages` with the runtime's own python,
#   then jobs/lib/runtime_venv.py pip-installs, with --no-deps and ET_PIP_ARGS, only the
#   dependencies of pyproject.toml the runtime lacks, never torch or torchvision (the build fails
#   if a copy of either lands in the venv), makes the project importable (a .pth file) and adds a
#   bin/torchrun that runs the runtime's torch with the venv's python. Its stamp file,
#   .et-runtime-stamp, is written last and says what was found and installed.
# - later jobs and requeues: the directory exists, so it is reused as it is (no pip, no network).
# - jobs that start together: each builds in <dir>.tmp-<host>-<pid> and renames it into place; the
#   first rename wins, the others drop their copy (no lock: works on any shared filesystem).
#   A killed build leaves its .tmp-* directory behind, which is safe to delete.
# - when pip fails (no internet on the nodes, no wheel for this python), the job exits 2 naming the
#   missing packages and the `pip download` command that brings their wheels for ET_PIP_ARGS.
ET_RUNTIME_STAMP=.et-runtime-stamp

# Fill the global array ET_RUN with the prefix that runs a command in the chosen runtime, and put
# that runtime's python and torchrun first on its PATH.
# shellcheck disable=SC2034  # ET_RUN is read by the scripts that source this file
et_setup_runtime() {
  ET_RUN=()
  # Quorum mode needs torchft (the pip extra "ft") in a module or container runtime's venv too.
  if [ "${ET_FT:-restart}" = quorum ]; then export ET_RUNTIME_EXTRAS=ft; fi
  case "${ET_RUNTIME:-venv}" in
    venv)
      local venv=${ET_VENV:-$ET_PROJECT_DIR/.venv}
      [ -x "$venv/bin/torchrun" ] || et_die "no torchrun in $venv (run 'make demo' once, or set ET_VENV)"
      PATH="$venv/bin:$PATH"; export PATH
      ;;
    module)
      command -v module >/dev/null 2>&1 ||
        et_die "ET_RUNTIME=module but the 'module' command is missing (submit from a login shell where 'module avail' works)"
      local m python
      set +u  # not every site's `module` function is written for `set -u`
      for m in ${ET_MODULES:?ET_RUNTIME=module needs ET_MODULES, e.g. ET_MODULES=PyTorch/2.1.2-foss-2023a-CUDA-12.1.1}; do
        module load "$m" || et_die "module load $m failed: look the name up with 'module spider ${m%%/*}'"
      done
      set -u
      python=$(command -v python3) || et_die "no python3 after 'module load $ET_MODULES': add a Python or PyTorch module"
      et_runtime_venv module "$ET_MODULES|$(readlink -f "$python")|${PYTHONPATH:-}"
      PATH="$ET_RUNTIME_VENV/bin:$PATH"; export PATH
      ;;
    container)
      [ -f "${ET_CONTAINER:-}" ] || et_die "ET_RUNTIME=container needs ET_CONTAINER pointing at an .sif image"
      command -v apptainer >/dev/null 2>&1 || et_die "ET_RUNTIME=container but 'apptainer' is not on PATH"
      local image
      image=$(readlink -f "$ET_CONTAINER")
      ET_RUN=(apptainer exec --nv --bind "$ET_PROJECT_DIR" --pwd "$ET_PROJECT_DIR" "$ET_CONTAINER")
      et_runtime_venv container "$image|$(stat -L -c '%s|%Y' "$image")"
      # The image's PATH is not this script's: put the venv first on it inside the container.
      # shellcheck disable=SC2016  # expanded by the shell inside the container
      ET_RUN+=(/bin/sh -c 'PATH="$0/bin:$PATH"; export PATH; exec "$@"' "$ET_RUNTIME_VENV")
      ;;
    *) et_die "ET_RUNTIME=${ET_RUNTIME} is not venv, module or container" ;;
  esac
}

# Make (first job) or reuse (later jobs) the runtime venv of runtime $1 whose identity is $2; sets
# ET_RUNTIME_VENV. Commands run in the runtime through "${ET_RUN[@]}" (see the notes above).
et_runtime_venv() {
  local kind=$1 identity=$2 key dir tmp pip_args
  key=$({ printf '%s|extras=%s\n' "$identity" "${ET_RUNTIME_EXTRAS:-}"; cat "$ET_PROJECT_DIR/pyproject.toml" "$ET_PROJECT_DIR/jobs/lib/runtime_venv.py"; } |
    sha256sum | cut -c1-12)
  dir=$ET_PROJECT_DIR/.venv-$kind-$key
  ET_RUNTIME_VENV=$dir
  # A directory of this name only ever appears by a rename of a finished build.
  if [ -e "$dir" ]; then
    [ -f "$dir/$ET_RUNTIME_STAMP" ] || et_die "$dir has no $ET_RUNTIME_STAMP (damaged, or not made by this script): delete it and resubmit"
    et_log "runtime venv $dir reused ($(cat "$dir/$ET_RUNTIME_STAMP"))"
    return
  fi
  tmp=$dir.tmp-${HOSTNAME:-host}-$$
  et_log "runtime venv $dir: first job with this $kind, building it (later jobs reuse it)"
  read -ra pip_args <<<"${ET_PIP_ARGS:-}"
  if ! "${ET_RUN[@]}" python3 -m venv --without-pip --system-site-packages "$tmp"; then
    rm -rf "$tmp"
    et_die "the $kind's python3 could not make a venv (python3 -m venv, error above)"
  fi
  if ! "${ET_RUN[@]}" "$tmp/bin/python" "$ET_PROJECT_DIR/jobs/lib/runtime_venv.py" setup "$ET_PROJECT_DIR" -- "${pip_args[@]}"; then
    rm -rf "$tmp"
    et_die "runtime venv $dir not built (the reason is above; nothing was left behind)"
  fi
  if mv -T "$tmp" "$dir" 2>/dev/null; then
    et_log "runtime venv $dir ready ($(cat "$dir/$ET_RUNTIME_STAMP"))"
  elif [ -f "$dir/$ET_RUNTIME_STAMP" ]; then
    rm -rf "$tmp"
    et_log "runtime venv $dir was built meanwhile by another job: using that one"
  else
    rm -rf "$tmp"
    et_die "could not rename $tmp to $dir (permissions on $ET_PROJECT_DIR?)"
  fi
}

# Fill ET_LAUNCH with the launcher: torchrun, or the same agent with warm (forked) worker starts.
# shellcheck disable=SC2034  # ET_LAUNCH is read by the scripts that source this file
et_setup_launcher() {
  case "${ET_LAUNCHER:-torchrun}" in
    torchrun) ET_LAUNCH=(torchrun) ;;
    warm) ET_LAUNCH=(python -m elastic_train.launch) ;;
    *) et_die "ET_LAUNCHER=${ET_LAUNCHER} is not torchrun or warm" ;;
  esac
}

# Fault tolerance (ET_FT; docs/slurm.md, "Fault-tolerance modes: ET_FT"):
#   restart (default)  torchrun's semantics: a failed worker stops every worker of the job, which
#                      restart and resume from the last checkpoint
#   quorum             python -m elastic_train.quorum.launch: every worker is a replica group of
#                      its own; the survivors keep training and only the failed worker restarts,
#                      healing from a live peer. Needs torchft in the runtime (pip extra `ft`)
# Sets ET_FT_MODE. Call it after et_setup_runtime: quorum mode checks that runtime for torchft's
# Lighthouse, so that a job without torchft exits 2 with the fix instead of failing (and being
# requeued as a crash) once its workers start.
# shellcheck disable=SC2034  # ET_FT_MODE is read by the scripts that source this file
et_setup_ft() {
  ET_FT_MODE=${ET_FT:-restart}
  case $ET_FT_MODE in
    restart) ;;
    quorum)
      # The agent runs torchft_lighthouse from beside its own python (elastic_train/quorum/
      # lighthouse.py); the wheel installs it there. A look in that directory costs no interpreter.
      # shellcheck disable=SC2016  # expanded by the shell inside the runtime
      "${ET_RUN[@]}" sh -c '[ -x "$(dirname "$(command -v python)")/torchft_lighthouse" ] || command -v torchft_lighthouse >/dev/null' ||
        et_die "ET_FT=quorum needs torchft in the runtime (no torchft_lighthouse beside its python): pip install -e '.[ft]' in the venv (ET_RUNTIME=venv), or submit with ET_FT=restart"
      ;;
    *) et_die "ET_FT=${ET_FT} is not restart or quorum" ;;
  esac
}

# ET_FT=quorum: the node's NPROC workers as replica groups of ET_PROCS_PER_REPLICA workers each
# (default 1: every worker a replica of its own; e.g. the node's GPU count: the node is one
# replica, DDP or FSDP2 inside it by the trainer's --parallel). Sets ET_QUORUM_SHAPE, the quorum
# agent's flags; a count that does not divide NPROC is refused before anything starts.
et_quorum_shape() {
  local nproc=$1 k=${ET_PROCS_PER_REPLICA:-1}
  [[ $k =~ ^[1-9][0-9]*$ ]] || et_die "ET_PROCS_PER_REPLICA=$k is not a positive whole number"
  (( nproc % k == 0 )) ||
    et_die "ET_PROCS_PER_REPLICA=$k does not divide the node's $nproc processes (ET_NPROC or its GPUs): pick a divisor of $nproc"
  # shellcheck disable=SC2034  # read by the scripts that source this file
  ET_QUORUM_SHAPE=(--nproc-per-node "$((nproc / k))" --procs-per-replica "$k")
}

et_gpus_on_node() {
  local n=${SLURM_GPUS_ON_NODE:-0}
  case $n in ''|*[!0-9]*) n=0 ;; esac
  echo "$n"
}

# Start the seed's background GPU monitor (CSV every 5 s) when GPUs exist; sets ET_MONITOR_PID.
et_start_gpu_monitor() {
  ET_MONITOR_PID=""
  if [ "$(et_gpus_on_node)" -gt 0 ] && command -v nvidia-smi >/dev/null 2>&1; then
    local log=${ET_GPU_LOG:-$ET_LOG_DIR/gpu-${SLURM_JOB_ID:-local}.csv}
    mkdir -p "$(dirname "$log")"
    nvidia-smi --query-gpu=timestamp,index,name,utilization.gpu,utilization.memory,memory.total,memory.used \
      --format=csv -l 5 >>"$log" &
    ET_MONITOR_PID=$!
    et_log "GPU monitor (pid $ET_MONITOR_PID) logging to $log"
  fi
}

# Stop the monitor by its PID (idempotent; called from the EXIT trap on every exit path).
et_stop_gpu_monitor() {
  if [ -n "${ET_MONITOR_PID:-}" ] && kill -0 "$ET_MONITOR_PID" 2>/dev/null; then
    et_log "stopping GPU monitor (pid $ET_MONITOR_PID)"
    kill "$ET_MONITOR_PID" 2>/dev/null || true
    wait "$ET_MONITOR_PID" 2>/dev/null || true
  fi
  ET_MONITOR_PID=""
}

# Signals. Slurm signals the batch shell (scancel, `--signal=B:USR1@120`, `scancel -s USR1 -b`);
# the script forwards each signal to the launcher, which forwards it to the workers. The first
# signal received also decides what happens after the launcher returns (et_finish): USR1/USR2
# ask for a checkpoint AND a requeue; TERM/INT/HUP/QUIT (a cancel, Slurm's own preemption, which
# requeues by itself) ask for a checkpoint only.
ET_SIGNALS=(TERM INT HUP QUIT USR1 USR2)
ET_SIGNAL_RECEIVED=""  # the first signal this script received
ET_SIGNAL_PENDING=""   # received before the launcher started: passed on once it runs

et_note_signal() {
  [ -n "$ET_SIGNAL_RECEIVED" ] || ET_SIGNAL_RECEIVED=$1
}

# Call this first: a signal that arrives during setup (module loads, the GPU check, the store)
# is remembered instead of killing the script, and passed to the launcher once it runs.
et_catch_signals() {
  local sig
  for sig in "${ET_SIGNALS[@]}"; do
    # shellcheck disable=SC2064  # expand $sig now
    trap "et_note_signal $sig; ET_SIGNAL_PENDING=$sig; et_log 'SIG$sig received during setup: passed on at launch'" "$sig"
  done
}

# Forward signal $1 to the launcher. TERM/INT/HUP/QUIT are relayed as ET_TERM_AS (default USR2):
# - a worker reads SIGTERM as "the launcher stops me" (torchrun sends it before every restart and
#   on a membership change: not a preemption), and SIGUSR1/SIGUSR2 as "the scheduler takes the
#   allocation" (a preemption, booked and requeued as one); a TERM from Slurm is the latter;
# - srun answers SIGTERM by SIGKILLing its tasks, which would leave no time to checkpoint.
# The launcher forwards USR1/USR2 to its workers (--signals-to-handle in elastic-agent.sh).
et_forward() {
  local sig=$1 as=$1
  et_note_signal "$sig"
  case $sig in TERM | INT | HUP | QUIT) as=${ET_TERM_AS:-USR2} ;; esac
  et_log "forwarding SIG$as to pid $ET_CHILD_PID$([ "$as" = "$sig" ] || echo " (received SIG$sig)")"
  kill -s "$as" "$ET_CHILD_PID" 2>/dev/null || true
}

# Run a command in the background, forwarding this script's signals to it (et_forward).
# Returns the command's exit status (a trapped signal interrupts `wait`, which is resumed).
et_run_forwarding() {
  "$@" &
  ET_CHILD_PID=$!
  local sig
  for sig in "${ET_SIGNALS[@]}"; do
    # shellcheck disable=SC2064  # expand $sig now
    trap "et_forward $sig" "$sig"
  done
  if [ -n "$ET_SIGNAL_PENDING" ]; then
    et_forward "$ET_SIGNAL_PENDING"
    ET_SIGNAL_PENDING=""
  fi
  local rc late
  while :; do
    rc=0
    wait "$ET_CHILD_PID" || rc=$?
    # >128 means the child died of a signal OR a trapped signal interrupted the wait.
    if [ "$rc" -le 128 ] || ! kill -0 "$ET_CHILD_PID" 2>/dev/null; then break; fi
  done
  if [ "$rc" -gt 128 ]; then  # an interrupted wait: the child's own status is still to collect
    late=0
    wait "$ET_CHILD_PID" 2>/dev/null || late=$?
    [ "$late" = 127 ] || rc=$late
  fi
  return "$rc"
}

# Requeue: a job whose trainer was preempted by USR1/USR2 (it committed a checkpoint and wrote
# $ET_CHECKPOINT_DIR/.preempted.json) or that crashed puts itself back in the queue with
# `scontrol requeue`: same job id, SLURM_RESTART_COUNT + 1, output appended, and the trainer
# resumes from checkpoints/latest by itself. torchrun exits 1 whatever its workers returned, so
# the marker, not the exit code, tells a preemption from a crash. It counts only if it carries
# this launch's id (ELASTIC_TRAIN_LAUNCH_ID, copied into it by the trainer): a marker of an
# earlier run, or of another job sharing the directory, says nothing about this one.
#   ET_MAX_REQUEUES          crash requeues allowed (default 5): a run that keeps crashing ends FAILED
#   ET_MAX_PREEMPT_REQUEUES  preemption requeues allowed (default 1000: a long run chained by time
#                            limits requeues once per limit)
# Both compare with SLURM_RESTART_COUNT, which counts every requeue and is unset on the first run.
# A job stopped by TERM/INT/HUP/QUIT (scancel, Slurm's own preemption) is never requeued here.

et_new_launch() {
  ELASTIC_TRAIN_LAUNCH_ID="${SLURM_JOB_ID:-local}.${SLURM_RESTART_COUNT:-0}.$$.$(date +%s%N)"
  export ELASTIC_TRAIN_LAUNCH_ID
}

# The marker contract is elastic_train/outcome.py's: the file name, the fields and their format,
# JSON with one key per line (`"key": value`, a comma after all but the last), which the reader
# below parses exactly. tests/unit/test_outcome.py runs it on the Python writer's output.
ET_PREEMPTED_MARKER=.preempted.json
# Written by rank 0 of a run whose checkpoint directory another job took over (exit 80,
# LOCK_LOST): a requeue would only be refused while that job holds it.
ET_LOCK_LOST_MARKER=.lock-lost.json

# Print field $2 of marker file $1: a string without its quotes; a number, true, false or null as
# written. Returns 1 when the file or the field is missing. Exact for values without JSON escapes,
# which is every value compared here (launch ids, exit codes, steps, signal names).
et_marker_field() {
  local file=$1 key=$2 line value
  [ -r "$file" ] || return 1
  while IFS= read -r line || [ -n "$line" ]; do
    case $line in
      "\"$key\": "*)
        value=${line#"\"$key\": "}
        value=${value%,}
        case $value in \"*\") value=${value#\"}; value=${value%\"} ;; esac
        printf '%s\n' "$value"
        return 0
        ;;
    esac
  done <"$file"
  return 1
}

# True when marker file $1 (in the checkpoint directory) carries this launch's id.
et_own_marker() {
  local launch
  [ -n "${ELASTIC_TRAIN_LAUNCH_ID:-}" ] || return 1
  launch=$(et_marker_field "$ET_CHECKPOINT_DIR/$1" launch_id) || return 1
  [ "$launch" = "$ELASTIC_TRAIN_LAUNCH_ID" ]
}

# True when this launch's trainer was preempted: the preemption marker carries its launch id.
et_was_preempted() { et_own_marker "$ET_PREEMPTED_MARKER"; }

# Set `reason` and `rc` from this launch's preemption marker: rc becomes the trainer's "preempted,
# requeue me" code as the marker states it (75), whatever torchrun returned.
et_read_preemption() {
  local marker=$ET_CHECKPOINT_DIR/$ET_PREEMPTED_MARKER step signal committed code
  step=$(et_marker_field "$marker" step) || step="?"
  signal=$(et_marker_field "$marker" signal) || signal="?"
  committed=$(et_marker_field "$marker" committed) || committed="?"
  code=$(et_marker_field "$marker" exit_code) || code=""
  [ "$committed" = true ] && committed="checkpoint committed" || committed="CHECKPOINT FAILED, the previous one is kept"
  reason="preempted by $signal at step $step ($committed)"
  case $code in '' | *[!0-9]*) et_log "$marker has no exit code: keeping the launcher's $rc" ;; *) rc=$code ;; esac
}

et_count() {  # $1 if it is a whole number, else 0 (a typo in a cap must not mean "requeue forever")
  case $1 in '' | *[!0-9]*) echo 0 ;; *) echo "$1" ;; esac
}

# Decide what the job does after the launcher returned with status $1: exit, or requeue itself.
et_finish() {
  local rc=$1 restarts cap reason
  trap '' "${ET_SIGNALS[@]}"  # nothing left to forward; the requeue's own SIGTERM must not cut this short
  restarts=$(et_count "${SLURM_RESTART_COUNT:-0}")
  if et_own_marker "$ET_LOCK_LOST_MARKER"; then
    rc=$(et_marker_field "$ET_CHECKPOINT_DIR/$ET_LOCK_LOST_MARKER" exit_code) || rc=80
    et_log "another job took $ET_CHECKPOINT_DIR over (its lock had gone stale): stopped at step" \
      "$(et_marker_field "$ET_CHECKPOINT_DIR/$ET_LOCK_LOST_MARKER" step || echo '?'); not requeued (exit $rc)"
    exit "$rc"
  fi
  if et_was_preempted; then
    et_read_preemption
    cap=$(et_count "${ET_MAX_PREEMPT_REQUEUES:-1000}")
  elif [ "$rc" = 0 ]; then
    et_log "training finished (exit 0)"
    exit 0
  else
    reason="failed with exit code $rc"
    cap=$(et_count "${ET_MAX_REQUEUES:-5}")
  fi
  case $ET_SIGNAL_RECEIVED in
    TERM | INT | HUP | QUIT)
      et_log "$reason after SIG$ET_SIGNAL_RECEIVED (a cancel, or Slurm's own preemption): not requeued"
      exit "$rc"
      ;;
  esac
  if [ -z "${SLURM_JOB_ID:-}" ]; then
    et_log "$reason; not under Slurm, so not requeued"
  elif [ "$restarts" -ge "$cap" ]; then
    et_log "$reason; not requeued: SLURM_RESTART_COUNT=$restarts has reached the cap of $cap"
  elif scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -q 'JobState=CANCELLED'; then
    et_log "$reason; the job was cancelled: not requeued"
  else
    et_log "$reason; requeueing job $SLURM_JOB_ID (restart $((restarts + 1)) of at most $cap)"
    if scontrol requeue "$SLURM_JOB_ID"; then
      exit 0  # Slurm ends this run and starts the job again, output appended
    fi
    et_log "scontrol requeue $SLURM_JOB_ID failed"
  fi
  exit "$rc"
}
