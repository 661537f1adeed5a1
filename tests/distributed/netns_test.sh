#!/usr/bin/env bash
# Two "hosts" on one machine: two network namespaces joined by a veth pair (10.77.0.1 and
# 10.77.0.2), two ranks in each, rank 0's store on 10.77.0.1. ZeRO stage 3 over gloo (ranks
# started with torchrun's variables in each namespace; or one rank in each with srun's, rank 0's
# host found by name in the node list) and over mpi (mpirun starts its daemon in the other
# namespace through an rsh agent that enters it) ends with the parameters of one process.
# Needs root and `ip netns`; exits 77 (skipped) with a message where either is missing.
# usage: netns_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
build=$1 src=$2 python=$3
loom=$build/bin/loom
job=$src/tests/distributed/zero_job.toml
# shellcheck source=testlib.sh
source "$src/tests/distributed/testlib.sh"
work=$(mktemp -d)
ns=(loom-h0-$$ loom-h1-$$)
cleanup() {
  kill $(jobs -p) 2>/dev/null
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null; done
  [ -n "${KEEP:-}" ] && echo "kept $work" || rm -rf "$work"
}
trap cleanup EXIT
if [ "$(id -u)" -ne 0 ] || ! ip netns add "${ns[0]}" 2>/dev/null; then
  echo "SKIPPED: network namespaces need root and 'ip netns' (iproute2); the two-host test did not run"
  exit 77
fi
ip netns add "${ns[1]}"
ip link add "veth-$$-0" netns "${ns[0]}" type veth peer name "veth-$$-1" netns "${ns[1]}"
ip -n "${ns[0]}" addr add 10.77.0.1/24 dev "veth-$$-0"
ip -n "${ns[1]}" addr add 10.77.0.2/24 dev "veth-$$-1"
for i in 0 1; do
  ip -n "${ns[$i]}" link set lo up
  ip -n "${ns[$i]}" link set "veth-$$-$i" up
done
export LOOM_PLUGIN_PATH=$build/tests/plugins

same_params() {  # A B: consolidated final weights within 1e-6
  "$loom" consolidate "$1/checkpoint-20" "$1.safetensors" >/dev/null &&
  "$loom" consolidate "$2/checkpoint-20" "$2.safetensors" >/dev/null &&
  "$python" "$src/tests/support/tensors.py" compare "$1.safetensors" "$2.safetensors" 1e-6
}
common=(--set optimizer.eps=1e-5 --set zero.stage=3)
"$loom" run "$job" --set "train.output_dir=$work/ref" "${common[@]}" --set zero.stage=0 \
  --set train.per_device_train_batch_size=8 >"$work/ref.log" 2>&1 || fail "reference: $(tail -3 "$work/ref.log")"

# --- gloo: ranks 0-1 on host 0, 2-3 on host 1; each finds its interface towards 10.77.0.1
for r in 0 1 2 3; do
  h=$((r / 2))
  ip netns exec "${ns[$h]}" env RANK=$r WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) LOCAL_WORLD_SIZE=2 \
    MASTER_ADDR=10.77.0.1 MASTER_PORT=29555 timeout 300 "$loom" run "$job" \
    --set "train.output_dir=$work/gloo" "${common[@]}" --set 'distributed.backend="gloo"' \
    >"$work/gloo$r.log" 2>&1 &
  eval "pid$r=\$!"
done
codes=""
for r in 0 1 2 3; do eval "wait \$pid$r"; codes="$codes$?"; done
if [ "$codes" = 0000 ] && d=$(same_params "$work/ref" "$work/gloo"); then
  ok "gloo across two network namespaces, 2 + 2 ranks, stage 3 == 1 process ($d)"
else fail "gloo across namespaces (exit codes $codes): ${d:-} $(tail -3 "$work/gloo0.log") $(tail -3 "$work/gloo2.log")"; fi

# --- srun's variables and no MASTER_ADDR/MASTER_PORT, one rank per host: rank 0's host is the
# first of the step's node list, the port comes from the job id. The hosts have names there,
# from a hosts file that each rank's own mount namespace puts over /etc/hosts.
{ cat /etc/hosts; printf '10.77.0.1 loom-node01\n10.77.0.2 loom-node02\n'; } >"$work/etc-hosts"
jobid=$((100000 + RANDOM))
for r in 0 1; do
  ip netns exec "${ns[$r]}" unshare --mount sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' \
    "$work/etc-hosts" env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE SLURM_JOB_ID=$jobid \
    SLURM_PROCID=$r SLURM_NTASKS=2 SLURM_NODEID=$r SLURM_LOCALID=0 SLURM_STEP_TASKS_PER_NODE='1(x2)' \
    SLURM_STEP_NODELIST='loom-node[01-02]' timeout 300 "$loom" run "$job" \
    --set "train.output_dir=$work/srun" "${common[@]}" --set train.per_device_train_batch_size=4 \
    --set 'distributed.backend="gloo"' --set 'train.log_level="info"' >"$work/srun$r.log" 2>&1 &
  eval "spid$r=\$!"
done
wait $spid0; c0=$?; wait $spid1; c1=$?
said="MASTER_ADDR = loom-node01, the first host of SLURM_STEP_NODELIST; MASTER_PORT = $((10000 + jobid % 20000)) from SLURM_JOB_ID"
if [ $c0 -eq 0 ] && [ $c1 -eq 0 ] && grep -qF "$said" "$work/srun0.log" &&
   d=$(same_params "$work/ref" "$work/srun"); then
  ok "srun's variables without MASTER_ADDR across two namespaces, 1 + 1 ranks == 1 process ($d)"
else fail "srun across namespaces (exit codes $c0 $c1): ${d:-} $(grep -F 'MASTER_' "$work/srun0.log") $(tail -3 "$work/srun0.log") $(tail -3 "$work/srun1.log")"; fi

# --- mpi: mpirun in host 0; its rsh agent starts the daemon for 10.77.0.2 inside host 1
cat >"$work/agent" <<AGENT
#!/usr/bin/env bash
# Open MPI's rsh agent: "agent HOST COMMAND..." runs COMMAND on HOST, here inside its namespace.
host=\$1; shift
case \$host in 10.77.0.1) n=${ns[0]} ;; 10.77.0.2) n=${ns[1]} ;; *) echo "agent: unknown host \$host" >&2; exit 1 ;; esac
# Its own hostname too (a UTS namespace), or Open MPI takes both "hosts" for one node.
exec ip netns exec "\$n" unshare --uts sh -c "hostname \$n; \$*"
AGENT
chmod +x "$work/agent"
printf '10.77.0.1 slots=2\n10.77.0.2 slots=2\n' >"$work/hosts"
if ip netns exec "${ns[0]}" unshare --uts sh -c 'hostname "$0"; exec "$@"' "${ns[0]}" \
     env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
     timeout 300 mpirun --hostfile "$work/hosts" -np 4 --bind-to none \
     --mca plm_rsh_agent "$work/agent" --mca btl_tcp_if_include 10.77.0.0/24 \
     --mca oob_tcp_if_include 10.77.0.0/24 -x LOOM_PLUGIN_PATH -x PATH \
     "$loom" run "$job" --set "train.output_dir=$work/mpi" "${common[@]}" \
     --set 'distributed.backend="mpi"' >"$work/mpi.log" 2>&1 &&
   d=$(same_params "$work/ref" "$work/mpi"); then
  ok "mpi across two network namespaces, 2 + 2 ranks, stage 3 == 1 process ($d)"
else fail "mpi across namespaces: ${d:-} $(grep -v '^\s*$' "$work/mpi.log" | tail -6)"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
