"""Bad input to tff-pfl-train: one line on stderr, exit code 2, nothing written."""

import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _npz(path, **changes):
    """A small valid Keras-layout file (4 classes, 6x6 images), with `changes` applied."""
    rng = np.random.default_rng(0)
    arrays = dict(
        x_train=rng.integers(0, 255, size=(80, 6, 6)).astype(np.uint8),
        y_train=np.repeat(np.arange(4), 20),
        x_test=rng.integers(0, 255, size=(40, 6, 6)).astype(np.uint8),
        y_test=np.repeat(np.arange(4), 10),
    )
    arrays.update(changes)
    np.savez(path, **arrays)
    return path


def _nan_features():
    x = np.ones((80, 6, 6), np.float32)
    x[3, 2, 1] = np.nan
    return x


# (what is wrong, how to make the data file (or None), configuration changes, the error's message)
CASES = [
    ('missing data file', None, dict(dataset='npz:/nonexistent/data.npz'), 'npz file not found: /nonexistent/data.npz'),
    ('corrupt data file', 'corrupt', {}, 'cannot read npz file'),
    ('a key missing', dict(drop='y_test'), {}, 'lacks key(s) y_test'),
    ('features of the wrong dtype', dict(x_train=np.full((80, 6, 6), 'a')), {}, 'x_train must be numeric'),
    ('features of the wrong shape', dict(x_train=np.ones(80, np.float32)), {}, 'x_train must have shape [N, ...]'),
    ('labels of the wrong dtype', dict(y_train=np.ones(80, np.float32)), {}, 'y_train must hold integer labels'),
    ('labels of the wrong shape', dict(y_train=np.ones((80, 2), np.int64)), {}, 'y_train must have shape [N]'),
    ('x and y lengths differ', dict(y_train=np.zeros(79, np.int64)), {}, 'x_train has 80 examples but y_train has 79'),
    ('labels outside the class range', dict(y_test=np.full(40, -1)), {}, 'y_test holds negative label -1'),
    ('NaN features', dict(x_train=_nan_features()), {}, 'x_train contains NaN or infinite values'),
    ('more clients than examples', {}, dict(num_clients=500), '500 clients requested but only 120 examples'),
    (
        'k larger than the number of classes',
        {},
        dict(partition='ds1', classes_per_client=5),
        'k must be in [1, 4], got 5',
    ),
    (
        'a client without a validation example',
        {},
        dict(num_clients=60, split_fractions=(0.8, 0.19, 0.01)),
        'client_00000: client has no validation examples',
    ),
    (
        'PersFL without validation splits',
        {},
        dict(algorithm='persfl', split_fractions=(0.9, 0.0, 0.1)),
        "persfl cannot run on this data and model: PersFL's teacher selection and distillation grid reads each "
        "client's validation split, and client_00000, client_00001, client_00002 and 1 more have none",
    ),
    (
        'a validation curve without validation splits',
        {},
        dict(eval_validation=True, split_fractions=(0.9, 0.0, 0.1)),
        'eval_validation scores the validation splits: give split_fractions a validation fraction',
    ),
    ('a negative validation fraction', {}, dict(split_fractions=(0.9, -0.1, 0.2)), 'validation >= 0'),
    ('sampling rate 0', {}, dict(client_fraction=0.0), 'client_fraction must be in (0, 1]'),
    ('sampling rate above 1', {}, dict(client_fraction=1.5), 'client_fraction must be in (0, 1]'),
    ('negative learning rate', {}, dict(client_learning_rate=-0.1), 'client_learning_rate'),
    ('negative epochs', {}, dict(local_epochs=-1), 'local_epochs'),
    ('negative checkpoint interval', {}, dict(checkpoint_every=-1), 'checkpoint_every must be >= 0'),
    ('an output directory that is not writable', {}, dict(output_dir='/proc/tff-pfl-run'), 'is not writable'),
    ('negative DP noise', {}, dict(dp_noise_multiplier=-0.5, dp_clip=1.0), 'dp_noise_multiplier must be >= 0'),
    ('non-positive DP clip', {}, dict(dp_noise_multiplier=1.0, dp_clip=-1.0), 'dp_clip must be > 0'),
    (
        'DP quantile outside (0, 1)',
        {},
        dict(dp_noise_multiplier=1.0, dp_target_quantile=1.5),
        'dp_target_quantile must be in (0, 1)',
    ),
    (
        'a target epsilon without noise',
        {},
        dict(dp_target_epsilon=1.0),
        '--dp_target_epsilon needs --dp_noise_multiplier',
    ),
    (
        'a target epsilon the schedule exceeds',
        {},
        dict(dp_noise_multiplier=0.5, dp_clip=1.0, rounds=50, dp_target_epsilon=1.0),
        '--dp_target_epsilon 1: 50 rounds at noise multiplier 0.5',
    ),
    ('rounds per call 0', {}, dict(rounds_per_call=0), 'rounds_per_call must be >= 1, got 0'),
    (
        'several rounds a call with sampled clients',
        {},
        dict(rounds_per_call=2, client_fraction=0.5),
        '--rounds_per_call=2 runs the same clients in every round of a call: it needs --client_fraction=1, got 0.5',
    ),
    (
        'evaluations inside a call',
        {},
        dict(rounds_per_call=3),
        '--eval_every=10 is not a multiple of --rounds_per_call=3',
    ),
    (
        'checkpoints inside a call',
        {},
        dict(rounds_per_call=2, eval_every=0, checkpoint_every=5),
        '--checkpoint_every=5 is not a multiple of --rounds_per_call=2',
    ),
    (
        'several rounds a call on several workers',
        {},
        dict(rounds_per_call=2, workers=('localhost:1', 'localhost:2')),
        '--rounds_per_call=2 keeps the client states in the driver, which several workers do not',
    ),
    (
        'several rounds a call of a serverless algorithm',
        {},
        dict(algorithm='kdpdfl', rounds_per_call=2),
        '--rounds_per_call: kdpdfl is serverless; each exchange interval is one call',
    ),
]


