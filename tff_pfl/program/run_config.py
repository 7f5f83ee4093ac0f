"""A run's configuration: the algorithm, its settings, the run's named parts, their checks and flat form.

`ExperimentConfig` is the algorithm (its name, model and settings), the
run's seed and one part per concern (`config_parts`: data, schedule,
evaluation, checkpoints, privacy, runtime). Its flat form (`to_dict` /
`from_dict`), every part's fields side by side, is what `tff-pfl-train`'s
flags, a `--config` file, a bench suite entry and a run's `config.json`
hold; `make_config` builds one from flat keyword arguments in Python.
`experiment.run_experiment` runs it.
"""

import dataclasses
import typing

from tff_pfl import models, runtime
from tff_pfl import settings as settings_lib
from tff_pfl.computations import privacy as privacy_lib
from tff_pfl.data import natural
from tff_pfl.program import algorithms, config_parts, training_loop


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


DEFAULT_MODELS = {'synthetic': 'logistic', 'mnist': 'mnist_dnn', 'fashion_mnist': 'mnist_dnn'}

PARTITIONS = tuple(config_parts.PARTITIONS)

# The parts of a configuration: attribute -> settings type.
PARTS = {
    'data': config_parts.DataConfig,
    'schedule': config_parts.ScheduleConfig,
    'evaluation': config_parts.EvaluationConfig,
    'checkpoints': config_parts.CheckpointConfig,
    'privacy': config_parts.PrivacyConfig,
    'runtime': config_parts.RuntimeConfig,
}
# The flat form, in config.json's order: (where the value lives, its name). Where is
# None for ExperimentConfig's own fields, 'partition' for the partition's settings
# (None in the flat form where the run's partition does not take them), else a part.
_PART_OF = {name: part for part, cls in PARTS.items() for name in cls.field_names()}
FLAT = (
    (None, 'algorithm'),
    *(('data', n) for n in ('dataset', 'data_dir', 'download', 'partition', 'num_clients')),
    *(('partition', n) for n in config_parts.PARTITION_SETTINGS),
    ('data', 'split_fractions'),
    (None, 'model'),
    (None, 'model_modules'),
    ('schedule', 'rounds'),
    ('schedule', 'client_fraction'),
    *(('evaluation', n) for n in config_parts.EvaluationConfig.field_names()),
    ('checkpoints', 'checkpoint_every'),
    (None, 'seed'),
    ('schedule', 'stop_on_divergence'),
    *(('privacy', n) for n in config_parts.PrivacyConfig.field_names()),
    *(('runtime', n) for n in config_parts.RuntimeConfig.field_names()),
)


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
    for (partition_name, old), new in config_parts.RENAMED.items():
        if values.get('partition') == partition_name and old in values and new not in values:
            values[new] = values.pop(old)
    return values


_setting = settings_lib.setting


def _partition_type(name: str, where: str = '') -> type:
    """The settings type of the partition `name`: the one place an unknown partition is refused."""
    if name not in config_parts.PARTITIONS:
        raise ConfigError(f'{where}unknown partition {name!r}; known: {", ".join(PARTITIONS)}')
    return config_parts.PARTITIONS[name]


