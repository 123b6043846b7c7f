#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for the Slurm tests (tests/slurm/test_slurm.py).
#
#   sudo .ci/local-slurm.sh start    # install if missing, configure, start, wait until the node is idle
#   sudo .ci/local-slurm.sh stop     # cancel jobs, stop the daemons this script started
#   .ci/local-slurm.sh status
#
# Debian/Ubuntu, root, no systemd needed: munged, slurmctld and slurmd run as plain daemons.
# Where a controller already answers (a real cluster, or one started another way) `start`
# leaves it alone and says so. `.ci/run` starts it before the tests and stops it after.
#
# The settings that make the tests fast and leak-free (the reasons are measured, not guessed):
# - AuthInfo=cred_expire=5 (Slurm's minimum): a requeued job becomes eligible again cred_expire + 1 s after its
#   previous run finished; with Slurm's default (120 s) a requeue test waits ~160 s.
# - ProctrackType cgroup (v1 freezer) where it is writable: every process of a job, torchrun's
#   workers in their own sessions included, is gone before the requeued run starts. Else pgid,
#   which misses processes that left the job's process group (torchrun's workers do): the tests
#   then also kill what they started, by an environment tag.
# - KillWait=5: SIGTERM -> SIGKILL grace for cancelled jobs (Slurm's default is 30 s).
# - MinJobAge=3600: without an accounting database, `scontrol show job` is how a test reads a
#   finished job's state, exit code and restart count; keep finished jobs visible for an hour.
# - sched_interval=1,bf_interval=1: a submitted or requeued job starts within a second or two.
#
# Knobs: ET_SLURM_DIR (state, spool, logs; default /var/tmp/elastic-train-slurm),
#        ET_SLURM_TIMEOUT (seconds to wait for the node; default 60).
set -euo pipefail

DIR=${ET_SLURM_DIR:-/var/tmp/elastic-train-slurm}
TIMEOUT=${ET_SLURM_TIMEOUT:-60}
CONF=/etc/slurm/slurm.conf  # the default path: sbatch/squeue/scontrol find it without SLURM_CONF
TAG="# written by elastic-train .ci/local-slurm.sh"
PACKAGES=(slurmctld slurmd slurm-client munge)

say() { printf '[local-slurm %(%T)T] %s\n' -1 "$*" >&2; }
fail() { say "ERROR: $*"; exit 1; }
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
controller_answers() { command -v scontrol >/dev/null && timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }
node_name() { local n; n=$(hostname -s 2>/dev/null || uname -n); echo "${n%%.*}"; }

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || fail "Slurm is not installed and apt-get is missing: install ${missing[*]} by hand"
  say "installing ${missing[*]}"
  # Keep the packages' init scripts from starting daemons with the distribution's config.
  local policy_added=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && policy_added=1
  fi
  local ok=0
  # shellcheck disable=SC2015  # a failed install is retried once after refreshing the lists
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null && ok=1 ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null && ok=1; } || true
  [ "$policy_added" = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ "$ok" = 1 ] || fail "apt-get install ${missing[*]} failed"
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
    else head -c 1024 /dev/urandom >/etc/munge/munge.key; fi
  fi
  chown -R munge:munge /etc/munge && chmod 0700 /etc/munge && chmod 0600 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
  rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
  runuser -u munge -- /usr/sbin/munged
  local _
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || fail "munged does not answer (see /var/log/munge/munged.log)"
  cp /run/munge/munged.pid "$DIR/run/munged.pid"  # ours: `stop` stops it
}

proctrack() {
  local freezer=/sys/fs/cgroup/freezer probe
  if [ "$(stat -fc %T "$freezer" 2>/dev/null)" = cgroupfs ]; then
    probe="$freezer/.elastic-train-probe.$$"
    if mkdir "$probe" 2>/dev/null; then rmdir "$probe"; echo cgroup; return; fi
  fi
  echo pgid
}

