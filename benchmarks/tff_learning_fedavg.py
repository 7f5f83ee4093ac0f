"""FedAvg seconds per round: the project's round vs tff.learning's own FedAvg, same model and data.

Workload (the same SGD work on both sides): 10 clients x 3600 Fashion-MNIST
training examples (28x28x1, iid: `partition.iid(..., examples_per_client=6000)`
then a (0.6, 0.2, 0.2) split per client), batch 32, one local epoch, client
learning rate 0.1, server learning rate 1.0, for the MLP 784-100-10
(`mnist_dnn`) and the CNN of McMahan et al. (`fedavg_cnn`), both from the same
initial weights (`model_weights.initial_weights`, seed 0).

* ours: `processes.fedavg.build_fedavg_process` on the data written by
  `client_data_writer.write_client_data` (clients read their files inside the
  TFF worker, docs/architecture.md);
* tff.learning: `tff.learning.algorithms.build_weighted_fed_avg` on
  `tff.learning.models.from_keras_model`, client and server optimizers
  `tff.learning.optimizers.build_sgdm`, each client a `tf.data.Dataset` built
  once in Python from the same client arrays (`from_tensor_slices`, a shuffle
  over the whole split, `batch(32)`), as TFF's tutorials do, and passed into
  every `next`.

Each (side, model) measurement runs in a fresh process of its own (its own
`runtime.local_runtime()`, so its own TFF worker): warm-up rounds (the first
call sends and instantiates the computation), then timed rounds of `next`
alone. The parent alternates the sides (ours first on even repeats,
tff.learning first on odd ones) and reports the median seconds per round over
all timed rounds of all repeats, the ratio tff.learning / ours, the final
mean test accuracy of each side's global model (a sanity check: same start,
same data, different kernels and batch orders), and each child's peak
resident memory (driver and TFF worker).

    uv run --locked python benchmarks/tff_learning_fedavg.py --rounds_mlp=10 --rounds_cnn=3 --repeats=2

One measurement alone (what the parent runs; writes its record as JSON):

    uv run --locked python benchmarks/tff_learning_fedavg.py --side=ours --model=mnist_dnn --rounds=10 \\
      --json_out=/tmp/ours_mlp.json
"""

import functools
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf  # before app.run: imported first inside main, Keras builds no model eagerly
import tensorflow_federated as tff
from absl import app, flags

from processes import fedavg
from tff_pfl import models, runtime
from tff_pfl.computations import model_weights
from tff_pfl.data import client_data, client_data_writer, partition, sources

_FASHION_MNIST = flags.DEFINE_string(
    'fashion_mnist', '../shared/data/fashion_mnist.npz', 'Keras-layout Fashion-MNIST file.'
)
_MODELS = flags.DEFINE_list('models', ['mnist_dnn', 'fedavg_cnn'], 'Models to measure (tff_pfl.models names).')
_ROUNDS_MLP = flags.DEFINE_integer('rounds_mlp', 10, 'Timed rounds of mnist_dnn per measurement.')
_ROUNDS_CNN = flags.DEFINE_integer('rounds_cnn', 3, 'Timed rounds of fedavg_cnn (and any other model) per measurement.')
_WARMUP = flags.DEFINE_integer('warmup_rounds', 2, 'Untimed rounds before the timed ones, in every measurement.')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Measurements per (side, model); the sides alternate.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/tff_learning_fedavg', 'Result path prefix (.json, .md).')
# One measurement (the parent's child processes).
_SIDE = flags.DEFINE_enum('side', None, ['ours', 'tff_learning'], 'Measure this side only, in this process.')
_MODEL = flags.DEFINE_string('model', 'mnist_dnn', 'With --side: the model.')
_ROUNDS = flags.DEFINE_integer('rounds', 10, 'With --side: timed rounds.')
_DATA_DIR = flags.DEFINE_string(
    'data_dir', None, 'With --side: client data written by the parent (default: write it to a temporary directory).'
)
_JSON_OUT = flags.DEFINE_string('json_out', None, 'With --side: where to write the record (JSON).')

