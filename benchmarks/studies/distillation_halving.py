"""PersFL's stage 2: successive halving of the (T, lambda) candidates against the full grid.

Timing: the default grid (23 distinct candidates of T in {1,5,...,25} x lambda
in {0,.25,.5,.75,1}), batch 32, learning rate 0.01, on one client of 3600
training and 1200 validation examples, for two models: the MNIST DNN
(784-100-10) on a real MNIST client, and PersFL's CIFAR CNN (`persfl_cnn`) on
random 32x32x3 images (timing only: its choices mean nothing). Both sides
(`distill_grid`, `distill_halving`) run alternately in one process; medians of
the repeats.

Choice agreement: on `--clients` real clients of two classes each (KT-pFL's
case-2 split, 250 examples of each class: 300 training, 100 validation and 100
test examples each, the DNN) of `--agreement_data` (Fashion-MNIST by default:
on MNIST the grid chooses lambda = 0 almost everywhere, the paper's Table 5),
each distilling the same teacher (a DNN trained for one epoch on 6000 pooled
examples, standing in for the FedAvg teacher), how often halving chooses the
grid's candidate, and the test accuracy of both choices.

    uv run python benchmarks/studies/distillation_halving.py --epochs=5 --repeats=3 --clients=20
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
from tff_pfl.data import client_data, paper_partitions, partition, sources
from tff_pfl.models import stacked

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_EPOCHS = flags.DEFINE_integer('epochs', 5, 'Distillation epochs of the timed runs (PersFL: 5).')
_AGREEMENT_DATA = flags.DEFINE_string(
    'agreement_data', '../shared/data/fashion_mnist.npz', 'Keras-layout file of the agreement clients.'
)
_AGREEMENT_EPOCHS = flags.DEFINE_integer('agreement_epochs', 5, 'Distillation epochs of the agreement runs.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed repeats per side.')
_CLIENTS = flags.DEFINE_integer('clients', 20, 'Clients of the agreement measurement.')
_OUT = flags.DEFINE_string('out', 'benchmarks/studies/results/distillation_halving', 'Result path prefix (.json, .md).')

SEARCHES = {'grid': distillation.distill_grid, 'halving': distillation.distill_halving}


def _split(x, y):
    return client_data.ClientSplit(tf.constant(x), tf.constant(y))


def _searches(layers, teacher, train, val, settings, seed):
    temperatures, imitations = distillation.candidate_arrays(
        distillation.grid_candidates(settings.temperatures, settings.imitations)
    )
    kwargs = dict(
        temperatures=tf.constant(temperatures),
        imitations=tf.constant(imitations),
        config=settings.distill_config(),
        seed=tf.constant(seed, tf.int64),
    )
    return {
        name: tf.function(lambda search=search: search(layers, teacher, train, val, **kwargs))
        for name, search in SEARCHES.items()
    }


def _timing(model, train, val, settings):
    layers = stacked.plan(model)
    teacher = [tf.constant(w) for w in model.get_weights()]
    sides = _searches(layers, teacher, train, val, settings, [3, 4])
    for fn in sides.values():  # trace and warm up
        fn().val_accuracy.numpy()
    times = {name: [] for name in sides}
    for _ in range(_REPEATS.value):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn().val_accuracy.numpy()
            times[name].append(time.perf_counter() - start)
            print(model.name, name, f'{times[name][-1]:.2f}s', flush=True)
    return {name: statistics.median(t) for name, t in times.items()}


def _agreement(pool, settings):
    rng_indices = paper_partitions.ktpfl_case2(
        pool.y, _CLIENTS.value, seed=0, classes_per_client=2, examples_per_class=250
    )
    model = models.mnist_dnn((28, 28, 1), 10)
    teacher_data = _split(pool.x[:6000], pool.y[:6000])
    seed = tf.constant([1, 2], tf.int64)
    local_training.train(model, teacher_data, epochs=1, batch_size=32, learning_rate=0.05, seed=seed)
    teacher = [tf.constant(w) for w in model.get_weights()]
    layers = stacked.plan(model)
    candidates = distillation.grid_candidates(settings.temperatures, settings.imitations)
    rows = []
    for client, indices in enumerate(rng_indices):
        split = partition.split_client(indices, pool.y, (0.6, 0.2, 0.2), seed=client)
        train, val, test = (_split(pool.x[split[k]], pool.y[split[k]]) for k in ('train', 'val', 'test'))
        sides = _searches(layers, teacher, train, val, settings, [client, 5])
        row = {'client': client}
        for name, fn in sides.items():
            result = fn()
            best = int(result.best)
            chosen = [w[best] for w in result.weights]
            logits = stacked.forward(layers, [w[tf.newaxis] for w in chosen], test.features)[0]
            accuracy = float(np.mean(np.argmax(logits.numpy(), axis=-1) == test.labels.numpy()))
            row[name] = {'candidate': list(candidates[best]), 'test_accuracy': accuracy}
        rows.append(row)
        print(client, row['grid']['candidate'], row['halving']['candidate'], flush=True)
    return rows


def main(argv):
    del argv
    pool = sources.load_npz(_MNIST.value)
    indices = partition.iid(pool.y, 10, seed=0, examples_per_client=6000)[0]
    split = partition.split_client(indices, pool.y, (0.6, 0.2, 0.2), seed=0)
    mnist_train, mnist_val = (_split(pool.x[split[k]], pool.y[split[k]]) for k in ('train', 'val'))
    rng = np.random.default_rng(0)
    cifar_train = _split(rng.random((3600, 32, 32, 3), np.float32), rng.integers(0, 10, 3600).astype(np.int32))
    cifar_val = _split(rng.random((1200, 32, 32, 3), np.float32), rng.integers(0, 10, 1200).astype(np.int32))
    timed = persfl.PersFLSettings(distill_epochs=_EPOCHS.value).validate()
    timing = {
        'mnist_dnn': _timing(models.mnist_dnn((28, 28, 1), 10), mnist_train, mnist_val, timed),
        'persfl_cnn': _timing(models.get('persfl_cnn')((32, 32, 3), 10), cifar_train, cifar_val, timed),
    }
    agreement_pool = sources.load_npz(_AGREEMENT_DATA.value)
    rows = _agreement(agreement_pool, persfl.PersFLSettings(distill_epochs=_AGREEMENT_EPOCHS.value).validate())
    same = sum(r['grid']['candidate'] == r['halving']['candidate'] for r in rows)
    result = {
        'candidates': len(distillation.grid_candidates(timed.temperatures, timed.imitations)),
        'survivors_per_rung': distillation.halving_survivors(23),
        'epochs': _EPOCHS.value,
        'agreement_data': _AGREEMENT_DATA.value,
        'repeats': _REPEATS.value,
        'timing_median_s': timing,
        'agreement_epochs': _AGREEMENT_EPOCHS.value,
        'agreement': rows,
        'same_choice': same,
    }
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(result, f, indent=1)
    lines = [
        "# PersFL's stage 2: successive halving against the full grid",
        '',
        f'Command: `uv run python benchmarks/studies/distillation_halving.py --epochs={_EPOCHS.value} '
        f'--repeats={_REPEATS.value} --clients={_CLIENTS.value}` (module docstring: the setting). '
        f'{result["candidates"]} candidates; halving trains {" -> ".join(map(str, result["survivors_per_rung"]))} '
        'of them in its three rungs. Medians of alternating repeats in one process, 2 shared CPU cores.',
        '',
        '| model, one client of 3600 / 1200 examples | grid s | halving s | speed-up |',
        '|---|---|---|---|',
    ]
    for name, t in timing.items():
        lines.append(f'| {name} | {t["grid"]:.2f} | {t["halving"]:.2f} | {t["grid"] / t["halving"]:.2f} |')
    grid_acc = np.mean([r['grid']['test_accuracy'] for r in rows]) * 100
    halving_acc = np.mean([r['halving']['test_accuracy'] for r in rows]) * 100
    lines += [
        '',
        f'Choice agreement ({_AGREEMENT_EPOCHS.value} distillation epochs, {len(rows)} clients of two classes of '
        f'`{_AGREEMENT_DATA.value}`): '
        f"halving chooses the grid's candidate on {same} of {len(rows)} clients; mean test accuracy of the chosen "
        f'student {grid_acc:.2f} % (grid) and {halving_acc:.2f} % (halving).',
        '',
        '| client | grid (T, lambda) | halving (T, lambda) | grid test % | halving test % |',
        '|---|---|---|---|---|',
    ]
    for r in rows:
        lines.append(
            f'| {r["client"]} | {tuple(r["grid"]["candidate"])} | {tuple(r["halving"]["candidate"])} | '
            f'{r["grid"]["test_accuracy"] * 100:.2f} | {r["halving"]["test_accuracy"] * 100:.2f} |'
        )
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
