"""Resident memory of the driver and of the TFF worker over 100 rounds of a full training run.

Runs `tff-pfl-train`'s code (`experiment.run_experiment`, checkpoints every 10
rounds, evaluation of every client every 10 rounds) on MNIST DS-1 with 10
clients, and records the resident set size of the driver process and of its
`worker_binary` child after every 10th round.

    uv run python benchmarks/memory_rounds.py --rounds=100
"""

import json
import os
import re
import tempfile

import psutil
from absl import app, flags

from tff_pfl.program import experiment, run_config

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_ROUNDS = flags.DEFINE_integer('rounds', 100, 'Rounds per algorithm.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/memory_rounds', 'Result path prefix (.json, .md).')

JOBS = {
    'fedavg': {},
    'persfl': dict(temperatures=(1.0, 5.0), imitations=(0.0, 0.5), distill_epochs=1),
}


def _rss_mb():
    me = psutil.Process()
    workers = [c for c in me.children(recursive=True) if 'worker_binary' in ' '.join(c.cmdline())]
    worker = sum(w.memory_info().rss for w in workers) / 2**20 if workers else float('nan')
    return me.memory_info().rss / 2**20, worker


def main(argv):
    del argv
    results = {}
    for algorithm, extra in JOBS.items():
        samples = []

        def log(line, samples=samples, algorithm=algorithm):
            match = re.match(r'round (\d+)/', line)
            if match and int(match.group(1)) % 10 == 0:
                driver, worker = _rss_mb()
                samples.append(
                    {'round': int(match.group(1)), 'driver_mb': round(driver, 1), 'worker_mb': round(worker, 1)}
                )
                print(f'{algorithm} {line.split("  ")[0]}: driver {driver:.0f} MB, worker {worker:.0f} MB', flush=True)

        with tempfile.TemporaryDirectory() as tmp:
            config = run_config.make_config(
                output_dir=os.path.join(tmp, algorithm),
                algorithm=algorithm,
                dataset=f'npz:{_MNIST.value}',
                partition='ds1',
                classes_per_client=4,
                num_clients=10,
                model='mnist_dnn',
                split_fractions=(0.6, 0.2, 0.2),
                batch_size=32,
                client_learning_rate=0.05,
                rounds=_ROUNDS.value,
                eval_every=10,
                checkpoint_every=10,
                **extra,
            )
            experiment.run_experiment(config, log=log)
        results[algorithm] = samples
    with open(_OUT.value + '.json', 'w') as f:
        json.dump({'rounds': _ROUNDS.value, 'samples': results}, f, indent=2)
    lines = [
        '# Resident memory over rounds (MB)',
        '',
        f"`uv run python benchmarks/memory_rounds.py --rounds={_ROUNDS.value}`: the training binary's code, MNIST "
        'DS-1, 10 clients, MLP 784-100-10; a checkpoint and an evaluation of every client every 10 rounds. '
        'Resident set size after every 10th round, of the driver and of its TFF worker.',
        '',
        '| round | ' + ' | '.join(f'{a} driver | {a} worker' for a in results) + ' |',
        '|---|' + '---|---|' * len(results),
    ]
    for i, sample in enumerate(next(iter(results.values()))):
        cells = []
        for samples in results.values():
            cells += [f'{samples[i]["driver_mb"]:.0f}', f'{samples[i]["worker_mb"]:.0f}']
        lines.append(f'| {sample["round"]} | ' + ' | '.join(cells) + ' |')
    lines.append('')
    for algorithm, samples in results.items():
        first, last = samples[1] if len(samples) > 1 else samples[0], samples[-1]
        lines.append(
            f'- {algorithm}: from round {first["round"]} to round {last["round"]}, the driver grew by '
            f'{last["driver_mb"] - first["driver_mb"]:+.0f} MB and the worker by '
            f'{last["worker_mb"] - first["worker_mb"]:+.0f} MB.'
        )
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
