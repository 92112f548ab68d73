#!/usr/bin/env bash
# t5scale on a Cloud TPU slice, or on several created as one multislice queued resource: one JAX
# process per TPU VM, every VM of every slice.
#
#   launch/tpu_vm.sh TPU_NAME ZONE t5scale train --gin_file=gin/models/mt5_xl.gin \
#       --gin_file=gin/zero/stage3.gin --gin.MODEL_DIR=gs://bucket/runs/xl   # all workers
#   launch/tpu_vm.sh TPU_NAME ZONE t5scale distributed-check               # check the processes
#   T5SCALE_QUEUED_RESOURCE=1 launch/tpu_vm.sh QR_ID ZONE t5scale train ...  # a multislice
#
# From your machine it runs itself on every worker (`gcloud compute tpus tpu-vm ssh --worker=all`;
# a multislice's every slice: `gcloud compute tpus queued-resources ssh --node=all --worker=all`)
# in T5SCALE_REMOTE_DIR (default: t5scale, the repository's clone on each VM, with t5scale
# installed there with the `tpu` extra; a path from the home directory, or absolute). T5SCALE_COORDINATOR_PORT and T5SCALE_PYTHON, if set
# here, go with it. On a worker it reads its place from the TPU VM's metadata, as
# jax.distributed does on TPU VMs: its worker number and the slice's workers (the first is the
# coordinator, port T5SCALE_COORDINATOR_PORT or 8482), and, on a multislice, the MEGASCALE_*
# settings (slice id, number of slices, coordinator) from the environment or else the VM's
# `tpu-env` metadata. t5scale then joins the others from T5SCALE_PROCESS_ID,
# T5SCALE_NUM_PROCESSES and T5SCALE_COORDINATOR_ADDRESS (t5scale/parallel/distributed.py).
# MODEL_DIR must be on storage every VM sees (a gs:// bucket, a Filestore share). Ctrl-C here
# does not stop the workers (ssh gives them no terminal): stop them with the same ssh and
# --command='pkill -f t5scale.cli'. docs/multihost.md has the rest.
set -euo pipefail

usage() {
  echo "usage: launch/tpu_vm.sh TPU_NAME ZONE [t5scale] COMMAND [ARGS...]" >&2
  exit 2
}

if [[ ${T5SCALE_ON_TPU_WORKER:-} != 1 ]]; then  # on your machine: start it on every worker
  [[ $# -lt 3 ]] && usage
  name=$1 zone=$2
  shift 2
  [[ $1 == t5scale ]] && shift
  [[ $# -lt 1 ]] && usage
  settings="T5SCALE_ON_TPU_WORKER=1"
  for setting in T5SCALE_COORDINATOR_PORT T5SCALE_PYTHON; do  # ssh carries no environment
    [[ -n ${!setting:-} ]] && settings+=" $setting=$(printf '%q' "${!setting}")"
  done
  remote="cd $(printf '%q' "${T5SCALE_REMOTE_DIR:-t5scale}") && $settings bash launch/tpu_vm.sh"
  if [[ ${T5SCALE_QUEUED_RESOURCE:-} == 1 ]]; then  # every slice of a multislice
    # every worker at once: gcloud's default batches of 64, each waited for, would leave the
    # first 64 waiting for peers not yet started
    where=(queued-resources ssh "$name" --zone="$zone" --node=all --worker=all
      --batch-size="${T5SCALE_SSH_BATCH_SIZE:-all}")
  else
    where=(tpu-vm ssh "$name" --zone="$zone" --worker=all)
  fi
  exec "${T5SCALE_GCLOUD:-gcloud}" compute tpus "${where[@]}" \
    --command="$remote $(printf '%q ' "$@")"
fi

# On a worker.
[[ $# -ge 1 && $1 == t5scale ]] && shift
[[ $# -lt 1 ]] && usage
metadata() {
  "${T5SCALE_CURL:-curl}" -sf -H "Metadata-Flavor: Google" \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}
worker=$(metadata agent-worker-number) || { echo "tpu_vm.sh: no TPU VM metadata here" >&2; exit 2; }
endpoints_list=$(metadata worker-network-endpoints) || {
  echo "tpu_vm.sh: cannot read this slice's workers (metadata worker-network-endpoints)" >&2
  exit 2
}
IFS=, read -r -a endpoints <<< "$endpoints_list"
first=${endpoints[0]}
# Each endpoint is a host name, or (older TPU VMs) name:id:address.
[[ $first == *:*:* ]] && first=${first##*:}
workers=${#endpoints[@]}
# A multislice's settings: the environment's, else the VM's tpu-env metadata (KEY: 'value'
# lines), where the TPU runtime keeps them for processes started over ssh.
tpu_env=$(metadata tpu-env) || tpu_env=""
megascale() {
  local name=$1 value=${!1:-}
  if [[ -z $value ]]; then
    # the last line that names it, as jax.distributed reads it; surrounding quotes and blanks off
    value=$(sed -n "s/^[[:space:]]*$name[[:space:]]*:[[:space:]]*//p" <<< "$tpu_env" | tail -1)
    value=$(sed -e "s/[[:space:]]*$//" -e "s/^'//" -e "s/'$//" <<< "$value")
  fi
  echo "${value:-$2}"
}
slices=$(megascale MEGASCALE_NUM_SLICES 1)
slice=$(megascale MEGASCALE_SLICE_ID 0)
coordinator=$(megascale MEGASCALE_COORDINATOR_ADDRESS "$first")
export T5SCALE_PROCESS_ID=$((slice * workers + worker))
export T5SCALE_NUM_PROCESSES=$((slices * workers))
export T5SCALE_COORDINATOR_ADDRESS="${coordinator%%:*}:${T5SCALE_COORDINATOR_PORT:-8482}"
echo "t5scale: worker ${worker} of ${workers} in slice ${slice} of ${slices}: process" \
  "${T5SCALE_PROCESS_ID}/${T5SCALE_NUM_PROCESSES}, coordinator ${T5SCALE_COORDINATOR_ADDRESS}"
unset PYTHONUNBUFFERED  # as slurm.sbatch: C++ messages unbuffered split t5scale's lines
python=${T5SCALE_PYTHON:-$(command -v python || command -v python3 || echo python)}
exec "$python" -m t5scale.cli "$@"
