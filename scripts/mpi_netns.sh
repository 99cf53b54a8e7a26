#!/usr/bin/env bash
# Ranks on one machine, each in its own network namespace, joined by veth
# pairs to a bridge, so that Open MPI's TCP transport crosses a real network
# stack; each link shaped to RATE with tc's token bucket (tbf) both ways.
# Needs root (ip netns, tc). This kernel has tbf and htb but not netem, so
# the links add no latency: the cost model (scripts/mpi_cost_model.py) takes
# latency as a parameter instead.
#   scripts/mpi_netns.sh up P RATE        P namespaces attnns0.., links of RATE (e.g. 25gbit, or "none")
#   scripts/mpi_netns.sh run P CMD...     mpirun -np P over them (the mpirun options below), CMD on each
#   scripts/mpi_netns.sh down             removes them
# Example:
#   scripts/mpi_netns.sh up 2 25gbit
#   scripts/mpi_netns.sh run 2 build/attn-mpi-bench --seq 16384 --strategy ring
#   scripts/mpi_netns.sh down
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
net=10.77.0 # the bridge is .1, rank r's namespace .(10 + r)

up() {
  local P=$1 rate=$2
  down >/dev/null 2>&1 || true
  ip link add attnbr type bridge
  ip addr add $net.1/24 dev attnbr
  ip link set attnbr up
  for ((i = 0; i < P; i++)); do
    ip netns add attnns$i
    ip link add attnv$i type veth peer name eth0 netns attnns$i
    ip link set attnv$i master attnbr up
    ip netns exec attnns$i ip addr add $net.$((10 + i))/24 dev eth0
    ip netns exec attnns$i ip link set eth0 up
    ip netns exec attnns$i ip link set lo up
    if [ "$rate" != none ]; then
      # a bucket of 4 ms at the rate (at least 256 KiB) lets the kernel's timer keep up
      local bits; bits=$(numfmt --from=si "$(echo "${rate%bit}" | tr a-z A-Z)")
      local burst=$((bits / 8 / 250)); [ $burst -lt 262144 ] && burst=262144
      tc qdisc add dev attnv$i root tbf rate "$rate" burst $burst latency 100ms
      ip netns exec attnns$i tc qdisc add dev eth0 root tbf rate "$rate" burst $burst latency 100ms
    fi
  done
}

down() {
  for l in $(ip -o link show | awk -F': ' '$2 ~ /^attnv[0-9]+@/ {sub(/@.*/, "", $2); print $2}'); do ip link del "$l"; done
  for ns in $(ip netns list | awk '/^attnns/ {print $1}'); do ip netns del "$ns"; done
  ip link del attnbr 2>/dev/null || true
  rm -rf /tmp/attn-netns
}

run() {
  local P=$1; shift
  local hosts; hosts=$(mktemp)
  for ((i = 0; i < P; i++)); do echo "$net.$((10 + i)) slots=1"; done >"$hosts"
  # every rank is a "node" of one slot: no shared memory between them (btl tcp,self), no
  # binding (each namespace's daemon would pin its rank to core 0)
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PMIX_MCA_gds=hash \
    mpirun -np "$P" --hostfile "$hosts" --mca plm_rsh_agent "$here/mpi_netns_rsh.sh" --mca routed direct \
    --mca btl tcp,self --mca btl_tcp_if_include $net.0/24 --mca oob_tcp_if_include $net.0/24 --bind-to none \
    -x OMP_NUM_THREADS=1 -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM "$@"
  local rc=$?
  rm -f "$hosts"
  return $rc
}

case "${1:-}" in
  up) up "$2" "$3" ;;
  down) down ;;
  run) shift; run "$@" ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
