"""Rounds on one TFF worker vs two, each worker pinned to a core of its own: the speed-up.

The same FedAvg job (Fashion-MNIST, iid, 10 clients, one local epoch, batch
32) runs through the training binary's code (`experiment.run_experiment`)
three ways:

* local: the worker the driver starts and owns, unpinned (both cores);
* one worker: `--workers=localhost:P0`, a `worker_binary` started here under
  `taskset -c 0` with `--max_concurrent_computation_calls=1`;
* two workers: `--workers=localhost:P0,localhost:P1`, the same worker and a
  second one under `taskset -c 1`: TFF's mergeable context gives each worker
  half of the round's clients.

The driver is not pinned. The ways alternate within each repeat, so machine
noise hits them alike. The numbers are compared with a reference run before
the repeats: the local runtime with its worker on core 0 alone, so that every
client trains with one thread, as on a one-core worker (TensorFlow's
convolutions add in another order with two threads). Per round it also reads, from the driver's side:

* each worker's CPU seconds (`/proc` through psutil): its busy time, the
  clients' work;
* the bytes on each worker's TCP connections (`ss -tin`, bytes_acked and
  bytes_received on the driver's sockets): what the worker received and sent.

From these: the per-client cost, the driver's part of a round (round seconds
minus the busiest worker's CPU seconds: serialization, the merge and the
server step, and the driver's own Python), and the inputs of the round-time
model of docs/runtime.md ("Several machines: a model of the round time").

    uv run python benchmarks/workers_scaling.py --repeats=2
"""

import csv
import json
import math
import os
import platform
import re
import statistics
import subprocess
import tempfile

import portpicker
import psutil
import run_csvs
from absl import app, flags

from tff_pfl import runtime
from tff_pfl.program import experiment, run_config

_DATA = flags.DEFINE_string('data', '../shared/data/fashion_mnist.npz', 'Keras-layout Fashion-MNIST file.')
_MODELS = flags.DEFINE_list('models', ['fedavg_cnn', 'mnist_dnn'], 'Models to time.')
_CLIENTS = flags.DEFINE_integer('clients', 10, 'Clients, all of them in every round.')
_EXAMPLES = flags.DEFINE_integer('examples_per_client', 2000, 'Examples per client (60 % train).')
_ROUNDS = flags.DEFINE_integer('rounds', 8, 'Rounds per run; the first two (tracing, warm-up) are not timed.')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Runs of each way per model.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/workers_scaling', 'Result path prefix (.json, .md).')

WAYS = ('local', 'one worker', 'two workers')


def _config(out, model, workers):
    return run_config.ExperimentConfig.from_dict(
        dict(
            output_dir=out,
            algorithm='fedavg',
            dataset=f'npz:{_DATA.value}',
            partition='iid',
            examples_per_client=_EXAMPLES.value,
            num_clients=_CLIENTS.value,
            model=model,
            split_fractions=(0.6, 0.2, 0.2),
            rounds=_ROUNDS.value,
            eval_every=_ROUNDS.value,
            workers=workers,
            local_epochs=1,
            batch_size=32,
            client_learning_rate=0.05,
        )
    )


def _connection_bytes(port):
    """(bytes the driver's sockets to `port` had acked, and received): what the worker got and sent."""
    out = subprocess.run(
        ['ss', '-tinH', 'state', 'established', f'( dport = :{port} )'], capture_output=True, text=True, check=True
    ).stdout
    acked = sum(int(v) for v in re.findall(r'bytes_acked:(\d+)', out))
    received = sum(int(v) for v in re.findall(r'bytes_received:(\d+)', out))
    return acked, received


def _cpu_seconds(process):
    times = psutil.Process(process.pid).cpu_times()
    return times.user + times.system


class _Sampler:
    """Reads the workers' CPU seconds and connection bytes after every round (the run's log callback)."""

    def __init__(self, workers):
        self.workers = workers  # (port, process)
        self.samples = []

    def __call__(self, line):
        if not line.startswith('round '):
            return
        self.samples.append([(_cpu_seconds(process), *_connection_bytes(port)) for port, process in self.workers])

    def per_round(self):
        """Per round from the second on, per worker: (CPU seconds, bytes in, bytes out)."""
        rounds = []
        for before, after in zip(self.samples, self.samples[1:]):
            rounds.append([tuple(a - b for a, b in zip(w1, w0)) for w0, w1 in zip(before, after)])
        return rounds


