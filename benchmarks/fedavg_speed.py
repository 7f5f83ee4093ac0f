"""FedAvg seconds per round: the project's TFF round vs the plain-TF floor.

Workload (the same SGD work on both sides): 10 clients x 3600 MNIST training
examples (784 float32 features), MLP 784-100-10, batch 32, one local epoch,
learning rate 0.1. Rounds of the two sides alternate in one process, so
machine noise hits both alike; the ratio is of medians.

* floor: plain TensorFlow, all 10 client loops in one tf.function (TF runs
  the independent loops on both cores), data already in memory as tensors;
* project: `processes.fedavg` on the project's TFF worker (clients read
  their files inside the worker), `next` alone and `next` + `evaluate` of
  every client on its test split.

It also records the TFF worker's and the driver's resident memory every 10
rounds over a long run.

    uv run python benchmarks/fedavg_speed.py --rounds=30 --memory_rounds=200
"""

import functools
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import psutil
import tensorflow as tf
from absl import app, flags

from processes import fedavg
from tff_pfl import models, runtime
from tff_pfl.computations import local_training
from tff_pfl.data import client_data, client_data_writer, partition, sources

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_ROUNDS = flags.DEFINE_integer('rounds', 30, 'Timed rounds per side (after 3 warm-up rounds).')
_MEMORY_ROUNDS = flags.DEFINE_integer('memory_rounds', 200, 'Rounds of the memory run (0: skip).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/fedavg_speed', 'Result path prefix (.json, .md).')

NUM_CLIENTS, TRAIN_PER_CLIENT, BATCH, LR = 10, 3600, 32, 0.1


def floor_start_weights(seed=0):
    """The floor's starting MLP weights (784-100-10), drawn from `seed`: float32 arrays."""
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 0.05, s).astype(np.float32) for s in [(784, 100), (100,), (100, 10), (10,)]]


def build_floor(client_arrays, seed=0):
    """Plain TF: every client's epoch in one tf.function; returns a round fn."""
    xs = [tf.constant(x.reshape(len(x), -1)) for x, _ in client_arrays]
    ys = [tf.constant(y) for _, y in client_arrays]
    counts = tf.constant([float(len(y)) for _, y in client_arrays])

    def client_epoch(weights, x, y, seed):
        n = tf.shape(y)[0]
        order = local_training.epoch_permutations(seed, 1, n)[0]
        steps = (n + BATCH - 1) // BATCH

        def body(step, w1, b1, w2, b2):
            idx = order[step * BATCH : tf.minimum((step + 1) * BATCH, n)]
            xb, yb = tf.gather(x, idx), tf.gather(y, idx)
            with tf.GradientTape() as tape:
                tape.watch([w1, b1, w2, b2])
                logits = tf.nn.relu(xb @ w1 + b1) @ w2 + b2
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits))
            grads = tape.gradient(loss, [w1, b1, w2, b2])
            return [step + 1] + [v - LR * g for v, g in zip([w1, b1, w2, b2], grads)]

        return tf.while_loop(lambda s, *_: s < steps, body, [tf.constant(0)] + list(weights))[1:]

    @tf.function
    def round_fn(weights, round_num):
        trained = [
            client_epoch(weights, xs[c], ys[c], tf.stack([tf.cast(round_num, tf.int64), c])) for c in range(len(xs))
        ]
        share = counts / tf.reduce_sum(counts)
        return [sum(share[c] * trained[c][i] for c in range(len(xs))) for i in range(4)]

    return round_fn


