"""Where a FedAvg round on the MLP spends its time above the plain-TF floor.

`fedavg_speed.py` gives the whole round against the floor (all clients' SGD
loops in one tf.function). This splits the difference, each part measured
side by side with the floor in one process (CPU seconds from /proc, which
machine noise disturbs less than wall time):

* the client step: one client's epoch of our SGD loop (Keras model, the
  batch's stats) against the floor's loop for one client, both in-process;
* the round's fixed cost and its cost per client: rounds of clients that hold
  36 training examples each (two SGD steps), with 10 and with 40 clients: the
  TFF worker's and the driver's CPU seconds per round; the slope is what
  each further client costs beyond its SGD (its calls, its reads, the
  aggregation's steps), the intercept what a round costs with no client;
* the floor's clients as separate calls: its ten clients' epochs as ten
  one-client tf.functions, two at a time from two threads (as TFF's worker
  runs clients, `max_concurrent_computation_calls=2`), against the floor's
  ten loops in one tf.function, in-process: what running each client as its
  own call costs with no TFF at all;
* the full round with one local step per client (10 clients x 3,600): what
  a round of full-size clients costs beyond SGD;
* the smallest TFF round on the same client training (FedAvg's own
  `build_client_training`; broadcast, one `federated_map`, two sums, a
  division: no client states, metrics or server optimizer), with one client
  a call and with 5 clients a call (one graph of 5 loops, the CLIENTS value
  a vector of 5 ids), beside the floor and the project's round in one
  runtime: what TFF's runtime costs on its own, and what grouping clients
  into a call would buy;
* the full round (10 clients x 3,600): wall seconds, the worker's and the
  driver's CPU seconds, and the floor's, on three fresh workers (on this
  machine a worker process's rounds were either all fast or all slow:
  0.17-0.18 s or 0.22-0.25 s against a floor of 0.13-0.14 s, with the
  worker's CPU seconds 0.28-0.30 or 0.34-0.38).

    uv run python benchmarks/fedavg_overhead.py
"""

import collections
import concurrent.futures
import functools
import json
import os
import platform
import statistics
import tempfile
import time

import fedavg_speed
import numpy as np
import psutil
import tensorflow as tf
import tensorflow_federated as tff
from absl import app, flags

from processes import fedavg
from tff_pfl import models, runtime
from tff_pfl.computations import building_blocks, local_training, model_weights
from tff_pfl.data import client_data, client_data_writer, partition, sources
from tff_pfl.models import adapters

_MNIST = fedavg_speed._MNIST  # its --mnist (importing fedavg_speed defines its flags)
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Alternating blocks of 10 rounds per side.')
_OUT = flags.DEFINE_string('results', 'benchmarks/results/fedavg_overhead', 'Result path prefix (.json, .md).')


def _spec(pool, workdir, clients, examples):
    members = partition.iid(pool.y, clients, seed=0, examples_per_client=examples)
    splits = [partition.split_client(c, pool.y, (0.6, 0.2, 0.2), seed=i) for i, c in enumerate(members)]
    return client_data_writer.write_client_data(
        os.path.join(workdir, f'{clients}x{examples}'), pool.x, pool.y, 10, splits
    )


def _cpu(process):
    times = process.cpu_times()
    return times.user + times.system


