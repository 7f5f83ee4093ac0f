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

import collections
import dataclasses
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable

from tff_pfl import models, runtime
from tff_pfl.program import algorithms, checkpoints, reports, training_loop


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line."""


_NEEDS_PUBLIC = ('ktpfl', 'feddf', 'pfeddf')

DEFAULT_MODELS = {'synthetic': 'logistic', 'mnist': 'mnist_dnn', 'fashion_mnist': 'mnist_dnn'}


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything that defines a run; saved as `config.json`.

    Attributes mirror the `tff-pfl-train` flags; see `tff_pfl.cli.train`.
    """

    output_dir: str
    algorithm: str = 'fedavg'
    dataset: str = 'synthetic'
    data_dir: str | None = None
    download: bool = False
    partition: str = 'natural'
    num_clients: int = 30
    classes_per_client: int | None = None
    dirichlet_alpha: float | None = None
    examples_per_client: int | None = None
    examples_per_class: int | None = None
    kt_case1_counts: tuple = (450, 150)
    kd_split_sizes: tuple = (15, 100, 20, 100)
    split_fractions: tuple = (0.6, 0.2, 0.2)
    model: str | None = None
    rounds: int = 100
    client_fraction: float = 1.0
    local_epochs: int = 1
    local_steps: int = 0
    batch_size: int = 10
    client_learning_rate: float = 0.05
    server_learning_rate: float = 1.0
    eval_every: int = 10
    checkpoint_every: int = 10
    seed: int = 0
    max_concurrent_clients: int = 2
    # PersFL / PersFL-GD stage 2.
    distill_epochs: int = 5
    distill_batch_size: int = 32
    distill_learning_rate: float = 0.01
    temperatures: tuple = (1.0, 5.0, 9.0, 13.0, 17.0, 21.0, 25.0)
    imitations: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)
    teacher: str = 'optimal'
    # Self-FL.
    selffl_max_steps: int = 40
    selffl_default_steps: int = 20
    warmup_rounds: int = 0
    # KT-pFL (distillation settings above are shared).
    architectures: tuple = ('lenet', 'alexnet_small', 'resnet_small', 'shufflenet_small')
    public_examples: int = 0
    public_batch: int = 1000
    kt_temperature: float = 10.0
    kt_coefficient_learning_rate: float = 0.1
    kt_rho: float = 0.7
    kt_c_update: str = 'paper'
    # FedDF / pFedDF (distill_epochs: the server's passes per prototype).
    finetune_epochs: int = 5
    # KD-PDFL and its serverless baselines: --rounds counts exchange intervals.
    exchange_interval: int = 5
    kd_mean_neighbours: float = 5.0
    kd_max_neighbours: int = 5
    kd_mu1: float = 1.0
    kd_mu2: float = 1.0
    kd_c_base: float = 100.0
    kd_distance_batch: int = 32
    kd_distance_layer: int = -1
    kd_broadcast: str = 'adopt'
    finetune_from_slot: int = 150
    # Runtime: a TFF worker someone runs at host:port (deploy/README.md); empty: a local one.
    workers: tuple = ()
    # Baselines (fedavg_ft uses finetune_epochs as its largest fine-tuning epoch count).
    personal_layers: int = 1
    ditto_lambda: float = 0.1
    personal_epochs: int = 1
    pfedme_lambda: float = 15.0
    pfedme_inner_steps: int = 5
    pfedme_personal_learning_rate: float = 0.09
    pfedme_beta: float = 1.0
    perfedavg_alpha: float = 0.01
    perfedavg_delta: float = 0.001
    apfl_alpha: float = 0.5
    apfl_alpha_learning_rate: float = 0.01

    def model_name(self) -> str:
        """The model to use: the explicit one, else the dataset's default.

        Returns:
          A `tff_pfl.models` registry name: `model` if set; else
          `mnist_dnn` for `.npz` data, the `DEFAULT_MODELS` entry of the
          dataset, or `persfl_cnn`.
        """
        if self.model:
            return self.model
        base = self.dataset.split(':', 1)[-1] if self.dataset.startswith('tfds:') else self.dataset
        base = base.split(':', 1)[0]
        if base.endswith('.npz') or base == 'npz':
            return 'mnist_dnn'
        return DEFAULT_MODELS.get(base, 'persfl_cnn')

    def partition_params(self) -> dict:
        """Keyword arguments of the chosen partitioner.

        Returns:
          Parameter name -> value for `partition`; values may be None (unset
          flags); empty for a partition without parameters.
        """
        params = {
            'ds1': {'k': self.classes_per_client, 'examples_per_client': self.examples_per_client},
            'ds2': {'alpha': self.dirichlet_alpha},
            'dirichlet_clients': {'alpha': self.dirichlet_alpha},
            'dirichlet': {
                'alpha': 0.9 if self.dirichlet_alpha is None else self.dirichlet_alpha,
                'examples_per_client': self.examples_per_client,
            },
            'kd_dirichlet': {
                'alpha': self.dirichlet_alpha,
                'min_train': int(self.kd_split_sizes[0]),
                'max_train': int(self.kd_split_sizes[1]),
                'val_examples': int(self.kd_split_sizes[2]),
                'test_examples': int(self.kd_split_sizes[3]),
            },
            'shards': {'shards_per_client': self.classes_per_client},
            'iid': {'examples_per_client': self.examples_per_client},
            'ds3': {'classes_per_client': self.classes_per_client},
            'kt_case1': {'major': int(self.kt_case1_counts[0]), 'minor': int(self.kt_case1_counts[1])},
            'kt_case2': {'classes_per_client': self.classes_per_client, 'examples_per_class': self.examples_per_class},
            'natural': {},
        }
        return params.get(self.partition, {})

    def validate(self) -> 'ExperimentConfig':
        """Returns self, or raises ConfigError on the first bad value.

        Returns:
          This configuration.

        Raises:
          ConfigError: on the first value that cannot run.
        """
        checks = [
            (
                self.algorithm in algorithms.names(),
                f'unknown algorithm {self.algorithm!r}; known: {", ".join(algorithms.names())}',
            ),
            (
                self.model_name() in models.names(),
                f'unknown model {self.model_name()!r}; known: {", ".join(models.names())}',
            ),
            (self.rounds >= 1, f'rounds must be >= 1, got {self.rounds}'),
            (0.0 < self.client_fraction <= 1.0, f'client_fraction must be in (0, 1], got {self.client_fraction}'),
            (self.num_clients >= 1, f'num_clients must be >= 1, got {self.num_clients}'),
            (self.local_epochs >= 1, f'local_epochs must be >= 1, got {self.local_epochs}'),
            (self.batch_size >= 1, f'batch_size must be >= 1, got {self.batch_size}'),
            (self.client_learning_rate > 0, f'client_learning_rate must be > 0, got {self.client_learning_rate}'),
            (self.server_learning_rate > 0, f'server_learning_rate must be > 0, got {self.server_learning_rate}'),
            (self.eval_every >= 0, f'eval_every must be >= 0, got {self.eval_every}'),
            (self.checkpoint_every >= 0, f'checkpoint_every must be >= 0, got {self.checkpoint_every}'),
            (
                self.classes_per_client is None or self.classes_per_client >= 1,
                f'classes_per_client must be >= 1, got {self.classes_per_client}',
            ),
            (
                self.examples_per_class is None or self.examples_per_class >= 1,
                f'examples_per_class must be >= 1, got {self.examples_per_class}',
            ),
            (
                len(self.kt_case1_counts) == 2 and all(int(c) == c and c >= 1 for c in self.kt_case1_counts),
                f'kt_case1_counts must be two positive integers, got {list(self.kt_case1_counts)}',
            ),
            (
                len(self.kd_split_sizes) == 4
                and all(int(c) == c and c >= 1 for c in self.kd_split_sizes)
                and self.kd_split_sizes[0] <= self.kd_split_sizes[1],
                f'kd_split_sizes must be min_train <= max_train, val, test (positive integers), '
                f'got {list(self.kd_split_sizes)}',
            ),
            (
                self.dirichlet_alpha is None or self.dirichlet_alpha > 0,
                f'dirichlet_alpha must be > 0, got {self.dirichlet_alpha}',
            ),
            (
                self.examples_per_client is None or self.examples_per_client >= 1,
                f'examples_per_client must be >= 1, got {self.examples_per_client}',
            ),
            (
                len(self.split_fractions) == 3
                and all(f > 0 for f in self.split_fractions)
                and abs(sum(self.split_fractions) - 1.0) < 1e-6,
                f'split_fractions must be three positive numbers summing to 1, got {list(self.split_fractions)}',
            ),
            (
                self.max_concurrent_clients >= 1 or self.max_concurrent_clients == -1,
                f'max_concurrent_clients must be >= 1 or -1, got {self.max_concurrent_clients}',
            ),
            (self.distill_epochs >= 1, f'distill_epochs must be >= 1, got {self.distill_epochs}'),
            (self.distill_batch_size >= 1, f'distill_batch_size must be >= 1, got {self.distill_batch_size}'),
            (self.distill_learning_rate > 0, f'distill_learning_rate must be > 0, got {self.distill_learning_rate}'),
            (
                len(self.temperatures) >= 1 and all(t > 0 for t in self.temperatures),
                f'temperatures must be positive numbers, got {list(self.temperatures)}',
            ),
            (
                len(self.imitations) >= 1 and all(0 <= i <= 1 for i in self.imitations),
                f'imitations must be numbers in [0, 1], got {list(self.imitations)}',
            ),
            (self.teacher in ('optimal', 'final'), f"teacher must be 'optimal' or 'final', got {self.teacher!r}"),
            (self.local_steps >= 0, f'local_steps must be >= 0, got {self.local_steps}'),
            (self.selffl_max_steps >= 1, f'selffl_max_steps must be >= 1, got {self.selffl_max_steps}'),
            (self.selffl_default_steps >= 1, f'selffl_default_steps must be >= 1, got {self.selffl_default_steps}'),
            (self.warmup_rounds >= 0, f'warmup_rounds must be >= 0, got {self.warmup_rounds}'),
            (
                all(a in models.names() for a in self.architectures),
                f'unknown architecture in {list(self.architectures)}; known: {", ".join(models.names())}',
            ),
            (self.public_examples >= 0, f'public_examples must be >= 0, got {self.public_examples}'),
            (
                self.algorithm not in _NEEDS_PUBLIC or self.public_examples > 0,
                f'{self.algorithm} needs --public_examples > 0',
            ),
            (
                self.algorithm not in ('ktpfl', 'ktpfl_homo') or self.client_fraction == 1.0,
                f'{self.algorithm} trains every client every round: --client_fraction=1',
            ),
            (self.finetune_epochs >= 0, f'finetune_epochs must be >= 0, got {self.finetune_epochs}'),
            (self.exchange_interval >= 2, f'exchange_interval must be >= 2, got {self.exchange_interval}'),
            (self.kd_mean_neighbours > 0, f'kd_mean_neighbours must be > 0, got {self.kd_mean_neighbours}'),
            (self.kd_max_neighbours >= 1, f'kd_max_neighbours must be >= 1, got {self.kd_max_neighbours}'),
            (
                self.kd_mu1 >= 0 and self.kd_mu2 >= 0,
                f'kd_mu1 and kd_mu2 must be >= 0, got {self.kd_mu1}, {self.kd_mu2}',
            ),
            (self.kd_c_base > 0, f'kd_c_base must be > 0, got {self.kd_c_base}'),
            (self.kd_distance_batch >= 1, f'kd_distance_batch must be >= 1, got {self.kd_distance_batch}'),
            (
                self.kd_distance_layer == -1 or self.kd_distance_layer >= 1,
                f'kd_distance_layer must be -1 (output) or >= 1, got {self.kd_distance_layer}',
            ),
            (self.kd_broadcast in ('adopt', 'keep'), f'kd_broadcast must be adopt or keep, got {self.kd_broadcast!r}'),
            (self.finetune_from_slot >= 0, f'finetune_from_slot must be >= 0, got {self.finetune_from_slot}'),
            (self.personal_layers >= 1, f'personal_layers must be >= 1, got {self.personal_layers}'),
            (self.ditto_lambda >= 0, f'ditto_lambda must be >= 0, got {self.ditto_lambda}'),
            (self.personal_epochs >= 1, f'personal_epochs must be >= 1, got {self.personal_epochs}'),
            (self.pfedme_lambda > 0, f'pfedme_lambda must be > 0, got {self.pfedme_lambda}'),
            (self.pfedme_inner_steps >= 1, f'pfedme_inner_steps must be >= 1, got {self.pfedme_inner_steps}'),
            (
                self.pfedme_personal_learning_rate > 0,
                f'pfedme_personal_learning_rate must be > 0, got {self.pfedme_personal_learning_rate}',
            ),
            (self.pfedme_beta > 0, f'pfedme_beta must be > 0, got {self.pfedme_beta}'),
            (self.perfedavg_alpha > 0, f'perfedavg_alpha must be > 0, got {self.perfedavg_alpha}'),
            (self.perfedavg_delta > 0, f'perfedavg_delta must be > 0, got {self.perfedavg_delta}'),
            (0 <= self.apfl_alpha <= 1, f'apfl_alpha must be in [0, 1], got {self.apfl_alpha}'),
            (
                self.apfl_alpha_learning_rate >= 0,
                f'apfl_alpha_learning_rate must be >= 0, got {self.apfl_alpha_learning_rate}',
            ),
            (
                self.algorithm != 'fedavg_ft' or self.finetune_epochs >= 1,
                f'fedavg_ft needs --finetune_epochs >= 1, got {self.finetune_epochs}',
            ),
            (self.public_batch >= 1, f'public_batch must be >= 1, got {self.public_batch}'),
            (self.kt_temperature > 0, f'kt_temperature must be > 0, got {self.kt_temperature}'),
            (
                self.kt_c_update in ('paper', 'released', 'fedmd', 'similarity', 'topk'),
                f'kt_c_update must be paper, released, fedmd, similarity or topk, got {self.kt_c_update!r}',
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if len(self.workers) > 1:
            limit = algorithms.get(self.algorithm).not_one_aggregation
            if limit:
                raise ConfigError(
                    f'--workers: {self.algorithm} cannot be split over several workers: {limit}; give one worker'
                )
            if len(set(self.workers)) != len(self.workers):
                raise ConfigError(f'--workers: an address repeats: {",".join(self.workers)}')
        for address in self.workers:
            try:
                runtime.parse_worker_address(address)
            except ValueError as e:
                raise ConfigError(f'--workers: {e}') from None
        return self


def prepare_output_dir(path: str, overwrite: bool) -> None:
    """Checks that `path` may be written: empty or absent (or `overwrite`), in a writable parent.

    Creates the parent directory if needed.

    Args:
      path: the run's output directory.
      overwrite: whether a non-empty `path` may be replaced.

    Raises:
      ConfigError: otherwise; nothing is written.
    """
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(f'output_dir {path} exists and is not a directory')
        if os.listdir(path) and not overwrite:
            raise ConfigError(f'output_dir {path} is not empty; pass --overwrite to replace it')
    parent = os.path.dirname(os.path.abspath(path)) or '.'
    try:
        os.makedirs(parent, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=parent, prefix='.probe.')
        probe.close()
    except OSError as e:
        raise ConfigError(f'output_dir {path} is not writable: {e.strerror}') from None


def write_client_data(config: ExperimentConfig, out: str, log: Callable[[str], None] = print):
    """Partitions the dataset into `out`: `client_data/`, `config.json`, `partition.csv` and `.png`.

    The data and `config.json` are written to a staging directory first and
    renamed to `out` (replacing it) in one step.

    Args:
      config: a validated configuration.
      out: absolute path of the run directory (checked by the caller).
      log: receives one line about the data.

    Returns:
      The `client_data.ClientDataSpec` rooted at `out/client_data`.

    Raises:
      sources.DataError, partition.PartitionError: bad input; nothing is
        written then.
    """
    from tff_pfl.data import pipeline

    staging = tempfile.mkdtemp(prefix=f'.{os.path.basename(out)}.staging.', dir=os.path.dirname(out))
    try:
        prepared = pipeline.prepare(
            os.path.join(staging, 'client_data'),
            dataset=config.dataset,
            partition_name=config.partition,
            num_clients=config.num_clients,
            seed=config.seed,
            split_fractions=config.split_fractions,
            partition_params={k: v for k, v in config.partition_params().items() if v is not None},
            data_dir=config.data_dir,
            download=config.download,
            public_examples=config.public_examples,
        )
        with open(os.path.join(staging, 'config.json'), 'w') as f:
            json.dump(dataclasses.asdict(config), f, indent=2)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    spec = dataclasses.replace(prepared.spec, root=os.path.join(out, 'client_data'))
    _write_partition_summary(out, spec, prepared.class_histogram)
    log(
        f'data: {prepared.source_name}, {spec.num_clients} clients, partition {config.partition}, '
        f'train/val/test examples {sum(spec.split_sizes["train"])}/{sum(spec.split_sizes["val"])}/'
        f'{sum(spec.split_sizes["test"])}'
    )
    return spec


class RunComplete(Exception):
    """The output directory already holds this run, finished."""


# Fields that may differ when a run is resumed: where and how it runs, not what it computes.
_RESUMABLE_CHANGES = frozenset({'output_dir', 'workers', 'max_concurrent_clients', 'checkpoint_every'})


def _saved_config(out: str) -> dict | None:
    """The `config.json` of an earlier run in `out`, or None if there is none."""
    path = os.path.join(out, 'config.json')
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f'output_dir {out} has an unreadable config.json ({e}); pass --overwrite to replace it'
        ) from None


def _changed_fields(saved: dict, config: ExperimentConfig) -> list[str]:
    current = json.loads(json.dumps(dataclasses.asdict(config)))
    return [
        f'{k}: {saved.get(k)!r} -> {current[k]!r}'
        for k in current
        if k not in _RESUMABLE_CHANGES and saved.get(k) != current[k]
    ]


def run_experiment(
    config: ExperimentConfig,
    *,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
    on_process: Callable[[object], None] | None = None,
) -> training_loop.RunResult:
    """Runs one experiment end to end and writes its output directory.

    A run writes a checkpoint every `config.checkpoint_every` rounds. Run
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
      ConfigError, sources.DataError, partition.PartitionError: bad input;
        raised before anything is written to `output_dir`. Also when
        `output_dir` holds a run with another configuration.
      RunComplete: `output_dir` holds this run, finished.
    """
    config.validate()
    out = os.path.abspath(config.output_dir)
    saved = None if overwrite else _saved_config(out)
    if saved is not None:
        changed = _changed_fields(saved, config)
        if changed:
            raise ConfigError(
                f'output_dir {out} holds a run with another configuration ({"; ".join(changed)}); '
                'pass --overwrite to replace it'
            )
        if os.path.exists(os.path.join(out, 'report.md')):
            raise RunComplete(f'output_dir {out} already holds this run, finished (report.md)')
    else:
        prepare_output_dir(out, overwrite)
    for address in config.workers:  # before anything is written
        try:
            runtime.check_worker(address)
        except runtime.RuntimeStartError as e:
            raise ConfigError(f'--workers: {e}') from None
    if saved is not None:
        from tff_pfl.data import client_data

        spec = client_data.load_client_data_spec(os.path.join(out, 'client_data'))
        log(f'continuing the run in {out}')
        # Rows past the last checkpoint are rewritten as the rounds are run again.
        for stale in ('metrics.csv', 'tensorboard'):
            path = os.path.join(out, stale)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    else:
        spec = write_client_data(config, out, log)
    model_fn = functools.partial(models.get(config.model_name()), spec.feature_shape, spec.num_classes)
    process = algorithms.build(config, spec, model_fn)
    if on_process is not None:
        on_process(process)
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
            config.workers,
            max_concurrent_computation_calls=config.max_concurrent_clients,
            log_path=os.path.join(out, 'worker.log'),
        ):
            loop = dict(
                on_round=on_round,
                log=log,
                checkpoints=checkpoints.RunCheckpoints(os.path.join(out, 'checkpoints')),
                checkpoint_every=config.checkpoint_every,
                on_resume=on_resume,
                # A large store is memory-mapped here (unlinked files).
                spill_dir=out,
            )
            custom_run = algorithms.get(config.algorithm).run
            if custom_run is not None:
                result = custom_run(process, spec, config, **loop)
            else:
                result = training_loop.run(
                    process,
                    spec.client_ids,
                    rounds=config.rounds,
                    client_fraction=config.client_fraction,
                    seed=config.seed,
                    eval_every=config.eval_every,
                    # Split over several workers, the round keeps client
                    # states on the devices (TFF's mergeable context returns
                    # nothing CLIENTS-placed from before the aggregation).
                    device_state_dir=os.path.join(out, 'client_states') if len(config.workers) > 1 else None,
                    **loop,
                )
    finally:
        on_round.close()
    _write_results(out, config, spec, result, process)
    return result


