# Compute nodes of the dev cluster as network + UTS + mount namespaces on this machine.
# Sourced by slurm/cluster.sh (it sets STATE, log, die, alive, stop_daemon).
#
# Each node t3d-nK is a network namespace with its own address 10.213.13.(10+K) on a veth
# pair whose other end sits on a bridge in the host namespace (10.213.13.1: slurmctld,
# slurmdbd, munge's socket is a file and reachable as it is). Its slurmd runs in a UTS
# namespace whose hostname is the node name (so slurmd finds its NodeName line, and ranks
# see the node they are on) and a mount namespace that sees a hosts file naming every node
# (so MASTER_ADDR=t3d-n1 resolves on every node). All traffic stays on the bridge, inside
# this machine. A node is "lost" by killing every process in its network namespace.

BRIDGE=t3d-br0
SUBNET=10.213.13
CTLD_ADDR=$SUBNET.1

node_name() { echo "t3d-n$1"; }
node_addr() { echo "$SUBNET.$((10 + $1))"; }

netns_usable() {  # root, iproute2, and the kernel lets us make a namespace
    [ "$(id -u)" -eq 0 ] && command -v ip >/dev/null && command -v unshare >/dev/null || return 1
    ip netns add t3d-probe 2>/dev/null || return 1
    ip netns del t3d-probe
}

write_hosts() {
    {
        echo "127.0.0.1 localhost"
        echo "$CTLD_ADDR $HOST"
        for k in $(seq "$NODES"); do echo "$(node_addr "$k") $(node_name "$k")"; done
    } >"$STATE/etc/hosts"
}

make_network() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        log "creating bridge $BRIDGE ($CTLD_ADDR/24)"
        ip link add "$BRIDGE" type bridge
        ip addr add "$CTLD_ADDR/24" dev "$BRIDGE"
        ip link set "$BRIDGE" up
    fi
    local k name
    for k in $(seq "$NODES"); do
        name=$(node_name "$k")
        ip netns list | grep -qw "^$name" && continue
        log "creating node namespace $name ($(node_addr "$k"))"
        ip netns add "$name"
        ip link add "t3d-v$k" type veth peer name eth0 netns "$name"
        ip link set "t3d-v$k" master "$BRIDGE"
        ip link set "t3d-v$k" up
        ip netns exec "$name" ip addr add "$(node_addr "$k")/24" dev eth0
        ip netns exec "$name" ip link set eth0 up
        ip netns exec "$name" ip link set lo up
    done
}

start_node() {  # start_node K
    local name
    name=$(node_name "$1")
    alive "slurmd-$name" && return 0
    log "starting slurmd on node $name"
    mkdir -p "$STATE/spool/d-$name"
    # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup mounts slurmd probes.
    nsenter --net="/run/netns/$name" unshare --uts --mount sh -c \
        "hostname $name && mount --bind $STATE/etc/hosts /etc/hosts && exec slurmd" \
        || die "slurmd on $name did not start (see $STATE/log/slurmd-$name.log)"
}

kill_node() {  # kill_node NAME: every process in the node's network namespace, at once
    local pids
    pids=$(ip netns pids "$1" 2>/dev/null | tr '\n' ' ')
    log "killing node $1 (pids: ${pids:-none})"
    [ -n "${pids// /}" ] && kill -KILL $pids 2>/dev/null
    rm -f "$STATE/run/slurmd-$1.pid"
}

remove_network() {
    local k name
    for k in $(seq "$NODES"); do
        name=$(node_name "$k")
        ip netns list | grep -qw "^$name" || continue
        stop_daemon "slurmd-$name"
        kill_node "$name" >/dev/null 2>&1 || true
        ip netns del "$name" && log "removed node namespace $name"
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link del "$BRIDGE" && log "removed bridge $BRIDGE"
    fi
}