def _rounds(spec, local_steps=0):
    """Per block of 10 rounds: (wall s, worker CPU s, driver CPU s, floor wall s, floor CPU s), per round."""
    model_fn = functools.partial(models.mnist_dnn, spec.feature_shape, 10)
    settings = fedavg.FedAvgSettings(batch_size=32, client_learning_rate=0.1, local_steps=local_steps)
    process = fedavg.build_fedavg_process(spec, model_fn, settings, seed=0)
    floor = fedavg_speed.build_floor([client_data.read_split_numpy(spec, c, 'train') for c in spec.client_ids])
    weights = [tf.constant(w) for w in fedavg_speed.floor_start_weights()]
    blocks = []
    with runtime.local_runtime(max_concurrent_computation_calls=2) as rt:
        worker = psutil.Process(rt.pid)
        state = process.initialize()
        client_states = [process.initial_client_state(c) for c in spec.client_ids]
        for r in range(3):
            out = process.next(state, client_states)
            state, client_states = out.state, out.client_states
            weights = floor(weights, tf.constant(r))
        for _ in range(_REPEATS.value):
            w0, d0, t0 = _cpu(worker), time.process_time(), time.perf_counter()
            for _ in range(10):
                out = process.next(state, client_states)
                state, client_states = out.state, out.client_states
            w1, d1, t1 = _cpu(worker), time.process_time(), time.perf_counter()
            for r in range(10):
                weights = floor(weights, tf.constant(r))
                weights[0].numpy()
            d2, t2 = time.process_time(), time.perf_counter()
            blocks.append([(t1 - t0) / 10, (w1 - w0) / 10, (d1 - d0) / 10, (t2 - t1) / 10, (d2 - d1) / 10])
    return [statistics.median(b[i] for b in blocks) for i in range(5)]


def _alternating(sides, runs=23, warmup=3):
    """Median seconds of each side's function, the sides called in turn `runs` times (the first `warmup` not timed)."""
    seconds = {side: [] for side in sides}
    for r in range(runs):
        for side, fn in sides.items():
            t = time.perf_counter()
            fn()
            if r >= warmup:
                seconds[side].append(time.perf_counter() - t)
    return {side: statistics.median(s) for side, s in seconds.items()}


def _client_step(spec):
    """Seconds of one client's epoch in-process: our SGD loop (`local_training.train`) and the floor's."""
    x, y = client_data.read_split_numpy(spec, spec.client_ids[0], 'train')
    split = client_data.ClientSplit(tf.constant(x), tf.constant(y), client_data.FLOAT32)
    model = models.mnist_dnn(spec.feature_shape, 10)
    model(tf.zeros((1, *spec.feature_shape)))
    floor = fedavg_speed.build_floor([(x.reshape(len(x), -1), y)])
    weights = [tf.constant(w) for w in model.get_weights()]
    seed = tf.constant([0, 1], tf.int64)

    @tf.function
    def ours():
        return local_training.train(model, split, epochs=1, batch_size=32, learning_rate=0.1, seed=seed)

    return _alternating({'ours': lambda: ours()[0].numpy(), 'floor': lambda: floor(weights, tf.constant(0))[0].numpy()})


def _separate_calls(spec):
    """Seconds of the floor's ten clients in one tf.function, and as ten one-client ones two at a time."""
    arrays = [client_data.read_split_numpy(spec, c, 'train') for c in spec.client_ids]
    together = fedavg_speed.build_floor(arrays)
    apart = [fedavg_speed.build_floor([a]) for a in arrays]
    weights = [tf.constant(w) for w in fedavg_speed.floor_start_weights()]
    round_num = tf.constant(0)

    def one(floor):
        return floor(weights, round_num)[0].numpy()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return _alternating({'one_call': lambda: one(together), 'separate_calls': lambda: list(pool.map(one, apart))})


GROUP = 5  # clients a call in the grouped bare round


def _bare_round(training, weights_type, ids_type, group):
    """The smallest FedAvg round on `training`: the example-weighted mean of `group` clients' updates a call."""

    @tff.tensorflow.computation(weights_type, np.int32, ids_type)
    def work(weights, round_num, ids):
        outs = [training(weights, round_num, ids[i] if group > 1 else ids) for i in range(group)]
        return collections.OrderedDict(
            update=[tf.add_n([o['update'][k] * o['weight'] for o in outs]) for k in range(len(weights))],
            weight=tf.add_n([o['weight'] for o in outs]),
        )

    @tff.tensorflow.computation
    def divide(total, weight):
        return [t / weight for t in total]

    @tff.federated_computation(
        tff.FederatedType(weights_type, tff.SERVER),
        tff.FederatedType(np.int32, tff.SERVER),
        tff.FederatedType(ids_type, tff.CLIENTS),
    )
    def bare_round(weights, round_num, ids):
        out = tff.federated_map(work, (tff.federated_broadcast(weights), tff.federated_broadcast(round_num), ids))
        return tff.federated_map(divide, (tff.federated_sum(out.update), tff.federated_sum(out.weight)))

    return bare_round


