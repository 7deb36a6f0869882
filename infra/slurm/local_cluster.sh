#!/usr/bin/env bash
# A real multi-node Slurm cluster on this one machine, for the tests and the demo: slurmctld,
# three slurmd daemons standing for nodes n1..n3 (`slurmd -N`), and munge, from Debian's packages
# (installed here if missing). Everything lives in one state directory.
#
#   infra/slurm/local_cluster.sh up   [DIR]   start (or reuse) it; prints `export SLURM_CONF=...`
#   infra/slurm/local_cluster.sh down [DIR]   stop slurmctld, every slurmd, and munged if up started it
#
# DIR defaults to data/slurm in the repository. Needs root (the daemons run as root here, as
# a throwaway test cluster).
set -euo pipefail

action=${1:-up}
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=$(mkdir -p "${2:-$root/data/slurm}" && cd "${2:-$root/data/slurm}" && pwd)
conf=$dir/slurm.conf
export SLURM_CONF=$conf

answers() { timeout 10 scontrol ping 2>/dev/null | grep -q UP; }

install() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && return
    command -v apt-get >/dev/null || { echo "local_cluster: Slurm is not installed and apt-get is not here" >&2; exit 2; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
    [ -f /etc/munge/munge.key ] || mungekey --create
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge && chown munge:munge /run/munge
    # Started here, it is ours to stop with the cluster; one already answering is left alone (a
    # munged process alone is not enough: a killed one left as a zombie still matches pgrep).
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 \
        || { su -s /bin/sh munge -c /usr/sbin/munged && touch "$dir/munged.ours"; }
}

write_conf() {
    mkdir -p "$dir/state" "$dir/log"
    host=$(hostname)
    # Memory per node: what this machine has, split over three nodes with room left for the host.
    memory=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) / 4 ))
    cat > "$conf" <<CONF
ClusterName=ckptops-local
SlurmctldHost=$host
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName=n[1-3] NodeHostname=$host NodeAddr=127.0.0.1 Port=17001-17003 CPUs=2 RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
}

up() {
    if [ -f "$conf" ] && answers; then
        echo "export SLURM_CONF=$conf"
        return
    fi
    install
    start_munge
    write_conf
    # -c: a fresh start forgets the last run's jobs and node states (a drained node stays drained).
    /usr/sbin/slurmctld -c -f "$conf"
    for node in n1 n2 n3; do /usr/sbin/slurmd -f "$conf" -N "$node"; done
    for _ in $(seq 120); do
        [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle')" = 3 ] && { echo "export SLURM_CONF=$conf"; return; }
        sleep 0.5
    done
    echo "local_cluster: the nodes did not come up; see $dir/log" >&2
    sinfo -N >&2 || true
    exit 1
}

down() {
    [ -f "$conf" ] || return 0
    timeout 30 scontrol shutdown 2>/dev/null || true
    pids=""
    for pidfile in "$dir"/slurmctld.pid "$dir"/slurmd-*.pid; do
        [ -f "$pidfile" ] && pids="$pids $(cat "$pidfile")"
    done
    [ -n "$pids" ] && kill $pids 2>/dev/null || true
    # munged last, once the daemons are gone: a slurmd that loses munge mid-shutdown hangs.
    for _ in $(seq 40); do
        alive=""
        for pid in $pids; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ -z "$alive" ] && break
        sleep 0.25
    done
    if [ -f "$dir/munged.ours" ]; then
        pkill -x munged || true
        # Gone before this returns: an `up` right after must not find a munged still exiting.
        for _ in $(seq 40); do pgrep -x munged >/dev/null || break; sleep 0.25; done
        rm -f "$dir/munged.ours"
    fi
}

case $action in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down [DIR]" >&2; exit 2 ;;
esac