def _start_worker(core):
    port = portpicker.pick_unused_port()
    command = ['taskset', '-c', str(core)] + runtime._worker_command(port, 1)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return port, process


_RENDER = flags.DEFINE_bool('render_only', False, 'Rewrite the .md from the committed .json, running nothing.')


def main(argv):
    del argv
    if _RENDER.value:
        with open(_OUT.value + '.json') as f:
            _write_markdown(json.load(f))
        return
    workers = [_start_worker(core) for core in (0, 1)]
    addresses = tuple(f'localhost:{port}' for port, _ in workers)
    ways = {'local': ((), []), 'one worker': (addresses[:1], workers[:1]), 'two workers': (addresses, workers)}
    results = {}
    try:
        for address in addresses:
            runtime.check_worker(address, timeout=60)
        with tempfile.TemporaryDirectory() as tmp:
            for model in _MODELS.value:
                seconds = {way: [] for way in WAYS}
                worker_rounds = {way: [] for way in WAYS}
                difference = {way: 0.0 for way in WAYS}
                # The numbers' reference: the local runtime with its worker on core 0 alone, the
                # threads every client of a pinned worker runs with (see the module docstring).
                out = os.path.join(tmp, f'{model}-reference')
                everywhere = os.sched_getaffinity(0)
                os.sched_setaffinity(0, {0})  # the local worker started now inherits it
                try:
                    experiment.run_experiment(_config(out, model, ()), log=lambda line: None)
                finally:
                    os.sched_setaffinity(0, everywhere)
                reference = sum(run_csvs.run_files(out), [])
                for repeat in range(_REPEATS.value):
                    order = WAYS if repeat % 2 == 0 else tuple(reversed(WAYS))
                    for way in order:
                        way_addresses, way_workers = ways[way]
                        out = os.path.join(tmp, f'{model}-{way.replace(" ", "_")}-{repeat}')
                        sampler = _Sampler(way_workers)
                        experiment.run_experiment(_config(out, model, way_addresses), log=sampler)
                        with open(os.path.join(out, 'metrics.csv'), newline='') as f:
                            rounds = [float(row['round_seconds']) for row in csv.DictReader(f)]
                        # Evaluation runs after the last round and is sampled with it: drop that round.
                        seconds[way].extend(rounds[2:-1])
                        worker_rounds[way].extend(sampler.per_round()[1:-1])
                        files = sum(run_csvs.run_files(out), [])
                        difference[way] = max(difference[way], run_csvs.max_relative_difference(files, reference))
                        median = statistics.median(rounds[2:-1])
                        print(f'{model} {way} repeat {repeat}: {median:.3f} s/round', flush=True)
                local_rows = reference
                result = {
                    'median_seconds_per_round': {way: statistics.median(s) for way, s in seconds.items()},
                    'max_relative_difference_to_local_on_one_core': difference,
                    'final_test_accuracy_mean': float(
                        [r for r in local_rows if r.get('test_global_model_accuracy_mean')][-1][
                            'test_global_model_accuracy_mean'
                        ]
                    ),
                }
                for way in ('one worker', 'two workers'):
                    per_worker = list(zip(*worker_rounds[way]))  # worker -> rounds of (cpu, in, out)
                    result[way] = {
                        'worker_cpu_seconds_per_round': [statistics.median(r[0] for r in w) for w in per_worker],
                        'worker_bytes_in_per_round': [statistics.median(r[1] for r in w) for w in per_worker],
                        'worker_bytes_out_per_round': [statistics.median(r[2] for r in w) for w in per_worker],
                    }
                    busiest = max(result[way]['worker_cpu_seconds_per_round'])
                    result[way]['driver_seconds_per_round'] = result['median_seconds_per_round'][way] - busiest
                one = result['median_seconds_per_round']['one worker']
                result['speed_up_two_over_one'] = one / result['median_seconds_per_round']['two workers']
                result['client_cpu_seconds'] = result['one worker']['worker_cpu_seconds_per_round'][0] / _CLIENTS.value
                results[model] = result
    finally:
        for _, process in workers:
            runtime.end_process(process)
    record = {
        'machine': {'cpus': os.cpu_count(), 'processor': platform.processor(), 'python': platform.python_version()},
        'workload': {
            'data': os.path.basename(_DATA.value),
            'clients': _CLIENTS.value,
            'train_examples_per_client': int(_EXAMPLES.value * 0.6),
            'batch_size': 32,
            'local_epochs': 1,
            'rounds': _ROUNDS.value,
        },
        'repeats': _REPEATS.value,
        'results': results,
    }
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(record, f, indent=2)
    _write_markdown(record)