NUM_CLIENTS, EXAMPLES_PER_CLIENT, TRAIN_PER_CLIENT = 10, 6000, 3600
BATCH, CLIENT_LR, SERVER_LR, SEED = 32, 0.1, 1.0, 0
SIDES = ('ours', 'tff_learning')


def write_data(npz_path: str, root: str):
    """Partitions Fashion-MNIST iid over 10 clients and writes their splits under `root`.

    Args:
      npz_path: the Keras-layout `.npz` file.
      root: target directory (must not exist).

    Returns:
      The `client_data.ClientDataSpec` written.
    """
    pool = sources.load_npz(npz_path)
    clients = partition.iid(pool.y, NUM_CLIENTS, seed=SEED, examples_per_client=EXAMPLES_PER_CLIENT)
    splits = [partition.split_client(c, pool.y, (0.6, 0.2, 0.2), seed=i) for i, c in enumerate(clients)]
    spec = client_data_writer.write_client_data(root, pool.x, pool.y, pool.num_classes, splits)
    if set(spec.split_sizes['train']) != {TRAIN_PER_CLIENT}:
        raise ValueError(f'expected {TRAIN_PER_CLIENT} training examples per client, got {spec.split_sizes["train"]}')
    return spec


def _status_mb(pid, field: str) -> float:
    """A memory field of /proc/<pid>/status (VmHWM: peak RSS, VmRSS: RSS), in MB; NaN if unreadable."""
    try:
        with open(f'/proc/{pid}/status') as f:
            for line in f:
                name, _, value = line.partition(':')
                if name == field:
                    return int(value.split()[0]) / 1024
    except OSError:
        pass
    return float('nan')


def _mean_test_accuracy(keras_model, weights, tests) -> float:
    """The mean over clients of the global model's accuracy on each client's test split (Keras, outside TFF)."""
    keras_model.set_weights([np.asarray(w) for w in weights])
    accuracies = []
    for x, y in tests:
        predicted = np.argmax(keras_model.predict(x, batch_size=500, verbose=0), axis=-1)
        accuracies.append(float(np.mean(predicted == y)))
    return float(np.mean(accuracies))


