#!/usr/bin/env bash
# A throw-away two-node SLURM cluster on this machine, for tests.
#
#   cluster.sh start STATE_DIR [OWNER_PID]   render slurm.conf.in into STATE_DIR, start munged, slurmctld and
#                                            two slurmd (nodeA, nodeB); return once both nodes are idle
#   cluster.sh stop STATE_DIR                cancel every job, stop the daemons and anything their jobs left
#   cluster.sh env STATE_DIR                 print `export SLURM_CONF=...` for using the cluster
#
# Everything (config, MUNGE key and socket, state, spool, logs, pid files) lives in STATE_DIR, which
# should be short (/tmp/vime-slurm.XXXX: the MUNGE socket path must stay under 108 bytes). Daemons run
# in the foreground of their own sessions and are tracked by pid, so `stop` never touches a system
# SLURM or MUNGE. With OWNER_PID a watchdog stops the cluster once that process is gone, so the daemons
# cannot outlive the test that started them, even if it is killed. `start` cleans up after itself when
# it fails. Needs root and the programs from tests/slurm/install.sh.
set -uo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "slurm-cluster: $*" >&2; exit 1; }

free_port() {  # a TCP port nothing listens on (random, so parallel clusters do not collide)
  # Below the kernel's ephemeral range: a port there can be the local end of some outgoing connection,
  # which a connect test does not see but which makes slurmctld's bind fail with "Address already in use".
  local port low
  low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  for _ in $(seq 100); do
    port=$((20000 + RANDOM % (low - 20000)))
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || { echo "$port"; return 0; }
  done
  die "no free TCP port found"
}

spawn() {  # spawn NAME COMMAND...: start a foreground daemon in its own session, remember its pid
  local name=$1; shift
  setsid "$@" >>"$STATE/log/$name.out" 2>&1 </dev/null &
  echo $! >"$STATE/pids/$name"
}

pid_of() { cat "$STATE/pids/$1" 2>/dev/null; }
running() {  # running PID: the process exists and is not a zombie (exited, waiting to be reaped)
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}
alive() { local pid; pid=$(pid_of "$1") && [ -n "$pid" ] && running "$pid"; }
daemons_gone() { local name; for name in slurmd-nodeA slurmd-nodeB slurmctld munged; do alive "$name" && return 1; done; return 0; }

wait_until() {  # wait_until SECONDS WHAT COMMAND...: poll COMMAND every 0.5 s
  local seconds=$1 what=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt "$deadline" ] || { echo "slurm-cluster: timed out after ${seconds}s waiting for $what" >&2; return 1; }
    sleep 0.5
  done
}

nodes_idle() { [ "$(sinfo -h -N -t idle -o '%N' | sort -u | wc -l)" -eq 2 ]; }

