#!/usr/bin/env bash
# A real Slurm cluster on this machine: for the test suite, CI, and trying the Slurm
# launcher without a cluster. Two compute nodes by default, each in network + UTS + mount
# namespaces of its own with its own hostname and address (slurm/nodes.sh); one node on the
# host itself where namespaces cannot be made (or with TRAINER3D_SLURM_NODES=1).
#
#   slurm/cluster.sh announce one line saying what `start` will install and create here, or
#                             why it cannot run (exit 3); changes nothing
#   slurm/cluster.sh start    install the Debian packages if missing (root, apt-get), write the
#                             configs, start munge, MariaDB, slurmdbd, slurmctld and the
#                             slurmd(s), wait until every node is idle and sacct answers
#   slurm/cluster.sh stop     cancel the cluster's jobs, stop exactly the daemons `start`
#                             started (by their pid files), remove the namespaces, the bridge
#                             and the /etc/slurm link
#   slurm/cluster.sh status   daemons, node states, queue (exit 0 only when the cluster is up)
#   slurm/cluster.sh env      print the `export SLURM_CONF=...` clients need
#   slurm/cluster.sh kill-node t3d-n2    lose a node: SIGKILL every process in its namespace
#                                        (slurmd, job steps, ranks), as a power cut would
#   slurm/cluster.sh start-node t3d-n2   bring it back (its slurmd again; the node returns)
#
# Everything it writes (configs, logs, pid files, spool, the accounting database, the munge
# key) lives in $TRAINER3D_SLURM_DIR (default /tmp/trainer3d-slurm); the only file outside
# is a /etc/slurm/slurm.conf symlink to it, made when none exists, so that plain `sbatch`
# works. Exit status: 0 done; 3 the cluster cannot run here (not root, no apt-get, the
# install failed) - the tests skip on 3 unless CI is set; 1 any other failure.
#
# Settings measured on a 2-core machine: CPUs=8 on the node line with
# SlurmdParameters=config_overrides lets 4-8 tasks run on 2 cores; AuthInfo cred_expire=5
# (Slurm's minimum) holds a requeued job back 6 s instead of 121 s, and a main scheduling
# pass every second (sched_interval=1; default 60) starts it when that hold ends: nothing else
# wakes the scheduler then, so a requeued job sat pending up to a minute (restart after a
# requeue: 24-41 s before, 5.6 s after); ReturnToService=2 brings the node back when slurmd
# restarts; proctrack/linuxproc and task/none need no cgroups or systemd.
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
NODES=${TRAINER3D_SLURM_NODES:-2}
export SLURM_CONF=$STATE/etc/slurm.conf
export PATH=$PATH:/usr/sbin:/sbin

