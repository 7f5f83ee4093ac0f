"""The named parts of a run's configuration, each a frozen settings dataclass.

`run_config.ExperimentConfig` is the algorithm, its model and settings and the
run's seed, plus one part per concern: `DataConfig` (the source and its
partition, one settings type per partition), `ScheduleConfig` (rounds and
sampling), `EvaluationConfig`, `CheckpointConfig`, `PrivacyConfig` (user-level
DP and secure sums) and `RuntimeConfig` (the TFF workers). A part's fields keep
their flat names: the flat form (`config.json`, a `--config` file, the flags)
is the parts' fields side by side, and each name belongs to one part.
"""

import dataclasses
import typing

from tff_pfl import settings as settings_lib
from tff_pfl.computations import privacy as privacy_lib

_setting = settings_lib.setting


@dataclasses.dataclass(frozen=True)
class PartitionSettings(settings_lib.Settings):
    """A partition's own settings: one type per partition (`PARTITIONS`).

    Unset (None) fields leave the partitioner's default, written in each help
    line. `params()` names them as the partitioner's keyword arguments.
    """

    # The partition's name (`--partition`).
    name: typing.ClassVar[str] = ''
    # Field -> the partitioner's keyword argument (a tuple: one per element of the value).
    _params: typing.ClassVar[dict] = {}
    # The partitioner's keyword arguments given even when no field sets them.
    _fixed: typing.ClassVar[dict] = {}

    def params(self) -> dict:
        """Keyword arguments of the partitioner, from the fields that are set.

        Returns:
          Parameter name -> value (unset fields are left to the
          partitioner's defaults); empty for a partition without parameters.
        """
        params = dict(self._fixed)
        for field, names in self._params.items():
            value = getattr(self, field)
            if value is None:
                continue
            if isinstance(names, tuple):
                params.update(zip(names, (int(v) for v in value)))
            else:
                params[names] = value
        return params

    def _checks(self):
        checks = super()._checks()
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and not isinstance(value, bool):
                checks.append((value >= 1, f'{field.name} must be >= 1, got {value}'))
            elif isinstance(value, float):
                checks.append((value > 0, f'{field.name} must be > 0, got {value}'))
        return checks


def _counts_check(name: str, value, length: int, what: str, ordered: bool = False):
    ok = value is None or (
        len(value) == length and all(c >= 1 for c in value) and (not ordered or value[0] <= value[1])
    )
    return ok, f'{name} must be {what}, got {list(value or ())}'


@dataclasses.dataclass(frozen=True)
class Ds1Partition(PartitionSettings):
    """PersFL's DS-1: k classes per client, examples split evenly among the clients holding a class."""

    name: typing.ClassVar[str] = 'ds1'
    _params: typing.ClassVar[dict] = {'classes_per_client': 'k', 'examples_per_client': 'examples_per_client'}
    classes_per_client: int | None = _setting(None, 'k, the classes of each client (default 4).')
    examples_per_client: int | None = _setting(None, 'examples per client (default: as many as fit).')


@dataclasses.dataclass(frozen=True)
class Ds2Partition(PartitionSettings):
    """PersFL's DS-2: each class spread over the clients by a Dirichlet draw."""

    name: typing.ClassVar[str] = 'ds2'
    _params: typing.ClassVar[dict] = {'dirichlet_alpha': 'alpha'}
    dirichlet_alpha: float | None = _setting(None, 'Dirichlet concentration (default 0.9).')


@dataclasses.dataclass(frozen=True)
class DirichletClientsPartition(PartitionSettings):
    """Each client's class mix drawn from a Dirichlet distribution."""

    name: typing.ClassVar[str] = 'dirichlet_clients'
    _params: typing.ClassVar[dict] = {'dirichlet_alpha': 'alpha'}
    dirichlet_alpha: float | None = _setting(None, 'Dirichlet concentration (default 0.9).')


