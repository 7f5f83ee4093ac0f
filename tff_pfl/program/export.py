"""Writes an algorithm's computations in TFF's production forms, with a manifest.

`export(config)` partitions the data as a training run would, builds the
algorithm's process and writes to `config.output_dir`:

* `computations/*.pb`: serialized `computation_pb2.Computation`s
  (`tff.framework.serialize_computation`) of `initialize`, the round,
  `evaluate`, `personalize` where the algorithm has one, and
  `initial_client_state`. For an algorithm whose process has a device-state
  form (`PersonalizedProcess.device`) the round is that form: one
  computation per phase (`next`, or KT-pFL's `share` and `distill`), each
  `(S@SERVER, {<client_id, state_file>}@CLIENTS) -> <state, metrics>@SERVER`;
  and the client-local stages a device runs are exported on their own:
  `client_work[_<phase>]` (what the device computes from the broadcast,
  reading and writing its client state), `client_evaluate` and
  `client_personalize` (e.g. PersFL's distillation). Otherwise the round is
  the in-process `next`.
* `map_reduce_form/<phase>/*.pb` and `distribute_aggregate_form/<phase>/*.pb`:
  each phase as `tff.backends.mapreduce.MapReduceForm` and
  `DistributeAggregateForm`, one file per piece.
* `manifest.json`: algorithm and configuration, package versions, the client
  data root the computations read, and for every file its SHA-256, size and
  TFF type signature; for an algorithm whose round does not fit, the reason.

`deploy/loader.py` reads the directory back and runs it.
"""

import collections
import hashlib
import json
import os
import platform
import shutil
import time
from collections.abc import Callable
from importlib import metadata

import tensorflow_federated as tff

from tff_pfl.computations import audit
from tff_pfl.data import client_data
from tff_pfl.program import algorithms, experiment, run_config

MANIFEST = 'manifest.json'
FORMAT_VERSION = 1
MAP_REDUCE_PIECES = (
    'prepare',
    'work',
    'zero',
    'accumulate',
    'merge',
    'report',
    'secure_sum_bitwidth',
    'secure_sum_max_input',
    'secure_modular_sum_modulus',
    'update',
)
DISTRIBUTE_AGGREGATE_PIECES = (
    'server_prepare',
    'server_to_client_broadcast',
    'client_work',
    'client_to_server_aggregation',
    'server_result',
)


