#!/bin/bash
# bench/cpu_budget.sh SECONDS COMMAND...: run COMMAND (an mpirun training) and stop it with
# SIGUSR1 (every rank checkpoints; exit 75) once the processes under it have used SECONDS
# CPU-seconds in all (user + system), so that a training budget reads the same on a busy machine.
# BUDGET_LOG=FILE records the CPU-seconds used every 10 s.
BUDGET=$1; shift
"$@" &
pid=$!
descendants() { local p; for p in $(pgrep -P "$1"); do echo "$p"; descendants "$p"; done; }
while kill -0 $pid 2>/dev/null; do
  sleep 10
  used=$(for p in $pid $(descendants $pid); do ps -o cputimes= -p $p; done | awk '{s+=$1} END {print s+0}')
  echo "$(date +%T) cpu_s=$used" >> "${BUDGET_LOG:-/dev/null}"
  if [ "${used:-0}" -ge "$BUDGET" ]; then kill -USR1 $pid; break; fi
done
wait $pid; echo "exit $?"
