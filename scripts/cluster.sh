#!/usr/bin/env bash
# Fake cluster nodes on one machine, each a set of Linux namespaces of its own (needs root).
#
#   scripts/cluster.sh up N [--rate RATE] [--keep PATH]... [--owner PID]
#                                                            build node1..nodeN (with --owner, the nodes
#                                                            also go when process PID ends, killed too)
#   scripts/cluster.sh down                                  remove all that `up` built
#   scripts/cluster.sh exec NODE CMD [ARG...]                run CMD on NODE, in the current directory
#   scripts/cluster.sh agent NODE CMDLINE...                 mpirun's launch agent (ssh's place):
#                                                            runs the shell command line on NODE
#   scripts/cluster.sh rate RATE                             reshape every link to RATE (e.g. 10gbit)
#   scripts/cluster.sh kill NODE [PATTERN]                   a node crash: SIGKILL to everything running
#                                                            on NODE at once (the node stays up, empty);
#                                                            with PATTERN only the processes whose
#                                                            command line matches it (grep -E)
#   scripts/cluster.sh processes NODE [PATTERN]              NODE's processes (whose command line matches)
#   scripts/cluster.sh freeze NODE | thaw NODE               a hung node: SIGSTOP (SIGCONT) to everything on
#                                                            NODE; its kernel still answers, nothing is closed
#   scripts/cluster.sh cut NODE | heal NODE                  a partition: NODE's link set down (no RST, no FIN),
#                                                            and up again
#   scripts/cluster.sh mpirun MPIRUN-ARGS...                 mpirun (${MPIRUN:-mpirun}) on node1 with what the
#                                                            nodes need: the launch agent, eth0 only, root
#   scripts/cluster.sh launcher NODE CMD [ARG...]            run a launcher (hpctrain launch, mpirun,
#                                                            horovodrun) on NODE so that it reaches the
#                                                            others: `ssh` on PATH is `cluster.sh ssh`,
#                                                            Open MPI and Gloo keep to eth0
#   scripts/cluster.sh ssh [SSH-OPTIONS] NODE CMDLINE...     ssh's place: ssh's options left out, the command
#                                                            line run on NODE (a name or an address)
#   scripts/cluster.sh status                                the nodes, their addresses and processes
#
# Each node has its own network namespace (one interface, eth0, 198.18.0.<i>/24, on a bridge that
# lives in a namespace of its own; both directions shaped to RATE with tc tbf when --rate is given,
# e.g. 1gbit), its own hostname (node<i>, resolvable on every node through a private /etc/hosts),
# and its own /dev/shm and /tmp (empty tmpfs in a private mount namespace: no node sees another's
# shared memory or temporary files).  The directory $HPCTRAIN_CLUSTER_DIR/shared (default
# /run/hpctrain-cluster/shared) is seen by every node, as a cluster's shared file system is.  Paths
# under /tmp that the nodes need (the repository and its venv when they are there) are kept visible
# with --keep PATH; the current directory is kept when it is under /tmp.  `exec`, `agent` and `mpirun`
# refuse a working directory, this script or an argument naming a path that the nodes cannot see.
#
# The host's own interfaces, routes, firewall and /etc are not touched: the links are made inside
# the bridge's namespace and moved into the nodes, the addresses come from 198.18.0.0/15 (reserved
# for benchmark networks), and each namespace lives as long as one holder process (`sleep`), so
# `down` (killing the holders and whatever still runs on a node) leaves nothing behind.
#
# mpirun across the nodes, from node1 (no ssh server needed), is
#   scripts/cluster.sh mpirun -H node1:2,node2:2 python train.py
# which runs, on node1:
#   mpirun --allow-run-as-root --bind-to none --mca plm_rsh_agent "<this script> agent" \
#       --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 --mca osc ^ucx [--with-ft ulfm] \
#       -H node1:2,node2:2 python train.py
# (--with-ft ulfm where the Open MPI has it: hpctrain then names a lost node and its ranks.)
set -euo pipefail

DIR=${HPCTRAIN_CLUSTER_DIR:-/run/hpctrain-cluster}
SUBNET=198.18.0
OWNER=""

die() { echo "cluster.sh: $*" >&2; exit 1; }

pid_of() {   # the holder process of NODE (node<i>, its address or bridge)
  local f="$DIR/$1.pid"
  case $1 in "$SUBNET".*) f="$DIR/node${1##*.}.pid" ;; esac
  [ -s "$f" ] || die "no node $1 (is the cluster up? scripts/cluster.sh status)"
  cat "$f"
}

