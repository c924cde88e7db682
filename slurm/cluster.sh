#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine: for the test suite, CI, and trying the
# Slurm launcher without a cluster.
#
#   slurm/cluster.sh start    install the Debian packages if missing (root, apt-get), write the
#                             configs, start munge, MariaDB, slurmdbd, slurmctld and slurmd,
#                             wait until the node is idle and sacct answers
#   slurm/cluster.sh stop     cancel the cluster's jobs, stop exactly the daemons `start`
#                             started (by their pid files), remove the /etc/slurm link
#   slurm/cluster.sh status   daemons, node state, queue (exit 0 only when the cluster is up)
#   slurm/cluster.sh env      print the `export SLURM_CONF=...` clients need
#
# Everything it writes (configs, logs, pid files, spool, the accounting database, the munge
# key) lives in $TRAINER3D_SLURM_DIR (default /tmp/trainer3d-slurm); the only file outside
# is a /etc/slurm/slurm.conf symlink to it, made when none exists, so that plain `sbatch`
# works. Exit status: 0 done; 3 the cluster cannot run here (not root, no apt-get, the
# install failed) — the tests skip on 3 unless CI is set; 1 any other failure.
#
# Settings measured on this machine kind (docs/FACTS): CPUs=8 on the node line with
# SlurmdParameters=config_overrides lets 4-8 tasks run on 2 cores; AuthInfo cred_expire=10
# lets a requeued job restart after ~10 s instead of 120 s; ReturnToService=2 brings the node
# back when slurmd restarts; proctrack/linuxproc and task/none need no cgroups or systemd.
# Without slurmdbd `sacct` fails and submitit cannot tell when a job ended, hence MariaDB.
set -euo pipefail

STATE=${TRAINER3D_SLURM_DIR:-/tmp/trainer3d-slurm}
DB_PORT=${TRAINER3D_SLURM_DB_PORT:-16819}
CLUSTER=trainer3d
HOST=$(hostname -s)
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd slurm-wlm-mysql-plugin mariadb-server)
NEEDED=(slurmctld slurmd slurmdbd sbatch sacct sacctmgr munged mariadbd mariadb-install-db)
DB_PASS=trainer3d-local   # a throw-away account in a database that listens on 127.0.0.1 only
ETC_LINK=/etc/slurm/slurm.conf
export SLURM_CONF=$STATE/etc/slurm.conf
export PATH=$PATH:/usr/sbin:/sbin

log() { printf '%s cluster.sh: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit "${2:-1}"; }

# ------------------------------------------------------------------ install

install_packages() {
    local missing=()
    for bin in "${NEEDED[@]}"; do command -v "$bin" >/dev/null || missing+=("$bin"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || die "not root, and Slurm is not installed (missing: ${missing[*]})" 3
    command -v apt-get >/dev/null || die "no apt-get to install Slurm (missing: ${missing[*]})" 3
    log "installing ${PACKAGES[*]} (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    # The image's policy-rc.d refuses service starts, so nothing starts behind our back.
    if ! apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >"$STATE/log/apt.log" 2>&1; then
        log "install failed; refreshing the package lists and retrying"
        apt-get update -q >>"$STATE/log/apt.log" 2>&1 || true
        apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >>"$STATE/log/apt.log" 2>&1 \
            || die "apt-get install failed (see $STATE/log/apt.log)" 3
    fi
}

# ------------------------------------------------------------------ configuration

write_if_changed() {  # write stdin to $1 (mode $2) unless identical
    local tmp
    tmp=$(mktemp "$1.XXXX")
    cat >"$tmp"
    chmod "$2" "$tmp"
    if cmp -s "$tmp" "$1" 2>/dev/null; then rm -f "$tmp"; else mv "$tmp" "$1"; log "wrote $1"; fi
}

write_configs() {
    local mem_mb
    mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    write_if_changed "$STATE/etc/slurm.conf" 644 <<EOF
# Written by slurm/cluster.sh for a one-node dev cluster; regenerated on every start.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/d
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=300
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
JobCompType=jobcomp/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=8 RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    # slurmdbd reads slurmdbd.conf next to \$SLURM_CONF and refuses one others can read.
    write_if_changed "$STATE/etc/slurmdbd.conf" 600 <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    if [ ! -e "$ETC_LINK" ] && [ -d /etc/slurm ]; then
        ln -s "$STATE/etc/slurm.conf" "$ETC_LINK" && log "linked $ETC_LINK -> $STATE/etc/slurm.conf"
    fi
}

# ------------------------------------------------------------------ daemons

alive() {  # alive NAME: the pid in run/NAME.pid is running
    local pid
    pid=$(cat "$STATE/run/$1.pid" 2>/dev/null) || return 1
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || return 1
        sleep 0.5
    done
    log "$what"
}

start_munge() {
    alive munged && return 0
    install -d -o munge -g munge -m 755 "$STATE/munge"
    if [ ! -s "$STATE/munge/munge.key" ]; then
        runuser -u munge -- mungekey --create --keyfile="$STATE/munge/munge.key" \
            || die "mungekey failed"
    fi
    log "starting munged"
    # The default socket: sacctmgr and sacct ignore AuthInfo's socket= (seen with 22.05).
    install -d -o munge -g munge -m 755 /run/munge
    runuser -u munge -- munged --num-threads=10 --key-file="$STATE/munge/munge.key" \
        --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
        --seed-file="$STATE/munge/munged.seed" || die "munged did not start (see $STATE/munge/munged.log)"
    wait_for 10 "munged up" test -s "$STATE/munge/munged.pid" || die "munged wrote no pid file"
    ln -sf "$STATE/munge/munged.pid" "$STATE/run/munged.pid"
}

sql() { mariadb --no-defaults --socket="$STATE/run/mariadb.sock" -u root -e "$1"; }

start_mariadb() {
    alive mariadbd && return 0
    if [ ! -d "$STATE/mysql/mysql" ]; then
        log "creating the accounting database in $STATE/mysql"
        mariadb-install-db --no-defaults --datadir="$STATE/mysql" --user=root --skip-test-db \
            >"$STATE/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed (see $STATE/log/mariadb-install.log)"
    fi
    log "starting mariadbd on 127.0.0.1:$DB_PORT"
    # Small buffers: this database holds a few hundred job records. The lock wait is what
    # slurmdbd asks for (it warns below 900 s).
    setsid mariadbd --no-defaults --user=root --datadir="$STATE/mysql" --socket="$STATE/run/mariadb.sock" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$STATE/run/mariadbd.pid" \
        --log-error="$STATE/log/mariadb.log" --innodb-buffer-pool-size=32M --performance-schema=OFF \
        --skip-name-resolve --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
    wait_for 60 "mariadbd up" sql "SELECT 1" || die "mariadbd did not come up (see $STATE/log/mariadb.log)"
    sql "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
         GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "could not create the slurm database user"
}

start_slurmdbd() {
    alive slurmdbd && return 0
    log "starting slurmdbd"
    slurmdbd || die "slurmdbd did not start (see $STATE/log/slurmdbd.log)"
    wait_for 30 "slurmdbd answers" sacctmgr -n show cluster || die "slurmdbd does not answer (see $STATE/log/slurmdbd.log)"
    if [ -z "$(sacctmgr -n -P show cluster format=cluster where cluster=$CLUSTER)" ]; then
        log "registering cluster $CLUSTER and account trainer3d in the accounting database"
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
        sacctmgr -i add account trainer3d cluster="$CLUSTER" description=dev organization=dev >/dev/null
        sacctmgr -i add user root account=trainer3d cluster="$CLUSTER" >/dev/null
    fi
}

start_slurmctld() {
    alive slurmctld && return 0
    log "starting slurmctld"
    slurmctld || die "slurmctld did not start (see $STATE/log/slurmctld.log)"
}

start_slurmd() {
    alive slurmd && return 0
    log "starting slurmd"
    slurmd || die "slurmd did not start (see $STATE/log/slurmd.log)"
}

node_state() { sinfo -h -N -n "$HOST" -o %t 2>/dev/null | head -1; }

node_up() {  # idle, or running jobs; never down, drained or not responding
    case "$(node_state)" in
        idle | mix | alloc | comp) return 0 ;;
        *) return 1 ;;
    esac
}

