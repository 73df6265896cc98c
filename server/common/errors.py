"""Error types that map to one clear user-facing message (and an exit code)."""

from __future__ import annotations


class BoincDLError(Exception):
    """Base class: the CLI prints ``str(e)`` on one line and exits with ``exit_code``."""

    exit_code = 2


class SpecError(BoincDLError):
    """The job spec is malformed or names something that does not exist."""


class DatasetError(BoincDLError):
    """A dataset file is missing, unreadable or has the wrong arrays."""


class ModelError(BoincDLError):
    """The model builder cannot be imported or does not return a Keras model."""


class StoreUnavailable(BoincDLError):
    """Redis cannot be reached: a transient fault (retry later)."""

    exit_code = 3


class UnknownJob(BoincDLError):
    """No job of that name is recorded in Redis."""


class WeightsFormatError(BoincDLError):
    """A weights file is unreadable or does not match the model fingerprint."""


class ResultRejected(BoincDLError):
    """A result failed validation; ``reason`` says why (recorded in Redis).

    ``host_fault``: the refusal judges what the host computed (its file's content, an
    update over the hard cap, the held-out loss check), so it costs the host its trust
    where the job system keeps one (BOINC's ``host_app_version.consecutive_valid``).
    False for refusals that say nothing about the host: a unit the job's records do not
    know, files the server cannot read, an error of the assimilator itself.
    """

    def __init__(self, reason: str, host_fault: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.host_fault = host_fault


class JobExists(BoincDLError):
    """The job is already recorded and the command was not told what to do with it."""


def job_exists_message(job: str, where: object, status: str = "") -> str:
    """One line naming the ways on when ``boinc-dl run`` finds the job already there."""
    was = f" ({status})" if status else ""
    return (f"job {job!r} already exists in {where}{was}: continue it with --resume, start a fresh "
            "numbered run beside it with --new, or replace it with --overwrite")
