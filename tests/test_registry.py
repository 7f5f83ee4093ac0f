"""Every registered algorithm: runs from its defaults, honours local steps, refuses a model it cannot take."""

import csv
import os
import subprocess
import sys

import pytest
import tensorflow_federated as tff

from tff_pfl.computations import template
from tff_pfl.program import algorithms, experiment, run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = algorithms.names()
LOCAL_STEPS = 3
# The algorithms whose server state holds one global model (`get_model_weights`).
GLOBAL_MODEL = {
    'apfl',
    'ditto',
    'fedavg',
    'fedavg_ft',
    'fedala',
    'feddbe',
    'fedrod',
    'perfedavg_fo',
    'perfedavg_hf',
    'persfl',
    'persfl_gd',
    'pfedme',
    'selffl',
}


@pytest.mark.parametrize('algorithm', ALGORITHMS)
def test_runs_from_its_defaults_and_takes_exactly_the_local_steps_asked(algorithm, tmp_path):
    """The default dataset and the algorithm's default settings; one round, `local_steps=3` where it applies.

    Every participating client runs exactly that many SGD steps of its local
    training (the round metric `mean_local_steps`, the mean over participating
    clients of the steps counted inside the training loop, with each client
    capped at that number: a mean equal to the cap means every client took it).
    """
    settings_cls = algorithms.get(algorithm).settings
    # `local_steps`, or an algorithm's own count of exactly K steps (pFedHN's `pfedhn_local_steps`).
    field = next((f for f in ('local_steps', f'{algorithm}_local_steps') if f in settings_cls.field_names()), None)
    steps = field is not None
    changes = {field: LOCAL_STEPS} if steps else {}
    if algorithms.get(algorithm).own_architectures:
        changes['public_examples'] = 200  # the paper's 3000 exceed these 6 clients' 804 examples
    config = run_config.make_config(
        output_dir=str(tmp_path / 'run'), algorithm=algorithm, num_clients=6, rounds=1, eval_every=0, **changes
    ).validate()
    processes = []
    experiment.run_experiment(config, log=lambda line: None, on_process=processes.append)
    (process,) = processes
    assert isinstance(process, template.PersonalizedProcess)
    # Declared outputs only: nothing is assigned to a process after construction.
    assert [k for k in vars(process) if not k.startswith('_')] == []
    # TFF's tools read the global model where there is one; elsewhere one line says why not.
    assert process.has_global_model == (algorithm in GLOBAL_MODEL), (
        f'{algorithm}: has_global_model is {process.has_global_model}; GLOBAL_MODEL (tests/test_registry.py) lists '
        'the algorithms whose server state holds one whole model'
    )
    if process.has_global_model:
        weights_type = process.get_model_weights.type_signature.result
        assert weights_type.python_container is tff.learning.models.ModelWeights
        assert weights_type.trainable.is_equivalent_to(process.initialize.type_signature.result.member['model'])
    else:
        with pytest.raises(ValueError, match='has no global model: ') as raised:
            process.get_model_weights  # noqa: B018 (the property raises)
        assert '\n' not in str(raised.value)
    assert os.path.exists(tmp_path / 'run' / 'report.md')
    with open(tmp_path / 'run' / 'metrics.csv') as f:
        rows = list(csv.DictReader(f))
    assert rows
    column = 'mean_local_steps'
    assert all(row.get(column) not in (None, '') for row in rows), f'{algorithm} does not report {column}'
    if steps:
        assert [float(row[column]) for row in rows] == [LOCAL_STEPS] * len(rows)
    else:  # Self-FL chooses its own steps (Eq. 8), capped at l_max
        assert all(0 < float(row[column]) <= settings_cls().selffl_max_steps for row in rows)


def _mismatch(algorithm) -> str:
    """A flag that gives `algorithm` a model the default (vector) dataset cannot feed."""
    if algorithms.get(algorithm).own_architectures:
        return '--architectures=lenet'
    return '--model=persfl_cnn'


def _args(algorithm, out):
    return [f'--algorithm={algorithm}', _mismatch(algorithm), '--num_clients=4', '--rounds=1', f'--output_dir={out}']


@pytest.mark.parametrize('algorithm', ALGORITHMS)
def test_a_model_the_data_cannot_feed_is_refused_before_anything_is_written(algorithm, tmp_path, train_in_process):
    """One line on stderr, exit 2, no output directory, no staging directory left behind."""
    code, stderr = train_in_process(*_args(algorithm, tmp_path / 'run'))
    lines = stderr.strip().splitlines()
    assert code == 2, stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith('tff-pfl-train: error: '), stderr[-2000:]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('algorithm', ['fedper', 'ktpfl'])
def test_the_binary_refuses_a_model_the_data_cannot_feed(algorithm, tmp_path):
    """The same through the installed entry point's module, in its own interpreter."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    result = subprocess.run(
        [sys.executable, '-m', 'tff_pfl.cli.train', *_args(algorithm, tmp_path / 'run'), '--noisolate_network'],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith('tff-pfl-train: error: '), result.stderr[-2000:]
    assert 'Traceback' not in result.stderr
    assert os.listdir(tmp_path) == []
