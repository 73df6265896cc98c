"""Cheap checks of a job against its data and this machine, before anything runs.

What a run would otherwise find late (after TensorFlow started in every slot, or as a
unit failing on every host): more subsets or partitions than training examples,
labels beyond the model's outputs, features the model cannot take, and a local
backend far larger than the machine. ``boinc-dl validate`` and ``boinc-dl run`` call
the same functions; each raises a one-line :class:`~boinc_dl.server.common.errors.SpecError`.
"""

from __future__ import annotations

import os
from typing import Any

from boinc_dl.server.common.errors import SpecError
from boinc_dl.server.common.spec import JobSpec, local_options

#: Resident memory of one slot or assimilator process with TensorFlow loaded (measured:
#: 350-450 MB on CPU builds): the unit of the memory estimate.
PROCESS_MB = 400
#: Slot threads per core beyond which a local run only thrashes.
MAX_THREADS_PER_CORE = 32
#: Fewer training examples than this cannot train anything worth a run.
MIN_TRAIN_EXAMPLES = 10


def machine() -> tuple[int, int]:
    """(cores, physical memory in MB) of this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError, AttributeError):
        mem = 0
    return cores, int(mem)


def check_resources(spec: JobSpec, opts: dict[str, Any] | None = None,
                    cores: int | None = None, memory_mb: int | None = None) -> None:
    """Refuse a local backend (``spec.backend.local`` overridden by ``opts``) far beyond
    this machine: more slot threads than ``MAX_THREADS_PER_CORE`` per core, or more
    processes than its memory can hold."""
    if spec.backend.kind != "local":
        return
    o = local_options(spec, opts)
    have_cores, have_mb = machine()
    cores = cores or have_cores
    memory_mb = memory_mb if memory_mb is not None else have_mb
    slots = int(o["workers"]) * int(o["slots"])
    threads = slots * int(o["threads_per_slot"])
    if threads > MAX_THREADS_PER_CORE * cores:
        raise SpecError(f"backend.local: {o['workers']} workers x {o['slots']} slots x {o['threads_per_slot']} "
                        f"thread(s) = {threads} threads on {cores} core(s); at most "
                        f"{MAX_THREADS_PER_CORE * cores} make sense here")
    need = (slots + int(o["assimilators"])) * PROCESS_MB
    if memory_mb and need > memory_mb:
        raise SpecError(f"backend.local: {slots} slots + {o['assimilators']} assimilators need about "
                        f"{need // 1024 + 1} GiB ({PROCESS_MB} MB each); this machine has {memory_mb // 1024} GiB")


def check_split(spec: JobSpec, n_train: int) -> None:
    """Enough training examples to train on: at least ``MIN_TRAIN_EXAMPLES``, at least one
    per subset (VC-ASGD) or partition (MOP), and a batch no larger than the data.

    (A batch larger than one *subset* is fine: that unit takes one step per local epoch
    on its whole subset, as Keras does with a batch larger than the data.)"""
    if n_train < MIN_TRAIN_EXAMPLES:
        d = spec.dataset
        field = "dataset.limit" if d.limit is not None else "dataset"
        source = f"{d.limit} examples" if d.limit is not None else (d.train or d.name)
        split = f" after the {d.val_fraction:.0%} validation split" if d.val is None and d.name != "mnist" else ""
        raise SpecError(f"{field}: {source} leave{'s' if d.limit is None else ''} {n_train} training example(s)"
                        f"{split}; at least {MIN_TRAIN_EXAMPLES} are needed")
    if spec.mode == "mop" and spec.mop is not None:
        if spec.mop.partitions > n_train:
            raise SpecError(f"mop.partitions: {spec.mop.partitions} partitions but only {n_train} training examples")
    elif spec.vcasgd.n_subsets is not None and spec.vcasgd.n_subsets > n_train:
        raise SpecError(f"vcasgd.n_subsets: {spec.vcasgd.n_subsets} subsets but only {n_train} training examples")
    if spec.training.batch_size > n_train:
        raise SpecError(f"training.batch_size: {spec.training.batch_size:,} is larger than the {n_train:,} "
                        "training examples")


def check_model_fits(in_shape: tuple[Any, ...], out_shape: tuple[Any, ...], features: tuple[int, ...],
                     n_classes: int) -> None:
    """The model takes the data's features and has an output per class label."""
    if in_shape and tuple(features) != tuple(in_shape):
        raise SpecError(f"model input shape {tuple(in_shape)} does not match the dataset's features {tuple(features)}")
    if out_shape and out_shape[-1] is not None and int(out_shape[-1]) < n_classes:
        raise SpecError(f"labels go up to {n_classes - 1} but the model has {out_shape[-1]} outputs: "
                        f"labels must be in 0..{int(out_shape[-1]) - 1}")