def _write_partition_summary(out, spec, histogram) -> None:
    rows = []
    for client_id, counts in zip(spec.client_ids, histogram):
        row = collections.OrderedDict(client_id=client_id)
        for split in ('train', 'val', 'test'):
            row[f'{split}_examples'] = spec.sizes(split)[client_id]
        row.update((f'class_{c}', int(n)) for c, n in enumerate(counts))
        rows.append(row)
    reports.write_csv(os.path.join(out, 'partition.csv'), rows)
    reports.plot_class_histogram(histogram, os.path.join(out, 'partition.png'), 'Examples per class and client')


def _add_client_columns(config, result) -> None:
    """Appends the algorithm's client-state columns to the per-client rows."""
    columns = algorithms.get(config.algorithm).client_columns
    if columns is None:
        return
    for row in result.clients:
        row.update(columns(result.client_states[row['client_id']]))


def _write_results(out, config, spec, result, process) -> list:
    """Writes clients.csv, plots and report.md; returns the extra plots."""
    _add_client_columns(config, result)
    reports.write_csv(os.path.join(out, 'clients.csv'), result.clients)
    test_columns = [k for k in result.rounds[-1] if k.startswith('test_') and k.endswith('_accuracy_mean')]
    x_axis = 'slot' if 'slot' in result.rounds[-1] else 'round'  # serverless runs count time slots
    reports.plot_curves(
        result.rounds,
        x_axis,
        ['train_accuracy'] + test_columns,
        os.path.join(out, 'accuracy.png'),
        f'{config.algorithm}: accuracy per {x_axis}',
        'accuracy',
    )
    series = collections.OrderedDict(
        (name, [row[f'{name}_accuracy'] for row in result.clients]) for name in result.summary
    )
    reports.plot_client_bars(
        [row['client_id'] for row in result.clients],
        series,
        os.path.join(out, 'clients.png'),
        f'{config.algorithm}: test accuracy per client',
        'test accuracy',
    )
    plots = algorithms.get(config.algorithm).plots
    extra = plots(out, result, process) if plots else []
    reports.write_text_atomic(os.path.join(out, 'report.md'), render_report(config, spec, result, extra))
    return extra


