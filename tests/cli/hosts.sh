# Sourced by tests that need several hosts on one machine. Each host is a
# network namespace with one address on a bridge (the bridge lives in a
# namespace of its own: the switch); every process started on a host also
# gets a UTS namespace with the host's name, so it reports that name as
# MPI and gethostname do on a real cluster. Open MPI reaches the other
# hosts over TCP and starts its daemons there through an rsh agent that
# enters the host's namespaces instead of logging in with ssh.
#
#   hosts_up N DIR [DISK]  hosts node1..nodeN at 10.213.0.1..N; writes DIR/agent; with DISK,
#                       a folder each host has for itself (a local disk): every process on
#                       host I sees DIR/disk-nodeI there, bind-mounted in a mount namespace
#   on_host I CMD...    runs CMD on host I (mpirun then starts remote ranks from there)
#   hostfile FILE I:SLOTS...   an Open MPI hostfile naming hosts by address
#   cut_link I          takes host I off the network (its port on the switch down)
#   kill_host I         SIGKILL to every process on host I and its link cut: a host lost
#   hosts_down          ends every process on the hosts and removes the namespaces
#
# hosts_can_run says why not (and returns 1) where namespaces cannot be made.

hosts_prefix="mt$$"
hosts_count=0
hosts_disk=""
hosts_dir=""

hosts_can_run() {
  local probe="${hosts_prefix}probe" dir
  command -v ip > /dev/null && command -v nsenter > /dev/null && command -v unshare > /dev/null || {
    echo "needs ip (iproute2), nsenter and unshare (util-linux)"; return 1; }
  ip netns add "$probe" 2> /dev/null || { echo "needs network namespaces (ip netns add: run as root)"; return 1; }
  if ! ip -n "$probe" link add br0 type bridge 2> /dev/null ||
     ! ip -n "$probe" link add v0 type veth peer name v1 2> /dev/null; then
    ip netns del "$probe"
    echo "needs bridges and veth pairs in a network namespace"
    return 1
  fi
  ip netns del "$probe"
  dir=$(mktemp -d)
  if ! unshare --uts --mount --propagation private sh -c 'hostname probe && mount --bind "$0" "$0"' "$dir" 2> /dev/null; then
    rmdir "$dir"
    echo "needs UTS and mount namespaces with bind mounts (unshare: run as root)"
    return 1
  fi
  rmdir "$dir"
}

host_address() { echo "10.213.0.$1"; }
host_netns() { echo "${hosts_prefix}h$1"; }

hosts_up() {
  local count=$1 dir=$2 disk=${3:-} switch="${hosts_prefix}sw" i
  hosts_disk=$disk hosts_dir=$dir
  ip netns add "$switch"
  hosts_count=$count
  ip -n "$switch" link add br0 type bridge
  ip -n "$switch" link set br0 up
  for i in $(seq "$count"); do
    ip netns add "$(host_netns "$i")"
    ip -n "$switch" link add "h$i" type veth peer name eth0 netns "$(host_netns "$i")"
    ip -n "$switch" link set "h$i" master br0 up
    ip -n "$(host_netns "$i")" addr add "$(host_address "$i")/24" dev eth0
    ip -n "$(host_netns "$i")" link set eth0 up
    ip -n "$(host_netns "$i")" link set lo up
  done
  {
    echo '#!/usr/bin/env bash'
    echo '# rsh agent: runs a command on a host, i.e. in its network namespace under its name.'
    echo 'while [ "${1#-}" != "$1" ]; do shift; done'
    echo 'case $1 in'
    for i in $(seq "$count"); do echo "  $(host_address "$i")|node$i) ns=$(host_netns "$i") name=node$i;;"; done
    echo '  *) echo "agent: no host $1" >&2; exit 255;;'
    echo 'esac'
    echo 'shift'
    if [ -n "$disk" ]; then
      echo "exec nsenter --net=\"/run/netns/\$ns\" -- unshare --uts --mount --propagation private -- \\"
      printf '%s\n' "  sh -c 'hostname \"\$0\" && mount --bind \"\$2\" \"\$3\" && eval \"\$1\"' \"\$name\" \"\$*\" $(printf %q "$dir")/disk-\"\$name\" $(printf %q "$disk")"
    else
      echo 'exec nsenter --net="/run/netns/$ns" -- unshare --uts -- sh -c '"'"'hostname "$0" && eval "$1"'"'"' "$name" "$*"'
    fi
  } > "$dir/agent"
  if [ -n "$disk" ]; then
    mkdir -p "$disk"
    for i in $(seq "$count"); do mkdir -p "$dir/disk-node$i"; done
  fi
  chmod +x "$dir/agent"
  # Open MPI: daemons started through the agent, ranks and daemons talking over the hosts' network.
  export OMPI_MCA_plm_rsh_agent="$dir/agent" OMPI_MCA_btl=self,vader,tcp
  export OMPI_MCA_btl_tcp_if_include=10.213.0.0/24 OMPI_MCA_oob_tcp_if_include=10.213.0.0/24
}

on_host() {
  local i=$1
  shift
  if [ -n "$hosts_disk" ]; then
    nsenter --net="/run/netns/$(host_netns "$i")" -- unshare --uts --mount --propagation private -- \
      sh -c 'hostname "$0" && mount --bind "$1" "$2" && shift 2 && exec "$@"' "node$i" "$hosts_dir/disk-node$i" "$hosts_disk" "$@"
  else
    nsenter --net="/run/netns/$(host_netns "$i")" -- unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "node$i" "$@"
  fi
}

hostfile() {
  local file=$1 entry
  shift
  : > "$file"
  for entry in "$@"; do echo "$(host_address "${entry%%:*}") slots=${entry#*:}" >> "$file"; done
}

cut_link() { ip -n "${hosts_prefix}sw" link set "h$1" down; }

host_pids() { ip netns pids "$(host_netns "$1")" 2> /dev/null; }

kill_host() {
  cut_link "$1"
  # shellcheck disable=SC2046
  kill -KILL $(host_pids "$1") 2> /dev/null || true
}

hosts_down() {
  local i
  for i in $(seq "$hosts_count"); do
    # shellcheck disable=SC2046
    kill -KILL $(host_pids "$i") 2> /dev/null || true
  done
  for i in $(seq "$hosts_count"); do ip netns del "$(host_netns "$i")" 2> /dev/null || true; done
  ip netns del "${hosts_prefix}sw" 2> /dev/null || true
  hosts_count=0 hosts_disk=""
}
