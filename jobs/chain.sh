#!/bin/bash
# Run a long job as a chain of N allocations: each starts when the previous one ends, in any
# state (--dependency=afterany), and continues from where it stopped (--resume auto). A link
# whose run is already finished exits at once.
#   jobs/chain.sh 5 jobs/train.sbatch jobs/train-3dgan.yaml runs/3dgan
#   jobs/chain.sh 3 --time=04:00:00 jobs/hpo.sbatch jobs/hpo-3dgan.yaml runs/hpo-3dgan
# Arguments after N go to sbatch as they are (sbatch flags, the script, its arguments).
# The links do not requeue themselves (MPILEARN_REQUEUE=0): the chain takes that role.
set -euo pipefail
n=${1:?usage: jobs/chain.sh N [sbatch flags] SCRIPT [CONFIG [OUTPUT]]}
shift
dependency=()
for i in $(seq "$n"); do
  id=$(sbatch --parsable "${dependency[@]}" --export=ALL,MPILEARN_REQUEUE=0 "$@")
  id=${id%%;*}
  echo "link $i/$n: job $id"
  dependency=(--dependency=afterany:"$id")
done
