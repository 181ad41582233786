#!/usr/bin/env bash
# `ray up deploy/ray/local.yaml`, tried for real on this one machine (issue 16):
#   * an sshd of its own on 127.0.0.1:22 (Debian's openssh-server), in a PID namespace of its
#     own, so that the config's `ray stop` reaches only the processes of this cluster;
#   * a key made for the run, and a copy of local.yaml pointed at 127.0.0.1 as the head with no
#     workers (the head offers the router, prefill and decode resources), whose setup reuses
#     this checkout's .venv instead of installing one, and whose service runs `--model tiny`
#     on the CPU (deploy/ray/pdserve.yaml with the GPU settings overridden);
#   * `ray up`, then a generation through the router from outside the cluster and
#     `pdserve status` through `ray exec`, then `ray down`.
# Needs root (sshd on port 22), the tools below and `make venv`; it names whatever is missing
# and stops before starting anything. Usage: bash deploy/ray/try_local.sh   (prints a transcript)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BIN=$ROOT/.venv/bin
. deploy/require.sh
need_root "its sshd listens on 127.0.0.1:22"
need ssh "apt-get install openssh-client"  # ray up reaches the head over ssh
need ssh-keygen "apt-get install openssh-client"
need /usr/sbin/sshd "apt-get install openssh-server"
need rsync "apt-get install rsync"  # ray up copies the file mounts with it
need unshare "apt-get install util-linux"
need pkill "apt-get install procps"
need hostname "apt-get install hostname"
need "$BIN/ray" "make venv"
need "$BIN/pdserve" "make venv"
require_done
WORK=$(mktemp -d /tmp/pdserve-ray-up.XXXX)
export RAY_AUTH_MODE=token
step() { printf '\n$ %s\n' "$*"; }

start_sshd() {
  ssh-keygen -q -t ed25519 -N '' -f "$WORK/key"
  ssh-keygen -q -t ed25519 -N '' -f "$WORK/host_key"
  cp "$WORK/key.pub" "$WORK/authorized_keys"
  cat > "$WORK/sshd_config" <<EOF
ListenAddress 127.0.0.1
Port 22
HostKey $WORK/host_key
AuthorizedKeysFile $WORK/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
StrictModes no
UsePAM no
PidFile $WORK/sshd.pid
EOF
  mkdir -p /run/sshd
  unshare --pid --fork --mount-proc /usr/sbin/sshd -D -f "$WORK/sshd_config" -E "$WORK/sshd.log" &
  for _ in $(seq 50); do
    ssh -q -i "$WORK/key" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null root@127.0.0.1 true && return
    sleep 0.2
  done
  echo "sshd did not come up"; cat "$WORK/sshd.log"; exit 1
}

derive_configs() {  # $WORK/cluster.yaml and $WORK/pdserve.yaml from the shipped ones
  "$BIN/python" - "$ROOT" "$WORK" <<'EOF'
import sys, yaml
root, work = sys.argv[1:]
path = f"export PATH={root}/.venv/bin:$PATH; "
c = yaml.safe_load(open(f"{root}/deploy/ray/local.yaml"))
c["provider"].update(head_ip="127.0.0.1", worker_ips=[])
c["auth"] = {"ssh_user": "root", "ssh_private_key": f"{work}/key"}
c["file_mounts"]["~/pdserve.yaml"] = f"{work}/pdserve.yaml"
c["setup_commands"] = [f"ln -sfn {root}/.venv ~/pdserve-venv"]  # this checkout's venv, no install
head = c["head_start_ray_commands"]
head[1] = head[1].replace('{"pdserve_router": 1}', '{"pdserve_router": 1, "pdserve_prefill": 1, "pdserve_decode": 1}')
c["head_start_ray_commands"] = [path + cmd for cmd in head]
c["worker_start_ray_commands"] = []
yaml.safe_dump(c, open(f"{work}/cluster.yaml", "w"), sort_keys=False)
s = yaml.safe_load(open(f"{root}/deploy/ray/pdserve.yaml"))
s["model"] = {"name": "tiny", "device": "cpu"}
s["cache"]["kv_cache_bytes"] = 64 << 20
for kind in ("prefill", "decode"):
    s[kind].update(num_nodes=1, num_cpus=0, num_gpus=0)
s["cluster"]["start_timeout_s"] = 300
yaml.safe_dump(s, open(f"{work}/pdserve.yaml", "w"), sort_keys=False)
EOF
}

cleanup() {
  step ray down -y cluster.yaml
  "$BIN/ray" down -y "$WORK/cluster.yaml" 2>&1 | tail -3 || true
  pkill -f "$WORK/sshd_config" || true  # the namespace's init: everything started in it goes too
  # Ray leaves this cluster's address as the machine's "current" one: `--address auto` elsewhere
  # would find the dead cluster
  [ "$(cat /tmp/ray/ray_current_cluster 2>/dev/null)" = "$(hostname -I | awk '{print $1}'):6379" ] &&
    rm -f /tmp/ray/ray_current_cluster || true
}

start_sshd
derive_configs
[ -f ~/.ray/auth_token ] || "$BIN/ray" get-auth-token --generate > /dev/null
trap cleanup EXIT
step ray up -y cluster.yaml "(local provider, head 127.0.0.1 over SSH)"
SECONDS=0
"$BIN/ray" up -y --no-config-cache "$WORK/cluster.yaml" > "$WORK/ray_up.log" 2>&1
grep -E "SUCC|\[[0-9]/[0-9]\]|Running .*(ray start|pdserve up|ln -sfn)" "$WORK/ray_up.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c 1-220
echo "(ray up: ${SECONDS} s)"
# router.host `auto` binds the Ray node's IP: on this machine, its first address, not 127.0.0.1
HEAD=$(hostname -I | awk '{print $1}')
step pdserve generate --router "$HEAD:50051" --max-tokens 8 --json "hello"
for _ in $(seq 90); do
  out=$("$BIN/pdserve" generate --router "$HEAD:50051" --max-tokens 8 --json "hello" 2>&1) && break
  sleep 2
done
echo "$out"
echo "(first generation answered ${SECONDS} s after ray up began)"
step ray exec cluster.yaml "pdserve status"
"$BIN/ray" exec "$WORK/cluster.yaml" "export PATH=$ROOT/.venv/bin:\$PATH RAY_AUTH_MODE=token; pdserve status --address auto" 2>&1 | tail -8