def client_table(result: training_loop.RunResult) -> tuple[list, list]:
    """Rows and columns of the per-client result table (accuracy in %).

    Columns: client id, test examples, each model's test accuracy, then any
    algorithm columns (e.g. PersFL's teacher round, T and lambda).

    Args:
      result: a finished run's `RunResult`.

    Returns:
      `(rows, columns)`: one dict per client, and the column names in order.
    """
    names = list(result.summary)
    columns = ['client_id', 'test_examples'] + [f'{name}_accuracy' for name in names]
    known = set(columns) | {f'{n}_{m}' for n in names for m in ('loss', 'accuracy', 'num_examples')}
    extra = [k for k in result.clients[0] if k not in known]
    rows = []
    for row in result.clients:
        shown = {'client_id': row['client_id'], 'test_examples': int(row[f'{names[0]}_num_examples'])}
        for name in names:
            shown[f'{name}_accuracy'] = 100.0 * row[f'{name}_accuracy']
        shown.update((k, row[k]) for k in extra)
        rows.append(shown)
    return rows, columns + extra


def summary_table(result: training_loop.RunResult) -> tuple[list, list]:
    """Rows and columns of the across-client summary (accuracy in %).

    Args:
      result: a finished run's `RunResult`.

    Returns:
      `(rows, columns)`: one dict per evaluated model (`model`, `mean`,
      `weighted_mean`, `std`, `worst_10`, `best_10`, `top_10_by_samples`),
      and those column names.
    """
    columns = ['model', 'mean', 'weighted_mean', 'std', 'worst_10', 'best_10', 'top_10_by_samples']
    rows = []
    for name, summary in result.summary.items():
        rows.append({'model': name, **{c: 100.0 * summary[c] for c in columns[1:]}})
    return rows, columns


