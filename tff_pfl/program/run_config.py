"""A run's configuration: the common settings, the algorithm's settings, their checks and flat form.

`ExperimentConfig` is what `tff-pfl-train`'s flags, a `--config` file, a
bench suite entry and a run's `config.json` hold (the flat form, `to_dict` /
`from_dict`); `make_config` builds one from keyword arguments in Python.
`experiment.run_experiment` runs it.
"""

import dataclasses
import typing

from tff_pfl import models, runtime
from tff_pfl import settings as settings_lib
from tff_pfl.computations import privacy as privacy_lib
from tff_pfl.data import natural
from tff_pfl.program import algorithms, training_loop


class ConfigError(settings_lib.SettingsError):
    """A configuration that cannot run; the message is one line."""


def declaration(name: str, where: str = ''):
    """The registered declaration of the algorithm `name`: the one place an unknown name is refused.

    Args:
      name: an algorithm name (`--algorithm`, a file's `algorithm`).
      where: prefix of the error message (e.g. `'run.toml: '`).

    Returns:
      Its `tff_pfl.algorithm.Algorithm`.

    Raises:
      ConfigError: `unknown algorithm 'x'; known: ...`, one line.
    """
    if name not in algorithms.names():
        raise ConfigError(f'{where}unknown algorithm {name!r}; known: {", ".join(algorithms.names())}')
    return algorithms.get(name)


# report.md's per-client table stops after this many clients; clients.csv holds every client.
DEFAULT_MODELS = {'synthetic': 'logistic', 'mnist': 'mnist_dnn', 'fashion_mnist': 'mnist_dnn'}

# Partition -> (ExperimentConfig field -> the partitioner's keyword argument).
_PARTITION_FIELDS = {
    'ds1': {'classes_per_client': 'k', 'examples_per_client': 'examples_per_client'},
    'ds2': {'dirichlet_alpha': 'alpha'},
    'dirichlet_clients': {'dirichlet_alpha': 'alpha'},
    'dirichlet': {'dirichlet_alpha': 'alpha', 'examples_per_client': 'examples_per_client'},
    'kd_dirichlet': {
        'dirichlet_alpha': 'alpha',
        'kd_split_sizes': ('min_train', 'max_train', 'val_examples', 'test_examples'),
    },
    'shards': {'shards_per_client': 'shards_per_client'},
    'iid': {'examples_per_client': 'examples_per_client'},
    'ds3': {'classes_per_client': 'classes_per_client', 'base_examples_per_class': 'base_examples'},
    'kt_case1': {'kt_case1_counts': ('major', 'minor')},
    'kt_case2': {'classes_per_client': 'classes_per_client', 'examples_per_class': 'examples_per_class'},
    'natural': {},
}
_PARTITION_DEFAULTS = {'dirichlet': {'alpha': 0.9}}
PARTITIONS = tuple(_PARTITION_FIELDS)
# The common settings that parameterize some partition, in the order of first use.
_PARTITION_SETTINGS = tuple(dict.fromkeys(name for fields in _PARTITION_FIELDS.values() for name in fields))
# Settings renamed so that no name means two things: (partition, old name) -> its name now.
# `migrate` reads the old name in files written before (config.json, --config); a flag refuses it.
_RENAMED = {('shards', 'classes_per_client'): 'shards_per_client'}


def migrate(values: dict) -> dict:
    """The flat form of a file written by an earlier version, in today's names (the one mapping).

    `shards` took its shards per client as `classes_per_client` until that
    name meant one thing; a `config.json` or `--config` file that says so
    reads as `shards_per_client`.

    Args:
      values: a flat `name -> value` form (`config.json`, a `--config` file).

    Returns:
      A new dict with today's names and the same values (anything but a
      dict is returned as it is, for the caller to refuse).
    """
    if not isinstance(values, dict):
        return values
    values = dict(values)
    for (partition_name, old), new in _RENAMED.items():
        if values.get('partition') == partition_name and old in values and new not in values:
            values[new] = values.pop(old)
    return values