def model_parameters(result, clients):
    """The round-time model's inputs, from one model's measurements (see `predicted_seconds`).

    Args:
      result: one model's entry of the record's `results`.
      clients: clients per round of the measurement.

    Returns:
      dict: `client_seconds` (one client's work on one core), `driver_seconds` (the round's part
      outside the clients' work, one worker), `split_seconds` (what the second worker added: the
      measured two-worker round minus the one-worker driver part and the busier worker's
      clients), `bytes_one` (bytes in + out of the one worker per round), `bytes_share` (in + out
      of the worker that only ran its share, of two) and `bytes_surplus` (what the other one
      carried on top of its share: the merge of the partial sums and the step after it).
    """
    one, two = result['one worker'], result['two workers']
    client = one['worker_cpu_seconds_per_round'][0] / clients
    driver = one['driver_seconds_per_round']
    split = result['median_seconds_per_round']['two workers'] - driver - math.ceil(clients / 2) * client
    per_worker = [i + o for i, o in zip(two['worker_bytes_in_per_round'], two['worker_bytes_out_per_round'])]
    return {
        'client_seconds': client,
        'driver_seconds': driver,
        'split_seconds': split,
        'bytes_one': one['worker_bytes_in_per_round'][0] + one['worker_bytes_out_per_round'][0],
        'bytes_share': min(per_worker),
        'bytes_surplus': sum(per_worker) - 2 * min(per_worker),
    }


def predicted_seconds(parameters, clients, workers, gigabits_per_second=None, split=True):
    """Seconds per round on `workers` one-core workers, with the driver's link at `gigabits_per_second`.

    T(W) = driver + (W - 1) x split + ceil(N / W) x client + bytes(W) x 8 / bandwidth, with
    bytes(1) the one worker's and bytes(W) = W x share + (W - 1) x surplus: every byte crosses
    the driver's link, one after another. TFF merges the W partial sums pairwise as workers
    finish (W - 1 merges) and runs the step after the merge once, so charging split and surplus
    W - 1 times overestimates a little. Workers beyond N get no clients (TFF's mergeable context
    makes at most N shares).

    Args:
      parameters: `model_parameters`' result.
      clients: N, clients per round.
      workers: W.
      gigabits_per_second: the driver's link; None: no transfer time (loopback).
      split: False leaves out the split's own cost (the model from one worker alone).

    Returns:
      Seconds per round.
    """
    w = min(workers, clients)
    seconds = parameters['driver_seconds'] + math.ceil(clients / w) * parameters['client_seconds']
    if split:
        seconds += (w - 1) * parameters['split_seconds']
    if gigabits_per_second is not None:
        sent = (
            parameters['bytes_one'] if w == 1 else w * parameters['bytes_share'] + (w - 1) * parameters['bytes_surplus']
        )
        seconds += sent * 8 / (gigabits_per_second * 1e9)
    return seconds


