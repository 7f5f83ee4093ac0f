"""What KT-pFL Table 1's small CPU variants change against the paper-size models.

The Table 1 suite (`benchmarks/suites/ktpfl_fmnist_table1.toml`) trains
`alexnet_small`, `resnet_small` and `shufflenet_small` where the paper has
AlexNet, ResNet-18 and ShuffleNetV2: a paper-size round costs 100-200
CPU-minutes here against 3-6 (benchmarks/results/model_cost.md). This script
measures what the substitution does to the quantity that sets a Table 1
client's accuracy in the first place, its local fit: each architecture, small
and paper-size, trains on the same real clients of that table (Fashion-MNIST,
non-IID case 1, 450/150 examples per class, the suite's 74/1/25 split, seed 0)
with the table's local optimizer (plain SGD, learning rate 0.01, batch 128),
and its accuracy on the client's own test split is recorded after every epoch.
LeNet, the same in both sets, is the reference.

This is local training only, no distillation: it says whether the small
variants fit a client's data as well as the paper's models do within the
epochs a Table 1 run gives them, not what KT-pFL would score with the
paper-size models (that run does not fit these machines).

    uv run --locked python benchmarks/studies/ktpfl_arch_size.py
"""

import json
import os
import platform
import sys
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

from tff_pfl import models
from tff_pfl.data import partition, partition_registry, sources

_DATA = flags.DEFINE_string('data', '../shared/data/fashion_mnist.npz', 'Keras-layout npz file.')
_CLIENTS = flags.DEFINE_list('clients', ['0'], 'Client indices (0-9: first group, 10-19: second).')
_EPOCHS = flags.DEFINE_integer('epochs', 20, 'Local epochs.')
_MODELS = flags.DEFINE_list(
    'models',
    ['lenet', 'alexnet_small', 'alexnet', 'resnet_small', 'resnet18', 'shufflenet_small', 'shufflenet_v2'],
    'Registered models to train.',
)
_OUT = flags.DEFINE_string('out', 'benchmarks/studies/results/ktpfl_arch_size', 'Result path prefix (.json, .md).')

NUM_CLIENTS, SEED, SPLIT = 20, 0, (0.74, 0.01, 0.25)
BATCH, LEARNING_RATE = 128, 0.01
PAIRS = (('alexnet_small', 'alexnet'), ('resnet_small', 'resnet18'), ('shufflenet_small', 'shufflenet_v2'))


def client_splits(pool, client):
    """The train and test arrays of one Table 1 case-1 client.

    Args:
      pool: the Fashion-MNIST `sources.Pool`.
      client: client index in `[0, 20)`.

    Returns:
      `(x_train, y_train, x_test, y_test)`.
    """
    parts = partition_registry.build_partition('kt_case1', pool.y, NUM_CLIENTS, SEED, major=450, minor=150)
    split = partition.split_client(parts[client], pool.y, SPLIT, seed=SEED + client)  # as pipeline.prepare
    return pool.x[split['train']], pool.y[split['train']], pool.x[split['test']], pool.y[split['test']]


def train_curve(name, x, y, x_test, y_test, epochs):
    """Test accuracy after each epoch of plain SGD, and seconds per epoch.

    Args:
      name: registered model name.
      x: training features.
      y: training labels.
      x_test: test features.
      y_test: test labels.
      epochs: number of epochs.

    Returns:
      `(accuracies, seconds_per_epoch)`.
    """
    with models.seeded(SEED):
        model = models.get(name)(x.shape[1:], 10)
    x, y = tf.constant(x), tf.constant(y)
    rng = np.random.default_rng(SEED)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits))
        for variable, grad in zip(model.trainable_weights, tape.gradient(loss, model.trainable_weights)):
            variable.assign_sub(LEARNING_RATE * grad)

    @tf.function
    def predict(xb):
        return tf.argmax(model(xb, training=False), axis=-1, output_type=tf.int32)

    accuracies, seconds = [], []
    for _ in range(epochs):
        start = time.perf_counter()
        order = tf.constant(rng.permutation(x.shape[0]))
        for i in range(0, x.shape[0], BATCH):
            batch = order[i : i + BATCH]
            step(tf.gather(x, batch), tf.gather(y, batch))
        seconds.append(time.perf_counter() - start)
        predicted = np.concatenate([predict(x_test[i : i + 256]).numpy() for i in range(0, len(x_test), 256)])
        accuracies.append(float(np.mean(predicted == y_test)))
    return accuracies, float(np.median(seconds))