def _bare_rounds(spec):
    """Median wall s a round in one runtime, alternating: the floor, bare rounds of 1 and GROUP clients a call, next."""
    model_fn = adapters.keras_model_fn(functools.partial(models.mnist_dnn, spec.feature_shape, 10))
    settings = fedavg.FedAvgSettings(batch_size=32, client_learning_rate=0.1)
    process = fedavg.build_fedavg_process(spec, model_fn, settings, seed=0)
    weights_type = model_weights.weights_type(model_fn)
    training = building_blocks.build_client_training(spec, model_fn, settings.training_config(), seed=0)
    one = _bare_round(training, weights_type, tff.TensorType(np.str_), 1)
    grouped = _bare_round(training, weights_type, tff.TensorType(np.str_, [GROUP]), GROUP)
    ids = [c.encode() for c in spec.client_ids]
    groups = [np.array(ids[i : i + GROUP], dtype=object) for i in range(0, len(ids), GROUP)]
    floor = fedavg_speed.build_floor([client_data.read_split_numpy(spec, c, 'train') for c in spec.client_ids])
    weights = fedavg_speed.floor_start_weights()
    floor_weights = [tf.constant(w) for w in weights]
    with runtime.local_runtime(max_concurrent_computation_calls=2):
        state = [process.initialize(), [process.initial_client_state(c) for c in spec.client_ids]]

        def project_round():
            out = process.next(*state)
            state[:] = [out.state, out.client_states]

        apart, together = one(weights, 0, ids), grouped(weights, 0, groups)
        difference = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(apart, together))
        seconds = _alternating(
            {
                'floor': lambda: floor(floor_weights, tf.constant(0))[0].numpy(),
                'bare_one_a_call': lambda: one(weights, 0, ids),
                'bare_grouped': lambda: grouped(weights, 0, groups),
                'next': project_round,
            },
            runs=10 * _REPEATS.value + 3,
        )
    return {'seconds': seconds, 'grouped_max_abs_difference': difference}