log() { printf '%s cluster.sh: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit "${2:-1}"; }
# shellcheck source=slurm/nodes.sh
. "$(dirname "${BASH_SOURCE[0]}")/nodes.sh"

choose_nodes() {  # two namespace nodes where namespaces work, else one node on the host
    rm -f "$STATE/run/one-node-reason"
    if [ "$NODES" -gt 1 ] && ! netns_usable; then
        echo "network namespaces cannot be made here (needs root and ip netns)" >"$STATE/run/one-node-reason"
        log "$(cat "$STATE/run/one-node-reason"): one node on the host instead of $NODES"
        NODES=1
    fi
}

node_names() {  # the NodeName of every compute node
    if [ "$NODES" -eq 1 ]; then echo "$HOST"; else for k in $(seq "$NODES"); do node_name "$k"; done; fi
}

# ------------------------------------------------------------------ install

missing_programs() { for bin in "${NEEDED[@]}"; do command -v "$bin" >/dev/null || echo "$bin"; done; }

cmd_announce() {  # one line on stdout saying what `start` will do to this machine; changes nothing
    local missing
    missing=$(missing_programs | tr '\n' ' ')
    if [ -n "$missing" ] && { [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; }; then
        echo "Slurm tier: skipped, Slurm is not installed (missing: ${missing% }) and this is not root with apt-get"
        exit 3
    fi
    local what="starts munge, MariaDB, slurmdbd, slurmctld and slurmd as root, with a bridge ($BRIDGE) and"
    what="$what network namespaces for its nodes, state in $STATE; stopped at the end (-m 'not slurm' skips it)"
    if [ -n "$missing" ]; then
        echo "Slurm tier: apt-get installs ${PACKAGES[*]} (missing: ${missing% }), then $what"
    else
        echo "Slurm tier: $what"
    fi
}

install_packages() {
    local missing=()
    for bin in $(missing_programs); do missing+=("$bin"); done
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

node_lines() {  # slurm.conf's NodeName and PartitionName lines
    local mem_mb k
    mem_mb=$(awk -v n="$NODES" '/MemTotal/ {print int($2 / 1024 * 0.9 / n)}' /proc/meminfo)
    if [ "$NODES" -eq 1 ]; then
        echo "NodeName=$HOST NodeAddr=127.0.0.1 CPUs=8 RealMemory=$mem_mb State=UNKNOWN"
    else
        for k in $(seq "$NODES"); do
            echo "NodeName=$(node_name "$k") NodeAddr=$(node_addr "$k") CPUs=8 RealMemory=$mem_mb State=UNKNOWN"
        done
    fi
    echo "PartitionName=debug Nodes=$(node_names | paste -sd,) Default=YES MaxTime=INFINITE State=UP"
}

write_configs() {
    local ctld_addr=127.0.0.1
    [ "$NODES" -gt 1 ] && ctld_addr=$CTLD_ADDR
    write_if_changed "$STATE/etc/slurm.conf" 644 <<EOF
# Written by slurm/cluster.sh for a dev cluster of $NODES node(s); regenerated on every start.
ClusterName=$CLUSTER
SlurmctldHost=$HOST($ctld_addr)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/d-%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=300
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
JobCompType=jobcomp/none
$(node_lines)
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
    if [ "$NODES" -gt 1 ]; then
        write_hosts
        make_network
        for k in $(seq "$NODES"); do start_node "$k"; done
        return 0
    fi
    alive "slurmd-$HOST" && return 0
    log "starting slurmd"
    slurmd || die "slurmd did not start (see $STATE/log/slurmd-$HOST.log)"
}

node_state() { sinfo -h -N -n "$1" -o %t 2>/dev/null | head -1; }

nodes_up() {  # every node idle, or running jobs; never down, drained or not responding
    local name
    for name in $(node_names); do
        case "$(node_state "$name")" in
            idle | mix | alloc | comp) ;;
            *) return 1 ;;
        esac
    done
}

wait_until_ready() {
    local name state
    if ! wait_for 30 "nodes up" nodes_up; then
        for name in $(node_names); do
            state=$(node_state "$name")
            case "$state" in
                down* | drain* | drng*)  # left over from an earlier run that stopped badly, or a lost node
                    log "node $name is $state; resuming it"
                    scontrol update nodename="$name" state=resume || true ;;
            esac
        done
        wait_for 30 "nodes up" nodes_up || die "nodes: $(sinfo -h -N -o '%N=%t' | paste -sd' ') (see $STATE/log/)"
    fi
    log "nodes: $(sinfo -h -N -o '%N=%t' | paste -sd' ')"
    wait_for 30 "sacct answers" sacct -n -X --starttime=now || die "sacct does not answer (see $STATE/log/slurmdbd.log)"
}

cmd_start() {
    local started=$SECONDS
    mkdir -p "$STATE"/{etc,log,run,spool/ctld}
    install_packages
    choose_nodes
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
    for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        log "$1 ignored TERM; killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$STATE/run/$1.pid"
}

stop_daemons() {  # stop_daemons NAME...: stop_daemon on each at once (each takes ~2 s to exit after TERM)
    local name
    for name in "$@"; do stop_daemon "$name" & done
    wait
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
    local pidfile nodes=()
    for pidfile in "$STATE"/run/slurmd-*.pid; do
        [ -e "$pidfile" ] && nodes+=("$(basename "$pidfile" .pid)")
    done
    stop_daemons "${nodes[@]}"
    remove_network
    stop_daemon slurmctld  # before slurmdbd, which takes its last accounting records
    stop_daemon slurmdbd   # before its database, and before munged, which both need
    stop_daemons mariadbd munged
    if [ -L "$ETC_LINK" ] && [ "$(readlink "$ETC_LINK")" = "$STATE/etc/slurm.conf" ]; then
        rm -f "$ETC_LINK" && log "removed $ETC_LINK"
    fi
    log "cluster stopped (state kept in $STATE; delete it for a fresh start)"
}

cmd_status() {
    local up=0
    for d in munged mariadbd slurmdbd slurmctld $(node_names | sed 's/^/slurmd-/'); do
        if alive "$d"; then echo "$d: running (pid $(cat "$STATE/run/$d.pid"))"; else echo "$d: stopped"; up=1; fi
    done
    if [ $up -eq 0 ]; then
        sinfo -N -o "%N %t %c %m" || up=1
        squeue || up=1
        nodes_up || up=1
    fi
    return $up
}

configured_nodes() { [ -f "$SLURM_CONF" ] && NODES=$(grep -c '^NodeName=' "$SLURM_CONF") || true; }

case "${1:-}" in
    announce) cmd_announce ;;
    start) cmd_start ;;
    stop) configured_nodes; cmd_stop ;;
    status) configured_nodes; cmd_status ;;
    env) echo "export SLURM_CONF=$SLURM_CONF" ;;
    kill-node) kill_node "${2:?node name}" ;;
    start-node) write_hosts; start_node "${2#t3d-n}"; wait_for 60 "node $2 back" nodes_up ;;
    *) echo "usage: $0 announce|start|stop|status|env|kill-node NAME|start-node NAME   (state in \$TRAINER3D_SLURM_DIR, default /tmp/trainer3d-slurm)" >&2; exit 2 ;;
esac