@dataclasses.dataclass(frozen=True)
class DirichletPartition(PartitionSettings):
    """Per-class Dirichlet proportions over the clients, with a set number of examples per client."""

    name: typing.ClassVar[str] = 'dirichlet'
    _params: typing.ClassVar[dict] = {'dirichlet_alpha': 'alpha', 'examples_per_client': 'examples_per_client'}
    _fixed: typing.ClassVar[dict] = {'alpha': 0.9}
    dirichlet_alpha: float | None = _setting(None, 'Dirichlet concentration (default 0.9).')
    examples_per_client: int | None = _setting(None, 'examples per client (required).')

    def _checks(self):
        return super()._checks() + [
            (self.examples_per_client is not None, 'partition dirichlet needs --examples_per_client')
        ]


@dataclasses.dataclass(frozen=True)
class KdDirichletPartition(PartitionSettings):
    """KD-PDFL's partition: Dirichlet class mixes and client sizes drawn in a range."""

    name: typing.ClassVar[str] = 'kd_dirichlet'
    _params: typing.ClassVar[dict] = {
        'dirichlet_alpha': 'alpha',
        'kd_split_sizes': ('min_train', 'max_train', 'val_examples', 'test_examples'),
    }
    dirichlet_alpha: float | None = _setting(None, 'Dirichlet concentration (default 0.1).')
    kd_split_sizes: tuple[int, ...] | None = _setting(
        None, 'min and max training examples, validation and test examples per client (default 15,100,20,100).'
    )

    def _checks(self):
        return super()._checks() + [
            _counts_check(
                'kd_split_sizes', self.kd_split_sizes, 4, 'min_train <= max_train, val, test (positive integers)', True
            )
        ]


@dataclasses.dataclass(frozen=True)
class DirichletPerClassPartition(PartitionSettings):
    """PFLlib's partition: each class split over the clients by a Dirichlet draw, capped at a fair share."""

    name: typing.ClassVar[str] = 'dirichlet_per_class'
    _params: typing.ClassVar[dict] = {'dirichlet_alpha': 'alpha'}
    dirichlet_alpha: float | None = _setting(None, 'Dirichlet concentration (default 0.1).')


@dataclasses.dataclass(frozen=True)
class ClassesInTurnPartition(PartitionSettings):
    """PFLlib's pathological partition: classes dealt to the clients in turn, random sizes."""

    name: typing.ClassVar[str] = 'classes_in_turn'
    _params: typing.ClassVar[dict] = {'classes_per_client': 'classes_per_client'}
    classes_per_client: int | None = _setting(None, 'classes per client (default 2).')


@dataclasses.dataclass(frozen=True)
class ShardsPartition(PartitionSettings):
    """McMahan et al.'s shards: label-sorted shards dealt to the clients."""

    name: typing.ClassVar[str] = 'shards'
    _params: typing.ClassVar[dict] = {'shards_per_client': 'shards_per_client'}
    shards_per_client: int | None = _setting(None, 'label-sorted shards per client (default 2).')


@dataclasses.dataclass(frozen=True)
class IidPartition(PartitionSettings):
    """Examples dealt to the clients at random."""

    name: typing.ClassVar[str] = 'iid'
    _params: typing.ClassVar[dict] = {'examples_per_client': 'examples_per_client'}
    examples_per_client: int | None = _setting(None, 'examples per client (default: as many as fit).')


@dataclasses.dataclass(frozen=True)
class Ds3Partition(PartitionSettings):
    """Self-FL's DS-3: a few classes per client, sizes from a power law."""

    name: typing.ClassVar[str] = 'ds3'
    _params: typing.ClassVar[dict] = {
        'classes_per_client': 'classes_per_client',
        'base_examples_per_class': 'base_examples',
    }
    classes_per_client: int | None = _setting(None, 'classes per client (default 2).')
    base_examples_per_class: int | None = _setting(
        None, "examples of each of a client's classes given before the power-law split (default 5)."
    )


@dataclasses.dataclass(frozen=True)
class KtCase1Partition(PartitionSettings):
    """KT-pFL's case 1: two groups of clients, each with more examples of its half of the classes."""

    name: typing.ClassVar[str] = 'kt_case1'
    _params: typing.ClassVar[dict] = {'kt_case1_counts': ('major', 'minor')}
    kt_case1_counts: tuple[int, ...] | None = _setting(
        None, "examples per class of a group's own half of the classes, and of the other (default 450,150)."
    )

    def _checks(self):
        return super()._checks() + [_counts_check('kt_case1_counts', self.kt_case1_counts, 2, 'two positive integers')]


