"""TFF's own personalization processes as bench peers (`bench_peers`) beside our FedAvg."""

import csv
import io
import json
import os
import types

import numpy as np
import pytest

from tff_pfl import models
from tff_pfl.data import client_data
from tff_pfl.program import config_parts, experiment, run_config
from tff_pfl_bench import (
    bench_layout,
    bench_parse,
    bench_peers,
    bench_record,
    bench_run,
    bench_suite,
    peer_processes,
    peer_scoring,
)

# Synthetic(1,1) with 3 clients, 2 rounds: our FedAvg and the two peers.
TINY = """
name = "tiny_peers"
[defaults]
dataset = "synthetic"
num_clients = 3
model = "mnist_dnn"
rounds = 2
eval_every = 1
batch_size = 16
client_learning_rate = 0.05
seeds = [0]
[[partitions]]
name = "natural"
partition = "natural"
[[algorithms]]
name = "FedAvg"
algorithm = "fedavg"
model = "global_model"
[[algorithms]]
name = "TFF FedRecon"
algorithm = "tff_fed_recon"
model = "personalized_model"
[[algorithms]]
name = "TFF FedAvg+FT"
algorithm = "tff_fedavg_pers_eval"
model = "personalized_model"
[algorithms.overrides]
finetune_epochs = 2
"""

RECORD_KEYS = (
    'suite',
    'partition',
    'algorithm',
    'registry_name',
    'seed',
    'model',
    'seconds',
    'seconds_per_round',
    'rounds',
    'final_round',
    'diverged_round',
    'summary',
    'clients',
    'final_only',
    'curve',
    'dp_epsilon',
    'communication',
    'partition_csv',
    'config',
)


@pytest.fixture(scope='module')
def peers_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp('peers') / 'out')
    results = str(tmp_path_factory.mktemp('peers') / 'results')
    suite = bench_parse.parse_suite(TINY, 'tiny_peers.toml')
    lines = []
    rows = bench_run.run_suite(suite, out, results_dir=results, log=lines.append)
    records = {}
    for run in suite.runs():
        with open(bench_layout.record_path(results, run), encoding='utf-8') as f:
            records[run.algorithm.name] = json.load(f)
    return dict(suite=suite, out=out, results=results, rows=rows, lines=lines, records=records)


def _test_sizes(partition_csv):
    return {row['client_id']: int(row['test_examples']) for row in csv.DictReader(io.StringIO(partition_csv))}


def test_each_peer_writes_a_complete_record_on_our_partition(peers_run):
    records = peers_run['records']
    fedavg = records['FedAvg']
    for label, registry, models_ in (
        ('TFF FedRecon', 'tff_fed_recon', {'personalized_model'}),
        ('TFF FedAvg+FT', 'tff_fedavg_pers_eval', {'global_model', 'personalized_model'}),
    ):
        record = records[label]
        assert set(RECORD_KEYS) <= set(record)
        assert record['registry_name'] == registry and record['config']['algorithm'] == registry
        assert set(record['summary']) == models_ and record['final_round'] == 2 and record['diverged_round'] is None
        assert record['partition_csv'] == fedavg['partition_csv']  # the same partition.csv as our FedAvg's
        sizes = _test_sizes(record['partition_csv'])
        assert [c['client_id'] for c in record['clients']] == list(sizes)
        for client in record['clients']:
            assert 0.0 <= client['accuracy'] <= 1.0
            assert client['num_examples'] == sizes[client['client_id']]
        assert record['communication']['bytes_down_per_client_per_round'] > 0
        mean = record['summary'][record['model']]['mean']
        assert mean == pytest.approx(np.mean([c['accuracy'] for c in record['clients']]))
    # FedRecon's reconstructed heads are scored every round (3 clients <= CURVE_CLIENTS); the
    # fine-tuned models only at the end.
    assert [p['round'] for p in records['TFF FedRecon']['curve']] == [1, 2]
    assert [p['round'] for p in records['TFF FedAvg+FT']['curve']] == [2]
    # The report takes them beside ours.
    labels = {row['algorithm'] for row in peers_run['rows']}
    assert labels == {'FedAvg', 'TFF FedRecon', 'TFF FedAvg+FT'}
    with open(os.path.join(peers_run['results'], 'report.md'), encoding='utf-8') as f:
        report = f.read()
    assert 'TFF FedRecon' in report and 'TFF FedAvg+FT' in report


