"""The cluster side: batch-job rendering, the job-start plan from the allocation, the
``mpilearn-run`` launcher, launcher detection, stop signals, node-local staging."""
