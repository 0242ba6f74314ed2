#!/usr/bin/env bash
# Creates a Cloud TPU VM / pod slice, installs cascade on every host, and runs a config on all hosts.
#
#   launch/tpu_vm.sh create  NAME ZONE ACCELERATOR [VERSION]   # e.g. my-v5p us-east5-a v5p-128 v2-alpha-tpuv5
#   launch/tpu_vm.sh install NAME ZONE                         # copies this checkout, pip installs it
#   launch/tpu_vm.sh pack    [OUT]                             # what install copies, as a tarball
#   launch/tpu_vm.sh run     NAME ZONE CONFIG WORKDIR [overrides...]
#   launch/tpu_vm.sh delete  NAME ZONE
#
# Every host runs the same command; JAX auto-detects the pod (CASCADE_DISTRIBUTED=auto makes
# cascade call jax.distributed.initialize()), process 0 writes logs and exports, and Orbax writes
# checkpoints collectively, so WORKDIR must be shared by all hosts (a gs:// bucket).
# Needs the gcloud CLI, authenticated, with a project set. tests/launch/test_tpu_vm.py runs every
# command against a stand-in gcloud that records what it was asked.
set -euo pipefail

# The repository root: the folder above this script's, wherever the script is called from.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# pack OUT: the checkout at $root as a gzipped tarball; in a git checkout the files git tracks
# plus untracked ones it does not ignore, otherwise all but the virtual env, runs and caches.
pack() {
  local out=$1
  if git -C "$root" rev-parse --show-toplevel >/dev/null 2>&1 &&
     [ "$(git -C "$root" rev-parse --show-toplevel)" = "$root" ]; then
    git -C "$root" ls-files -z --cached --others --exclude-standard |
      (cd "$root" && xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh) |
      tar -C "$root" --null -T - -czf "$out"
  else
    tar -C "$root" -czf "$out" --exclude=./.venv --exclude=./runs --exclude=./.git \
      --exclude='__pycache__' --exclude='*.egg-info' .
  fi
}

cmd=${1:?usage: tpu_vm.sh create|install|run|delete NAME ZONE ... or pack [OUT]}
if [ "$cmd" = pack ]; then
  pack "${2:-/tmp/cascade-src.tgz}"
  echo "packed $root into ${2:-/tmp/cascade-src.tgz}"
  exit 0
fi
name=${2:?TPU name}
zone=${3:?zone}
ssh_all() { gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="$1"; }

case "$cmd" in
  create)
    accel=${4:?accelerator type, e.g. v5p-128}
    version=${5:-v2-alpha-tpuv5}
    gcloud compute tpus tpu-vm create "$name" --zone="$zone" \
      --accelerator-type="$accel" --version="$version"
    ;;
  install)
    pack /tmp/cascade-src.tgz
    gcloud compute tpus tpu-vm scp /tmp/cascade-src.tgz "$name":~/ --zone="$zone" --worker=all
    ssh_all 'mkdir -p ~/cascade && tar xzf ~/cascade-src.tgz -C ~/cascade && cd ~/cascade &&
             python3 -m venv .venv && .venv/bin/pip install -q -U pip &&
             .venv/bin/pip install -q -e ".[tpu]" && sudo apt-get install -y -qq bubblewrap'
    ;;
  run)
    config=${4:?config file, e.g. configs/nemotron_cascade_14b.py}
    workdir=${5:?workdir, e.g. gs://bucket/runs/cascade14b}
    shift 5
    # Each argument quoted for the remote shell (an override such as stages["a-b"].x stays whole).
    ssh_all "cd ~/cascade && CASCADE_DISTRIBUTED=auto nohup .venv/bin/python -m cascade.main \
             --config=$(printf %q "$config") --workdir=$(printf %q "$workdir") \
             $(printf '%q ' "$@")> run.log 2>&1 &"
    echo "started on all hosts; follow with: gcloud compute tpus tpu-vm ssh $name --zone=$zone --worker=0 --command='tail -f ~/cascade/run.log'"
    ;;
  delete)
    gcloud compute tpus tpu-vm delete "$name" --zone="$zone" --quiet
    ;;
  *)
    echo "unknown command $cmd (create|install|run|delete|pack)" >&2; exit 2
    ;;
esac
