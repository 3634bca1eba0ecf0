"""Where a worker runs when a batch scheduler started it: Slurm's node name and job id, for ``producer status``.

Slurm sets these in every job's environment (sbatch/srun); a worker started by ``deploy/slurm/thinkfleet.sbatch``
publishes them beside its host and pid in its heartbeat, so an operator can map a worker to ``squeue``/``scancel``.
"""

from __future__ import annotations

import os

#: Heartbeat field ← Slurm environment variable. An array element has its own SLURM_JOB_ID and also the
#: array's id and its index (what ``squeue`` shows as ``ARRAYID_INDEX``).
SLURM_FIELDS = {
    "slurm_node": "SLURMD_NODENAME",
    "slurm_job_id": "SLURM_JOB_ID",
    "slurm_array_job_id": "SLURM_ARRAY_JOB_ID",
    "slurm_array_task_id": "SLURM_ARRAY_TASK_ID",
}


def slurm_info(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The Slurm fields of this process's environment that are set ({} outside Slurm)."""
    env = os.environ if environ is None else environ
    return {field: env[var] for field, var in SLURM_FIELDS.items() if env.get(var)}