def _write_markdown(record):
    w = record['workload']
    lines = [
        '# Rounds split over TFF workers pinned to cores of their own',
        '',
        f'`uv run python benchmarks/workers_scaling.py --models={",".join(record["results"])} '
        f'--clients={w["clients"]} --repeats={record["repeats"]}`: FedAvg on '
        f'{w["data"]}, iid, {w["clients"]} clients x {w["train_examples_per_client"]} training examples, batch '
        f'{w["batch_size"]}, one local epoch, every client in every round; {record["machine"]["cpus"]} cores. '
        'Workers: `taskset -c 0` and `taskset -c 1`, `--max_concurrent_computation_calls=1`; the driver unpinned; '
        'local: the driver-owned worker on both cores. Median over rounds 3 to '
        f'{w["rounds"] - 1} of every repeat (rounds 1 and 2 warm up; the last one also evaluates).',
        '',
        '| model | s/round local (2 cores) | one worker (core 0) | two workers (cores 0, 1) | speed-up two / one | '
        'largest relative difference to local on one core: local (2 cores) | one worker | two workers |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for model, r in record['results'].items():
        s, d = r['median_seconds_per_round'], r['max_relative_difference_to_local_on_one_core']
        lines.append(
            f'| {model} | {s["local"]:.3f} | {s["one worker"]:.3f} | {s["two workers"]:.3f} | '
            f'{r["speed_up_two_over_one"]:.2f}x | {d["local"]:.1e} | {d["one worker"]:.1e} | {d["two workers"]:.1e} |'
        )
    lines += [
        '',
        '## Where a round goes (per round, medians)',
        '',
        '| model | way | worker CPU s (each) | driver part s | worker received MB (each) | worker sent MB (each) |',
        '|---|---|---|---|---|---|',
    ]
    for model, r in record['results'].items():
        for way in ('one worker', 'two workers'):
            x = r[way]
            lines.append(
                f'| {model} | {way} | {" / ".join(f"{v:.3f}" for v in x["worker_cpu_seconds_per_round"])} | '
                f'{x["driver_seconds_per_round"]:.3f} | '
                f'{" / ".join(f"{v / 1e6:.2f}" for v in x["worker_bytes_in_per_round"])} | '
                f'{" / ".join(f"{v / 1e6:.2f}" for v in x["worker_bytes_out_per_round"])} |'
            )
    lines += [
        '',
        "Driver part: the round seconds minus the busiest worker's CPU seconds: what the round spends outside the "
        "clients' work (the driver's Python and serialization, the merge of the workers' partial sums and the server "
        "step, which run on one worker after the other has finished). Bytes: on the driver's TCP connections to each "
        'worker (`ss -tin`). CSV cells have 6 significant digits; 0 means every cell of metrics.csv and clients.csv is '
        'identical to the reference: the local runtime with its worker on core 0 alone (the driver pinned there '
        "when it starts the worker). A client's training gives the same bits on one core wherever it runs, but "
        "TensorFlow's convolutions (oneDNN) sum in another order with two threads than with one, so the local "
        'runtime on both cores differs from it, and that difference grows over rounds. With two workers the '
        "server's sums add one partial sum per worker, where one worker adds the clients one after the other, so "
        'float32 results can differ in the last bits.',
    ]
    lines += _model_lines(record)
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


def _model_lines(record):
    clients = record['workload']['clients']
    lines = [
        '',
        '## The round-time model, checked and extrapolated',
        '',
        'T(W) = driver + (W - 1) x split + ceil(N / W) x client + bytes(W) x 8 / bandwidth '
        '(`predicted_seconds`; docs/runtime.md "Several machines"). From the one-worker run alone (split = 0, '
        "loopback) it predicts the two-worker round below; the difference is the split's own cost (the merge, "
        "the step after it, the device form's state files), charged once per further worker in the table.",
        '',
        '| model | client s (1 core) | driver s | split s | MB per round: one worker | a share | surplus | '
        'two workers predicted from one (no split cost) | measured |',
        '|---|---|---|---|---|---|---|---|---|',
    ]
    table = []
    for model, result in record['results'].items():
        p = model_parameters(result, clients)
        lines.append(
            f'| {model} | {p["client_seconds"]:.3f} | {p["driver_seconds"]:.3f} | {p["split_seconds"]:.3f} | '
            f'{p["bytes_one"] / 1e6:.2f} | {p["bytes_share"] / 1e6:.2f} | {p["bytes_surplus"] / 1e6:.2f} | '
            f'{predicted_seconds(p, clients, 2, split=False):.3f} | '
            f'{result["median_seconds_per_round"]["two workers"]:.3f} |'
        )
        for n in (clients, 100):
            for gbps in (1, 10):
                t1 = predicted_seconds(p, n, 1, gbps)
                row = [predicted_seconds(p, n, w, gbps) for w in (1, 2, 4, 16)]
                table.append(
                    f'| {model} | {n} | {gbps} Gb/s | ' + ' | '.join(f'{t:.2f} ({t1 / t:.1f}x)' for t in row) + ' |'
                )
    lines += [
        '',
        'Predicted seconds per round (speed-up over one worker) on W one-core workers on other machines, '
        "the driver's link at the given bandwidth:",
        '',
        '| model | clients per round | link | W = 1 | W = 2 | W = 4 | W = 16 |',
        '|---|---|---|---|---|---|---|',
        *table,
    ]
    return lines


if __name__ == '__main__':
    app.run(main)