def main(argv):
    del argv
    pool = sources.load_npz(_MNIST.value)
    clients = partition.iid(pool.y, NUM_CLIENTS, seed=0, examples_per_client=6000)
    splits = [partition.split_client(c, pool.y, (0.6, 0.2, 0.2), seed=i) for i, c in enumerate(clients)]
    workdir = tempfile.mkdtemp(prefix='fedavg_speed.')
    spec = client_data_writer.write_client_data(os.path.join(workdir, 'data'), pool.x, pool.y, 10, splits)
    assert set(spec.split_sizes['train']) == {TRAIN_PER_CLIENT}, spec.split_sizes['train']
    arrays = [client_data.read_split_numpy(spec, c, 'train') for c in spec.client_ids]

    floor = build_floor(arrays)
    floor_weights = [tf.constant(w) for w in floor_start_weights()]

    model_fn = functools.partial(models.mnist_dnn, spec.feature_shape, 10)
    settings = fedavg.FedAvgSettings(local_epochs=1, batch_size=BATCH, client_learning_rate=LR)
    process = fedavg.build_fedavg_process(spec, model_fn, settings, seed=0)
    result = {
        'workload': f'{NUM_CLIENTS} clients x {TRAIN_PER_CLIENT} x 784, MLP 784-100-10, batch {BATCH}, 1 epoch',
        'machine': f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores',
        'rounds_timed': _ROUNDS.value,
    }
    with runtime.local_runtime(max_concurrent_computation_calls=2) as rt:
        state = process.initialize()
        client_states = [process.initial_client_state(c) for c in spec.client_ids]
        times = {'floor': [], 'next': [], 'next_and_evaluate': []}
        for r in range(_ROUNDS.value + 3):
            t = time.perf_counter()
            floor_weights = floor(floor_weights, tf.constant(r))
            _ = floor_weights[0].numpy()
            t_floor = time.perf_counter() - t
            t = time.perf_counter()
            out = process.next(state, client_states)
            state, client_states = out.state, out.client_states
            t_next = time.perf_counter() - t
            t = time.perf_counter()
            out = process.next(state, client_states)
            state, client_states = out.state, out.client_states
            evaluation = process.evaluate(state, client_states)
            t_both = time.perf_counter() - t
            if r >= 3:
                times['floor'].append(t_floor)
                times['next'].append(t_next)
                times['next_and_evaluate'].append(t_both)
            print(f'round {r}: floor {t_floor:.3f}s  next {t_next:.3f}s  next+evaluate {t_both:.3f}s', flush=True)
        medians = {k: statistics.median(v) for k, v in times.items()}
        result['median_seconds_per_round'] = medians
        result['ratio_to_floor'] = {k: medians[k] / medians['floor'] for k in ('next', 'next_and_evaluate')}
        result['final_mean_test_accuracy'] = float(np.mean([e['global_model']['accuracy'] for e in evaluation]))

        memory = []
        worker = psutil.Process(rt.pid)
        driver = psutil.Process()
        for r in range(_MEMORY_ROUNDS.value):
            out = process.next(state, client_states)
            state, client_states = out.state, out.client_states
            if r % 10 == 0 or r == _MEMORY_ROUNDS.value - 1:
                memory.append(
                    {
                        'round': r,
                        'worker_rss_mb': worker.memory_info().rss / 2**20,
                        'driver_rss_mb': driver.memory_info().rss / 2**20,
                    }
                )
                print(memory[-1], flush=True)
        result['memory'] = memory

    with open(_OUT.value + '.json', 'w') as f:
        json.dump(result, f, indent=1)
    lines = [
        '# FedAvg round time vs the plain-TF floor',
        '',
        f'Workload: {result["workload"]}; {result["machine"]}; {_ROUNDS.value} alternating timed rounds per side.',
        'Command: `uv run python benchmarks/fedavg_speed.py '
        f'--rounds={_ROUNDS.value} --memory_rounds={_MEMORY_ROUNDS.value}`',
        '',
        '| side | median s/round | ratio to floor |',
        '|---|---|---|',
        f'| plain TF, all clients in one tf.function (floor) | {medians["floor"]:.4f} | 1.00 |',
        f'| project FedAvg `next` | {medians["next"]:.4f} | {result["ratio_to_floor"]["next"]:.2f} |',
        f'| project FedAvg `next` + `evaluate` (every client, test split) | {medians["next_and_evaluate"]:.4f} | '
        f'{result["ratio_to_floor"]["next_and_evaluate"]:.2f} |',
        '',
        'The floor is functional TF (no Keras), all clients fused into one graph; the project round',
        "also reads every client's files, builds its Keras model, aggregates through",
        '`tff.aggregators.MeanFactory`, applies a `tff.learning` server optimizer and returns client',
        'states and metrics. `evaluate` of every client costs about one extra forward pass over each',
        'test split plus one more file read; the binary evaluates every `--eval_every` rounds (10).',
        '',
    ]
    if memory:
        lines += ['## Resident memory over rounds (MB)', '', '| round | TFF worker | driver |', '|---|---|---|']
        lines += [f'| {m["round"]} | {m["worker_rss_mb"]:.0f} | {m["driver_rss_mb"]:.0f} |' for m in memory]
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
