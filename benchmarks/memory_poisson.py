"""TFF worker memory over rounds when every round has its own number of clients (Poisson sampling).

User-level DP samples each client independently (`--client_fraction` q < 1 with
`--dp_noise_multiplier`), so the number of clients changes from round to round,
and TFF keeps one executor per number of clients on the worker. Two sides, one
after the other in this process, each a fresh worker: the runtime's
`ClosingExecutorFactory` (closes the executors it evicts) and TFF's own
`ResourceManagingExecutorFactory` (drops them without closing). FedAvg with DP
(fixed clip 1, noise multiplier 1) on Fashion-MNIST, 1,000 clients of 60
examples (Dirichlet 0.5), q = 0.1, the MLP 784-100-10, no evaluation until the
end; resident set size of the worker after every 10th round.

    uv run python benchmarks/memory_poisson.py --rounds=100
"""

import json
import os
import re
import tempfile

import psutil
import tensorflow_federated as tff
from absl import app, flags

from tff_pfl import runtime
from tff_pfl.program import experiment, run_config

_DATA = flags.DEFINE_string('data', '../shared/data/fashion_mnist.npz', 'Keras-layout Fashion-MNIST file.')
_ROUNDS = flags.DEFINE_integer('rounds', 100, 'Rounds per side.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/memory_poisson', 'Result path prefix (.json, .md).')

SIDES = {
    "the runtime's ClosingExecutorFactory": runtime.ClosingExecutorFactory,
    "TFF's ResourceManagingExecutorFactory": lambda executor_fn: tff.framework.ResourceManagingExecutorFactory(
        executor_fn
    ),
}


def _worker_mb():
    workers = [c for c in psutil.Process().children(recursive=True) if 'worker_binary' in ' '.join(c.cmdline())]
    return sum(w.memory_info().rss for w in workers) / 2**20 if workers else float('nan')


def main(argv):
    del argv
    results = {}
    for side, factory in SIDES.items():
        samples = []

        def log(line, samples=samples, side=side):
            match = re.match(r'round (\d+)/', line)
            if match and int(match.group(1)) % 10 == 0:
                samples.append({'round': int(match.group(1)), 'worker_mb': round(_worker_mb(), 1)})
                print(f'{side} {line.split("  ")[0]}: worker {samples[-1]["worker_mb"]:.0f} MB', flush=True)

        runtime.ClosingExecutorFactory, original = factory, runtime.ClosingExecutorFactory
        try:
            with tempfile.TemporaryDirectory() as tmp:
                config = run_config.make_config(
                    output_dir=os.path.join(tmp, 'run'),
                    algorithm='fedavg',
                    dataset=f'npz:{_DATA.value}',
                    partition='dirichlet',
                    dirichlet_alpha=0.5,
                    num_clients=1000,
                    examples_per_client=60,
                    client_fraction=0.1,
                    model='mnist_dnn',
                    batch_size=16,
                    client_learning_rate=0.05,
                    rounds=_ROUNDS.value,
                    eval_every=0,
                    dp_noise_multiplier=1.0,
                    dp_clip=1.0,
                )
                result = experiment.run_experiment(config, log=log)
                counts = sorted({int(r['num_clients']) for r in result.rounds})
        finally:
            runtime.ClosingExecutorFactory = original
        results[side] = {'samples': samples, 'distinct_client_counts': len(counts)}
    with open(_OUT.value + '.json', 'w') as f:
        json.dump({'rounds': _ROUNDS.value, 'sides': results}, f, indent=2)
    names = list(results)
    lines = [
        '# TFF worker memory over rounds under Poisson sampling (MB)',
        '',
        f'`uv run python benchmarks/memory_poisson.py --rounds={_ROUNDS.value}` (module docstring: the setting). '
        'Resident set size of the TFF worker after every 10th round; the two sides ran one after the other in one '
        f'process. Distinct numbers of clients per round: {results[names[0]]["distinct_client_counts"]}.',
        '',
        '| round | ' + ' | '.join(names) + ' |',
        '|---|' + '---|' * len(names),
    ]
    for i, sample in enumerate(results[names[0]]['samples']):
        lines.append(
            f'| {sample["round"]} | ' + ' | '.join(f'{results[n]["samples"][i]["worker_mb"]:.0f}' for n in names) + ' |'
        )
    lines.append('')
    for name in names:
        samples = results[name]['samples']
        first, last = samples[1], samples[-1]
        lines.append(
            f'- {name}: from round {first["round"]} to round {last["round"]} the worker grew by '
            f'{last["worker_mb"] - first["worker_mb"]:+.0f} MB.'
        )
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
