"""The states a job and a unit end in: one home for the names that the work generators,
the assimilator, the backends and ``boinc-dl status`` compare against."""

from __future__ import annotations

#: A job's ``status`` once nothing more will run for it: finished, failed, or cancelled
#: by the user. A finished job is never resumed, re-issued or merged into.
FINISHED: tuple[str, ...] = ("done", "failed", "cancelled")

#: A unit's state once its result will never be merged (again): merged, given up, or
#: cancelled with its job.
SETTLED: tuple[str, ...] = ("assimilated", "failed", "cancelled")

#: A unit's state while its result may still be merged: registered, or handed to hosts.
OPEN: tuple[str, ...] = ("created", "in_progress")