show_logs() {
  for f in "$STATE"/log/*; do echo "----- $f"; tail -n 20 "$f"; done >&2
}

# Every process started for this cluster carries SLURM_CONF=$STATE/slurm.conf in its environment
# (daemons, slurmstepd, job tasks): that finds leftovers without guessing by process name.
cluster_pids() {
  local marker="SLURM_CONF=$STATE/slurm.conf" self=$$ pid
  for env in /proc/[0-9]*/environ; do
    pid=${env#/proc/}; pid=${pid%/environ}
    [ "$pid" = "$self" ] || [ "$pid" = "$BASHPID" ] && continue
    [ "$pid" = "$(pid_of watchdog)" ] && continue
    running "$pid" && tr '\0' '\n' 2>/dev/null <"$env" | grep -qxF "$marker" && echo "$pid"
  done
}

start() {
  [ "$EUID" -eq 0 ] || die "must run as root"
  for prog in munged mungekey slurmctld slurmd sinfo scontrol; do
    command -v "$prog" >/dev/null || die "$prog not found: run tests/slurm/install.sh first"
  done
  mkdir -p "$STATE"/{munge,ctld,spool,log,pids} || die "cannot create $STATE"
  chmod 0755 "$STATE"
  export SLURM_CONF="$STATE/slurm.conf"
  trap 'echo "slurm-cluster: start failed; stopping what was started" >&2; show_logs; stop; exit 1' ERR
  set -E

  sed -e "s|@STATE@|$STATE|g" -e "s|@HOST@|$(hostname -s)|g" -e "s|@CTLD_PORT@|$(free_port)|" \
      -e "s|@NODEA_PORT@|$(free_port)|" -e "s|@NODEB_PORT@|$(free_port)|" \
      "$here/slurm.conf.in" >"$SLURM_CONF"

  # MUNGE: a fresh key and a private socket (slurm.conf's AuthInfo points there).
  mungekey --create --keyfile="$STATE/munge/munge.key" >/dev/null
  spawn munged munged --foreground --socket="$STATE/munge/munge.socket" --key-file="$STATE/munge/munge.key" \
    --log-file="$STATE/log/munged.log" --pid-file="$STATE/munge/munged.pid" --seed-file="$STATE/munge/seed"
  wait_until 20 "munged" bash -c "munge -n -S '$STATE/munge/munge.socket' | unmunge -S '$STATE/munge/munge.socket'"

  spawn slurmctld slurmctld -D -c -f "$SLURM_CONF"
  wait_until 30 "slurmctld to answer" scontrol ping
  spawn slurmd-nodeA slurmd -D -N nodeA -f "$SLURM_CONF"
  spawn slurmd-nodeB slurmd -D -N nodeB -f "$SLURM_CONF"
  wait_until 60 "nodeA and nodeB to become idle" nodes_idle

  if [ -n "${OWNER:-}" ]; then
    # Watchdog: stop the cluster as soon as the owner is gone (killed tests must not leak daemons).
    # Without SLURM_CONF in its environment, so `stop` does not take its `sleep` for a leftover.
    env -u SLURM_CONF setsid bash "${BASH_SOURCE[0]}" watchdog "$STATE" "$OWNER" >>"$STATE/log/watchdog.out" 2>&1 </dev/null &
    echo $! >"$STATE/pids/watchdog"
  fi
  trap - ERR
  echo "slurm-cluster: up: $(sinfo -h -N -o '%N %t %c' | tr '\n' ' ')(SLURM_CONF=$SLURM_CONF)"
}

stop() {
  export SLURM_CONF="$STATE/slurm.conf"
  [ -f "$SLURM_CONF" ] || { echo "slurm-cluster: nothing to stop in $STATE"; return 0; }
  if alive slurmctld; then
    # Let SLURM end the jobs first (SIGTERM to every task, SIGKILL after KillWait).
    squeue -h -o '%A' 2>/dev/null | xargs -r scancel 2>/dev/null
    wait_until 30 "jobs to end" bash -c '[ -z "$(squeue -h -o %A)" ]' || true
  fi
  local name pid
  for name in slurmd-nodeA slurmd-nodeB slurmctld munged; do
    alive "$name" && kill -TERM "$(pid_of "$name")" 2>/dev/null
  done
  wait_until 15 "daemons to exit" daemons_gone || true
  # Anything left (daemons that ignored SIGTERM, slurmstepd, job tasks): SIGKILL.
  for pid in $(for name in slurmd-nodeA slurmd-nodeB slurmctld munged; do alive "$name" && pid_of "$name"; done) $(cluster_pids); do
    kill -KILL "$pid" 2>/dev/null && echo "slurm-cluster: killed leftover pid $pid ($(tr '\0' ' ' 2>/dev/null </proc/"$pid"/cmdline | cut -c1-80))"
  done
  if [ "${1:-}" != from-watchdog ] && alive watchdog; then
    # The watchdog is its own session (setsid): end it with its `sleep`, and return only once it is
    # gone (bash acts on a signal only after the sleep it waits for, up to 2 s later).
    kill -TERM -- "-$(pid_of watchdog)" 2>/dev/null || kill -TERM "$(pid_of watchdog)" 2>/dev/null
    wait_until 10 "the watchdog to exit" bash -c "! kill -0 $(pid_of watchdog) 2>/dev/null || grep -q '^[^)]*) Z' /proc/$(pid_of watchdog)/stat" || true
  fi
  echo "slurm-cluster: stopped ($STATE)"
}

watchdog() {
  while kill -0 "$OWNER" 2>/dev/null; do sleep 2; done
  echo "slurm-cluster: owner $OWNER is gone; stopping the cluster"
  stop from-watchdog
}

cmd=${1:-}; STATE=${2:-}
[ -n "$cmd" ] && [ -n "$STATE" ] || die "usage: cluster.sh start|stop|env STATE_DIR [OWNER_PID]"
STATE="$(cd "$(dirname "$STATE")" && pwd)/$(basename "$STATE")"
OWNER=${3:-}
case "$cmd" in
  start) start ;;
  stop) stop ;;
  watchdog) watchdog ;;
  env) echo "export SLURM_CONF=$STATE/slurm.conf" ;;
  *) die "unknown command $cmd (start|stop|env)" ;;
esac