write_config() {
  local node=$1 hw cpus mem track
  hw=$(slurmd -C 2>/dev/null | head -n1)  # e.g. "NodeName=vm CPUs=2 ... RealMemory=24105"
  cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw"); cpus=${cpus:-$(nproc)}
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
  [ -n "$mem" ] || mem=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024))
  mem=$((mem * 9 / 10))  # under the real figure, or slurmd drains the node as "Low RealMemory"
  track=$(proctrack)
  if [ -e "$CONF" ] && ! grep -qF "$TAG" "$CONF"; then
    cp -a "$CONF" "$CONF.before-elastic-train"
    say "kept the existing $CONF as $CONF.before-elastic-train"
  fi
  mkdir -p /etc/slurm
  if [ "$track" = cgroup ]; then
    if [ -e /etc/slurm/cgroup.conf ] && ! grep -qF "$TAG" /etc/slurm/cgroup.conf; then
      cp -a /etc/slurm/cgroup.conf /etc/slurm/cgroup.conf.before-elastic-train
    fi
    printf '%s\nCgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n' \
      "$TAG" >/etc/slurm/cgroup.conf
  fi
  cat >"$CONF" <<EOF
$TAG
ClusterName=elastic-train-ci
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
CredType=cred/munge
ProctrackType=proctrack/$track
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
JobRequeue=1
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=3600
MailProg=/bin/true
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  say "config: node $node, $cpus CPUs, ${mem} MB, proctrack/$track"
}

wait_idle() {
  local node=$1 deadline state=""
  deadline=$(($(date +%s) + TIMEOUT))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    state=$(sinfo -h -n "$node" -o '%t' 2>/dev/null | head -n1 || true)
    case $state in
      idle | mix | alloc) return 0 ;;
      down* | drain* | drng* | fail*) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
    esac
    running "$DIR/run/slurmctld.pid" || fail "slurmctld died: $(tail -n 5 "$DIR/log/slurmctld.log")"
    running "$DIR/run/slurmd.pid" || fail "slurmd died: $(tail -n 5 "$DIR/log/slurmd.log")"
    sleep 0.5
  done
  fail "node $node not idle after ${TIMEOUT}s (state '$state'); logs in $DIR/log"
}

start() {
  [ "$(id -u)" = 0 ] || fail "run as root: it installs packages and starts system daemons"
  if controller_answers && ! running "$DIR/run/slurmctld.pid"; then
    say "a Slurm controller already answers; using it as it is"
    return 0
  fi
  install_packages
  mkdir -p "$DIR"/{state,spool,log,run}
  start_munge
  local node
  node=$(node_name)
  if running "$DIR/run/slurmctld.pid" && running "$DIR/run/slurmd.pid"; then
    say "already running"
  else
    write_config "$node"
    running "$DIR/run/slurmctld.pid" || slurmctld -i || fail "slurmctld: $(tail -n 5 "$DIR/log/slurmctld.log")"
    running "$DIR/run/slurmd.pid" || slurmd -N "$node" || fail "slurmd: $(tail -n 5 "$DIR/log/slurmd.log")"
  fi
  wait_idle "$node"
  say "up: $(sinfo -h -o '%P %a %D %t %N')"
}

stop_daemon() {  # name pidfile
  local pid
  running "$2" || { rm -f "$2"; return 0; }
  pid=$(cat "$2")
  say "stopping $1 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  local _
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    say "$1 ignored SIGTERM for 10 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$2"
}

stop() {
  if running "$DIR/run/slurmctld.pid"; then
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      say "cancelling jobs $jobs"
      # shellcheck disable=SC2086  # one word per job id
      scancel $jobs 2>/dev/null || true
      local _
      for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
  fi
  stop_daemon slurmd "$DIR/run/slurmd.pid"
  stop_daemon slurmctld "$DIR/run/slurmctld.pid"
  stop_daemon munged "$DIR/run/munged.pid"
  say "stopped"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) if controller_answers; then sinfo; squeue; else say "no Slurm controller answers"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
