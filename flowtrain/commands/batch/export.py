"""``flowtrain export``: a batch run's bundle (``run_export(ExportJob)``), rebuilt from its run directory (``model.pt``,
``config.json``: the run's ``BatchJob``, its dataset), written with the weights, the architecture, the feature spec
and statistics, the drift reference and checksums; signed with ``--bundle-key-file`` when given."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from connectors.fields import build, check, to_config
from connectors.paths import is_url
from flowtrain.commands.batch.options import BatchJob, ExportJob
from flowtrain.commands.drift.options import REFERENCE
from flowtrain.errors import FlowtrainError
from flowtrain.train.bundle import bundle_key, owned_bundle_files, read_bundle, write_bundle
from flowtrain.train.loader import TabularDataset
from flowtrain.train.models import build_run_model
from flowtrain.train.plan import train_config
from flowtrain.train.rundir.files import RunFiles, file_name
from flowtrain.train.staging import fetch_dir, staged_dir


def run_export(job: ExportJob) -> str:
    """Write the bundle of run directory ``job.run`` into ``job.out`` (from its model.pt, config.json and
    dataset), signed with ``--bundle-key-file`` when given; returns where the bundle is, as a ``str`` whatever
    ``--out`` is: its absolute local path, or the object-store URL given (what ``load`` and ``--model``
    take; ``pathlib.Path`` would break a URL's ``//``). An existing ``--out`` is
    replaced (``--overwrite``) only when it is empty or a bundle flowtrain wrote: a link, a file, or anything
    its bundle.json does not list is an error naming it, and nothing is touched."""
    job = check(job)
    if not job.run or not job.out:
        raise FlowtrainError("export needs RUN (a `flowtrain batch` run directory) and --out DIR")

    if is_url(job.run) or is_url(job.out):  # object stores: a local copy of the run, the bundle published
        run = str(fetch_dir(job.run, "RUN", marker=file_name("model"))) if is_url(job.run) else job.run
        if not is_url(job.out):
            return run_export(dataclasses.replace(job, run=run))
        with staged_dir(job.out, "--out", marker="bundle.json") as stage:
            run_export(dataclasses.replace(job, run=run, out=str(stage.local)))
            stage.push()  # bundle.json after the files it lists
        return job.out
    run = Path(job.run).resolve()
    out = Path(os.path.abspath(job.out))  # a link at --out is not followed (and not replaced)
    key = bundle_key(job.bundle_key_file)
    files = RunFiles(run)
    for needed in (files.model, files.config):
        if not needed.is_file():
            raise FlowtrainError(f"export {run}: no {needed.name}; give the directory of a finished `flowtrain "
                                 f"batch` run")
    if (out.exists() or out.is_symlink()) and not job.overwrite and out != files.bundle:
        raise FlowtrainError(f"--out {out} exists; give a new directory, or --overwrite to replace it (only a bundle "
                             f"flowtrain wrote is replaced)")
    owned_bundle_files(out)  # --overwrite replaces only a bundle flowtrain wrote: checked before any work
    options = json.loads(files.config.read_text())
    try:
        batch_job = build(BatchJob, {k: v for k, v in options.items() if k in to_config(BatchJob())})
    except FlowtrainError as err:
        raise FlowtrainError(f"export {run}: config.json: {err}") from None
    dataset = Path(batch_job.dataset) if batch_job.dataset else files.dataset
    try:
        data = TabularDataset(dataset)
    except Exception as err:  # noqa: BLE001 - named for the user below
        raise FlowtrainError(f"export {run}: its dataset {dataset} cannot be read ({err}); export needs the run's "
                             f"dataset (later, the bundle alone is enough)") from None
    config = train_config(batch_job)
    model = build_run_model(batch_job.model, data, config)
    model.load_state_dict(torch.load(files.model, weights_only=True))

    reference = files.drift_reference  # the run's drift reference travels with its bundle
    extra = {REFERENCE: json.loads(reference.read_text())} if reference.is_file() else None
    write_bundle(out, model, data, config, factory=batch_job.model, run=run.name, torch_export=job.torch_export,
                 key=key, extra=extra)
    read_bundle(out, key=key)  # the bundle written checks
    return str(out)