@dataclasses.dataclass(frozen=True)
class KtCase2Partition(PartitionSettings):
    """KT-pFL's case 2: a few classes per client, the same number of examples of each."""

    name: typing.ClassVar[str] = 'kt_case2'
    _params: typing.ClassVar[dict] = {
        'classes_per_client': 'classes_per_client',
        'examples_per_class': 'examples_per_class',
    }
    classes_per_client: int | None = _setting(None, 'classes per client (default 2).')
    examples_per_class: int | None = _setting(None, "examples of each of a client's classes (default 300).")


@dataclasses.dataclass(frozen=True)
class NaturalPartition(PartitionSettings):
    """The clients of a naturally federated source, as they are."""

    name: typing.ClassVar[str] = 'natural'


PARTITIONS = {
    cls.name: cls
    for cls in (
        Ds1Partition,
        Ds2Partition,
        DirichletClientsPartition,
        DirichletPartition,
        KdDirichletPartition,
        DirichletPerClassPartition,
        ClassesInTurnPartition,
        ShardsPartition,
        IidPartition,
        Ds3Partition,
        KtCase1Partition,
        KtCase2Partition,
        NaturalPartition,
    )
}
# Every partition setting's name, in the order config.json has always written them.
PARTITION_SETTINGS = (
    'classes_per_client',
    'shards_per_client',
    'dirichlet_alpha',
    'examples_per_client',
    'examples_per_class',
    'base_examples_per_class',
    'kt_case1_counts',
    'kd_split_sizes',
)
# Settings renamed so that no name means two things: (partition, old name) -> its name now.
RENAMED = {('shards', 'classes_per_client'): 'shards_per_client'}


def partition_users(name: str) -> list[str]:
    """The partitions that take the setting `name`.

    Args:
      name: a partition setting's name.

    Returns:
      Partition names, in `PARTITIONS` order.
    """
    return [p for p, cls in PARTITIONS.items() if name in cls.field_names()]


def stray_line(name: str, partition_name: str) -> str:
    """The refusal of a setting given to a partition that does not take it.

    Args:
      name: the setting.
      partition_name: the run's partition.

    Returns:
      One line; it names the new setting when `name` was renamed for this partition.
    """
    line = f'--{name} does not apply to partition {partition_name}'
    renamed = RENAMED.get((partition_name, name))
    return f'{line}: its setting is --{renamed} now' if renamed else line


@dataclasses.dataclass(frozen=True)
class DataConfig(settings_lib.Settings):
    """Where the clients' data come from and how they are split into clients."""

    dataset: str = _setting(
        'synthetic',
        'synthetic[:alpha,beta[,heterogeneity]] | npz:PATH (Keras layout) | tfds:NAME | folder:PATH; '
        'naturally federated: '
        'tff:NAME (shakespeare, emnist, emnist_digits, cifar100) | sqlite:PATH[#TRAIN,TEST] | clients:DIR '
        '(docs/data.md).',
    )
    data_dir: str | None = _setting(None, "TFDS data directory; TFF's cache directory for tff: datasets.")
    download: bool = _setting(False, 'Let TFDS (tfds:) or TFF (tff:) download the dataset.')
    partition: PartitionSettings = _setting(NaturalPartition(), ' | '.join(PARTITIONS) + ' (docs/data.md).')
    num_clients: int = _setting(30, 'Number of clients.')
    split_fractions: tuple[float, ...] = _setting(
        (0.6, 0.2, 0.2),
        'Train, validation, test fractions of each client; a validation fraction of 0 keeps no validation split '
        '(refused by the algorithms and settings that read one).',
    )

    def _checks(self):
        fractions = self.split_fractions
        return super()._checks() + [
            (self.num_clients >= 1, f'num_clients must be >= 1, got {self.num_clients}'),
            (
                len(fractions) == 3
                and fractions[0] > 0
                and fractions[1] >= 0
                and fractions[2] > 0
                and abs(sum(fractions) - 1.0) < 1e-6,
                'split_fractions must be three numbers summing to 1, train and test positive, validation >= 0, '
                f'got {list(fractions)}',
            ),
        ]

    def validate(self) -> 'DataConfig':
        """Checks the data settings and the partition's; returns self.

        Returns:
          This part.

        Raises:
          settings.SettingsError: on the first value that cannot run.
        """
        if not isinstance(self.partition, PartitionSettings):
            raise settings_lib.SettingsError(
                f'partition must be one of the partition settings types, got {self.partition!r}'
            )
        super().validate()
        self.partition.validate()
        return self


