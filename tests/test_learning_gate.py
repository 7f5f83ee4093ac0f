"""The learning gate: every registered algorithm learns, from its defaults, on real data.

Data: `tests/data/mnist_gate.npz`, 2,000 real MNIST images (benchmarks/make_mnist_gate.py),
split by `ds2` (Dirichlet(0.9) label skew) over 8 clients with the default 60/20/20 splits.
Everything else is the algorithm's default (model, learning rates, local epochs, grids); only
the size and the rounds are reduced (`ROUNDS`, `FEWER_ROUNDS`). The gate, per algorithm:

- its global model (where it has one) and its personalized model (where it has one) reach
  mean test accuracy at least `CHANCE + ABOVE_CHANCE` (10 % + 30 points);
- its personalized model is at most `BELOW_LOCAL` (20 points) under local-only training of
  the same models on the same clients (`local_reference`).

Its table (accuracies, margins) is in docs/reliability.md ("The learning gate"), with the run
that fails it: FedAvg with its server step zeroed.
"""

import os

import pytest

from tff_pfl import settings as settings_lib
from tff_pfl.program import algorithms, experiment, run_config

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'mnist_gate.npz')
NUM_CLIENTS = 8
ROUNDS = 10
# Rounds other than ROUNDS. KT-pFL, FedDF and pFedDF train 20 local epochs of their CNNs per
# round, the gate's costliest runs: 2 rounds carry KT-pFL and FedDF past it (58.8 % and 48.0 %);
# pFedDF's personalized models need 3 (58.3 % at 2, under local-only - 20). pFedMe's personalized
# models trail its global model and local training early on (docs/reliability.md): 25 rounds.
OTHER_ROUNDS = {'feddf': 2, 'pfeddf': 3, 'ktpfl': 2, 'pfedme': 25}
# The algorithms that distill on public data take 200 public examples (default 3,000, more
# than the 2,000 examples of the gate's data).
PUBLIC_EXAMPLES = {'feddf': 200, 'pfeddf': 200, 'ktpfl': 200}
CHANCE = 0.1  # ten classes
ABOVE_CHANCE = 0.30
BELOW_LOCAL = 0.20


def rounds_of(algorithm: str) -> int:
    return OTHER_ROUNDS.get(algorithm, ROUNDS)


def run(algorithm: str, out: str, rounds: int | None = None, **changes) -> dict:
    """One gate run; returns model name -> mean test accuracy over the clients."""
    if algorithm in PUBLIC_EXAMPLES:
        changes['public_examples'] = PUBLIC_EXAMPLES[algorithm]
    config = run_config.make_config(
        output_dir=out,
        algorithm=algorithm,
        dataset=f'npz:{DATA}',
        partition='ds2',
        num_clients=NUM_CLIENTS,
        rounds=rounds or rounds_of(algorithm),
        eval_every=0,
        checkpoint_every=0,
        **changes,
    ).validate()
    result = experiment.run_experiment(config, log=lambda line: None)
    return {name: summary['mean'] for name, summary in result.summary.items()}


def failures(accuracies: dict, local: float) -> list[str]:
    """What the gate finds wrong with one run's accuracies (empty: it passes).

    Args:
      accuracies: model name (`global_model`, `personalized_model`) -> mean
        test accuracy.
      local: local-only training's mean test accuracy on the same clients.

    Returns:
      One message per failed condition.
    """
    found = []
    for name in ('global_model', 'personalized_model'):
        if name in accuracies and accuracies[name] < CHANCE + ABOVE_CHANCE:
            found.append(f'{name} {accuracies[name]:.3f} < chance {CHANCE} + {ABOVE_CHANCE}')
    personalized = accuracies.get('personalized_model')
    if personalized is not None and personalized < local - BELOW_LOCAL:
        found.append(f'personalized_model {personalized:.3f} < local-only {local:.3f} - {BELOW_LOCAL}')
    if not {'global_model', 'personalized_model'} & set(accuracies):
        found.append(f'no model evaluated: {sorted(accuracies)}')
    return found


@pytest.fixture(scope='module')
def local_only(tmp_path_factory):
    """`local` (each client trains the default model alone) for `ROUNDS` rounds."""
    accuracies = run('local', str(tmp_path_factory.mktemp('local') / 'run'), rounds=ROUNDS)
    return accuracies['personalized_model']


def local_reference(algorithm: str, local_only: float, tmp_path) -> float:
    """Local-only training of the models `algorithm` personalizes, on the same clients.

    KT-pFL (every client its own architecture): KT-pFL itself with no knowledge transfer
    (`kt_distill_epochs=0`: local training only), for as many rounds; else `local_only`.
    """
    if 'kt_distill_epochs' in algorithms.get(algorithm).settings.field_names():
        return run(algorithm, str(tmp_path / 'local'), kt_distill_epochs=0)['personalized_model']
    return local_only


def test_local_only_learns(local_only):
    assert local_only >= CHANCE + ABOVE_CHANCE + BELOW_LOCAL, local_only


@pytest.mark.parametrize('algorithm', [a for a in algorithms.names() if a != 'local'])
def test_every_algorithm_learns_from_its_defaults(algorithm, local_only, tmp_path):
    accuracies = run(algorithm, str(tmp_path / 'run'))
    has_personalized = 'personalized_model' in accuracies
    local = local_reference(algorithm, local_only, tmp_path) if has_personalized else local_only
    print(f'gate: {algorithm} rounds {rounds_of(algorithm)} {accuracies} local-only {local:.4f}')
    assert failures(accuracies, local) == [], f'{algorithm}: {accuracies}, local-only {local:.3f}'


def test_the_gate_fails_fedavg_with_its_server_step_zeroed(local_only, tmp_path, monkeypatch):
    """The server applies `0 * update`: the global model never leaves its initialization."""
    import tensorflow_federated as tff

    monkeypatch.setattr(
        settings_lib.ServerSGD, 'server_optimizer', lambda self: tff.learning.optimizers.build_sgdm(learning_rate=0.0)
    )
    accuracies = run('fedavg', str(tmp_path / 'run'))
    found = failures(accuracies, local_only)
    print(f'gate: fedavg with its server step zeroed {accuracies}: {found}')
    assert found and found[0].startswith('global_model'), (accuracies, found)


@pytest.mark.parametrize(
    'accuracies, local, expected',
    [
        ({'global_model': 0.40}, 0.9, []),
        ({'global_model': 0.3999}, 0.9, ['global_model']),
        ({'personalized_model': 0.70}, 0.90, []),
        ({'personalized_model': 0.6999}, 0.90, ['personalized_model 0.700 < local-only']),
        ({'global_model': 0.2, 'personalized_model': 0.3}, 0.9, ['global_model', 'personalized_model', 'pers']),
        ({'train': 1.0}, 0.9, ['no model']),
    ],
)
def test_the_gates_conditions_at_their_boundaries(accuracies, local, expected):
    found = failures(accuracies, local)
    assert len(found) == len(expected) and all(f.startswith(e) for f, e in zip(found, expected)), found