def _versions() -> collections.OrderedDict:
    versions = collections.OrderedDict(python=platform.python_version())
    for package in ('tff-pfl', 'tensorflow-federated', 'tensorflow', 'numpy'):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _write_computation(out: str, relative: str, comp: tff.Computation) -> collections.OrderedDict:
    """Serializes `comp` to `out/relative`; returns its manifest entry."""
    blob = tff.framework.serialize_computation(comp).SerializeToString()
    path = os.path.join(out, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
        f.write(blob)
    return collections.OrderedDict(
        file=relative,
        sha256=hashlib.sha256(blob).hexdigest(),
        bytes=len(blob),
        type_signature=str(comp.type_signature),
    )


def exported_computations(process) -> collections.OrderedDict:
    """Name -> computation of what `export` serializes under `computations/`.

    Args:
      process: a `PersonalizedProcess`; its device-state form, if it has one,
        gives the round's phases, `evaluate`, `personalize` and the client
        computations.

    Returns:
      `initialize` and `initial_client_state`, then the round (`next`, or
      one computation per device phase), `evaluate`, `personalize` where
      there is one, and any client computations of the device form.
    """
    device = process.device
    comps = collections.OrderedDict(
        initialize=device.initialize if device is not None else process.initialize,
        initial_client_state=process.initial_client_state,
    )
    if device is not None:
        comps.update(device.phases)
        comps['evaluate'] = device.evaluate
        if device.personalize is not None:
            comps['personalize'] = device.personalize
        comps.update(device.client_computations)
    else:
        comps.update(next=process.next, evaluate=process.evaluate)
        if process.personalize is not None:
            comps['personalize'] = process.personalize
    return comps


def export(
    config: run_config.ExperimentConfig,
    *,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> collections.OrderedDict:
    """Exports `config.algorithm` to `config.output_dir`; see the module docstring.

    Args:
      config: the algorithm and its hyperparameters, the dataset and the
        partition, as for a training run; `output_dir` receives the export.
      overwrite: replace a non-empty `output_dir`.
      log: receives progress lines.

    Returns:
      The manifest.

    Raises:
      run_config.ConfigError, sources.DataError, partition.PartitionError:
        bad input, raised before anything is written. If writing fails
        later, the output directory is removed.
    """
    config.validate()
    out = os.path.abspath(config.output_dir)
    experiment.prepare_output_dir(out, overwrite)
    spec, process = experiment.prepare_run(config, out, log)
    try:
        manifest = _export_into(out, config, spec, process, log)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return manifest


def _aggregation(config, process) -> collections.OrderedDict:
    """How the uploads reach the server: DP, secure sums, and each phase's CLIENTS-to-SERVER intrinsics."""
    phases = process.device.phases if process.device is not None else {'next': process.next}
    return collections.OrderedDict(
        dp=config.privacy.dp_noise_multiplier is not None,
        secure_aggregation=config.privacy.secure_aggregation,
        phases=collections.OrderedDict(
            (phase, sorted(audit.clients_to_server_intrinsics(comp))) for phase, comp in phases.items()
        ),
    )


def _export_into(out, config, spec, process, log) -> collections.OrderedDict:
    limit = algorithms.get(config.algorithm).not_one_aggregation
    manifest = collections.OrderedDict(
        format_version=FORMAT_VERSION,
        algorithm=config.algorithm,
        created=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
        versions=_versions(),
        client_data_root=spec.root,
        client_ids=list(spec.client_ids),
        # What the client computations read, for a device that prepares its own files
        # (`deploy/loader.py --clients_dir`): the client data's own manifest.
        client_data=client_data.load_client_data_manifest(spec.root),
        device_state=process.device is not None,
        # The round's phases, in order (device form): `computations/<phase>.pb`.
        phases=list(process.device.phases) if process.device is not None else [],
        forms=collections.OrderedDict(),
        computations=collections.OrderedDict(),
        config=config.to_dict(),
        aggregation=_aggregation(config, process),
    )
    for name, comp in exported_computations(process).items():
        manifest['computations'][name] = _write_computation(out, f'computations/{name}.pb', comp)
    log(f'wrote {len(manifest["computations"])} computations')
    forms = (
        ('map_reduce_form', tff.backends.mapreduce.get_map_reduce_form_for_computation, MAP_REDUCE_PIECES),
        (
            'distribute_aggregate_form',
            tff.backends.mapreduce.get_distribute_aggregate_form_for_computation,
            DISTRIBUTE_AGGREGATE_PIECES,
        ),
    )
    for form_name, convert, pieces in forms:
        if process.device is None:
            reason = limit or 'the process has no device-state form'
            manifest['forms'][form_name] = collections.OrderedDict(exported=False, reason=reason)
            continue
        entry = collections.OrderedDict(exported=True, phases=collections.OrderedDict())
        for phase, comp in process.device.phases.items():
            form = convert(comp)
            entry['phases'][phase] = collections.OrderedDict(
                (piece, _write_computation(out, f'{form_name}/{phase}/{piece}.pb', getattr(form, piece)))
                for piece in pieces
            )
        manifest['forms'][form_name] = entry
        log(f'wrote {form_name}: {len(entry["phases"])} phase(s) of {len(pieces)} pieces')
    if process.device is None:
        reason = manifest['forms']['map_reduce_form']['reason']
        log(f'{config.algorithm}: no MapReduceForm or DistributeAggregateForm: {reason}')
    with open(os.path.join(out, MANIFEST + '.tmp'), 'w') as f:
        json.dump(manifest, f, indent=2)
    os.replace(os.path.join(out, MANIFEST + '.tmp'), os.path.join(out, MANIFEST))
    return manifest
