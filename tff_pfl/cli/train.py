"""tff-pfl-train: train one algorithm on one partition; one output directory.

With no flags it runs the main job: FedAvg on the Synthetic(1,1) federated
benchmark (30 clients, generated on the fly, no network), and prints a
per-client result table and where the report and plots were written.

Bad flag values print one line `tff-pfl-train: error: ...` and exit with 2.
"""

import dataclasses
import os
import sys
import time

# TensorFlow's C++ start-up chatter (oneDNN, CPU features, CUDA plug-ins on a
# CPU-only machine) is not for users of the binary; TF_CPP_MIN_LOG_LEVEL=0
# brings it back. Errors still surface as Python exceptions.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from absl import app, flags, logging

from tff_pfl.cli import common
from tff_pfl.program import experiment

_D = experiment.ExperimentConfig(output_dir='')

# Algorithm and model.
_ALGORITHM = flags.DEFINE_string('algorithm', _D.algorithm, 'Algorithm to run.')
_MODEL = flags.DEFINE_string('model', None, 'Model name; default: chosen from the dataset.')

# Data.
_DATASET = flags.DEFINE_string(
    'dataset', _D.dataset, 'synthetic[:alpha,beta] | npz:PATH (Keras layout) | tfds:NAME | folder:PATH.'
)
_DATA_DIR = flags.DEFINE_string('data_dir', None, 'TFDS data directory.')
_DOWNLOAD = flags.DEFINE_bool('download', False, 'Let TFDS download the dataset.')
_PARTITION = flags.DEFINE_string(
    'partition',
    _D.partition,
    'natural | iid | ds1 | ds2 | ds3 | dirichlet | dirichlet_clients | shards | kt_case1 | kt_case2 | kd_dirichlet.',
)
_NUM_CLIENTS = flags.DEFINE_integer('num_clients', _D.num_clients, 'Number of clients.')
_CLASSES_PER_CLIENT = flags.DEFINE_integer(
    'classes_per_client',
    None,
    'k of ds1 (default 4); shards per client of shards (2); classes per client of ds3 and kt_case2 (2).',
)
_DIRICHLET_ALPHA = flags.DEFINE_float(
    'dirichlet_alpha', None, 'Dirichlet concentration (default 0.9; kd_dirichlet: 0.1).'
)
_EXAMPLES_PER_CLIENT = flags.DEFINE_integer(
    'examples_per_client', None, 'Examples per client (ds1, iid, dirichlet); default: as many as fit.'
)
_EXAMPLES_PER_CLASS = flags.DEFINE_integer(
    'examples_per_class', None, "Examples of each of a client's classes (kt_case2; default 300)."
)
_KT_CASE1_COUNTS = flags.DEFINE_list(
    'kt_case1_counts',
    [str(c) for c in _D.kt_case1_counts],
    "kt_case1: examples per class of a group's own half of the classes, and of the other half.",
)
_KD_SPLIT_SIZES = flags.DEFINE_list(
    'kd_split_sizes',
    [str(c) for c in _D.kd_split_sizes],
    'kd_dirichlet: min and max training examples, validation and test examples per client.',
)
_SPLIT_FRACTIONS = flags.DEFINE_list(
    'split_fractions', ['0.6', '0.2', '0.2'], 'Train,validation,test fractions of each client.'
)

# Training.
_ROUNDS = flags.DEFINE_integer('rounds', _D.rounds, 'Training rounds.')
_CLIENT_FRACTION = flags.DEFINE_float('client_fraction', _D.client_fraction, 'Clients sampled per round, in (0, 1].')
_LOCAL_EPOCHS = flags.DEFINE_integer('local_epochs', _D.local_epochs, 'Local epochs per round.')
_LOCAL_STEPS = flags.DEFINE_integer(
    'local_steps', _D.local_steps, 'Local SGD steps per round instead of epochs (0: use epochs).'
)
_BATCH_SIZE = flags.DEFINE_integer('batch_size', _D.batch_size, 'Local batch size.')
_CLIENT_LR = flags.DEFINE_float('client_learning_rate', _D.client_learning_rate, 'Client SGD learning rate.')
_SERVER_LR = flags.DEFINE_float('server_learning_rate', _D.server_learning_rate, 'Server SGD learning rate.')
_EVAL_EVERY = flags.DEFINE_integer('eval_every', _D.eval_every, 'Evaluate every client every N rounds (0: at the end).')

