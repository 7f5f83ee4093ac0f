"""TFF's own personalization processes as benchmark peers (docs/benchmarks.md).

A peer is a suite algorithm that is not one of the project's algorithms but a
process of `tff.learning` run as TFF builds it, on the same client data, so a
suite puts it beside ours in the same tables. Peers are not in the
`algorithms` registry: `bench_suite` accepts their names as `algorithm = ...`
and `bench_run` runs them here instead of `experiment.run_experiment`.

* `tff_fed_recon`: Federated Reconstruction
  (`tff.learning.algorithms.build_fed_recon`; Singhal et al., 2021). The
  model's last Dense layer is local (reconstructed on each client, never
  sent), the layers before it are global. The result, `personalized_model`,
  is each client's head reconstructed on its training split
  (`tff.learning.algorithms.build_fed_recon_eval`) and scored on its test
  split.
* `tff_fedavg_pers_eval`: FedAvg (`tff.learning.algorithms.build_weighted_fed_avg`),
  then TFF's personalization evaluation
  (`tff.learning.algorithms.build_personalization_eval_computation`) of the
  final global model on every client: `global_model` is its baseline metrics
  (the global model on the client's test split), `personalized_model` the
  model fine-tuned on the client's training split for the number of epochs
  (0 to `finetune_epochs`) best on its validation split, as `fedavg_ft`
  chooses.

Both read the partition `experiment.run_experiment` writes for the same
configuration (the same `partition.csv`), sample the clients of each round
as `training_loop.run` does, and start from the model of the project's
`tff_pfl.models` registry. Loss and accuracy count the scored positions only
(`losses.hard_cross_entropy`; for text: characters, docs/data.md "Text").

Their client data, models, rounds and evaluations are in `peer_processes`;
their loss and metrics over the scored positions in `peer_scoring`.
"""

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping

from tff_pfl import runtime
from tff_pfl.data import client_data
from tff_pfl.program import config_parts, run_config
from tff_pfl_bench import peer_processes, peer_scoring


@dataclasses.dataclass(frozen=True)
class Peer:
    """One of TFF's processes as a suite algorithm.

    Attributes:
      title: what it is, one line.
      settings_of: the registered algorithm whose settings dataclass holds
        the peer's settings (its configuration is that algorithm's).
      settings: the settings of `settings_of` the peer takes; the others must
        keep their defaults.
      models: the models its record can report.
    """

    title: str
    settings_of: str
    settings: tuple
    models: tuple


PEERS = {
    'tff_fed_recon': Peer(
        "Federated Reconstruction, TFF's build_fed_recon (head local, reconstructed on each client)",
        'fedavg',
        ('batch_size', 'client_learning_rate', 'local_epochs', 'server_learning_rate'),
        ('personalized_model',),
    ),
    'tff_fedavg_pers_eval': Peer(
        "FedAvg, TFF's build_weighted_fed_avg, then TFF's build_personalization_eval_computation (fine-tuning)",
        'fedavg_ft',
        ('batch_size', 'client_learning_rate', 'local_epochs', 'server_learning_rate', 'finetune_epochs'),
        ('global_model', 'personalized_model'),
    ),
}

# The run's settings a peer takes: the data (and every partition's settings), the model and the
# schedule. The others (DP, secure aggregation, remote workers, sampled evaluations, ...) must keep
# their defaults.
COMMON_SETTINGS = (
    'algorithm',
    *config_parts.DataConfig.field_names(),
    *config_parts.PARTITION_SETTINGS,
    'model',
    'model_modules',
    *config_parts.ScheduleConfig.field_names(),
    'eval_every',
    'checkpoint_every',  # a peer checkpoints its model, sampler and rows as our runs do (`peer_processes._train`)
    'seed',
    'max_concurrent_clients',
)


def names() -> list[str]:
    """The peers' names, sorted.

    Returns:
      The names a suite's `algorithm = ...` may give besides the registry's.
    """
    return sorted(PEERS)


def is_peer(name: str) -> bool:
    """Whether `name` is a peer (not a registered algorithm).

    Args:
      name: a suite's `algorithm` value.

    Returns:
      True for a key of `PEERS`.
    """
    return name in PEERS