def measure(side: str, model: str, rounds: int, warmup: int, spec) -> dict:
    """One measurement: builds `side`'s FedAvg for `model`, runs warm-up then timed rounds in a fresh runtime.

    Args:
      side: 'ours' or 'tff_learning'.
      model: a `tff_pfl.models` name.
      rounds: timed rounds.
      warmup: untimed rounds before them.
      spec: the client data (`client_data.ClientDataSpec`).

    Returns:
      The record: per-round seconds, final mean test accuracy, peak memory.
    """
    keras_fn = functools.partial(models.get(model), spec.feature_shape, spec.num_classes)
    initial = [w.numpy() for w in model_weights.initial_weights(keras_fn, SEED)]
    tests = [client_data.read_split_numpy(spec, c, 'test') for c in spec.client_ids]
    record = dict(side=side, model=model, rounds=rounds, warmup_rounds=warmup)
    started = time.perf_counter()
    with runtime.local_runtime() as rt:
        if side == 'ours':
            settings = fedavg.FedAvgSettings(
                local_epochs=1, batch_size=BATCH, client_learning_rate=CLIENT_LR, server_learning_rate=SERVER_LR
            )
            process = fedavg.build_fedavg_process(spec, keras_fn, settings, seed=SEED)
            state = process.initialize()
            start_weights = process.get_model_weights(state).trainable
            if not all(np.array_equal(a, b) for a, b in zip(start_weights, initial)):
                raise AssertionError('our process.initialize() does not start from model_weights.initial_weights')
            client_states = [process.initial_client_state(c) for c in spec.client_ids]

            def round_fn(state, client_states):
                out = process.next(state, client_states)
                return out.state, out.client_states

        else:
            trains = [client_data.read_split_numpy(spec, c, 'train') for c in spec.client_ids]
            x0, y0 = trains[0]
            input_spec = (
                tf.TensorSpec([None, *x0.shape[1:]], tf.as_dtype(x0.dtype)),
                tf.TensorSpec([None], tf.as_dtype(y0.dtype)),
            )

            def model_fn():
                return tff.learning.models.from_keras_model(
                    keras_fn(),
                    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    input_spec=input_spec,
                    metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
                )

            process = tff.learning.algorithms.build_weighted_fed_avg(
                model_fn,
                client_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=CLIENT_LR),
                server_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=SERVER_LR),
            )
            state = process.initialize()
            state = process.set_model_weights(
                state, tff.learning.models.ModelWeights(trainable=initial, non_trainable=[])
            )
            # Built once, as a user builds them; every `next` takes the same datasets.
            client_states = [
                tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=SEED * 1000 + i).batch(BATCH)
                for i, (x, y) in enumerate(trains)
            ]

            def round_fn(state, datasets):
                return process.next(state, datasets).state, datasets

        record['setup_seconds'] = time.perf_counter() - started
        warmup_seconds, round_seconds, worker_rss = [], [], []
        for r in range(warmup + rounds):
            t = time.perf_counter()
            state, client_states = round_fn(state, client_states)
            seconds = time.perf_counter() - t
            (warmup_seconds if r < warmup else round_seconds).append(seconds)
            worker_rss.append(_status_mb(rt.pid, 'VmRSS'))  # after the round, outside the timing
            print(
                f'{side} {model} round {r}{" (warm-up)" if r < warmup else ""}: {seconds:.3f}s, '
                f'worker {worker_rss[-1]:.0f} MB',
                flush=True,
            )
        record['worker_rss_mb_by_round'] = worker_rss
        record['worker_peak_rss_mb'] = _status_mb(rt.pid, 'VmHWM')
        final_weights = process.get_model_weights(state).trainable
    record['warmup_seconds'] = warmup_seconds
    record['round_seconds'] = round_seconds
    record['median_seconds_per_round'] = statistics.median(round_seconds) if round_seconds else float('nan')
    record['final_mean_test_accuracy'] = _mean_test_accuracy(keras_fn(), final_weights, tests)
    record['driver_peak_rss_mb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return record


def _child_main() -> None:
    runtime.install_sigterm_handler()
    workdir = None
    try:
        if _DATA_DIR.value:
            spec = client_data.load_client_data_spec(_DATA_DIR.value)
        else:
            workdir = tempfile.mkdtemp(prefix='tff_learning_fedavg.')
            spec = write_data(_FASHION_MNIST.value, os.path.join(workdir, 'data'))
        record = measure(_SIDE.value, _MODEL.value, _ROUNDS.value, _WARMUP.value, spec)
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        json.dumps(
            {k: v for k, v in record.items() if k not in ('round_seconds', 'warmup_seconds', 'worker_rss_mb_by_round')}
        ),
        flush=True,
    )
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, 'w') as f:
            json.dump(record, f, indent=1)


class ChildFailed(Exception):
    """A measurement's process exited with an error (the message is one line)."""


def _rounds_for(model: str) -> int:
    return _ROUNDS_MLP.value if model == 'mnist_dnn' else _ROUNDS_CNN.value


def _last_line(path: str) -> str:
    with open(path, errors='replace') as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else '(no output)'


def _run_child(side: str, model: str, data_dir: str, workdir: str, tag: str) -> dict:
    """Runs one measurement in a fresh process; its output goes to `<workdir>/<tag>.log`."""
    json_out = os.path.join(workdir, f'{tag}.json')
    log = os.path.join(workdir, f'{tag}.log')
    command = [
        sys.executable,
        os.path.abspath(__file__),
        f'--side={side}',
        f'--model={model}',
        f'--rounds={_rounds_for(model)}',
        f'--warmup_rounds={_WARMUP.value}',
        f'--data_dir={data_dir}',
        f'--json_out={json_out}',
    ]
    with open(log, 'w') as sink:
        returncode = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT).returncode
    if returncode != 0:
        how = f'killed by signal {-returncode}' if returncode < 0 else f'exit {returncode}'
        raise ChildFailed(
            f'tff_learning_fedavg: the {side} {model} measurement failed ({how}): {_last_line(log)} (log: {log})'
        )
    with open(json_out) as f:
        return json.load(f)