@dataclasses.dataclass(frozen=True)
class ScheduleConfig(settings_lib.Settings):
    """How many rounds, which clients take part in each, and what stops a run early."""

    rounds: int = _setting(100, 'Training rounds (serverless algorithms: exchange intervals).')
    client_fraction: float = _setting(1.0, 'Clients sampled per round, in (0, 1].')
    stop_on_divergence: bool = _setting(
        True,
        'Stop after the first round whose mean training loss is NaN or infinite, evaluating its models as the last '
        "round's (report.md says where); off: train every round.",
    )

    def _checks(self):
        return super()._checks() + [
            (self.rounds >= 1, f'rounds must be >= 1, got {self.rounds}'),
            (0.0 < self.client_fraction <= 1.0, f'client_fraction must be in (0, 1], got {self.client_fraction}'),
        ]


@dataclasses.dataclass(frozen=True)
class EvaluationConfig(settings_lib.Settings):
    """When the clients' models are scored, and how many clients before the last round."""

    eval_every: int = _setting(10, 'Evaluate every client every N rounds (0: at the end only).')
    eval_clients: int = _setting(
        0,
        'Evaluations before the last round score a seeded sample of this many clients, with a 95% confidence '
        'interval of the mean (0: every client); the last round scores every client.',
    )
    eval_validation: bool = _setting(
        False,
        "Each evaluation also scores every client's models on its validation split (val_* columns of "
        'metrics.csv and clients.csv): the curve a round or a setting is chosen on, never the test split.',
    )

    def _checks(self):
        return super()._checks() + [
            (self.eval_every >= 0, f'eval_every must be >= 0, got {self.eval_every}'),
            (self.eval_clients >= 0, f'eval_clients must be >= 0, got {self.eval_clients}'),
        ]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(settings_lib.Settings):
    """How often an interrupted run can be continued from."""

    checkpoint_every: int = _setting(
        10,
        'Write a checkpoint every this many rounds (0: never); rerun the same command in the same --output_dir to '
        'continue an interrupted run.',
    )

    def _checks(self):
        return super()._checks() + [
            (self.checkpoint_every >= 0, f'checkpoint_every must be >= 0, got {self.checkpoint_every}')
        ]


@dataclasses.dataclass(frozen=True)
class PrivacyConfig(settings_lib.Settings):
    """User-level differential privacy of the uploads and secure sums (docs/privacy.md)."""

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

    @property
    def dp(self) -> bool:
        """Whether the run has user-level DP (`dp_noise_multiplier` is set)."""
        return self.dp_noise_multiplier is not None

    @property
    def adaptive_clipping(self) -> bool:
        """Whether DP clips adaptively (a target quantile and no fixed clip)."""
        return self.dp and self.dp_clip is None and self.dp_target_quantile is not None

    def mechanism(self, clients_per_round: float) -> 'privacy_lib.DPConfig | None':
        """The DP mechanism, or None without DP.

        Args:
          clients_per_round: the expected clients per round (client fraction x
            N), what the noised sum is divided by.

        Returns:
          A `privacy.DPConfig`, or None when `dp_noise_multiplier` is not set.

        Raises:
          privacy.PrivacyError: a mechanism that cannot run.
        """
        if not self.dp:
            return None
        return privacy_lib.DPConfig(
            noise_multiplier=self.dp_noise_multiplier,
            clients_per_round=clients_per_round,
            clip=self.dp_clip,
            target_quantile=self.dp_target_quantile,
            initial_clip=privacy_lib.DEFAULT_INITIAL_CLIP if self.dp_initial_clip is None else self.dp_initial_clip,
        )

    def delta_for(self, num_clients: int) -> float:
        """The delta epsilon is reported at.

        Args:
          num_clients: N, the run's population.

        Returns:
          `dp_delta` if set, else 1 / N^1.1.
        """
        return self.dp_delta if self.dp_delta is not None else privacy_lib.default_delta(num_clients)


