"""Seconds per round on the local runtime, on one TFF worker and on two, and that the results agree.

Runs the same training job three ways, through the project's training
binary code (`experiment.run_experiment`):

* local: the worker the driver starts and owns (client states in the driver);
* one worker: `--workers=localhost:P1`, a worker_binary started here;
* two workers: `--workers=localhost:P1,localhost:P2`, TFF's mergeable context
  splitting each round's clients over both (client states kept by the devices
  in `client_states/`).

For each algorithm it compares every number of metrics.csv and clients.csv
(timing columns aside) with the local run's and reports the largest relative
difference, and the median seconds per round of each way, from metrics.csv.
The three ways alternate within a repeat, in one process, so machine noise
hits them alike.

    uv run python benchmarks/workers_mnist.py --repeats=2
"""

import json
import os
import platform
import statistics
import subprocess
import tempfile

import portpicker
import run_csvs
from absl import app, flags

from tff_pfl import runtime
from tff_pfl.program import experiment, run_config

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Runs of each way per algorithm.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/workers_mnist', 'Result path prefix (.json, .md).')

JOBS = {
    # MNIST DS-1 (4 classes per client), 10 clients, the PersFL suite's settings.
    'fedavg': dict(rounds=20),
    'persfl': dict(rounds=10, temperatures=(1.0, 5.0), imitations=(0.0, 0.5), distill_epochs=2),
    # Two phases per round on several workers (share, then distill); R, eta_2, eta_3 and rho as
    # the command line's defaults were before the settings redesign.
    'ktpfl_homo': dict(
        rounds=10,
        kt_transfer_steps=5,
        kt_transfer_learning_rate=0.01,
        kt_coefficient_learning_rate=0.1,
        kt_rho=0.7,
    ),
}


def _config(out, algorithm, workers):
    """The run's configuration in its flat form: common and algorithm settings side by side."""
    return run_config.ExperimentConfig.from_dict(
        dict(
            output_dir=out,
            algorithm=algorithm,
            dataset=f'npz:{_MNIST.value}',
            partition='ds1',
            classes_per_client=4,
            num_clients=10,
            model='mnist_dnn',
            split_fractions=(0.6, 0.2, 0.2),
            eval_every=5,
            workers=workers,
            local_epochs=1,
            batch_size=32,
            client_learning_rate=0.05,
            **JOBS[algorithm],
        )
    )


def main(argv):
    del argv
    ports = [portpicker.pick_unused_port() for _ in range(2)]
    workers = [
        subprocess.Popen(runtime._worker_command(port, 2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for port in ports
    ]
    addresses = tuple(f'localhost:{port}' for port in ports)
    ways = {'local': (), 'one worker': addresses[:1], 'two workers': addresses}
    results = {}
    try:
        for address in addresses:
            runtime.check_worker(address, timeout=60)
        with tempfile.TemporaryDirectory() as tmp:
            for algorithm in JOBS:
                seconds = {way: [] for way in ways}
                reference = None
                differences = {way: {'metrics.csv': 0.0, 'clients.csv': 0.0} for way in ways}
                for repeat in range(_REPEATS.value):
                    for way, way_workers in ways.items():
                        out = os.path.join(tmp, f'{algorithm}-{way.replace(" ", "_")}-{repeat}')
                        experiment.run_experiment(_config(out, algorithm, way_workers), log=lambda line: None)
                        rounds = run_csvs.round_seconds(out)
                        seconds[way].extend(rounds[1:])  # round 1 includes tracing and warm-up
                        files = run_csvs.run_files(out)
                        if reference is None:
                            reference = files
                        for name, rows, ref in zip(('metrics.csv', 'clients.csv'), files, reference):
                            difference = run_csvs.max_relative_difference(rows, ref)
                            differences[way][name] = max(differences[way][name], difference)
                        print(
                            f'{algorithm} {way} repeat {repeat}: median {statistics.median(rounds[1:]):.3f} s/round',
                            flush=True,
                        )
                final = reference[0][-1]
                results[algorithm] = {
                    'rounds': JOBS[algorithm]['rounds'],
                    'max_relative_difference_to_local': differences,
                    'final_test_accuracy_mean': {
                        k: float(v) for k, v in final.items() if k.startswith('test_') and k.endswith('_accuracy_mean')
                    },
                    'median_seconds_per_round': {way: statistics.median(s) for way, s in seconds.items()},
                }
    finally:
        for worker in workers:
            runtime.end_process(worker)
    record = {
        'machine': {'cpus': os.cpu_count(), 'python': platform.python_version()},
        'repeats': _REPEATS.value,
        'results': results,
    }
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(record, f, indent=2)
    lines = [
        '# Seconds per round: local runtime, one TFF worker, two TFF workers',
        '',
        f'`uv run python benchmarks/workers_mnist.py --repeats={_REPEATS.value}`: MNIST DS-1, 10 clients, '
        f'MLP 784-100-10, batch 32, one local epoch; {os.cpu_count()} CPU cores, all workers on loopback. '
        'Median over rounds 2.. of every repeat (round 1 includes tracing).',
        '',
        '| algorithm | rounds | s/round local | one worker | two workers | two / local | '
        'largest relative difference to local, metrics.csv / clients.csv: one worker | two workers |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for algorithm, r in results.items():
        s = r['median_seconds_per_round']
        d = r['max_relative_difference_to_local']
        lines.append(
            f'| {algorithm} | {r["rounds"]} | {s["local"]:.3f} | {s["one worker"]:.3f} | '
            f'{s["two workers"]:.3f} | {s["two workers"] / s["local"]:.2f} | '
            f'{d["one worker"]["metrics.csv"]:.1e} / {d["one worker"]["clients.csv"]:.1e} | '
            f'{d["two workers"]["metrics.csv"]:.1e} / {d["two workers"]["clients.csv"]:.1e} |'
        )
    lines += [
        '',
        "CSV cells have 6 significant digits; 0 means every cell is identical. With two workers the server's "
        'sums add two partial sums (one per worker) where the local runtime adds the clients one after the other, '
        'so float32 results can differ in the last bits and, over rounds, reach the 6th digit of a cell.',
    ]
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
