"""One experiment = one output directory: config, data summary, metrics, report.

`run_experiment(config)` is what the `tff-pfl-train` binary calls, and what a
notebook calls: it validates the configuration, writes the client partition,
builds the algorithm's process, runs it on a project-owned TFF worker and
writes

    <output_dir>/config.json       the configuration of the run
    <output_dir>/client_data/      every client's splits (read inside TFF)
    <output_dir>/partition.csv|png per-client class histogram
    <output_dir>/metrics.csv       one row per round
    <output_dir>/clients.csv       one row per client (final evaluation)
    <output_dir>/tensorboard/      the round metrics as TensorBoard scalars
    <output_dir>/accuracy.png      test accuracy (and train accuracy) per round
    <output_dir>/clients.png       per-client test accuracy bars
    <output_dir>/report.md         the paper-style summary
    <output_dir>/worker.log        the TFF worker's own output
"""

import dataclasses
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable

from tff_pfl import models, reports, runtime
from tff_pfl.computations import privacy as privacy_lib
from tff_pfl.program import algorithms, checkpoints, decentralized, health, run_config, run_report, training_loop


def prepare_output_dir(path: str, overwrite: bool) -> None:
    """Checks that `path` may be written: empty or absent (or `overwrite`), in a writable parent.

    Creates the parent directory if needed.

    Args:
      path: the run's output directory.
      overwrite: whether a non-empty `path` may be replaced.

    Raises:
      run_config.ConfigError: otherwise; nothing is written.
    """
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise run_config.ConfigError(f'output_dir {path} exists and is not a directory')
        if os.listdir(path) and not overwrite:
            raise run_config.ConfigError(f'output_dir {path} is not empty; pass --overwrite to replace it')
    parent = os.path.dirname(os.path.abspath(path)) or '.'
    try:
        os.makedirs(parent, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=parent, prefix='.probe.')
        probe.close()
    except OSError as e:
        raise run_config.ConfigError(f'output_dir {path} is not writable: {e.strerror}') from None


def public_examples(config: run_config.ExperimentConfig) -> int:
    """Examples the algorithm needs set aside as public data.

    Args:
      config: the run's configuration.

    Returns:
      The algorithm's `public_examples` setting; 0 for an algorithm without
      public data.
    """
    from tff_pfl.computations import heterogeneous

    if isinstance(config.settings, heterogeneous.PublicKnowledge):
        return config.settings.public_examples
    return 0


def public_dataset(config: run_config.ExperimentConfig) -> str | None:
    """Where the algorithm's public data come from.

    Args:
      config: the run's configuration.

    Returns:
      The algorithm's `public_dataset` source spec, or None when the public
      examples are set aside from `config.data.dataset` (or it has no public data).
    """
    from tff_pfl.computations import heterogeneous

    if isinstance(config.settings, heterogeneous.PublicKnowledge):
        return config.settings.public_dataset or None
    return None


def prepare_run(config: run_config.ExperimentConfig, out: str, log: Callable[[str], None] = print):
    """Writes a new run's client data and config, and builds its process; all or nothing.

    The client data, `config.json` and the partition summary are written to a
    staging directory beside `out`; the algorithm's process is built (its
    model against the data, the algorithm's checks against the model) for
    the data's final place, `out/client_data`; only then is the staging
    directory renamed to `out` (replacing it). On any failure nothing is
    left: `out` is as it was.

    Args:
      config: a validated configuration.
      out: absolute path of the run directory (checked by the caller).
      log: receives one line about the data.

    Returns:
      `(spec, process)`: the `client_data.ClientDataSpec` rooted at
      `out/client_data`, and the built `PersonalizedProcess`.

    Raises:
      run_config.ConfigError: the model or the process cannot be built for this data
        (one line, e.g. a convolutional model on vector features).
      sources.DataError, partition.PartitionError: bad data or partition.
    """
    staging = tempfile.mkdtemp(prefix=f'.{os.path.basename(out)}.staging.', dir=os.path.dirname(out))
    try:
        prepared, spec = write_client_data(config, staging, out)
        process = build_process(config, spec)
        if config.evaluation.eval_validation:
            check_validation(spec)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(data_line(config, prepared, spec))
    return spec, process