def _partition_setting(name: str) -> tuple[typing.Any, str]:
    """The type and the help line of the partition setting `name` (its help per partition)."""
    users = config_parts.partition_users(name)
    first = config_parts.PARTITIONS[users[0]]
    helps = [
        f'{user}: {settings_lib.help_of(config_parts.PARTITIONS[user].__dataclass_fields__[name])}' for user in users
    ]
    return typing.get_type_hints(first)[name], ' '.join(helps)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(settings_lib.Settings):
    """Everything that defines a run: the algorithm and its settings, the seed, and the run's parts.

    `settings` is the chosen algorithm's settings dataclass
    (`algorithms.get(algorithm).settings`; None: its defaults). The parts
    (`data`, `schedule`, `evaluation`, `checkpoints`, `privacy`, `runtime`)
    are `config_parts` dataclasses. The flat form (`to_dict`, `from_dict`)
    puts every field side by side: it is `config.json`, a `--config` file
    and a bench suite entry; `replace` changes fields by their flat names.
    """

    output_dir: str
    algorithm: str = _setting('fedavg', 'Algorithm to run: ' + ', '.join(algorithms.names()) + '.')
    model: str | None = _setting(None, 'Model name; default: chosen from the dataset (and the algorithm).')
    model_modules: tuple[str, ...] = _setting(
        (),
        'Python modules (dotted names, or .py files) imported before the run is checked: modules that call '
        'tff_pfl.models.register(name, builder) make their models usable as --model and --architectures.',
    )
    seed: int = _setting(0, 'Seed of the partition, the sampling and the training.')
    data: config_parts.DataConfig = _setting(
        config_parts.DataConfig(), 'The source, the number of clients, their splits and the partition.'
    )
    schedule: config_parts.ScheduleConfig = _setting(
        config_parts.ScheduleConfig(), 'Rounds, the clients sampled per round, stopping on divergence.'
    )
    evaluation: config_parts.EvaluationConfig = _setting(
        config_parts.EvaluationConfig(), 'When and how many clients are evaluated.'
    )
    checkpoints: config_parts.CheckpointConfig = _setting(config_parts.CheckpointConfig(), 'How often to checkpoint.')
    privacy: config_parts.PrivacyConfig = _setting(
        config_parts.PrivacyConfig(), 'User-level DP of the uploads and secure sums.'
    )
    runtime: config_parts.RuntimeConfig = _setting(config_parts.RuntimeConfig(), 'The TFF workers the rounds run on.')
    settings: settings_lib.Settings | None = _setting(
        None, "The algorithm's settings dataclass (processes/<algo>.py); None: its defaults."
    )

    def __post_init__(self):
        if self.settings is None and self.algorithm in algorithms.names():
            object.__setattr__(self, 'settings', algorithms.get(self.algorithm).settings())

    @classmethod
    def common_fields(cls) -> list[str]:
        """The flat names of the run's settings (all but `output_dir` and the algorithm's), in config.json's order.

        Returns:
          Flat names: ExperimentConfig's own fields, the parts' fields and
          every partition's settings.
        """
        return [name for _, name in FLAT]

    @classmethod
    def common_settings(cls) -> list[tuple[str | None, str, typing.Any, str, typing.Any]]:
        """What a flag (or the docs) needs to know of each flat name but the algorithm's.

        Returns:
          `[(part, name, type hint, help line, default)]` in `common_fields`
          order; `part` is None for ExperimentConfig's own fields, a `PARTS`
          name, or 'partition' for a partition's setting (its help names each
          partition that takes it; its default is None: the partition's).
        """
        own_hints = typing.get_type_hints(cls)
        result = []
        for part, name in FLAT:
            if part == 'partition':
                hint, help_line = _partition_setting(name)
                result.append((part, name, hint, help_line, None))
            elif part is None:
                field = cls.__dataclass_fields__[name]
                result.append((part, name, own_hints[name], settings_lib.help_of(field), field.default))
            elif name == 'partition':
                field = config_parts.DataConfig.__dataclass_fields__[name]
                result.append((part, name, str, settings_lib.help_of(field), field.default.name))
            else:
                part_cls = PARTS[part]
                field = part_cls.__dataclass_fields__[name]
                result.append(
                    (part, name, typing.get_type_hints(part_cls)[name], settings_lib.help_of(field), field.default)
                )
        return result

    @classmethod
    def from_dict(cls, values, where: str = '') -> 'ExperimentConfig':
        """A configuration from its flat form: every part's settings and the algorithm's side by side.

        Args:
          values: `name -> value`; `output_dir` is required unless given as
            `values['output_dir']` later by the caller; `algorithm` defaults to
            'fedavg', `partition` to 'natural'. Every other name is a setting
            of a part, of the partition, or of the algorithm.
          where: prefix of error messages (e.g. `'run.toml: '`).

        Returns:
          The (not yet validated) configuration.

        Raises:
          ConfigError: an unknown name, a name that does not apply to the
            algorithm or the partition, an unknown partition, or a value of
            the wrong type.
        """
        values = dict(values)
        algorithm = values.get('algorithm', 'fedavg')
        settings_cls = declaration(algorithm, where).settings
        common_names = set(cls.common_fields()) | {'output_dir'}
        rest = {k: v for k, v in values.items() if k not in common_names}
        own = set(settings_cls.field_names())
        for name in rest:
            if name not in own:
                if name in algorithms.all_setting_names():
                    raise ConfigError(f'{where}{name} does not apply to {algorithm}')
                raise ConfigError(f'{where}unknown setting {name!r}')
        try:
            partition_name = settings_lib.coerce('partition', values.get('partition', 'natural'), str, where)
            partition_cls = _partition_type(partition_name, where)
            takes = set(partition_cls.field_names())
            stray = [n for n in config_parts.PARTITION_SETTINGS if values.get(n) is not None and n not in takes]
            if stray:
                raise ConfigError(where + config_parts.stray_line(stray[0], partition_name))
            partition = partition_cls.from_dict({n: values[n] for n in takes if n in values}, where)
            hints = typing.get_type_hints(cls)
            top = {
                name: settings_lib.coerce(name, values[name], hints[name], where)
                for name in ('output_dir', *(name for part, name in FLAT if part is None))
                if name in values
            }
            top.setdefault('output_dir', '')
            parts = {}
            for part, part_cls in PARTS.items():
                given = {n: values[n] for n in part_cls.field_names() if n in values and n != 'partition'}
                if part == 'data':
                    parts[part] = dataclasses.replace(part_cls.from_dict(given, where), partition=partition)
                else:
                    parts[part] = part_cls.from_dict(given, where)
            return cls(settings=settings_cls.from_dict(rest, where), **top, **parts)
        except ConfigError:
            raise
        except settings_lib.SettingsError as e:
            raise ConfigError(str(e)) from None

    def flat_value(self, name: str):
        """The value of a setting by its flat name.

        Args:
          name: a name of `common_fields()`, `output_dir`, or one of the
            algorithm's settings.

        Returns:
          Its value (None for a partition setting the run's partition does
          not take; the partition's name for `partition`).

        Raises:
          KeyError: an unknown name.
        """
        if name == 'output_dir' or (name in ExperimentConfig.__dataclass_fields__ and name not in PARTS):
            return getattr(self, name)
        if name == 'partition':
            return self.data.partition.name
        if name in config_parts.PARTITION_SETTINGS:
            return getattr(self.data.partition, name, None)
        if name in _PART_OF:
            return getattr(getattr(self, _PART_OF[name]), name)
        if self.settings is not None and name in self.settings.field_names():
            return getattr(self.settings, name)
        raise KeyError(name)

    def to_dict(self) -> dict:
        """The flat form: `output_dir`, the run's settings (`common_fields`), then the algorithm's.

        Returns:
          A JSON-ready dict (what `config.json` records).
        """
        flat = {'output_dir': self.output_dir}
        flat.update((name, settings_lib.plain(self.flat_value(name))) for name in self.common_fields())
        flat.update(self.settings.to_dict())
        return flat

    def replace(self, **changes) -> 'ExperimentConfig':
        """This configuration with settings changed, named by their flat names.

        Args:
          **changes: flat name -> new value, e.g. `rounds=5`,
            `partition='ds1'`, `classes_per_client=3`, `distill_epochs=2`.
            A new `partition` starts from that partition's defaults; a new
            `algorithm` from its settings' defaults.

        Returns:
          A new (not yet validated) configuration.

        Raises:
          ConfigError: an unknown name, or a setting of another algorithm
            or partition.
        """
        top, parts, partition, own = {}, {}, {}, {}
        settings_cls = declaration(changes.get('algorithm', self.algorithm)).settings
        for name, value in changes.items():
            if name == 'output_dir' or (name in ExperimentConfig.__dataclass_fields__ and name not in PARTS):
                top[name] = value
            elif name == 'partition' or name in config_parts.PARTITION_SETTINGS:
                partition[name] = value
            elif name in _PART_OF:
                parts.setdefault(_PART_OF[name], {})[name] = value
            elif name in settings_cls.field_names():
                own[name] = value
            else:
                raise ConfigError(f'unknown setting {name!r} for {changes.get("algorithm", self.algorithm)}')
        if 'algorithm' in changes and changes['algorithm'] != self.algorithm:
            top['settings'] = settings_cls(**own)
        elif own:
            top['settings'] = dataclasses.replace(self.settings, **own)
        if partition:
            name = partition.pop('partition', self.data.partition.name)
            current = self.data.partition if name == self.data.partition.name else _partition_type(name)()
            for key in partition:
                if key not in current.field_names():
                    raise ConfigError(config_parts.stray_line(key, name))
            parts.setdefault('data', {})['partition'] = dataclasses.replace(current, **partition)
        for part, values in parts.items():
            top[part] = dataclasses.replace(getattr(self, part), **values)
        return dataclasses.replace(self, **top)

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
        dataset = self.data.dataset
        if natural.is_natural(dataset):
            return natural.default_model(dataset) or 'persfl_cnn'
        base = dataset.split(':', 1)[-1] if dataset.startswith('tfds:') else dataset
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

    def dp_mechanism(self, num_clients: int | None = None) -> 'privacy_lib.DPConfig | None':
        """The run's user-level DP mechanism, or None without DP.

        Args:
          num_clients: the population N (default `data.num_clients`); the
            noised sum is divided by the expected clients per round,
            client_fraction x N.

        Returns:
          A `privacy.DPConfig`, or None when `dp_noise_multiplier` is not set.

        Raises:
          privacy.PrivacyError: a mechanism that cannot run.
        """
        population = self.data.num_clients if num_clients is None else num_clients
        return self.privacy.mechanism(self.schedule.client_fraction * population)

    def poisson_sampling(self) -> bool:
        """Whether rounds draw their clients by Poisson sampling.

        Returns:
          True with DP and `client_fraction` < 1 (the accountant assumes
          Poisson sampling), else False.
        """
        return self.privacy.dp and self.schedule.client_fraction < 1

    def max_clients_per_round(self, num_clients: int) -> int:
        """The most clients a round of this run can take: N under Poisson sampling, else `ceil(client_fraction x N)`.

        Args:
          num_clients: N, the run's population.

        Returns:
          The bound, in [1, N].
        """
        if self.poisson_sampling():
            return num_clients
        return training_loop.clients_per_round(num_clients, self.schedule.client_fraction)

    def dp_sampling_probability(self) -> float:
        """Each client's chance to take part in a round, as the accountant counts it.

        Returns:
          `client_fraction` for central DP; 1 for an algorithm whose noise is
          added on the clients (local DP: the server knows who sent each
          value, so sampling does not amplify; a client that takes part in
          every round is accounted).
        """
        return 1.0 if algorithms.get(self.algorithm).privacy.local else self.schedule.client_fraction

    def _check_privacy(self, entry) -> None:
        privacy = self.privacy
        if privacy.secure_aggregation:
            if entry.privacy.uploads is None:
                raise ConfigError(f'--secure_aggregation: {self.algorithm} {entry.privacy.why_not}')
            if len(self.runtime.workers) > 1:
                raise ConfigError('--secure_aggregation runs on one worker: give one --workers address or none')
        dp_fields = [n for n in privacy.field_names() if n.startswith('dp_') and getattr(privacy, n) is not None]
        if not dp_fields:
            return
        if not privacy.dp:
            raise ConfigError(f'--{dp_fields[0]} needs --dp_noise_multiplier (user-level DP)')
        if entry.privacy.uploads is None:
            raise ConfigError(f'--dp_noise_multiplier: {self.algorithm} {entry.privacy.why_not}')
        if privacy.dp_initial_clip is not None and privacy.dp_clip is not None:
            raise ConfigError('--dp_initial_clip applies to adaptive clipping (--dp_target_quantile), not to --dp_clip')
        if privacy.dp_delta is not None and not 0 < privacy.dp_delta < 1:
            raise ConfigError(f'dp_delta must be in (0, 1), got {privacy.dp_delta}')
        try:
            dp = self.dp_mechanism()
        except privacy_lib.PrivacyError as e:
            raise ConfigError(str(e)) from None
        target = privacy.dp_target_epsilon
        if target is None:
            return
        if target <= 0:
            raise ConfigError(f'dp_target_epsilon must be > 0, got {target}')
        if dp.noise_multiplier == 0:
            raise ConfigError('--dp_target_epsilon needs --dp_noise_multiplier > 0: without noise epsilon is infinite')
        if privacy.dp_delta is None and natural.is_natural(self.data.dataset):
            raise ConfigError(
                f'--dp_target_epsilon with {self.data.dataset}: give --dp_delta '
                '(the population is known only once read)'
            )
        delta = privacy.delta_for(self.data.num_clients)
        rounds = self.schedule.rounds
        reached = privacy_lib.epsilon(dp, self.dp_sampling_probability(), rounds, delta)
        if reached > target:
            raise ConfigError(
                f'--dp_target_epsilon {target:g}: {rounds} rounds at noise multiplier '
                f'{dp.noise_multiplier:g} and client fraction {self.schedule.client_fraction:g} reach epsilon '
                f'{reached:.5g} at delta {delta:.3g}; '
                'lower --rounds or --client_fraction, or raise --dp_noise_multiplier'
            )

    def validate(self) -> 'ExperimentConfig':
        """Returns self, or raises ConfigError on the first value that cannot run.

        Checks each part, that `settings` is the algorithm's settings type
        and valid, the model against the algorithm, and the algorithm's own
        conditions on the run (e.g. full participation).

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
            for part, part_cls in PARTS.items():
                value = getattr(self, part)
                if type(value) is not part_cls:
                    raise ConfigError(f'{part} must be a config_parts.{part_cls.__name__}, got {type(value).__name__}')
                value.validate()
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
        problem = (entry.check(self.settings, self.schedule.client_fraction) if entry.check else None) or (
            algorithms.privacy_problem(entry, self.privacy)
        )
        if problem:
            raise ConfigError(problem)
        if self.evaluation.eval_validation and self.data.split_fractions[1] == 0:
            raise ConfigError(
                'eval_validation scores the validation splits: give split_fractions a validation fraction'
            )
        self._check_privacy(entry)
        workers = self.runtime.workers
        if len(workers) > 1:
            if entry.not_one_aggregation:
                raise ConfigError(
                    f'--workers: {self.algorithm} cannot be split over several workers: {entry.not_one_aggregation}; '
                    'give one worker'
                )
            if len(set(workers)) != len(workers):
                raise ConfigError(f'--workers: an address repeats: {",".join(workers)}')
        for address in workers:
            try:
                runtime.parse_worker_address(address)
            except ValueError as e:
                raise ConfigError(f'--workers: {e}') from None
        self._check_rounds_per_call(entry)
        return self

    def _check_rounds_per_call(self, entry) -> None:
        k = self.runtime.rounds_per_call
        if k > 1 and entry.serverless:
            raise ConfigError(f'--rounds_per_call: {self.algorithm} is serverless; each exchange interval is one call')
        if k > 1 and len(self.runtime.workers) > 1:
            raise ConfigError(
                f'--rounds_per_call={k} keeps the client states in the driver, which several workers do not: '
                'give one --workers address or none'
            )
        try:
            training_loop.check_rounds_per_call(
                k,
                client_fraction=self.schedule.client_fraction,
                eval_every=self.evaluation.eval_every,
                checkpoint_every=self.checkpoints.checkpoint_every,
                prefix='--',
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None


def make_config(settings: settings_lib.Settings | None = None, **values) -> ExperimentConfig:
    """A configuration from flat keyword arguments (`ExperimentConfig.from_dict`), or with a settings object.

    Args:
      settings: optional, the algorithm's settings object (an instance of
        `algorithms.get(algorithm).settings`), used as it is; then `values`
        holds no algorithm setting.
      **values: `output_dir`, `algorithm` and any setting by its flat name,
        e.g. `make_config(output_dir='runs/x', algorithm='persfl', rounds=50,
        distill_epochs=5)`.

    Returns:
      The (not yet validated) configuration.

    Raises:
      ConfigError: a name that does not apply to the algorithm or the
        partition, a value of the wrong type, or an algorithm setting given
        both in `settings` and by name.
    """
    config = ExperimentConfig.from_dict(values)
    if settings is None:
        return config
    named = sorted(set(values) & set(config.settings.field_names()))
    if named:
        raise ConfigError(f'make_config: {named[0]} is given by name and in settings; give it in one place')
    return dataclasses.replace(config, settings=settings)