wait_until_ready() {
    if ! wait_for 30 "node $HOST is up" node_up; then
        local state
        state=$(node_state)
        case "$state" in
            down* | drain* | drng*)  # left over from an earlier run that stopped badly
                log "node is $state; resuming it"
                scontrol update nodename="$HOST" state=resume || true
                wait_for 30 "node $HOST is up" node_up || die "node stays $(node_state) (see $STATE/log/slurmd.log)" ;;
            *) die "node is '$state' after 30 s (see $STATE/log/slurmctld.log, $STATE/log/slurmd.log)" ;;
        esac
    fi
    log "node $HOST: $(node_state)"
    wait_for 30 "sacct answers" sacct -n -X --starttime=now || die "sacct does not answer (see $STATE/log/slurmdbd.log)"
}

cmd_start() {
    local started=$SECONDS
    mkdir -p "$STATE"/{etc,log,run,spool/ctld,spool/d}
    install_packages
    write_configs
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld
    start_slurmd
    wait_until_ready
    log "cluster $CLUSTER up in $((SECONDS - started)) s; clients need: export SLURM_CONF=$SLURM_CONF"
}

stop_daemon() {  # stop_daemon NAME: TERM, then KILL after 15 s; only the pid its pid file names
    local pid
    alive "$1" || { rm -f "$STATE/run/$1.pid"; return 0; }
    pid=$(cat "$STATE/run/$1.pid")
    log "stopping $1 (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then
        log "$1 ignored TERM; killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$STATE/run/$1.pid"
}

cmd_stop() {
    if alive slurmctld; then
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
        if [ -n "${jobs// /}" ]; then
            log "cancelling jobs $jobs"
            scancel $jobs 2>/dev/null || true
            wait_for 30 "jobs ended" test -z "$(squeue -h -o %i 2>/dev/null)" || log "jobs still listed; stopping anyway"
        fi
    fi
    stop_daemon slurmd
    stop_daemon slurmctld
    stop_daemon slurmdbd
    stop_daemon mariadbd
    stop_daemon munged
    if [ -L "$ETC_LINK" ] && [ "$(readlink "$ETC_LINK")" = "$STATE/etc/slurm.conf" ]; then
        rm -f "$ETC_LINK" && log "removed $ETC_LINK"
    fi
    log "cluster stopped (state kept in $STATE; delete it for a fresh start)"
}

cmd_status() {
    local up=0
    for d in munged mariadbd slurmdbd slurmctld slurmd; do
        if alive "$d"; then echo "$d: running (pid $(cat "$STATE/run/$d.pid"))"; else echo "$d: stopped"; up=1; fi
    done
    if [ $up -eq 0 ]; then
        sinfo -N -o "%N %t %c %m" || up=1
        squeue || up=1
        node_up || up=1
    fi
    return $up
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$SLURM_CONF" ;;
    *) echo "usage: $0 start|stop|status|env   (state in \$TRAINER3D_SLURM_DIR, default /tmp/trainer3d-slurm)" >&2; exit 2 ;;
esac