# PersFL / PersFL-GD stage 2 (local distillation).
_DISTILL_EPOCHS = flags.DEFINE_integer('distill_epochs', _D.distill_epochs, 'Distillation epochs per grid candidate.')
_DISTILL_BATCH = flags.DEFINE_integer('distill_batch_size', _D.distill_batch_size, 'Distillation batch size.')
_DISTILL_LR = flags.DEFINE_float('distill_learning_rate', _D.distill_learning_rate, 'Distillation SGD learning rate.')
_TEMPERATURES = flags.DEFINE_list(
    'temperatures', [f'{t:g}' for t in _D.temperatures], 'Grid of distillation temperatures T.'
)
_IMITATIONS = flags.DEFINE_list('imitations', [f'{i:g}' for i in _D.imitations], 'Grid of imitation parameters lambda.')
_TEACHER = flags.DEFINE_enum(
    'teacher', _D.teacher, ['optimal', 'final'], 'Distil from the optimal teacher or the final global model.'
)

# Self-FL (--client_fraction is its activity rate C, --client_learning_rate its eta).
_SELFFL_MAX_STEPS = flags.DEFINE_integer('selffl_max_steps', _D.selffl_max_steps, 'l_max, the cap on local steps.')
_SELFFL_DEFAULT_STEPS = flags.DEFINE_integer(
    'selffl_default_steps', _D.selffl_default_steps, 'Local steps while uncertainties are unknown (warm-up).'
)
_WARMUP_ROUNDS = flags.DEFINE_integer('warmup_rounds', _D.warmup_rounds, 'Plain FedAvg rounds before Self-FL starts.')

# KT-pFL (also uses the distillation flags above).
_ARCHITECTURES = flags.DEFINE_list(
    'architectures', list(_D.architectures), 'Client architectures, assigned to clients in turn.'
)
_PUBLIC_EXAMPLES = flags.DEFINE_integer(
    'public_examples', _D.public_examples, 'Examples set aside as unlabeled public data before partitioning.'
)
_PUBLIC_BATCH = flags.DEFINE_integer('public_batch', _D.public_batch, 'Public examples drawn per round.')
_KT_TEMPERATURE = flags.DEFINE_float('kt_temperature', _D.kt_temperature, 'Soft-prediction temperature T.')
_KT_C_LR = flags.DEFINE_float('kt_coefficient_learning_rate', _D.kt_coefficient_learning_rate, 'eta_3, the c step.')
_KT_RHO = flags.DEFINE_float('kt_rho', _D.kt_rho, 'rho, the weight of ||c - 1/N||^2.')
_KT_C_UPDATE = flags.DEFINE_enum(
    'kt_c_update',
    _D.kt_c_update,
    ['paper', 'released', 'fedmd', 'similarity', 'topk'],
    'How c is updated: KT-pFL (paper, released) or a baseline (FedMD, Sim-pFL, TopK-pFL).',
)

# FedDF / pFedDF (--distill_epochs: the server's passes over the public batch per prototype).
_FINETUNE_EPOCHS = flags.DEFINE_integer(
    'finetune_epochs', _D.finetune_epochs, 'pFedDF: local fine-tuning epochs of the prototype at evaluation.'
)