holder() {   # start a process in new namespaces that runs SETUP, writes its pid to NAME.pid and waits
  local name=$1 flags=$2 setup=$3 wait="exec sleep infinity"
  [ -z "$OWNER" ] || wait="while kill -0 $OWNER 2>/dev/null; do sleep 1; done"
  setsid unshare $flags sh -c "$setup
echo \$\$ > '$DIR/$name.pid.tmp' && mv '$DIR/$name.pid.tmp' '$DIR/$name.pid' && $wait" \
    </dev/null >"$DIR/$name.log" 2>&1 &
  for _ in $(seq 100); do [ -s "$DIR/$name.pid" ] && return 0; sleep 0.05; done
  die "namespace holder $name did not start: $(cat "$DIR/$name.log")"
}

in_ns() { local pid; pid=$(pid_of "$1"); shift; nsenter -t "$pid" -n -- "$@"; }

up() {
  local n=${1:-}; shift || true
  [[ "$n" =~ ^[1-9][0-9]?$ ]] && [ "$n" -le 200 ] || die "usage: cluster.sh up N [--rate RATE] [--keep PATH]... [--owner PID]"
  local rate="" keep=()
  while [ $# -gt 0 ]; do
    case $1 in
      --rate) rate=${2:?--rate needs a value such as 1gbit}; shift 2 ;;
      --keep) keep+=("$(realpath "${2:?--keep needs a path}")"); shift 2 ;;
      --owner) OWNER=${2:?--owner needs a pid}; shift 2; kill -0 "$OWNER" || die "no process $OWNER" ;;
      *) die "unknown argument $1" ;;
    esac
  done
  [ "$(id -u)" = 0 ] || die "needs root (network and mount namespaces)"
  [ ! -e "$DIR/bridge.pid" ] || die "a cluster is already up ($DIR); run: scripts/cluster.sh down"
  case $PWD in /tmp/*) keep+=("$PWD") ;; esac
  mkdir -p "$DIR/shared" "$DIR/keep"
  trap 'echo "cluster.sh: up failed; tearing down" >&2; down' ERR
  {
    printf '127.0.0.1 localhost\n::1 localhost\n'
    for i in $(seq "$n"); do printf '%s.%s node%s\n' "$SUBNET" "$i" "$i"; done
  } > "$DIR/hosts"
  holder bridge "--net" "ip link set lo up && ip link add br0 type bridge && ip link set br0 up"
  for i in $(seq "$n"); do
    # Paths under /tmp to keep: bind each to a private mount point first, then back after /tmp is new.
    local binds="" moves="" k=0 p
    for p in "${keep[@]}"; do
      case $p in /tmp/*) ;; *) continue ;; esac
      k=$((k + 1))
      mkdir -p "$DIR/keep/node$i-$k"
      binds+="mount --bind '$p' '$DIR/keep/node$i-$k' && "
      moves+="mkdir -p '$p' && mount --move '$DIR/keep/node$i-$k' '$p' && "
    done
    holder "node$i" "--net --uts --mount --propagation private" \
      "hostname node$i && ${binds}mount -t tmpfs -o mode=1777 shm /dev/shm && mount -t tmpfs -o mode=1777 tmp /tmp && ${moves}mount --bind '$DIR/hosts' /etc/hosts && ip link set lo up"
    in_ns bridge ip link add "n$i" type veth peer name "b$i"
    in_ns bridge ip link set "n$i" netns "$(pid_of "node$i")"
    in_ns bridge ip link set "b$i" master br0
    in_ns bridge ip link set "b$i" up
    in_ns "node$i" ip link set "n$i" name eth0
    in_ns "node$i" ip addr add "$SUBNET.$i/24" dev eth0
    in_ns "node$i" ip link set eth0 up
    [ -z "$rate" ] || shape "$i" "$rate" add
  done
  mkdir -p "$DIR/bin"     # (an ssh for launchers that know no other way to the nodes: `launcher`)
  printf '#!/bin/sh\nHPCTRAIN_CLUSTER_DIR=%s exec %s ssh "$@"\n' "$DIR" "$(realpath "$0")" > "$DIR/bin/ssh"
  chmod 755 "$DIR/bin/ssh"
  echo "$n" > "$DIR/nodes"
  echo "${rate:-unshaped}" > "$DIR/rate"
  for p in "${keep[@]}"; do echo "$p"; done > "$DIR/kept"
  trap - ERR
  for j in $(seq 2 "$n"); do   # node1 reaches every other node over TCP before we say it is up
    in_ns "node$j" python3 -c "import socket; s = socket.create_server(('$SUBNET.$j', 7999)); s.settimeout(10); s.accept()" &
    local listener=$!
    for _ in $(seq 50); do
      in_ns node1 python3 -c "import socket; socket.create_connection(('$SUBNET.$j', 7999), timeout=2)" \
        2>/dev/null && break
      sleep 0.1
    done
    wait "$listener" || die "node1 cannot reach node$j"
  done
  echo "cluster up: $n nodes (node1..node$n, $SUBNET.1-$n, links ${rate:-unshaped}), shared directory $DIR/shared"
}

shape() {   # shape NODE_INDEX RATE add|replace: tbf on both directions of node i's link
  # The node's egress (eth0) and the bridge port's (the node's ingress).  The bucket holds 4 ms of
  # traffic (at least 512 KiB): a smaller one cannot reach the rate between two timer ticks.
  local burst
  burst=$(python3 -c "
import re, sys
m = re.fullmatch(r'([0-9.]+)([kmg]?)bit', sys.argv[1].lower())
if not m: sys.exit('cluster.sh: a rate looks like 100mbit, 1gbit or 10gbit, not ' + sys.argv[1])
bits = float(m.group(1)) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9}[m.group(2)]
print(max(512 * 1024, int(bits / 8 * 0.004)))" "$2") || die "bad rate $2"
  in_ns "node$1" tc qdisc "$3" dev eth0 root tbf rate "$2" burst "$burst" latency 100ms
  in_ns bridge tc qdisc "$3" dev "b$1" root tbf rate "$2" burst "$burst" latency 100ms
}

reshape() {   # reshape RATE: every link of the cluster that is up
  [ -s "$DIR/nodes" ] || die "no cluster up (scripts/cluster.sh up N first)"
  local i
  for i in $(seq "$(cat "$DIR/nodes")"); do shape "$i" "${1:?rate, e.g. 10gbit}" replace; done
  echo "$1" > "$DIR/rate"
  echo "links shaped to $1"
}

ns_pids() {   # every process in the network namespace of holder $1 (the holder too)
  local ns p
  ns=$(readlink "/proc/$1/ns/net" 2>/dev/null) || return 0
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/ns/net" 2>/dev/null)" = "$ns" ] && echo "${p#/proc/}"
  done
  return 0
}

down() {
  trap - ERR
  set +e
  local f pid pids
  for f in "$DIR"/node*.pid "$DIR"/bridge.pid; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    pids=$(ns_pids "$pid")
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  done
  for f in "$DIR"/node*.pid "$DIR"/bridge.pid; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  done
  rm -rf "$DIR"
  echo "cluster down"
}

crash() {   # SIGKILL every process on the node but its holder (or those matching $2), in one kill(1)
  local holder pids p matching=""
  holder=$(pid_of "${1:?which node?}")
  pids=$(ns_pids "$holder" | grep -vx "$holder" || true)
  if [ -n "${2:-}" ]; then
    for p in $pids; do
      tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -Eq -- "$2" && matching+="$p "
    done
    pids=$matching
  fi
  [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
  echo "$1: killed $(echo $pids | wc -w) processes"
}

signal_node() {   # SIGSTOP (freeze) or SIGCONT (thaw) every process on the node but its holder: a hung node
  local sig=$1 holder pids
  holder=$(pid_of "${2:?which node?}")
  pids=$(ns_pids "$holder" | grep -vx "$holder" || true)
  [ -z "$pids" ] || kill "-$sig" $pids 2>/dev/null || true
  echo "$2: sent SIG$sig to $(echo $pids | wc -w) processes"
}

node_processes() {   # the command lines of the node's processes (but its holder) that match $2 (grep -E)
  local holder p
  holder=$(pid_of "${1:?which node?}")
  for p in $(ns_pids "$holder" | grep -vx "$holder" || true); do
    tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -E -- "${2:-.}" | sed "s/^/$p /" || true
  done
}

cut_off() {   # a partition: NODE's link down (nothing is closed; the others hear nothing more from it), or up again
  run_on "${2:?which node?}" ip link set eth0 "$1"
  echo "$2: link $1"
}

status() {
  [ -s "$DIR/nodes" ] || { echo "no cluster up"; return 0; }
  local n i pid
  n=$(cat "$DIR/nodes")
  echo "$n nodes, links $(cat "$DIR/rate"), shared directory $DIR/shared"
  for i in $(seq "$n"); do
    pid=$(pid_of "node$i")
    echo "node$i $SUBNET.$i: $(($(ns_pids "$pid" | wc -l) - 1)) processes"
  done
}

visible() {   # visible PATH: whether the nodes see PATH (absolute) as the host does
  local k
  case $1 in /tmp|/tmp/*|/dev/shm|/dev/shm/*) ;; *) return 0 ;; esac
  [ -s "$DIR/kept" ] || return 1
  while IFS= read -r k; do
    case $1 in "$k"|"$k"/*) return 0 ;; esac
  done < "$DIR/kept"
  return 1
}

need_visible() {   # need_visible PATH...: refuse, before anything starts, a path (that exists here) the nodes cannot see
  local p abs kept
  for p in "$@"; do
    [ -e "$p" ] || continue
    abs=$(realpath -- "$p")
    visible "$abs" && continue
    kept=$(paste -sd, "$DIR/kept" 2>/dev/null || true)
    die "$abs is not visible on the nodes: each node has its own /tmp and /dev/shm. They see every other path of \
this machine, $DIR/shared, and the paths kept at 'up' (${kept:-none}); work from one of those, or bring the \
cluster up with --keep $abs"
  done
}

run_on() {   # run_on NODE CMD...: the node's network, hostname and mounts; same directory and environment
  local node=${1:?which node?}; shift
  [ $# -gt 0 ] || die "nothing to run on $node"
  need_visible "$PWD"
  exec nsenter -t "$(pid_of "$node")" -n -u -m --wd="$PWD" -- "$@"
}

cluster_mpirun() {   # mpirun from node1 over the nodes; the arguments are mpirun's
  local self mpirun ft=()
  self=$(realpath "$0")
  need_visible "$PWD" "$self" "$@"
  mpirun=$(command -v "${MPIRUN:-mpirun}") || die "no ${MPIRUN:-mpirun} on PATH"
  # Open MPI's fault-tolerance extension (ULFM), where it has it: survivors of a lost node keep running
  # long enough for hpctrain to name the node and its ranks (hpctrain/comm/backends/mpi/failures.py).
  "$(dirname "$mpirun")/ompi_info" 2>/dev/null | grep -Eq '^ *FT MPI support: yes' && ft=(--with-ft ulfm)
  run_on node1 "$mpirun" --allow-run-as-root --bind-to none --mca plm_rsh_agent "$self agent" \
    --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 --mca osc ^ucx "${ft[@]}" "$@"
}

cmd=${1:-}; shift || true
case $cmd in
  up) up "$@" ;;
  down) down ;;
  status) status ;;
  kill) crash "$@" ;;
  freeze) signal_node STOP "$@" ;;
  processes) node_processes "$@" ;;
  cut) cut_off down "$@" ;;
  heal) cut_off up "$@" ;;
  thaw) signal_node CONT "$@" ;;
  rate) reshape "$@" ;;
  mpirun) cluster_mpirun "$@" ;;
  exec) run_on "$@" ;;
  agent) node=${1:?}; shift; run_on "$node" /bin/sh -c "$*" ;;
  ssh)
    while [ $# -gt 0 ]; do case $1 in -[oplieFJ]) shift 2 ;; -*) shift ;; *) break ;; esac; done
    node=${1:?usage: cluster.sh ssh [OPTIONS] NODE CMDLINE}; shift
    run_on "$node" /bin/sh -c "$*" ;;
  launcher)
    node=${1:?usage: cluster.sh launcher NODE CMD...}; shift
    export PATH="$DIR/bin:$PATH" OMPI_MCA_btl_tcp_if_include=eth0 OMPI_MCA_oob_tcp_if_include=eth0 \
      PRTE_MCA_oob_tcp_if_include=eth0 GLOO_SOCKET_IFNAME=eth0
    run_on "$node" "$@" ;;
  *) die "usage: cluster.sh up N [--rate RATE] [--keep PATH]... | down | exec NODE CMD... | agent NODE CMDLINE | launcher NODE CMD... | ssh NODE CMDLINE | mpirun ARGS | rate RATE | kill NODE | freeze NODE | thaw NODE | cut NODE | heal NODE | processes NODE | status" ;;
esac
