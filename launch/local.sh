#!/usr/bin/env bash
# Run N processes of a t5scale command on this machine as one JAX distributed run (127.0.0.1 only).
#
#   launch/local.sh N [t5scale] COMMAND [ARGS...]
#   launch/local.sh 2 t5scale train --cpu_devices=4 --gin_file=gin/models/mt5_tiny.gin ...
#
# Each process gets T5SCALE_COORDINATOR_ADDRESS, T5SCALE_NUM_PROCESSES and T5SCALE_PROCESS_ID
# (t5scale/parallel/distributed.py), and its output lines are prefixed with [pI]. Choose the port
# with T5SCALE_COORDINATOR_PORT (default: a free one) and the interpreter with PYTHON. When all
# have ended, one line per process says how it ended; the exit code is the first failure's.
# SIGTERM is passed on to every process (t5scale then saves a checkpoint and stops). A process
# still running LOCAL_GRACE_S seconds (default 120) after another failed is killed: t5scale's
# processes stop by themselves well before that (exit 4); the limit only guards against a hang.
set -uo pipefail

if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: launch/local.sh N [t5scale] COMMAND [ARGS...]" >&2
  exit 2
fi
count=$1
shift
[[ $1 == t5scale ]] && shift
python=${PYTHON:-python}
port=${T5SCALE_COORDINATOR_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
grace=${LOCAL_GRACE_S:-120}

state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
pids() { cat "$state"/pid.* 2>/dev/null; }
trap 'kill -TERM $(pids) 2>/dev/null' TERM INT  # before the first process starts
for ((i = 0; i < count; i++)); do
  (
    T5SCALE_COORDINATOR_ADDRESS=127.0.0.1:$port T5SCALE_NUM_PROCESSES=$count \
      T5SCALE_PROCESS_ID=$i env -u PYTHONUNBUFFERED "$python" -m t5scale.cli "$@" 2>&1 &
    echo $! >"$state/pid.$i"
    wait $!
    # written whole, then named: the watch below never reads a half-written code
    echo $? >"$state/rc.$i.tmp" && mv "$state/rc.$i.tmp" "$state/rc.$i"
    # gloo announces every connection it makes on stdout: noise here. (Neither `python -u` nor
    # PYTHONUNBUFFERED: they unbuffer C's stdout too, gloo's announcement then comes out in
    # pieces, and a line of t5scale's written between two pieces went with it. t5scale's own
    # lines are line-buffered.)
  ) | sed -u -e '/^\[Gloo\] Rank [0-9]* is connected to/d' -e "s/^/[p$i] /" &
done

failed_at=""
while :; do
  ended=0
  for ((i = 0; i < count; i++)); do
    [[ -f $state/rc.$i ]] || continue
    ended=$((ended + 1))
    [[ -z $failed_at && $(<"$state/rc.$i") != 0 ]] && failed_at=$SECONDS
  done
  ((ended == count)) && break
  if [[ -n $failed_at ]] && ((SECONDS - failed_at > grace)); then
    echo "local.sh: killing the processes still running ${grace} s after the first failure" >&2
    kill -KILL $(pids) 2>/dev/null
  fi
  sleep 0.2
done
wait  # the output prefixers

code=0
for ((i = 0; i < count; i++)); do
  rc=$(<"$state/rc.$i")
  if ((rc == 0)); then
    how="exited normally"
  elif ((rc > 128)); then
    how="was killed by signal $((rc - 128)) (SIG$(kill -l $((rc - 128)) 2>/dev/null || echo '?'))"
  else
    how="exited with code $rc"
  fi
  echo "local.sh: process $i of $count $how" >&2
  ((code == 0 && rc != 0)) && code=$rc
done
exit "$code"