def write_client_data(config: run_config.ExperimentConfig, directory: str, out: str):
    """Writes the run's client data, `config.json` and partition summary into `directory`.

    Args:
      config: a validated configuration.
      directory: where to write (`directory/client_data`, `config.json`,
        `partition.csv`, `partition.png`).
      out: the run directory the data will live in (`directory` itself, or
        the directory a staging `directory` is renamed to).

    Returns:
      `(prepared, spec)`: `pipeline.prepare`'s result, and its spec rooted
      at `out/client_data`.

    Raises:
      sources.DataError, partition.PartitionError: bad data or partition.
    """
    from tff_pfl.data import pipeline

    prepared = pipeline.prepare(
        os.path.join(directory, 'client_data'),
        dataset=config.data.dataset,
        partition_name=config.data.partition.name,
        num_clients=config.data.num_clients,
        seed=config.seed,
        split_fractions=config.data.split_fractions,
        partition_params=config.data.partition.params(),
        data_dir=config.data.data_dir,
        download=config.data.download,
        public_examples=public_examples(config),
        public_dataset=public_dataset(config),
    )
    with open(os.path.join(directory, 'config.json'), 'w') as f:
        json.dump(config.to_dict(), f, indent=2)
    spec = dataclasses.replace(prepared.spec, root=os.path.join(out, 'client_data'))
    run_report.write_partition_summary(directory, spec, prepared.class_histogram)
    return prepared, spec


def data_line(config: run_config.ExperimentConfig, prepared, spec) -> str:
    """The run's one line about its data (source, clients, partition, examples per split).

    Args:
      config: the run's configuration.
      prepared: `pipeline.prepare`'s result (`write_client_data`).
      spec: the run's `client_data.ClientDataSpec`.

    Returns:
      The line, without a trailing newline.
    """
    return (
        f'data: {prepared.source_name}, {spec.num_clients} clients, partition {config.data.partition.name}, '
        f'train/val/test examples {sum(spec.split_sizes["train"])}/{sum(spec.split_sizes["val"])}/'
        f'{sum(spec.split_sizes["test"])}' + (f' ({prepared.note})' if prepared.note else '')
    )


def check_validation(spec) -> None:
    """Refuses `eval_validation` on a partition where some client has no validation examples.

    Args:
      spec: the run's `client_data.ClientDataSpec`.

    Raises:
      run_config.ConfigError: one line naming the clients.
    """
    from tff_pfl.data import client_data

    try:
        client_data.require_validation(spec, 'eval_validation')
    except ValueError as e:
        raise run_config.ConfigError(str(e)) from None


def build_process(config: run_config.ExperimentConfig, spec):
    """Builds the algorithm's process for `spec`; one-line run_config.ConfigError when it cannot be.

    Args:
      config: a validated configuration.
      spec: the run's `client_data.ClientDataSpec`.

    Returns:
      The algorithm's `PersonalizedProcess`.

    Raises:
      run_config.ConfigError: the model does not take the data, or the algorithm does
        not take the model (e.g. FedPer's personal layers, PersFL's stacked
        grid), with the builder's message.
    """
    model_fn = functools.partial(models.get(config.model_name()), spec.feature_shape, spec.num_classes)
    try:
        return algorithms.build(config.algorithm, config.settings, spec, model_fn, config)
    except (ValueError, TypeError) as e:
        raise run_config.ConfigError(f'{config.algorithm} cannot run on this data and model: {e}') from None


class RunComplete(Exception):
    """The output directory already holds this run, finished."""


# Fields that may differ when a run is resumed: where and how it runs, not what it computes.
# Where and how a run executes (the workers, the TLS files the driver reaches them with, the rounds a
# call: the same numbers either way), and
# what it does on a non-finite loss (a run that has not diverged trains the same rounds either way;
# a config.json written before that setting resumes too).
_RESUMABLE_CHANGES = frozenset(
    {
        'output_dir',
        'workers',
        'worker_tls_ca',
        'worker_tls_cert',
        'worker_tls_key',
        'max_concurrent_clients',
        'rounds_per_call',
        'checkpoint_every',
        'stop_on_divergence',
    }
)


