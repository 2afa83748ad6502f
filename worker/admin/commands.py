"""The operators' fleet commands, for the CLI to register: `kvflow workers | status | drain |
resume | cancel | scale | up` (each defined in the module of its job)."""

from worker.admin.cancel import cancel
from worker.admin.drain import drain, resume
from worker.admin.fleet import status, workers
from worker.admin.scale import scale, up

__all__ = ["cancel", "drain", "resume", "scale", "status", "up", "workers"]