def config_values(name: str, values: Mapping) -> dict:
    """A peer's flat configuration as the configuration of the algorithm holding its settings.

    Args:
      name: a peer name.
      values: flat settings (common and the peer's), with `algorithm` = `name`.

    Returns:
      `values` with `algorithm` = `PEERS[name].settings_of`.

    Raises:
      run_config.ConfigError: a setting the peer does not take (one line).
    """
    peer = PEERS[name]
    for key in values:
        if key not in COMMON_SETTINGS and key not in peer.settings and key != 'output_dir':
            raise run_config.ConfigError(_refusal(name, key))
    return {**values, 'algorithm': peer.settings_of}


def check_config(name: str, config: run_config.ExperimentConfig) -> None:
    """Refuses a configuration that sets what the peer does not take.

    Args:
      name: a peer name.
      config: its configuration (`config_values`'s algorithm).

    Raises:
      run_config.ConfigError: a common setting or a setting of
        `PEERS[name].settings_of` that differs from its default and that the
        peer does not take (one line).
    """
    peer = PEERS[name]
    defaults = run_config.ExperimentConfig(output_dir='')
    for field in run_config.ExperimentConfig.common_fields():
        if field not in COMMON_SETTINGS and config.flat_value(field) != defaults.flat_value(field):
            raise run_config.ConfigError(_refusal(name, field))
    own_defaults = type(config.settings)()
    for field in type(config.settings).field_names():
        if field not in peer.settings and getattr(config.settings, field) != getattr(own_defaults, field):
            raise run_config.ConfigError(_refusal(name, field))


def _refusal(name: str, key: str) -> str:
    taken = ', '.join(PEERS[name].settings)
    return f"{key} does not apply to {name} (TFF's own process; besides the data and the run it takes {taken})"


# ----------------------------------------------------------------------------
# Running a peer.


def run_peer(
    name: str,
    config: run_config.ExperimentConfig,
    *,
    log: Callable[[str], None] = print,
    on_data: Callable[[str], None] | None = None,
    resume: bool = False,
):
    """Runs one peer on the run's partition and returns what `bench_run` records.

    Args:
      name: a peer name.
      config: its configuration (`config_values`'s), `output_dir` the run directory.
      log: receives progress lines.
      on_data: called with the text of `partition.csv` before training.
      resume: continue the unfinished run in `output_dir` from its newest
        checkpoint (`experiment.resumable_round` found one); otherwise the
        directory is removed and the run starts from nothing.

    Returns:
      `(result, communication)`: a `training_loop.RunResult` (rounds, clients
      and summary as `run_experiment` gives them; no state) and the
      communication per call as `bench_run._check_process` returns it.
    """
    config.validate()
    check_config(name, config)
    out = os.path.abspath(config.output_dir)
    if resume:
        clients = peer_processes.load_clients(client_data.load_client_data_spec(os.path.join(out, 'client_data')))
    else:
        if os.path.exists(out):  # a redone run starts from nothing
            shutil.rmtree(out)
        clients = peer_processes.prepare_data(config, out, log)
    _check_markable(name, clients)
    if on_data is not None:
        with open(os.path.join(out, 'partition.csv'), encoding='utf-8') as f:
            on_data(f.read())
    with runtime.runtime_for(
        config.runtime.workers,
        max_concurrent_computation_calls=config.runtime.max_concurrent_clients,
        log_path=os.path.join(out, 'worker.log'),
    ):
        run = peer_processes.run_fed_recon if name == 'tff_fed_recon' else peer_processes.run_fedavg_pers_eval
        result, communication = run(config, clients, out, log, resume)
    with open(os.path.join(out, 'clients.csv'), 'w', encoding='utf-8') as f:
        columns = list(result.clients[0])
        f.write(','.join(columns) + '\n')
        for row in result.clients:
            f.write(','.join(str(row[c]) for c in columns) + '\n')
    return result, communication


def _check_markable(name: str, clients: 'peer_processes.Clients') -> None:
    """Refuses data whose marked test labels float32 could not hold (`peer_scoring.TEST_MARK`)."""
    if len(clients.ids) > peer_scoring.MAX_MARKED_CLIENTS:
        raise run_config.ConfigError(
            f'{name} scores at most {peer_scoring.MAX_MARKED_CLIENTS} clients (their test labels are marked inside '
            f'TFF datasets and read back through float32), got {len(clients.ids)}'
        )
    if clients.spec.num_classes >= peer_scoring.TEST_MARK:
        raise run_config.ConfigError(
            f'{name} scores at most {peer_scoring.TEST_MARK - 1} classes (marked test labels), '
            f'got {clients.spec.num_classes}'
        )