def _saved_config(out: str) -> dict | None:
    """The `config.json` of an earlier run in `out`, or None if there is none."""
    path = os.path.join(out, 'config.json')
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return run_config.migrate(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
        raise run_config.ConfigError(
            f'output_dir {out} has an unreadable config.json ({e}); pass --overwrite to replace it'
        ) from None


# Run settings added after runs were recorded: the value a `config.json` that lacks one means.
_ADDED_SINCE = {'eval_validation': False}


def _changed_fields(saved: dict, config: run_config.ExperimentConfig) -> list[str]:
    # The flat form holds only the run's settings and the chosen algorithm's:
    # a setting of another algorithm can neither be set nor differ.
    current = json.loads(json.dumps(config.to_dict()))
    saved = {**_ADDED_SINCE, **saved}
    return [
        f'{k}: {saved.get(k)!r} -> {current[k]!r}'
        for k in current
        if k not in _RESUMABLE_CHANGES and saved.get(k) != current[k]
    ]


def _epsilon_column(dp: privacy_lib.DPConfig, config: run_config.ExperimentConfig, num_clients: int):
    delta = config.privacy.delta_for(num_clients)

    def columns(round_num: int) -> dict:
        return {'dp_epsilon': privacy_lib.epsilon(dp, config.dp_sampling_probability(), round_num, delta)}

    return columns


def resumable_round(config: run_config.ExperimentConfig) -> int | None:
    """The round an interrupted run in `config.output_dir` would continue from.

    Args:
      config: the run's configuration.

    Returns:
      The round of the newest checkpoint, if `config.output_dir` holds an
      unfinished run of this configuration (fields in `_RESUMABLE_CHANGES`
      may differ) with a checkpoint; None otherwise (no run, another
      configuration, an unreadable config.json, a finished run, or no
      checkpoint yet).
    """
    out = os.path.abspath(config.output_dir)
    try:
        saved = _saved_config(out)
    except run_config.ConfigError:
        return None
    if saved is None or _changed_fields(saved, config) or os.path.exists(os.path.join(out, 'report.md')):
        return None
    return checkpoints.RunCheckpoints(os.path.join(out, 'checkpoints')).latest_round()


def run_experiment(
    config: run_config.ExperimentConfig,
    *,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
    on_process: Callable[[object], None] | None = None,
) -> training_loop.RunResult:
    """Runs one experiment end to end and writes its output directory.

    A run writes a checkpoint every `config.checkpoints.checkpoint_every` rounds. Run
    again with the same configuration and `output_dir`, an interrupted run
    continues from its last checkpoint (killed, even with SIGKILL, at any
    point) and ends with the numbers an uninterrupted run gives.

    Args:
      config: the run's configuration.
      overwrite: replace a non-empty `output_dir`, even one holding this run.
      log: receives progress lines.
      on_process: called with the built process before training starts.

    Returns:
      The `training_loop.RunResult`.

    Raises:
      run_config.ConfigError, sources.DataError, partition.PartitionError: bad input;
        raised before anything is written to `output_dir`. Also when
        `output_dir` holds a run with another configuration, or checkpoints
        none of which can be read whole (nothing is touched then).
      RunComplete: `output_dir` holds this run, finished.
    """
    config.validate()
    out = os.path.abspath(config.output_dir)
    saved = None if overwrite else _saved_config(out)
    if saved is not None:
        changed = _changed_fields(saved, config)
        if changed:
            raise run_config.ConfigError(
                f'output_dir {out} holds a run with another configuration ({"; ".join(changed)}); '
                'pass --overwrite to replace it'
            )
        if os.path.exists(os.path.join(out, 'report.md')):
            raise RunComplete(f'output_dir {out} already holds this run, finished (report.md)')
    else:
        prepare_output_dir(out, overwrite)
    tls = config.runtime.worker_tls()  # the PEM files (validate checked them); None without TLS
    for address in config.runtime.workers:  # before anything is written
        try:
            runtime.check_worker(address, tls=tls)
        except runtime.RuntimeStartError as e:
            raise run_config.ConfigError(f'--workers: {e}') from None
    if saved is not None:
        from tff_pfl.data import client_data

        try:  # before anything is rewritten: with no readable checkpoint the directory stays as it is
            checkpoints.RunCheckpoints(os.path.join(out, 'checkpoints')).check()
        except checkpoints.CheckpointError as e:
            raise run_config.ConfigError(
                f'output_dir {out} cannot continue: {e}; nothing was changed: move the damaged files out of '
                f'{os.path.join(out, "checkpoints")} to start again from round 1, or pass --overwrite to replace it'
            ) from None
        spec = client_data.load_client_data_spec(os.path.join(out, 'client_data'))
        process = build_process(config, spec)
        log(f'continuing the run in {out}')
        # config.json says how the run goes on (a field of _RESUMABLE_CHANGES may differ).
        reports.write_text_atomic(os.path.join(out, 'config.json'), json.dumps(config.to_dict(), indent=2))
        # Rows past the last checkpoint are rewritten as the rounds are run again.
        for stale in ('metrics.csv', 'tensorboard'):
            path = os.path.join(out, stale)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    else:
        spec, process = prepare_run(config, out, log)
    if on_process is not None:
        on_process(process)
    # The validation curve: the same algorithm built on the clients' validation splits scores the same states.
    validation = None
    if config.evaluation.eval_validation:
        validation = build_process(config, dataclasses.replace(spec, evaluation_split='val'))
    # Settings that imply a model that barely moves: one line each, before round 1 (docs/reliability.md).
    warnings = health.pre_run_warnings(config, health.dp_uploads(config, spec, process))
    for line in warnings:
        log(f'warning: {line}')
    metrics_path = os.path.join(out, 'metrics.csv')
    # Rounds are released through TFF's release managers as they finish; the
    # CSV manager rewrites the file whenever a row brings new columns
    # (evaluated rounds), so every row has every column.
    on_round = reports.RoundRelease(metrics_path, os.path.join(out, 'tensorboard'))

    def on_resume(round_num, rows):
        del round_num
        for row in rows:
            on_round(row)

    try:
        with runtime.runtime_for(
            config.runtime.workers,
            tls=tls,
            max_concurrent_computation_calls=config.runtime.max_concurrent_clients,
            log_path=os.path.join(out, 'worker.log'),
        ):
            loop = dict(
                on_round=on_round,
                log=log,
                checkpoints=checkpoints.RunCheckpoints(os.path.join(out, 'checkpoints')),
                checkpoint_every=config.checkpoints.checkpoint_every,
                eval_clients=config.evaluation.eval_clients,
                stop_on_divergence=config.schedule.stop_on_divergence,
                on_resume=on_resume,
                # A large store is memory-mapped here (unlinked files).
                spill_dir=out,
                # The progress lines' STALLED / DIVERGING tags compare with chance (health.RunMonitor).
                num_classes=spec.num_classes,
                # A source's own client ids (TFF's Shakespeare roles, a user's ClientData ids) in clients.csv.
                source_ids=spec.source_ids,
                validation=validation,
            )
            if algorithms.get(config.algorithm).serverless:
                result = decentralized.run(
                    process,
                    spec.client_ids,
                    intervals=config.schedule.rounds,
                    seed=config.seed,
                    eval_every=config.evaluation.eval_every,
                    **config.settings.loop_arguments(),
                    **loop,
                )
            else:
                dp = config.dp_mechanism(spec.num_clients)
                result = training_loop.run(
                    process,
                    spec.client_ids,
                    rounds=config.schedule.rounds,
                    client_fraction=config.schedule.client_fraction,
                    seed=config.seed,
                    eval_every=config.evaluation.eval_every,
                    # Split over several workers, the round keeps client
                    # states on the devices (TFF's mergeable context returns
                    # nothing CLIENTS-placed from before the aggregation).
                    device_state_dir=os.path.join(out, 'client_states') if len(config.runtime.workers) > 1 else None,
                    # DP accounting assumes Poisson sampling of the clients.
                    poisson_sampling=config.poisson_sampling(),
                    privacy=None if dp is None else _epsilon_column(dp, config, spec.num_clients),
                    rounds_per_call=config.runtime.rounds_per_call,
                    **loop,
                )
            on_round.close()
            result.warnings[:0] = [f'before round 1: {line}' for line in warnings]
            # Inside the runtime: reading the state of a client that never took
            # part makes its initial state with a TFF call.
            run_report.write_results(out, config, spec, result, process)
    finally:
        on_round.close()
    return result