def _summary(records: list) -> dict:
    summary = {}
    for model in _MODELS.value:
        entry = {}
        for side in SIDES:
            mine = [r for r in records if r['model'] == model and r['side'] == side]
            entry[side] = dict(
                median_seconds_per_round=statistics.median(s for r in mine for s in r['round_seconds']),
                median_seconds_per_round_by_repeat=[r['median_seconds_per_round'] for r in mine],
                final_mean_test_accuracy=[r['final_mean_test_accuracy'] for r in mine],
                driver_peak_rss_mb=max(r['driver_peak_rss_mb'] for r in mine),
                worker_peak_rss_mb=max(r['worker_peak_rss_mb'] for r in mine),
            )
        entry['ratio_tff_learning_to_ours'] = (
            entry['tff_learning']['median_seconds_per_round'] / entry['ours']['median_seconds_per_round']
        )
        summary[model] = entry
    return summary


def _command() -> str:
    args = [
        f'--{holder.name}={",".join(holder.value) if isinstance(holder.value, list) else holder.value}'
        for holder in (_MODELS, _ROUNDS_MLP, _ROUNDS_CNN, _WARMUP, _REPEATS)
    ]
    return 'uv run --locked python benchmarks/tff_learning_fedavg.py ' + ' '.join(args)


def _markdown(result: dict) -> str:
    def accuracy(values):
        return '/'.join(f'{100 * a:.1f}' for a in values)

    lines = [
        "# FedAvg round time: ours vs tff.learning's `build_weighted_fed_avg`",
        '',
        f'Workload: {result["workload"]}; {result["machine"]} (load average '
        f'{" at the start, ".join(f"{v:.1f}" for v in result["load_average_1min_start_end"])} at the end).',
        f'Repeats: {result["repeats"]} measurements per (side, model), each in a fresh process with its own TFF',
        'worker, the sides alternating (ours first on even repeats, tff.learning first on odd ones).',
        f'Rounds per measurement: {result["warmup_rounds"]} untimed warm-up, then timed: '
        f'{", ".join(f"{m} {n}" for m, n in result["rounds_timed"].items())}.',
        f'Command: `{result["command"]}`',
        '',
        '| model | ours s/round | tff.learning s/round | ratio tff.learning / ours | '
        'accuracy %, ours | accuracy %, tff.learning | peak RSS MB driver / worker, ours | '
        'peak RSS MB driver / worker, tff.learning |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for model, entry in result['summary'].items():
        ours, theirs = entry['ours'], entry['tff_learning']
        lines.append(
            f'| `{model}` | {ours["median_seconds_per_round"]:.3f} | {theirs["median_seconds_per_round"]:.3f} | '
            f'{entry["ratio_tff_learning_to_ours"]:.2f} | {accuracy(ours["final_mean_test_accuracy"])} | '
            f'{accuracy(theirs["final_mean_test_accuracy"])} | '
            f'{ours["driver_peak_rss_mb"]:.0f} / {ours["worker_peak_rss_mb"]:.0f} | '
            f'{theirs["driver_peak_rss_mb"]:.0f} / {theirs["worker_peak_rss_mb"]:.0f} |'
        )
    lines += [
        '',
        'TFF worker resident memory after the first and after the last round (MB; one pair per repeat):',
        '',
        '| model | ours | tff.learning |',
        '|---|---|---|',
    ]
    for model in result['summary']:
        pairs = {
            side: ', '.join(
                f'{r["worker_rss_mb_by_round"][0]:.0f} -> {r["worker_rss_mb_by_round"][-1]:.0f}'
                for r in result['records']
                if r['model'] == model and r['side'] == side
            )
            for side in SIDES
        }
        lines.append(f'| `{model}` | {pairs["ours"]} | {pairs["tff_learning"]} |')
    lines += [
        '',
        "s/round: the median over all timed rounds of all repeats; each repeat's median is in the .json.",
        'Accuracy: the global model after the last round (warm-up and timed), the mean over the 10 clients of',
        "its accuracy on each client's test split (1,200 examples), one value per repeat; both sides start",
        'from the same weights (`model_weights.initial_weights`, seed 0) on the same examples, with',
        'different batch orders and kernels, so they agree closely but not exactly. Peak RSS: the largest',
        'over the repeats, of the measuring process (the driver, data and models included) and of its TFF',
        'worker (VmHWM).',
        '',
        'What is timed: `next` alone, ours `process.next(state, client_states)` (each client reads its',
        "training split inside the worker), tff.learning's `process.next(state, client_datasets)`. The",
        'tff.learning clients are `tf.data.Dataset`s built once before the timed rounds, as a user builds',
        "them (`from_tensor_slices` of the client's training arrays, a shuffle over the whole split,",
        "`batch(32)`), and passed into every call. Both sides run on the project's local runtime",
        "(`runtime.local_runtime()`: TFF's `worker_binary`, `max_concurrent_computation_calls=2`), with",
        'SGD from `tff.learning.optimizers.build_sgdm` on the server (learning rate 1.0); clients: ours',
        'plain SGD at 0.1, tff.learning `build_sgdm(0.1)`.',
        '',
    ]
    return '\n'.join(lines)


def _measure_all(data_dir: str, workdir: str) -> list:
    """Writes the client data, then every measurement, alternating the sides; returns their records."""
    write_data(_FASHION_MNIST.value, data_dir)
    records = []
    for repeat in range(_REPEATS.value):
        for model in _MODELS.value:
            for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                record = _run_child(side, model, data_dir, workdir, f'{repeat}_{model}_{side}')
                record['repeat'] = repeat
                records.append(record)
                print(
                    f'repeat {repeat} {model} {side}: median {record["median_seconds_per_round"]:.3f} s/round over '
                    f'{len(record["round_seconds"])} rounds, accuracy {record["final_mean_test_accuracy"]:.4f}, '
                    f'peak RSS driver {record["driver_peak_rss_mb"]:.0f} MB / worker '
                    f'{record["worker_peak_rss_mb"]:.0f} MB',
                    flush=True,
                )
    return records


def main(argv):
    del argv
    runtime.refuse_implicit_runtime()  # nothing here may start TFF's own (never reaped) worker
    if _SIDE.value is not None:
        _child_main()
        return
    # A SIGTERM becomes SystemExit, so that subprocess.run ends the running child (its worker follows it).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    unknown = [m for m in _MODELS.value if m not in ('mnist_dnn', 'fedavg_cnn')]
    if unknown:
        sys.exit(f'tff_learning_fedavg: --models takes mnist_dnn and fedavg_cnn, got {",".join(unknown)}')
    load_start = os.getloadavg()[0]
    workdir = tempfile.mkdtemp(prefix='tff_learning_fedavg.')
    data_dir = os.path.join(workdir, 'data')
    keep_logs = False
    try:
        records = _measure_all(data_dir, workdir)
    except ChildFailed as e:
        keep_logs = True  # the failed child's log, which the line names
        sys.exit(str(e))
    finally:
        shutil.rmtree(data_dir if keep_logs else workdir, ignore_errors=True)
    result = {
        'workload': (
            f'{NUM_CLIENTS} clients x {TRAIN_PER_CLIENT} Fashion-MNIST training examples (28x28x1, iid), '
            f'batch {BATCH}, 1 local epoch, client learning rate {CLIENT_LR}, server learning rate {SERVER_LR}'
        ),
        'machine': f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores',
        'load_average_1min_start_end': [load_start, os.getloadavg()[0]],
        'command': _command(),
        'repeats': _REPEATS.value,
        'warmup_rounds': _WARMUP.value,
        'rounds_timed': {m: _rounds_for(m) for m in _MODELS.value},
        'summary': _summary(records),
        'records': records,
    }
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(result, f, indent=1)
    text = _markdown(result)
    with open(_OUT.value + '.md', 'w') as f:
        f.write(text)
    print(text)


if __name__ == '__main__':
    app.run(main)