# The mutual-TLS settings of `RuntimeConfig`, in the order of `TlsCredentials.from_files`'s arguments.
WORKER_TLS_SETTINGS = ('worker_tls_ca', 'worker_tls_cert', 'worker_tls_key')


@dataclasses.dataclass(frozen=True)
class RuntimeConfig(settings_lib.Settings):
    """Where the rounds run: a local TFF worker or remote ones, and how many clients at once."""

    max_concurrent_clients: int = _setting(2, 'Client computations the TFF worker runs at once (-1: no limit).')
    workers: tuple[str, ...] = _setting(
        (),
        'host:port of each TFF worker_binary to run the rounds on (deploy/README.md); several split every round '
        'over the workers; default: a local one.',
    )
    worker_tls_ca: str | None = _setting(
        None,
        "Mutual TLS with the --workers' TLS fronts (deploy/README.md): PEM file of the CA that signed the "
        "workers' certificates; with --worker_tls_cert and --worker_tls_key (default: plain gRPC, for loopback).",
    )
    worker_tls_cert: str | None = _setting(
        None, "Mutual TLS: PEM file of the driver's client certificate, signed by the CA the workers' fronts trust."
    )
    worker_tls_key: str | None = _setting(None, "Mutual TLS: PEM file of the driver's private key (unencrypted).")
    rounds_per_call: int = _setting(
        1,
        "Rounds run in one TFF call, with the same numbers and less of TFF's fixed cost a round (docs/runtime.md); "
        'needs --client_fraction=1, one worker at most, and --eval_every and --checkpoint_every multiples of it.',
    )

    def _checks(self):
        return super()._checks() + [
            (
                self.max_concurrent_clients >= 1 or self.max_concurrent_clients == -1,
                f'max_concurrent_clients must be >= 1 or -1, got {self.max_concurrent_clients}',
            ),
            (self.rounds_per_call >= 1, f'rounds_per_call must be >= 1, got {self.rounds_per_call}'),
        ]

    def validate(self) -> 'RuntimeConfig':
        """Checks the settings, and that the TLS files (if any) can be used; returns self.

        Returns:
          This part.

        Raises:
          settings.SettingsError: on the first value that cannot run: a TLS
            setting without the other two or without `workers`, or a TLS file
            that cannot be read, is not PEM of its kind, or a key that does not
            match the certificate.
        """
        super().validate()
        self.worker_tls()
        return self

    def worker_tls(self):
        """The driver's mutual-TLS credentials for the workers' fronts, read from the files.

        Returns:
          A `runtime.TlsCredentials`, or None when no TLS setting is given.

        Raises:
          settings.SettingsError: as `validate`, with one line.
        """
        given = [name for name in WORKER_TLS_SETTINGS if getattr(self, name) is not None]
        if not given:
            return None
        if len(given) < len(WORKER_TLS_SETTINGS):
            missing = [f'--{name}' for name in WORKER_TLS_SETTINGS if name not in given]
            raise settings_lib.SettingsError(
                '--worker_tls_ca, --worker_tls_cert and --worker_tls_key go together: '
                f'{", ".join(f"--{name}" for name in given)} given without {" and ".join(missing)}'
            )
        if not self.workers:
            raise settings_lib.SettingsError(
                '--worker_tls_ca, --worker_tls_cert and --worker_tls_key apply to remote workers: give --workers'
            )
        from tff_pfl import runtime

        try:
            return runtime.TlsCredentials.from_files(self.worker_tls_ca, self.worker_tls_cert, self.worker_tls_key)
        except runtime.TlsFileError as e:
            raise settings_lib.SettingsError(f'--worker_tls_{e.which} {e.path} {e.reason}') from None
