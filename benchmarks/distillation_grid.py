"""PersFL's (T, lambda) grid: all candidates in one loop vs one after another.

One MNIST client (3600 training and 1200 validation examples, the MNIST DNN
784-100-10), a teacher trained briefly, the paper's grid (T in
{1,5,...,25}, lambda in {0,.25,.5,.75,1}: 23 distinct candidates), batch 32,
learning rate 0.01: the defaults of `persfl.PersFLSettings`. Both sides are the same TF code (`distill_grid` with all
G candidates stacked vs `distill_sequential`: G one-model loops chained), run
alternately in one process; medians of the repeats.

    uv run python benchmarks/distillation_grid.py --epochs=1 --repeats=3
"""

import json
import statistics
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

from processes import persfl
from tff_pfl import models
from tff_pfl.computations import distillation, local_training
from tff_pfl.data import client_data, partition, sources
from tff_pfl.models import stacked

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_EPOCHS = flags.DEFINE_integer('epochs', 1, 'Distillation epochs.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed repeats per side.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/distillation_grid', 'Result path prefix (.json, .md).')


def main(argv):
    del argv
    pool = sources.load_npz(_MNIST.value)
    indices = partition.iid(pool.y, 10, seed=0, examples_per_client=6000)[0]
    split = partition.split_client(indices, pool.y, (0.6, 0.2, 0.2), seed=0)

    def as_split(name):
        return client_data.ClientSplit(tf.constant(pool.x[split[name]]), tf.constant(pool.y[split[name]]))

    train, val = as_split('train'), as_split('val')
    model = models.mnist_dnn((28, 28, 1), 10)
    teacher_stats = local_training.train(
        model, train, epochs=1, batch_size=32, learning_rate=0.05, seed=tf.constant([1, 2], tf.int64)
    )
    teacher = [tf.constant(w) for w in model.get_weights()]
    settings = persfl.PersFLSettings(distill_epochs=_EPOCHS.value).validate()  # the paper's grid, batch, rate
    candidates = distillation.grid_candidates(settings.temperatures, settings.imitations)
    temperatures, imitations = distillation.candidate_arrays(candidates)
    kwargs = dict(
        temperatures=tf.constant(temperatures),
        imitations=tf.constant(imitations),
        config=settings.distill_config(),
        seed=tf.constant([3, 4], tf.int64),
    )
    layers = stacked.plan(model)
    sides = {
        'grid (all candidates stacked, one loop)': tf.function(
            lambda: distillation.distill_grid(layers, teacher, train, val, **kwargs)
        ),
        'sequential (one loop per candidate)': tf.function(
            lambda: distillation.distill_sequential(layers, teacher, train, val, **kwargs)
        ),
    }
    results = {name: fn() for name, fn in sides.items()}  # trace + warm up
    times = {name: [] for name in sides}
    for _ in range(_REPEATS.value):
        for name, fn in sides.items():
            start = time.perf_counter()
            out = fn()
            _ = out.val_accuracy.numpy()
            times[name].append(time.perf_counter() - start)
            print(name, f'{times[name][-1]:.2f}s', flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    names = list(sides)
    grid, seq = results[names[0]], results[names[1]]
    max_diff = max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(grid.weights, seq.weights))
    result = {
        'candidates': len(candidates),
        'epochs': _EPOCHS.value,
        'train_examples': int(train.num_examples),
        'teacher_train_accuracy': float(teacher_stats.num_correct / teacher_stats.num_examples),
        'median_seconds': medians,
        'speedup': medians[names[1]] / medians[names[0]],
        'same_choice': int(grid.best) == int(seq.best),
        'chosen': candidates[int(grid.best)],
        'max_weight_difference': max_diff,
        'val_accuracy': np.asarray(grid.val_accuracy).tolist(),
    }
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(result, f, indent=1)
    lines = [
        '# PersFL distillation grid: vectorized vs sequential',
        '',
        f'One MNIST client ({result["train_examples"]} training examples), MNIST DNN, {len(candidates)} distinct '
        f"(T, lambda) candidates of the paper's 7 x 5 grid, {_EPOCHS.value} epoch(s), "
        f'batch {settings.distill_batch_size}, learning rate {settings.distill_learning_rate:g}; '
        f'{_REPEATS.value} alternating repeats, 2 CPU cores.',
        f'Command: `uv run python benchmarks/distillation_grid.py --epochs={_EPOCHS.value} --repeats={_REPEATS.value}`',
        '',
        '| side | median s | speed-up |',
        '|---|---|---|',
        f'| {names[1]} | {medians[names[1]]:.2f} | 1.00 |',
        f'| {names[0]} | {medians[names[0]]:.2f} | {result["speedup"]:.2f} |',
        '',
        f'Same chosen candidate: {result["same_choice"]} (T={result["chosen"][0]:g}, lambda={result["chosen"][1]:g}); '
        f'largest weight difference between the two sides: {max_diff:.2e}.',
        '',
    ]
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines))
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
