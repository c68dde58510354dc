#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (slurmctld + slurmd on localhost, CPUs as the resource),
# for tests and CI: `bash launchers/slurm_local_cluster.sh`. Idempotent: installs slurm-wlm and munge
# with apt-get if missing, writes /etc/slurm/slurm.conf, starts munged, slurmctld and slurmd, and waits
# until `sinfo` shows the node idle. Exits non-zero with the reason if it cannot. Needs root.
set -u
say() { echo "[slurm_local_cluster] $*"; }
die() { echo "[slurm_local_cluster] FAILED: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (installs packages, writes /etc/slurm, starts daemons as root)"
NODE="$(hostname -s)"
CPUS="$(nproc)"
MEM_MB="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  say "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null 2>&1 || die "apt-get update failed (no network?)"
  apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1 || die "apt-get install slurm-wlm munge failed"
fi

# ---- munge ----
mkdir -p /etc/munge /var/log/munge /var/lib/munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key >/dev/null 2>&1 || true; fi
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /var/log/munge /var/lib/munge /run/munge
chmod 0700 /etc/munge /var/log/munge /var/lib/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged --force || die "munged did not start"
  for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.5; done
  munge -n | unmunge >/dev/null 2>&1 || die "munge credentials do not round-trip"
fi

# ---- slurm.conf ----
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
CONF=/etc/slurm/slurm.conf
cat > "$CONF.new" <<CONF
# written by launchers/slurm_local_cluster.sh: one node, this machine
ClusterName=scalelab
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire seconds before it may start again (default 120); also the lifetime of a job
# step's credential, which slurmd checks when the step starts (within a second here)
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# a requeued job, eligible again once cred_expire has passed, is started only by the periodic pass of the main
# scheduler (no event wakes it): every second on this one-node cluster, not every 60 s (the default)
SchedulerParameters=sched_interval=1
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# submitit's pre-emption test requeues jobs and signals them before their time limit
JobRequeue=1
KillWait=5
MinJobAge=300
SlurmdTimeout=300
InactiveLimit=0
NodeName=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
if ! cmp -s "$CONF.new" "$CONF"; then mv "$CONF.new" "$CONF"; RESTART=1; else rm -f "$CONF.new"; RESTART=0; fi
# Debian's slurm-wlm also reads /etc/slurm-llnl on older releases
[ -d /etc/slurm-llnl ] && ln -sf "$CONF" /etc/slurm-llnl/slurm.conf

if [ "$RESTART" = 1 ]; then  # a new configuration: restart the daemons this script started
  for pidf in /run/slurm/slurmd.pid /run/slurm/slurmctld.pid; do
    if [ -f "$pidf" ]; then
      pid="$(cat "$pidf")"; kill "$pid" 2>/dev/null
      for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
  done
fi
if ! scontrol ping 2>/dev/null | grep -q UP; then
  /usr/sbin/slurmctld || die "slurmctld did not start: $(tail -5 /var/log/slurm/slurmctld.log 2>/dev/null)"
fi
if ! { [ -f /run/slurm/slurmd.pid ] && kill -0 "$(cat /run/slurm/slurmd.pid)" 2>/dev/null; }; then
  /usr/sbin/slurmd || die "slurmd did not start: $(tail -5 /var/log/slurm/slurmd.log 2>/dev/null)"
fi

for _ in $(seq 60); do
  state="$(sinfo -h -n "$NODE" -o '%t' 2>/dev/null | head -1)"
  case "$state" in
    idle|mix|alloc) say "up: $(sinfo -h -o '%P %N %t %c CPUs')"; exit 0 ;;
    down*|drain*) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 ;;
  esac
  sleep 1
done
die "node $NODE not idle after 60 s (state '${state:-none}'); see /var/log/slurm/slurmctld.log and slurmd.log"