_setting = settings_lib.setting


def _stray_line(stray: list[str], partition_name: str) -> str:
    if not stray:
        return ''
    line = f'--{stray[0]} does not apply to partition {partition_name}'
    renamed = _RENAMED.get((partition_name, stray[0]))
    return f'{line}: its setting is --{renamed} now' if renamed else line


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(settings_lib.Settings):
    """Everything that defines a run: the common settings and the algorithm's.

    The common settings are the fields below; `settings` is the chosen
    algorithm's settings dataclass (`algorithms.get(algorithm).settings`;
    None: its defaults). The flat form (`to_dict`, `from_dict`) puts both side
    by side: it is `config.json`, a `--config` file and a bench suite entry.
    """

    output_dir: str
    algorithm: str = _setting('fedavg', 'Algorithm to run: ' + ', '.join(algorithms.names()) + '.')
    # Data.
    dataset: str = _setting(
        'synthetic',
        'synthetic[:alpha,beta[,heterogeneity]] | npz:PATH (Keras layout) | tfds:NAME | folder:PATH; '
        'naturally federated: '
        'tff:NAME (shakespeare, emnist, emnist_digits, cifar100) | sqlite:PATH[#TRAIN,TEST] | clients:DIR '
        '(docs/data.md).',
    )
    data_dir: str | None = _setting(None, "TFDS data directory; TFF's cache directory for tff: datasets.")
    download: bool = _setting(False, 'Let TFDS (tfds:) or TFF (tff:) download the dataset.')
    partition: str = _setting('natural', ' | '.join(PARTITIONS) + ' (docs/data.md).')
    num_clients: int = _setting(30, 'Number of clients.')
    classes_per_client: int | None = _setting(
        None, 'ds1: k, the classes of each client (default 4); ds3, kt_case2: classes per client (2).'
    )
    shards_per_client: int | None = _setting(None, 'shards: label-sorted shards per client (2).')
    dirichlet_alpha: float | None = _setting(
        None, 'ds2, dirichlet, dirichlet_clients, kd_dirichlet: Dirichlet concentration (0.9; kd_dirichlet 0.1).'
    )
    examples_per_client: int | None = _setting(
        None, 'ds1, iid, dirichlet: examples per client (default: as many as fit).'
    )
    examples_per_class: int | None = _setting(None, "kt_case2: examples of each of a client's classes (300).")
    base_examples_per_class: int | None = _setting(
        None, "ds3: examples of each of a client's classes given before the power-law split (5)."
    )
    kt_case1_counts: tuple[int, ...] | None = _setting(
        None, "kt_case1: examples per class of a group's own half of the classes, and of the other (450,150)."
    )
    kd_split_sizes: tuple[int, ...] | None = _setting(
        None, 'kd_dirichlet: min and max training examples, validation and test examples per client (15,100,20,100).'
    )
    split_fractions: tuple[float, ...] = _setting((0.6, 0.2, 0.2), 'Train, validation, test fractions of each client.')
    model: str | None = _setting(None, 'Model name; default: chosen from the dataset (and the algorithm).')
    model_modules: tuple[str, ...] = _setting(
        (),
        'Python modules (dotted names, or .py files) imported before the run is checked: modules that call '
        'tff_pfl.models.register(name, builder) make their models usable as --model and --architectures.',
    )
    # The run.
    rounds: int = _setting(100, 'Training rounds (serverless algorithms: exchange intervals).')
    client_fraction: float = _setting(1.0, 'Clients sampled per round, in (0, 1].')
    eval_every: int = _setting(10, 'Evaluate every client every N rounds (0: at the end only).')
    eval_clients: int = _setting(
        0,
        'Evaluations before the last round score a seeded sample of this many clients, with a 95% confidence '
        'interval of the mean (0: every client); the last round scores every client.',
    )
    checkpoint_every: int = _setting(
        10,
        'Write a checkpoint every this many rounds (0: never); rerun the same command in the same --output_dir to '
        'continue an interrupted run.',
    )
    seed: int = _setting(0, 'Seed of the partition, the sampling and the training.')
    stop_on_divergence: bool = _setting(
        True,
        'Stop after the first round whose mean training loss is NaN or infinite, evaluating its models as the last '
        "round's (report.md says where); off: train every round.",
    )
    # User-level differential privacy of the uploads (docs/privacy.md).
    dp_noise_multiplier: float | None = _setting(
        None,
        'User-level DP: Gaussian noise stddev over the clipping norm, added at the server to the sum of clipped '
        'uploads (the KT-pFL family: on each client, local DP) (default: no DP). Needs --dp_clip or '
        '--dp_target_quantile.',
    )
    dp_clip: float | None = _setting(None, "DP: fixed L2 clipping norm of each client's upload.")
    dp_target_quantile: float | None = _setting(
        None, "DP: adaptive clipping towards this quantile of the clients' upload norms, in (0, 1)."
    )
    dp_initial_clip: float | None = _setting(None, 'DP, adaptive clipping: the initial clipping norm (0.1).')
    dp_delta: float | None = _setting(None, 'DP: the delta epsilon is reported at (default 1 / num_clients^1.1).')
    dp_target_epsilon: float | None = _setting(
        None, 'DP: refuse, before anything is written, a run whose epsilon after --rounds would exceed this.'
    )
    secure_aggregation: bool = _setting(
        False,
        "Sum the clients' uploads with TFF's secure-sum aggregators (federated_secure_sum_bitwidth); with DP the "
        'noise is added after the secure sum (docs/privacy.md).',
    )
    max_concurrent_clients: int = _setting(2, 'Client computations the TFF worker runs at once (-1: no limit).')
    workers: tuple[str, ...] = _setting(
        (),
        'host:port of each TFF worker_binary to run the rounds on (deploy/README.md); several split every round '
        'over the workers; default: a local one.',
    )
    settings: settings_lib.Settings | None = None

    def __post_init__(self):
        if self.settings is None and self.algorithm in algorithms.names():
            object.__setattr__(self, 'settings', algorithms.get(self.algorithm).settings())

    @classmethod
    def common_fields(cls) -> list[str]:
        """The names of the common settings (every field but `output_dir` and `settings`).

        Returns:
          Field names in declaration order.
        """
        return [f.name for f in dataclasses.fields(cls) if f.name not in ('output_dir', 'settings')]

    @classmethod
    def from_dict(cls, values, where: str = '') -> 'ExperimentConfig':
        """A configuration from its flat form: common and algorithm settings side by side.

        Args:
          values: `name -> value`; `output_dir` is required unless given as
            `values['output_dir']` later by the caller; `algorithm` defaults to
            'fedavg'. Every other name is a common setting or one of the
            algorithm's.
          where: prefix of error messages (e.g. `'run.toml: '`).

        Returns:
          The (not yet validated) configuration.

        Raises:
          ConfigError: an unknown name, a name that does not apply to the
            algorithm, or a value of the wrong type.
        """
        values = dict(values)
        algorithm = values.get('algorithm', 'fedavg')
        settings_cls = declaration(algorithm, where).settings
        common_names = set(cls.common_fields()) | {'output_dir'}
        common = {k: v for k, v in values.items() if k in common_names}
        rest = {k: v for k, v in values.items() if k not in common_names}
        own = set(settings_cls.field_names())
        for name in rest:
            if name not in own:
                if name in algorithms.all_setting_names():
                    raise ConfigError(f'{where}{name} does not apply to {algorithm}')
                raise ConfigError(f'{where}unknown setting {name!r}')
        hints = typing.get_type_hints(cls)
        try:
            kwargs = {k: settings_lib.coerce(k, v, hints[k], where) for k, v in common.items()}
            kwargs.setdefault('output_dir', '')
            return cls(settings=settings_cls.from_dict(rest, where), **kwargs)
        except settings_lib.SettingsError as e:
            raise ConfigError(str(e)) from None

    def to_dict(self) -> dict:
        """The flat form: `output_dir`, the common settings, then the algorithm's.

        Returns:
          A JSON-ready dict (what `config.json` records).
        """
        flat = {'output_dir': self.output_dir}
        flat.update((name, settings_lib.plain(getattr(self, name))) for name in self.common_fields())
        flat.update(self.settings.to_dict())
        return flat

    def model_name(self) -> str:
        """The model to use: the explicit one, else the dataset's (and algorithm's) default.

        Returns:
          A `tff_pfl.models` registry name: `model` if set; else, for a
          naturally federated source, `natural.default_model` (`char_gru`
          for text); else the algorithm's default for the dataset, if it has
          one; else `mnist_dnn` for `.npz` data, the `DEFAULT_MODELS` entry
          of the dataset, or `persfl_cnn`.
        """
        if self.model:
            return self.model
        if natural.is_natural(self.dataset):
            return natural.default_model(self.dataset) or 'persfl_cnn'
        base = self.dataset.split(':', 1)[-1] if self.dataset.startswith('tfds:') else self.dataset
        base = base.split(':', 1)[0]
        if base.endswith('.npz') or base == 'npz':
            base = 'npz'
        if self.algorithm in algorithms.names():
            own = algorithms.get(self.algorithm).default_models.get(base)
            if own:
                return own
        if base == 'npz':
            return 'mnist_dnn'
        return DEFAULT_MODELS.get(base, 'persfl_cnn')

    def partition_params(self) -> dict:
        """Keyword arguments of the chosen partitioner, from the fields that are set.

        Returns:
          Parameter name -> value for `partition` (unset fields are left to
          the partitioner's defaults); empty for a partition without
          parameters.
        """
        params = dict(_PARTITION_DEFAULTS.get(self.partition, {}))
        for field, names in _PARTITION_FIELDS.get(self.partition, {}).items():
            value = getattr(self, field)
            if value is None:
                continue
            if isinstance(names, tuple):
                params.update(zip(names, (int(v) for v in value)))
            else:
                params[names] = value
        return params

    def _checks(self):
        optional_positive = [
            (name, getattr(self, name))
            for name in (
                'classes_per_client',
                'shards_per_client',
                'examples_per_class',
                'examples_per_client',
                'base_examples_per_class',
            )
            if getattr(self, name) is not None
        ]
        applies = _PARTITION_FIELDS.get(self.partition, {})
        stray = [name for name in _PARTITION_SETTINGS if getattr(self, name) is not None and name not in applies]
        return super()._checks() + [
            (self.partition in PARTITIONS, f'unknown partition {self.partition!r}; known: {", ".join(PARTITIONS)}'),
            (not stray, _stray_line(stray, self.partition)),
            (self.rounds >= 1, f'rounds must be >= 1, got {self.rounds}'),
            (0.0 < self.client_fraction <= 1.0, f'client_fraction must be in (0, 1], got {self.client_fraction}'),
            (self.num_clients >= 1, f'num_clients must be >= 1, got {self.num_clients}'),
            (self.eval_every >= 0, f'eval_every must be >= 0, got {self.eval_every}'),
            (self.eval_clients >= 0, f'eval_clients must be >= 0, got {self.eval_clients}'),
            (self.checkpoint_every >= 0, f'checkpoint_every must be >= 0, got {self.checkpoint_every}'),
            *[(value >= 1, f'{name} must be >= 1, got {value}') for name, value in optional_positive],
            (
                self.kt_case1_counts is None
                or (len(self.kt_case1_counts) == 2 and all(c >= 1 for c in self.kt_case1_counts)),
                f'kt_case1_counts must be two positive integers, got {list(self.kt_case1_counts or ())}',
            ),
            (
                self.kd_split_sizes is None
                or (
                    len(self.kd_split_sizes) == 4
                    and all(c >= 1 for c in self.kd_split_sizes)
                    and self.kd_split_sizes[0] <= self.kd_split_sizes[1]
                ),
                'kd_split_sizes must be min_train <= max_train, val, test (positive integers), '
                f'got {list(self.kd_split_sizes or ())}',
            ),
            (
                self.dirichlet_alpha is None or self.dirichlet_alpha > 0,
                f'dirichlet_alpha must be > 0, got {self.dirichlet_alpha}',
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
        ]

    def privacy(self, num_clients: int | None = None) -> 'privacy_lib.DPConfig | None':
        """The run's user-level DP mechanism, or None without DP.

        Args:
          num_clients: the population N (default `num_clients`); the noised
            sum is divided by the expected clients per round, client_fraction x N.

        Returns:
          A `privacy.DPConfig`, or None when `dp_noise_multiplier` is not set.

        Raises:
          privacy.PrivacyError: a mechanism that cannot run.
        """
        if self.dp_noise_multiplier is None:
            return None
        population = self.num_clients if num_clients is None else num_clients
        return privacy_lib.DPConfig(
            noise_multiplier=self.dp_noise_multiplier,
            clients_per_round=self.client_fraction * population,
            clip=self.dp_clip,
            target_quantile=self.dp_target_quantile,
            initial_clip=privacy_lib.DEFAULT_INITIAL_CLIP if self.dp_initial_clip is None else self.dp_initial_clip,
        )

    def poisson_sampling(self) -> bool:
        """Whether rounds draw their clients by Poisson sampling.

        Returns:
          True with DP and `client_fraction` < 1 (the accountant assumes
          Poisson sampling), else False.
        """
        return self.dp_noise_multiplier is not None and self.client_fraction < 1

    def max_clients_per_round(self, num_clients: int) -> int:
        """The most clients a round of this run can take: N under Poisson sampling, else `ceil(client_fraction x N)`.

        Args:
          num_clients: N, the run's population.

        Returns:
          The bound, in [1, N].
        """
        if self.poisson_sampling():
            return num_clients
        return training_loop.clients_per_round(num_clients, self.client_fraction)

    def dp_sampling_probability(self) -> float:
        """Each client's chance to take part in a round, as the accountant counts it.

        Returns:
          `client_fraction` for central DP; 1 for an algorithm whose noise is
          added on the clients (local DP: the server knows who sent each
          value, so sampling does not amplify; a client that takes part in
          every round is accounted).
        """
        return 1.0 if algorithms.get(self.algorithm).privacy.local else self.client_fraction

    def dp_delta_for(self, num_clients: int) -> float:
        """The delta epsilon is reported at.

        Args:
          num_clients: N, the run's population.

        Returns:
          `dp_delta` if set, else 1 / N^1.1.
        """
        return self.dp_delta if self.dp_delta is not None else privacy_lib.default_delta(num_clients)

    def _check_privacy(self, entry) -> None:
        if self.secure_aggregation:
            if entry.privacy.uploads is None:
                raise ConfigError(f'--secure_aggregation: {self.algorithm} {entry.privacy.why_not}')
            if len(self.workers) > 1:
                raise ConfigError('--secure_aggregation runs on one worker: give one --workers address or none')
        dp_fields = [n for n in self.common_fields() if n.startswith('dp_') and getattr(self, n) is not None]
        if not dp_fields:
            return
        if self.dp_noise_multiplier is None:
            raise ConfigError(f'--{dp_fields[0]} needs --dp_noise_multiplier (user-level DP)')
        if entry.privacy.uploads is None:
            raise ConfigError(f'--dp_noise_multiplier: {self.algorithm} {entry.privacy.why_not}')
        if self.dp_initial_clip is not None and self.dp_clip is not None:
            raise ConfigError('--dp_initial_clip applies to adaptive clipping (--dp_target_quantile), not to --dp_clip')
        if self.dp_delta is not None and not 0 < self.dp_delta < 1:
            raise ConfigError(f'dp_delta must be in (0, 1), got {self.dp_delta}')
        try:
            dp = self.privacy()
        except privacy_lib.PrivacyError as e:
            raise ConfigError(str(e)) from None
        if self.dp_target_epsilon is None:
            return
        if self.dp_target_epsilon <= 0:
            raise ConfigError(f'dp_target_epsilon must be > 0, got {self.dp_target_epsilon}')
        if dp.noise_multiplier == 0:
            raise ConfigError('--dp_target_epsilon needs --dp_noise_multiplier > 0: without noise epsilon is infinite')
        if self.dp_delta is None and natural.is_natural(self.dataset):
            raise ConfigError(
                f'--dp_target_epsilon with {self.dataset}: give --dp_delta (the population is known only once read)'
            )
        delta = self.dp_delta_for(self.num_clients)
        reached = privacy_lib.epsilon(dp, self.dp_sampling_probability(), self.rounds, delta)
        if reached > self.dp_target_epsilon:
            raise ConfigError(
                f'--dp_target_epsilon {self.dp_target_epsilon:g}: {self.rounds} rounds at noise multiplier '
                f'{dp.noise_multiplier:g} and client fraction {self.client_fraction:g} reach epsilon {reached:.5g} '
                f'at delta {delta:.3g}; lower --rounds or --client_fraction, or raise --dp_noise_multiplier'
            )

    def validate(self) -> 'ExperimentConfig':
        """Returns self, or raises ConfigError on the first value that cannot run.

        Checks the common settings, that `settings` is the algorithm's
        settings type and valid, the model against the algorithm, and the
        algorithm's own conditions on the run (e.g. full participation).

        Returns:
          This configuration.

        Raises:
          ConfigError: on the first value that cannot run.
        """
        entry = declaration(self.algorithm)
        for module in self.model_modules:
            problem = models.import_module(module)
            if problem:
                raise ConfigError(f'--model_modules: {problem}')
        if type(self.settings) is not entry.settings:
            raise ConfigError(f'{self.algorithm} takes {entry.settings.__name__}, got {type(self.settings).__name__}')
        try:
            super().validate()
            self.settings.validate()
        except ConfigError:
            raise
        except settings_lib.SettingsError as e:
            raise ConfigError(str(e)) from None
        if entry.own_architectures and self.model is not None:
            raise ConfigError(
                f'--model does not apply to {self.algorithm}: each client has its own architecture (--architectures)'
            )
        if self.model_name() not in models.names():
            raise ConfigError(f'unknown model {self.model_name()!r}; known: {", ".join(models.names())}')
        problem = (entry.check(self.settings, self.client_fraction) if entry.check else None) or (
            algorithms.privacy_problem(entry, self)
        )
        if problem:
            raise ConfigError(problem)
        self._check_privacy(entry)
        if len(self.workers) > 1:
            if entry.not_one_aggregation:
                raise ConfigError(
                    f'--workers: {self.algorithm} cannot be split over several workers: {entry.not_one_aggregation}; '
                    'give one worker'
                )
            if len(set(self.workers)) != len(self.workers):
                raise ConfigError(f'--workers: an address repeats: {",".join(self.workers)}')
        for address in self.workers:
            try:
                runtime.parse_worker_address(address)
            except ValueError as e:
                raise ConfigError(f'--workers: {e}') from None
        return self


def make_config(**values) -> ExperimentConfig:
    """`ExperimentConfig.from_dict(values)`: a configuration from flat keyword arguments.

    Args:
      **values: `output_dir`, `algorithm` and any common or algorithm
        setting, e.g. `make_config(output_dir='runs/x', algorithm='persfl',
        rounds=50, distill_epochs=5)`.

    Returns:
      The (not yet validated) configuration.

    Raises:
      ConfigError: a name that does not apply to the algorithm, or a value
        of the wrong type.
    """
    return ExperimentConfig.from_dict(values)