# KD-PDFL and its serverless baselines (--rounds counts exchange intervals of --exchange_interval slots).
_EXCHANGE_INTERVAL = flags.DEFINE_integer('exchange_interval', _D.exchange_interval, 'T_ex, slots per exchange.')
_KD_MEAN_NEIGHBOURS = flags.DEFINE_float(
    'kd_mean_neighbours', _D.kd_mean_neighbours, 'Mean number of peers a star reaches (Rayleigh fading).'
)
_KD_MAX_NEIGHBOURS = flags.DEFINE_integer('kd_max_neighbours', _D.kd_max_neighbours, "Cap on a star's neighbours.")
_KD_MU1 = flags.DEFINE_float('kd_mu1', _D.kd_mu1, 'mu_1, the weight of the logit distances in Eq. 2.')
_KD_MU2 = flags.DEFINE_float('kd_mu2', _D.kd_mu2, 'mu_2, the weight of the collaboration regulariser g.')
_KD_C_BASE = flags.DEFINE_float('kd_c_base', _D.kd_c_base, 'c_base of the confidence (Eq. 4).')
_KD_DISTANCE_BATCH = flags.DEFINE_integer('kd_distance_batch', _D.kd_distance_batch, "n_i, the star's batch.")
_KD_DISTANCE_LAYER = flags.DEFINE_integer(
    'kd_distance_layer', _D.kd_distance_layer, 'Layers whose output is compared (-1: the softmax output).'
)
_KD_BROADCAST = flags.DEFINE_enum(
    'kd_broadcast', _D.kd_broadcast, ['adopt', 'keep'], "What neighbours do with the star's new model."
)
_FINETUNE_FROM_SLOT = flags.DEFINE_integer(
    'finetune_from_slot', _D.finetune_from_slot, 'kdpdfl_fedavg_plus: slot from which clients only fine-tune.'
)

# Baselines (fedavg_ft: --finetune_epochs is the largest fine-tuning epoch count tried on validation;
# Ditto's, pFedMe's and Per-FedAvg's local learning rate is --client_learning_rate).
_PERSONAL_LAYERS = flags.DEFINE_integer(
    'personal_layers', _D.personal_layers, 'FedPer: the last N layers with weights stay on the clients.'
)
_DITTO_LAMBDA = flags.DEFINE_float('ditto_lambda', _D.ditto_lambda, 'Ditto: lambda, the pull towards the global model.')
_PERSONAL_EPOCHS = flags.DEFINE_integer(
    'personal_epochs', _D.personal_epochs, 'Ditto: personal-model epochs per round.'
)
_PFEDME_LAMBDA = flags.DEFINE_float('pfedme_lambda', _D.pfedme_lambda, 'pFedMe: lambda of the Moreau envelope.')
_PFEDME_K = flags.DEFINE_integer(
    'pfedme_inner_steps', _D.pfedme_inner_steps, 'pFedMe: K, steps that approximate theta.'
)
_PFEDME_PLR = flags.DEFINE_float(
    'pfedme_personal_learning_rate',
    _D.pfedme_personal_learning_rate,
    'pFedMe: the personal learning rate of those K steps.',
)
_PFEDME_BETA = flags.DEFINE_float('pfedme_beta', _D.pfedme_beta, "pFedMe: beta, the server's step towards the mean.")
_PERFEDAVG_ALPHA = flags.DEFINE_float(
    'perfedavg_alpha', _D.perfedavg_alpha, 'Per-FedAvg: alpha, the adaptation step (--client_learning_rate is beta).'
)
_PERFEDAVG_DELTA = flags.DEFINE_float('perfedavg_delta', _D.perfedavg_delta, 'Per-FedAvg HF: finite-difference step.')
_APFL_ALPHA = flags.DEFINE_float('apfl_alpha', _D.apfl_alpha, "APFL: every client's initial mixing weight alpha.")
_APFL_ALPHA_LR = flags.DEFINE_float(
    'apfl_alpha_learning_rate', _D.apfl_alpha_learning_rate, 'APFL: eta_alpha, the alpha step size (0 fixes alpha).'
)