def write_markdown(path, report):
    """Writes the accuracy table of `report`.

    Args:
      path: the .md file to write.
      report: the dict written to the .json file.
    """
    epochs = report['epochs']
    marks = sorted({1, max(1, epochs // 2), epochs})
    lines = [
        "# KT-pFL Table 1: the small CPU variants against the paper's architectures (local fit)",
        '',
        f'Command: `{report["command"]}`',
        '',
        f'Machine: {report["machine"]}; {report["elapsed_s"]:.0f} s in all (shared cores).',
        '',
        'Fashion-MNIST, KT-pFL non-IID case 1 (450/150 examples per class), 20 clients, split 74/1/25, seed 0; '
        f'local SGD, learning rate {LEARNING_RATE}, batch {BATCH}, no distillation. Test accuracy (%) on the '
        "client's own test split after the given number of epochs; seconds per epoch (median).",
        '',
        '| client | model | parameters | ' + ' | '.join(f'epoch {m}' for m in marks) + ' | s per epoch |',
        '|---|---|---:|' + '---:|' * len(marks) + '---:|',
    ]
    for client, rows in report['clients'].items():
        for name, row in rows.items():
            accs = ' | '.join(f'{100 * row["accuracy"][m - 1]:.1f}' for m in marks)
            lines.append(f'| {client} | {name} | {row["parameters"]:,} | {accs} | {row["seconds_per_epoch"]:.1f} |')
    lines += ['', f'## Paper-size minus small, points of test accuracy at epoch {epochs}', '']
    lines += ['| client | ' + ' | '.join(f'{big} - {small}' for small, big in PAIRS) + ' |']
    lines += ['|---|' + '---:|' * len(PAIRS)]
    for client, rows in report['clients'].items():
        cells = []
        for small, big in PAIRS:
            if small in rows and big in rows:
                cells.append(f'{100 * (rows[big]["accuracy"][-1] - rows[small]["accuracy"][-1]):+.1f}')
            else:
                cells.append('n/a')
        lines.append(f'| {client} | ' + ' | '.join(cells) + ' |')
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')


def main(argv):
    del argv
    start = time.perf_counter()
    pool = sources.load_npz(_DATA.value)
    report = {
        'command': 'uv run --locked python ' + ' '.join(sys.argv),
        'machine': f'{platform.machine()} {platform.system()}, {os.cpu_count()} cores, TensorFlow {tf.__version__}',
        'epochs': _EPOCHS.value,
        'clients': {},
    }
    for client in (int(c) for c in _CLIENTS.value):
        x, y, x_test, y_test = client_splits(pool, client)
        rows = {}
        for name in _MODELS.value:
            accuracy, seconds = train_curve(name, x, y, x_test, y_test, _EPOCHS.value)
            with models.seeded(SEED):
                parameters = models.get(name)(x.shape[1:], 10).count_params()
            rows[name] = {'parameters': parameters, 'accuracy': accuracy, 'seconds_per_epoch': seconds}
            print(
                f'client {client} {name}: {100 * accuracy[-1]:.1f}% after {_EPOCHS.value} epochs, {seconds:.1f} s/epoch'
            )
        report['clients'][str(client)] = rows
    report['elapsed_s'] = time.perf_counter() - start
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(report, f, indent=1)
    write_markdown(_OUT.value + '.md', report)


if __name__ == '__main__':
    app.run(main)
