"""Preemption notices: watch the cloud's interruption signal, then report the unit lost.

A spot/preemptible VM gets a short warning before it is reclaimed: AWS posts a spot
``instance-action`` in the instance metadata service about two minutes ahead, GCP flips
``instance/preempted`` to ``TRUE`` about 30 seconds ahead. :func:`start_watcher` starts a
background :class:`Watcher` that notices either signal (or, for the local backend, a notice
file appearing) and calls ``on_notice(reason)`` once. The client app then checkpoints and
reports the unit lost so that the server re-issues it at once instead of after its deadline:

- on BOINC, :func:`report_lost_to_boinc` aborts the task through ``boinccmd --task URL NAME
  abort`` and then forces a scheduler RPC with ``boinccmd --project URL update`` so that the
  aborted result reaches the server before the VM goes away;
- on the local backend, the client exits with status 75 (``EX_TEMPFAIL``).

Off the cloud (laptops, volunteers) detection costs one parallel probe with a 0.3 s timeout
and :func:`start_watcher` returns ``None``. Network errors never stop a watcher: they are
logged at debug level and retried with exponential backoff.

Environment:

``BDL_METADATA_URL``
    base URL of the metadata service (overrides the cloud's address; tests point it at a
    local HTTP server).
``BDL_PREEMPT_PROVIDER``
    ``auto`` (default), ``aws``, ``gcp`` or ``none`` (no cloud watching).
``BDL_PREEMPT_NOTICE_FILE``
    a path; the watcher also fires when this file appears (local backend's simulated notice).

The package, by concern: :mod:`.notices` (the notice sources and cloud detection),
:mod:`.watcher` (the watcher thread) and :mod:`.boinc_client` (``boinccmd`` calls).
"""

from boinc_dl.client_app.preemption.boinc_client import (
    BoincTask,
    boinc_task_from_slot,
    boinccmd_abort_argv,
    boinccmd_update_argv,
    escape_project_url,
    report_lost_to_boinc,
)
from boinc_dl.client_app.preemption.notices import (
    ENV_METADATA_URL,
    ENV_NOTICE_FILE,
    ENV_PROVIDER,
    EXIT_PREEMPTED,
    PROVIDERS,
    AwsSpotSource,
    GcpPreemptedSource,
    MetadataError,
    NoticeFileSource,
    NoticeSource,
    Signal,
    detect_provider,
)
from boinc_dl.client_app.preemption.watcher import Watcher, start_watcher

__all__ = [
    "ENV_METADATA_URL",
    "ENV_NOTICE_FILE",
    "ENV_PROVIDER",
    "EXIT_PREEMPTED",
    "PROVIDERS",
    "AwsSpotSource",
    "BoincTask",
    "GcpPreemptedSource",
    "MetadataError",
    "NoticeFileSource",
    "NoticeSource",
    "Signal",
    "Watcher",
    "boinc_task_from_slot",
    "boinccmd_abort_argv",
    "boinccmd_update_argv",
    "detect_provider",
    "escape_project_url",
    "report_lost_to_boinc",
    "start_watcher",
]
