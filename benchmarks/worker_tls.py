"""Seconds per round on a TFF worker over plain gRPC and on the same worker behind its nginx mTLS front.

Runs the same FedAvg job, through the project's training code
(`experiment.run_experiment`), two ways on one `worker_binary` started here:

* plain: `--workers=localhost:P`, plain gRPC to the worker's port;
* mTLS: `--workers=localhost:T --worker_tls_ca/cert/key`, mutual TLS to nginx
  (deploy/tls/nginx-worker.conf, certificates from deploy/tls/make-certs.sh),
  which passes the calls to the same worker on loopback.

The ways alternate within each repeat, in one process, so machine noise hits
them alike. It reports the median seconds per round of each way (rounds 2..,
from metrics.csv), their ratio, and the largest relative difference between
the two ways' metrics.csv and clients.csv (timing columns aside).

    uv run --locked python benchmarks/worker_tls.py --repeats=3
"""

import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile

import portpicker
import run_csvs
from absl import app, flags

from tff_pfl import runtime
from tff_pfl.program import experiment, run_config

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Runs of each way.')
_ROUNDS = flags.DEFINE_integer('rounds', 20, 'FedAvg rounds per run.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/worker_tls', 'Result path prefix (.json, .md).')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(out, workers, tls):
    """FedAvg on MNIST DS-1 with 10 clients, as benchmarks/workers_mnist.py runs it."""
    return run_config.ExperimentConfig.from_dict(
        dict(
            output_dir=out,
            algorithm='fedavg',
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
            rounds=_ROUNDS.value,
            **tls,
        )
    )


def _start_front(directory, worker_port):
    """nginx from deploy/tls/nginx-worker.conf in `directory`; returns (process, port, driver's TLS settings)."""
    certs = os.path.join(directory, 'certs')
    subprocess.run(
        [os.path.join(REPO, 'deploy', 'tls', 'make-certs.sh'), certs, 'localhost,127.0.0.1'],
        check=True,
        capture_output=True,
    )
    front = os.path.join(directory, 'front')
    shutil.copytree(os.path.join(certs, 'localhost'), os.path.join(front, 'tls'))
    tls_port = portpicker.pick_unused_port()
    with open(os.path.join(REPO, 'deploy', 'tls', 'nginx-worker.conf')) as f:
        conf = f.read().replace('@TLS_PORT@', str(tls_port)).replace('@WORKER_PORT@', str(worker_port))
    with open(os.path.join(front, 'nginx.conf'), 'w') as f:
        f.write(conf)
    nginx = subprocess.Popen(
        [shutil.which('nginx') or '/usr/sbin/nginx', '-p', front + '/', '-c', os.path.join(front, 'nginx.conf')]
        + ['-e', 'stderr'],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tls = dict(
        worker_tls_ca=os.path.join(certs, 'ca.pem'),
        worker_tls_cert=os.path.join(certs, 'driver.pem'),
        worker_tls_key=os.path.join(certs, 'driver.key'),
    )
    return nginx, tls_port, tls


def main(argv):
    del argv
    worker_port = portpicker.pick_unused_port()
    worker = subprocess.Popen(
        runtime._worker_command(worker_port, 2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    nginx = None
    seconds = {'plain': [], 'mTLS': []}
    reference, difference = None, {'metrics.csv': 0.0, 'clients.csv': 0.0}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            nginx, tls_port, tls = _start_front(tmp, worker_port)
            ways = {
                'plain': ((f'localhost:{worker_port}',), {}),
                'mTLS': ((f'localhost:{tls_port}',), tls),
            }
            runtime.check_worker(ways['plain'][0][0], timeout=60)
            runtime.check_worker(ways['mTLS'][0][0], timeout=60, tls=runtime.TlsCredentials.from_files(*tls.values()))
            for repeat in range(_REPEATS.value):
                # Alternate which way goes first, so neither always follows the other.
                order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
                for way in order:
                    workers, way_tls = ways[way]
                    out = os.path.join(tmp, f'{way}-{repeat}')
                    experiment.run_experiment(_config(out, workers, way_tls), log=lambda line: None)
                    rounds = run_csvs.round_seconds(out)
                    seconds[way].extend(rounds[1:])  # round 1 includes tracing and warm-up
                    files = run_csvs.run_files(out)
                    if reference is None:
                        reference = files
                    for name, rows, ref in zip(('metrics.csv', 'clients.csv'), files, reference):
                        difference[name] = max(difference[name], run_csvs.max_relative_difference(rows, ref))
                    print(f'{way} repeat {repeat}: median {statistics.median(rounds[1:]):.3f} s/round', flush=True)
    finally:
        for process in (nginx, worker):
            if process is not None:
                runtime.end_process(process)
    median = {way: statistics.median(s) for way, s in seconds.items()}
    record = {
        'machine': {'cpus': os.cpu_count(), 'python': platform.python_version()},
        'nginx': subprocess.run(
            [shutil.which('nginx') or '/usr/sbin/nginx', '-v'], capture_output=True, text=True
        ).stderr.strip(),
        'repeats': _REPEATS.value,
        'rounds': _ROUNDS.value,
        'median_seconds_per_round': median,
        'tls_over_plain': median['mTLS'] / median['plain'],
        'seconds_per_round': seconds,
        'max_relative_difference': difference,
        'final_test_accuracy_mean': {
            k: float(v) for k, v in reference[0][-1].items() if k.startswith('test_') and k.endswith('_accuracy_mean')
        },
    }
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(record, f, indent=2)
    lines = [
        '# Seconds per round: a TFF worker over plain gRPC, and the same worker behind its nginx mTLS front',
        '',
        f'`uv run --locked python benchmarks/worker_tls.py --repeats={_REPEATS.value}`: FedAvg, MNIST DS-1, 10 '
        f'clients, MLP 784-100-10, batch 32, one local epoch, {_ROUNDS.value} rounds; one worker_binary, and nginx '
        f'({record["nginx"]}, deploy/tls/nginx-worker.conf) in front of it, all on loopback on one machine with '
        f'{os.cpu_count()} CPU cores. The two ways alternate within one process. Median over rounds 2.. of every '
        'repeat (round 1 includes tracing).',
        '',
        '| way | s/round (median) | rounds measured |',
        '|---|---|---|',
        *(f'| {way} | {median[way]:.3f} | {len(seconds[way])} |' for way in seconds),
        '',
        f'mTLS / plain: **{record["tls_over_plain"]:.2f}**.',
        '',
        'Largest relative difference between any run and the first (plain) run: '
        f'metrics.csv {difference["metrics.csv"]:.1e}, clients.csv {difference["clients.csv"]:.1e} '
        '(0: every cell identical, timing columns aside).',
        '',
        'What the front adds to a round: TLS on every call between driver and front, and one more hop (nginx) '
        "to the worker over loopback; the round's computation is the same worker's. On loopback the network "
        "costs nothing, so the ratio is the front's whole cost; between machines the network adds to both ways.",
    ]
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