def render_report(config, spec, result, extra_plots=()) -> str:
    """The markdown report of a run.

    Args:
      config: the run's `ExperimentConfig`.
      spec: the run's `client_data.ClientDataSpec`.
      result: the run's `RunResult`.
      extra_plots: `(title, file name)` pairs of the algorithm's own plots,
        relative to the output directory.

    Returns:
      The `report.md` text, ending with a newline.
    """
    client_rows, client_columns = client_table(result)
    summary_rows, summary_columns = summary_table(result)
    last = result.rounds[-1]
    seconds = [row['round_seconds'] for row in result.rounds]
    lines = [
        f'# {config.algorithm} on {config.dataset}',
        '',
        f'{spec.num_clients} clients, partition `{config.partition}`, model `{config.model_name()}`, '
        f'{config.rounds} rounds, client fraction {config.client_fraction}, seed {config.seed}.',
        f'Median round time {sorted(seconds)[len(seconds) // 2]:.3f} s; final train loss '
        f'{last.get("train_loss", float("nan")):.4f}.',
        '',
        '## Test accuracy across clients (%)',
        '',
        reports.markdown_table(summary_rows, summary_columns, '{:.2f}'),
        '',
        'std is the population standard deviation across clients (the fairness measure);',
        'worst_10/best_10 average the lowest/highest 10% of clients; top_10_by_samples is the',
        'sample-weighted accuracy of the 10% of clients with the most data.',
        '',
        '## Per-client test accuracy (%)',
        '',
        reports.markdown_table(client_rows, client_columns, '{:.2f}'),
        '',
        '![accuracy per round](accuracy.png)',
        '![per-client accuracy](clients.png)',
        '![partition](partition.png)',
    ]
    lines += [f'![{title}]({path})' for title, path in extra_plots]
    return '\n'.join(lines) + '\n'