def test_personalization_baseline_equals_our_evaluation_of_the_global_weights(peers_run):
    """TFF's baseline metrics of each client are the final global weights scored on its test split."""
    suite = peers_run['suite']
    run = suite.select(algorithms=['TFF FedAvg+FT'])[0]
    directory = run.directory(peers_run['out'])
    spec = client_data.load_client_data_spec(os.path.join(directory, 'client_data'))
    with np.load(os.path.join(directory, 'global_weights.npz')) as f:
        weights = [f[f'arr_{i}'] for i in range(len(f.files))]
    keras_model = models.get('mnist_dnn')(spec.feature_shape, spec.num_classes)
    keras_model.set_weights(weights)
    with open(os.path.join(directory, 'clients.csv'), encoding='utf-8') as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == spec.num_clients
    for client_id, row in zip(spec.client_ids, rows):
        x, y = client_data.read_split_numpy(spec, client_id, 'test')
        ours = float(np.mean(np.argmax(keras_model.predict(x, verbose=0), axis=-1) == y))
        assert float(row['global_model_accuracy']) == pytest.approx(ours, abs=1e-6)
        epochs = int(row['personalized_model_finetune_epochs'])
        assert 0 <= epochs <= 2
        if epochs == 0:  # kept the global model: the same accuracy
            assert float(row['personalized_model_accuracy']) == pytest.approx(ours, abs=1e-6)
    record = peers_run['records']['TFF FedAvg+FT']
    # The last curve point of FedAvg's global model, scored outside TFF, is TFF's baseline mean.
    assert record['summary']['global_model']['mean'] == pytest.approx(
        np.mean([float(r['global_model_accuracy']) for r in rows])
    )


def test_fed_recon_reconstructs_a_head_per_client(peers_run):
    """The reconstructed model differs from one shared model: clients' accuracies are not all equal
    to the accuracy of the same head, and they are scored on exactly their test examples."""
    record = peers_run['records']['TFF FedRecon']
    accuracies = [c['accuracy'] for c in record['clients']]
    assert len(set(accuracies)) > 1
    assert record['summary']['personalized_model']['num_clients'] == 3.0
    # The head is never sent: each round moves the global layers only, mnist_dnn less its last layer.
    spec = _spec(peers_run, 'TFF FedRecon')
    keras_model = models.get('mnist_dnn')(spec.feature_shape, spec.num_classes)
    global_bytes = sum(w.size * 4 for layer in keras_model.layers[:-1] for w in layer.get_weights())
    assert record['communication']['bytes_down_per_client_per_round'] == global_bytes
    assert record['communication']['reconstruction_bytes_down_per_client'] == global_bytes


def _spec(peers_run, label):
    run = peers_run['suite'].select(algorithms=[label])[0]
    return client_data.load_client_data_spec(os.path.join(run.directory(peers_run['out']), 'client_data'))


@pytest.mark.parametrize(
    'override, message',
    [
        ('local_steps = 5', r'local_steps does not apply to tff_fed_recon \(TFF'),
        ('dp_noise_multiplier = 1.0', r'dp_noise_multiplier does not apply to tff_fed_recon \(TFF'),
        ('finetune_epochs = 3', r'finetune_epochs does not apply to tff_fed_recon \(TFF'),
        ('distill_epochs = 3', r'distill_epochs does not apply to tff_fed_recon \(TFF'),
    ],
)
def test_a_setting_a_peer_does_not_take_is_one_line(override, message):
    text = TINY.replace(
        'algorithm = "tff_fed_recon"\nmodel = "personalized_model"\n',
        f'algorithm = "tff_fed_recon"\nmodel = "personalized_model"\n[algorithms.overrides]\n{override}\n',
    )
    with pytest.raises(bench_suite.SuiteError, match=message) as error:
        bench_parse.parse_suite(text, 'tiny_peers.toml')
    assert '\n' not in str(error.value) and str(error.value).startswith('tiny_peers.toml: algorithms "TFF FedRecon"')


def test_a_model_a_peer_does_not_report_is_one_line():
    text = TINY.replace('algorithm = "tff_fed_recon"\nmodel = "personalized_model"', 'algorithm = "tff_fed_recon"')
    text = text.replace('seeds = [0]', 'seeds = [0]\nheadline_model = "global_model"')
    with pytest.raises(bench_suite.SuiteError, match='tff_fed_recon reports personalized_model, not .global_model.'):
        bench_parse.parse_suite(text, 'tiny_peers.toml')


def test_peers_are_not_registered_algorithms():
    from tff_pfl.program import algorithms

    assert not set(bench_peers.names()) & set(algorithms.names())
    assert set(bench_peers.names()) <= set(bench_suite.known_algorithms())


class _Interrupted(Exception):
    pass


class _CutLog(bench_run._RunLog):
    """A run's log that interrupts the run at its first line about round 4."""

    def __call__(self, line):
        super().__call__(line)
        if line.startswith('round 4'):
            raise _Interrupted(line)