def main(argv):
    del argv
    runtime.refuse_implicit_runtime()
    pool = sources.load_npz(_MNIST.value)
    workdir = tempfile.mkdtemp(prefix='fedavg_overhead.')
    full = _spec(pool, workdir, 10, 6000)
    tiny = {n: _spec(pool, workdir, n, 60) for n in (10, 40)}
    step = _client_step(full)
    separate = _separate_calls(full)
    bare = _bare_rounds(full)
    keys = ('wall', 'worker_cpu', 'driver_cpu', 'floor_wall', 'floor_cpu')
    # The full round three times, each on a fresh worker: its wall time differs from one worker
    # process to the next (see the .md); the table shows the median one and the range.
    full_runs = sorted((dict(zip(keys, _rounds(full))) for _ in range(3)), key=lambda r: r['wall'] / r['floor_wall'])
    rounds = {'full': full_runs[1], 'full_runs': full_runs}
    rounds['full_one_step'] = dict(zip(keys, _rounds(full, local_steps=1)))
    for n, spec in tiny.items():
        rounds[f'tiny_{n}'] = dict(zip(keys, _rounds(spec)))
    per_client = {k: (rounds['tiny_40'][k] - rounds['tiny_10'][k]) / 30 for k in ('wall', 'worker_cpu', 'driver_cpu')}
    fixed = {k: rounds['tiny_10'][k] - 10 * per_client[k] for k in per_client}
    record = {
        'machine': {'cpus': os.cpu_count(), 'processor': platform.processor(), 'python': platform.python_version()},
        'repeats': _REPEATS.value,
        'client_epoch_seconds_one_thread': step,
        'floor_clients_seconds': separate,
        'bare_rounds': bare,
        'rounds': rounds,
        'per_client': per_client,
        'fixed_per_round': fixed,
    }
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(record, f, indent=2)
    f_, o_ = rounds['full'], rounds['full_one_step']
    lines = [
        '# Where a FedAvg round on the MLP spends its time above the plain-TF floor',
        '',
        f'`uv run python benchmarks/fedavg_overhead.py --repeats={_REPEATS.value}`: MNIST, iid, MLP 784-100-10, '
        f'batch 32, one epoch; {os.cpu_count()} cores; the local runtime (2 concurrent clients). Medians of '
        'blocks of 10 rounds, each block followed by 10 floor rounds.',
        '',
        '| what | ours | floor | ratio |',
        '|---|---|---|---|',
        f"| one client's epoch, 3,600 examples, in-process (s) | {step['ours']:.4f} | "
        f'{step["floor"]:.4f} | {step["ours"] / step["floor"]:.2f} |',
        f"| the floor's 10 clients as separate calls, 2 at a time, in-process (s) | "
        f'{separate["separate_calls"]:.4f} | {separate["one_call"]:.4f} | '
        f'{separate["separate_calls"] / separate["one_call"]:.2f} |',
        f'| full round, 10 clients x 3,600: wall s | {f_["wall"]:.4f} | {f_["floor_wall"]:.4f} | '
        f'{f_["wall"] / f_["floor_wall"]:.2f} |',
        f'| the same clients, one local step each: wall s | {o_["wall"]:.4f} | {o_["floor_wall"]:.4f} | '
        f'{o_["wall"] / o_["floor_wall"]:.2f} |',
        f'| full round: CPU s (ours: worker + driver) | {f_["worker_cpu"]:.4f} + {f_["driver_cpu"]:.4f} | '
        f'{f_["floor_cpu"]:.4f} | {(f_["worker_cpu"] + f_["driver_cpu"]) / f_["floor_cpu"]:.2f} |',
        '',
        'The full round on three fresh workers (the table shows the middle one), wall s ours / floor: '
        + ', '.join(
            f'{r["wall"]:.4f} / {r["floor_wall"]:.4f} ({r["wall"] / r["floor_wall"]:.2f}x, worker CPU '
            f'{r["worker_cpu"]:.4f} s)'
            for r in full_runs
        )
        + '.',
        '',
        "The smallest TFF round on the same client training (FedAvg's `build_client_training`: broadcast, "
        'one `federated_map`, two `federated_sum`s and a division; no client states, metrics or server '
        f'optimizer), in one runtime, the four sides alternating, {10 * _REPEATS.value} rounds each:',
        '',
        '| | wall s a round | against the floor |',
        '|---|---|---|',
    ]
    labels = {
        'floor': 'the floor',
        'bare_one_a_call': 'smallest TFF round, one client a call',
        'bare_grouped': f'smallest TFF round, {GROUP} clients a call (one graph of {GROUP} loops)',
        'next': "the project's FedAvg `next`",
    }
    for key, label in labels.items():
        value = bare['seconds'][key]
        lines.append(f'| {label} | {value:.4f} | {value / bare["seconds"]["floor"]:.2f} |')
    lines += [
        '',
        f"The grouped round's mean update differs from one client a call by at most "
        f'{bare["grouped_max_abs_difference"]:.1e} (the weighted sum adds in another order).',
        '',
        'Rounds of clients with 36 training examples (two SGD steps each): what a round costs beyond SGD.',
        '',
        '| | wall s | worker CPU s | driver CPU s |',
        '|---|---|---|---|',
    ]
    for n in (10, 40):
        r = rounds[f'tiny_{n}']
        lines.append(f'| {n} clients | {r["wall"]:.4f} | {r["worker_cpu"]:.4f} | {r["driver_cpu"]:.4f} |')
    lines += [
        f'| each further client (slope) | {per_client["wall"]:.4f} | {per_client["worker_cpu"]:.4f} | '
        f'{per_client["driver_cpu"]:.4f} |',
        f'| a round of no client (intercept) | {fixed["wall"]:.4f} | {fixed["worker_cpu"]:.4f} | '
        f'{fixed["driver_cpu"]:.4f} |',
        '',
        "The floor's CPU seconds are the driver process's own (it runs the floor in-process). The separate "
        "calls' row runs the floor's own code, each client as its own tf.function, from two threads: the ratio "
        'is what one call per client costs without TFF. The one-step row is the full round with '
        '`local_steps=1`: every cost of the round but its SGD, on clients of the full size; its floor column is '
        "the floor's full round, measured in the same blocks.",
    ]
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