def _dataset(data, tmp_path) -> dict:
    if isinstance(data, dict):
        changes = dict(data)
        drop = changes.pop('drop', None)
        path = _npz(tmp_path / 'data.npz', **changes)
        if drop:
            with np.load(path) as archive:
                kept = {k: archive[k] for k in archive.files if k != drop}
            np.savez(path, **kept)
        return dict(dataset=f'npz:{path}', partition='iid')
    if data == 'corrupt':
        (tmp_path / 'data.npz').write_bytes(b'PK\x03\x04 this is not a zip archive')
        return dict(dataset=f'npz:{tmp_path / "data.npz"}', partition='iid')
    return {}


@pytest.mark.parametrize('what, data, changes, message', CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_anything_is_written(what, data, changes, message, tmp_path):
    from tff_pfl.data import partition, sources
    from tff_pfl.program import experiment, run_config

    del what
    kwargs = dict(num_clients=4, rounds=1, output_dir=str(tmp_path / 'run'), **_dataset(data, tmp_path))
    kwargs.update(changes)
    with pytest.raises((run_config.ConfigError, sources.DataError, partition.PartitionError)) as raised:
        experiment.run_experiment(run_config.make_config(**kwargs), log=lambda line: None)
    assert message in str(raised.value)
    assert '\n' not in str(raised.value)
    assert not os.path.exists(kwargs['output_dir'])
    assert [p for p in os.listdir(tmp_path) if p != 'data.npz'] == []


# The binary turns these errors into one line and exit code 2: one refused while
# reading the data, one while preparing the output directory, one DP schedule (each start of the
# binary imports TensorFlow and TFF; the other messages are checked above).
BINARY_CASES = [
    c
    for c in CASES
    if c[0]
    in (
        'corrupt data file',
        'an output directory that is not writable',
        'a target epsilon the schedule exceeds',
        'evaluations inside a call',
    )
]


@pytest.mark.parametrize('what, data, changes, message', BINARY_CASES, ids=[c[0] for c in BINARY_CASES])
def test_bad_input_binary_prints_one_line_and_exits_2(what, data, changes, message, tmp_path):
    del what
    kwargs = dict(num_clients=4, rounds=1, output_dir=str(tmp_path / 'run'), **_dataset(data, tmp_path))
    kwargs.update(changes)
    args = [f'--{k}={",".join(map(str, v)) if isinstance(v, tuple) else v}' for k, v in kwargs.items()]
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    result = subprocess.run(
        [sys.executable, '-m', 'tff_pfl.cli.train', *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith('tff-pfl-train: error: '), result.stderr[-2000:]
    assert message in lines[0], lines[0]
    assert not os.path.exists(kwargs['output_dir'])
    assert [p for p in os.listdir(tmp_path) if p != 'data.npz'] == []