@pytest.mark.parametrize('label', ['TFF FedRecon', 'TFF FedAvg+FT'])
def test_an_interrupted_peer_continues_from_its_checkpoint_to_the_same_numbers(label, tmp_path, monkeypatch):
    """4 rounds, a checkpoint every 2, cut during round 4: the harness continues from round 2."""
    # 2 of the 3 clients a round: a continued run must draw the clients an uninterrupted one draws.
    text = TINY.replace('rounds = 2', 'rounds = 4\nclient_fraction = 0.6')
    suite = bench_parse.parse_suite(text, 'tiny_peers.toml')
    run = suite.select(algorithms=[label])[0]
    uninterrupted = bench_run.run_config(suite, str(tmp_path / 'a'), run, 2)
    expected_lines = []
    expected, _ = bench_peers.run_peer(run.algorithm.algorithm, uninterrupted, log=expected_lines.append)

    out = str(tmp_path / 'b')
    with monkeypatch.context() as patch:
        patch.setattr(bench_run, '_RunLog', _CutLog)
        with pytest.raises(_Interrupted):
            bench_run.run_suite(suite, out, algorithms=[label], checkpoint_every=2, log=lambda line: None)
    config = bench_run.run_config(suite, out, run, 2)
    assert experiment.resumable_round(config) == 2
    # Another configuration in the directory (more rounds) is not continued.
    assert experiment.resumable_round(config.replace(rounds=5)) is None
    lines = []
    bench_run.run_suite(suite, out, algorithms=[label], checkpoint_every=2, log=lines.append)
    assert any('continuing from its round-2 checkpoint' in line for line in lines), lines
    with open(os.path.join(run.directory(out), bench_layout.RESULT_FILE), encoding='utf-8') as f:
        record = json.load(f)
    assert record['continued'] and record['continued_from_round'] == 2
    # Every model's per-client numbers (clients.csv) and the curve, as the uninterrupted run's.
    final_only = record['final_only']
    assert record['curve'] == bench_record.model_curve(expected.rounds, run.algorithm.model, final_only)
    with open(os.path.join(run.directory(out), 'clients.csv'), encoding='utf-8') as f:
        continued = f.read()
    with open(os.path.join(uninterrupted.output_dir, 'clients.csv'), encoding='utf-8') as f:
        assert continued == f.read()
    # Rounds 3 and 4 were trained again after the checkpoint: their losses are the uninterrupted run's.
    with open(os.path.join(run.directory(out), 'progress.log'), encoding='utf-8') as f:
        continued_lines = f.read().split('continuing from the round-2 checkpoint\n')[1].splitlines()
    expected_losses = _train_losses(expected_lines)
    assert len(expected_losses) == 4 and _train_losses(continued_lines) == expected_losses[2:]
    assert not os.path.exists(os.path.join(run.directory(out), 'checkpoints'))


def _train_losses(lines):
    return [line.split('  ')[0] for line in lines if line.startswith('round ') and 'train_loss' in line]


def test_marked_labels_survive_float32_for_every_client_a_peer_takes():
    """TFF's FedRecon passes labels through a Keras MeanMetricWrapper (float32) before the loss reads them."""
    import tensorflow as tf

    y = np.array([-1, 0, 1, 89, peer_scoring.TEST_MARK - 2], np.int32)
    for index in (0, 15, 16, 612, peer_scoring.MAX_MARKED_CLIENTS - 1):
        marked = tf.cast(tf.constant(peer_scoring.mark_test(y, index)), tf.float32)
        assert peer_scoring.label(marked).numpy().tolist() == y.tolist(), index
        assert set(peer_scoring.client_tag(marked).numpy().tolist()) == {index + 1}, index
    # The loss as FedRecon's evaluation computes it: through MeanMetricWrapper.
    logits = tf.one_hot(np.maximum(y, 0), peer_scoring.TEST_MARK - 1) * 5.0
    wrapped = tf.keras.metrics.MeanMetricWrapper(peer_scoring.ScoredCrossEntropy(), name='loss')
    wrapped.update_state(peer_scoring.mark_test(y, 612), logits)
    direct = peer_scoring.ScoredCrossEntropy()(y, logits)
    assert float(wrapped.result()) == pytest.approx(float(direct), rel=1e-6)


def test_a_peer_refuses_more_clients_than_its_marks_hold():
    too_many = [f'c{i}' for i in range(peer_scoring.MAX_MARKED_CLIENTS + 1)]
    clients = peer_processes.Clients(types.SimpleNamespace(client_ids=too_many, num_classes=10), {})
    with pytest.raises(bench_peers.run_config.ConfigError, match=r'tff_fed_recon scores at most 16383 clients'):
        bench_peers._check_markable('tff_fed_recon', clients)
    clients = peer_processes.Clients(types.SimpleNamespace(client_ids=['c0'], num_classes=peer_scoring.TEST_MARK), {})
    with pytest.raises(bench_peers.run_config.ConfigError, match=r'at most 1023 classes'):
        bench_peers._check_markable('tff_fed_recon', clients)


@pytest.mark.parametrize('partition', ['shards', 'ds1', 'kd_dirichlet'])
def test_a_peer_takes_every_setting_of_the_data_part_and_of_its_partition(partition):
    """The data a peer trains on is ours: a partition's own settings are never refused (shards_per_client was)."""
    cls = config_parts.PARTITIONS[partition]
    values = {name: {'kd_split_sizes': (5, 9, 3, 4)}.get(name, 3) for name in cls.field_names()}
    values = {k: 0.5 if k == 'dirichlet_alpha' else v for k, v in values.items()}
    for name in bench_peers.PEERS:
        algorithm = bench_peers.PEERS[name].settings_of
        config = run_config.make_config(
            output_dir='x',
            algorithm=algorithm,
            partition=partition,
            num_clients=7,
            split_fractions=(0.5, 0.3, 0.2),
            **values,
        )
        bench_peers.check_config(name, config)