# Run.
_SEED = flags.DEFINE_integer('seed', _D.seed, 'Seed of partition, sampling and training.')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Output directory; default runs/<algorithm>-<time>.')
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace a non-empty output directory.')
_WORKERS = flags.DEFINE_list(
    'workers',
    [],
    'host:port of each TFF worker_binary to run the rounds on (deploy/README.md); several split '
    'every round over the workers, with client states kept in --output_dir/client_states; default: a local one.',
)
_ISOLATE_NETWORK = flags.DEFINE_bool(
    'isolate_network',
    True,
    'Run in a private network namespace, so that nothing else can reach the local TFF worker (docs/runtime.md); '
    'off with --workers or --download, which need the network.',
)
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    'checkpoint_every',
    _D.checkpoint_every,
    'Write a checkpoint every this many rounds (0: never). Rerun the same command in the same --output_dir to '
    'continue an interrupted run from its last checkpoint.',
)
_MAX_CONCURRENT = flags.DEFINE_integer(
    'max_concurrent_clients',
    _D.max_concurrent_clients,
    'Client computations the TFF worker runs at once (-1: no limit).',
)

_PROG = 'tff-pfl-train'


def _fail(message) -> None:
    common.fail(_PROG, message)


def _floats(flag) -> tuple:
    try:
        return tuple(float(v) for v in flag.value)
    except ValueError:
        raise experiment.ConfigError(f'{flag.name} must be numbers, got {",".join(flag.value)}') from None


def config_from_flags() -> experiment.ExperimentConfig:
    """Builds and validates the configuration from the parsed flags.

    Every `ExperimentConfig` field has a flag of the same name; list flags
    become tuples of floats.

    Returns:
      The validated `experiment.ExperimentConfig`.

    Raises:
      experiment.ConfigError: a flag value the configuration refuses.
    """
    values = {}
    for field in dataclasses.fields(experiment.ExperimentConfig):
        if field.name == 'output_dir':
            continue
        flag = flags.FLAGS[field.name]
        if field.name in ('architectures', 'workers'):
            values[field.name] = tuple(flag.value)
        elif isinstance(field.default, tuple):
            values[field.name] = _floats(flag)
        else:
            values[field.name] = flag.value
    values['output_dir'] = _OUTPUT_DIR.value or os.path.join(
        'runs', f'{_ALGORITHM.value}-{time.strftime("%Y%m%d-%H%M%S")}'
    )
    return experiment.ExperimentConfig(**values).validate()


def main(argv) -> None:
    """Validates the flags, then runs the experiment and prints its tables.

    Exits with 2 and one line on stderr on bad input, 130 on Ctrl-C, and 0
    (without running) when the output directory holds this run, finished.

    Args:
      argv: what absl leaves of the command line after the flags; must hold
        only the program name.
    """
    if len(argv) > 1:
        _fail(f'unexpected arguments: {" ".join(argv[1:])}')
    from tff_pfl import runtime
    from tff_pfl.data import partition, sources
    from tff_pfl.program import reports

    logging.set_verbosity(logging.WARNING)
    try:
        config = config_from_flags()
    except experiment.ConfigError as e:
        _fail(str(e))  # before re-executing in a namespace: bad flags cost one start-up, not two
    if _ISOLATE_NETWORK.value and not flags.FLAGS['workers'].value and not _DOWNLOAD.value:
        runtime.isolate_network(_PROG, ['-m', 'tff_pfl.cli.train', *sys.argv[1:]])
    runtime.install_sigterm_handler()
    try:
        result = experiment.run_experiment(config, overwrite=_OVERWRITE.value)
    except (experiment.ConfigError, sources.DataError, partition.PartitionError) as e:
        _fail(str(e))
    except experiment.RunComplete as e:
        print(f'{_PROG}: {e}; nothing to do')
        return
    except KeyboardInterrupt:
        print(f'{_PROG}: interrupted', file=sys.stderr)
        sys.exit(130)
    rows, columns = experiment.client_table(result)
    print()
    print(reports.format_table(rows, columns))
    print()
    rows, columns = experiment.summary_table(result)
    print(reports.format_table(rows, columns))
    out = os.path.abspath(config.output_dir)
    print(f'\nreport: {os.path.join(out, "report.md")}')
    print(
        f'plots:  {os.path.join(out, "accuracy.png")}, {os.path.join(out, "clients.png")}, '
        f'{os.path.join(out, "partition.png")}'
    )


def run() -> None:
    """Console-script entry point."""
    common.use_invocation_directory()
    app.run(main, flags_parser=common.flags_parser(_PROG))


if __name__ == '__main__':
    run()
