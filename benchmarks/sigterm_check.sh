#!/usr/bin/env bash
# What a preemption costs: train, send SIGTERM after step AFTER, time how long the run takes to save and exit,
# then run the same command again (with steps = the stopped step + 3) and check it resumes there.
#
#   bash benchmarks/sigterm_check.sh 20 --config configs/llama3_8b.yaml model.n_layers=8 ... run_dir=/tmp/sig
#
# The trainer arguments must set run_dir to a fresh directory; `steps` is set here (to 100000, then the resume's).
set -u
after=$1; shift
log=$(mktemp /tmp/sigterm_check.XXXX.log)
python3 -m mx_jax.train "$@" steps=100000 log.progress=false > "$log" 2>&1 &  # no bar: its \r hides the lines
pid=$!
until grep -qE "^step +$after " "$log"; do
  if ! kill -0 $pid 2>/dev/null; then echo "training ended before step $after:"; tail -20 "$log"; exit 1; fi
  sleep 0.2
done
t0=$(date +%s.%N)
kill -TERM $pid
wait $pid
rc=$?
t1=$(date +%s.%N)
grep -E "ckpt|stop" "$log" | tail -4
stopped=$(sed -nE 's/^stop +\| SIGTERM: stopped after step ([0-9]+) .*/\1/p' "$log")
echo "SIGTERM after the step $after log line -> exit $rc in $(python3 -c "print(f'{$t1 - $t0:.1f}')") s;" \
  "stopped after step $stopped"
[[ $rc -eq 143 && -n "$stopped" ]] || { tail -30 "$log"; exit 1; }
python3 -m mx_jax.train "$@" steps=$((stopped + 3)) 2>&1 | grep -E "resume|^step|done|error" | tail -6
