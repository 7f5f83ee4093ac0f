"""Self-FL vs FedAvg on non-IID MNIST with many clients (Self-FL §4.1-4.2).

FedProx-style non-IID MNIST: every client holds two digits (`ds3`, classes
assigned cyclically), client sizes from a log-normal power law; multinomial
logistic regression; activity rate C = 0.1, batch 10, eta = 0.03; FedAvg
takes 20 local steps (the paper's baselines), Self-FL at most 40. Both runs
share the partition (same seed). Writes the per-round curve of the
sample-weighted per-client test accuracy and Table 1's metrics.

    uv run python benchmarks/selffl_mnist.py --num_clients=1000 --rounds=200
"""

import json
import os
import time

from absl import app, flags

from tff_pfl import reports
from tff_pfl.program import experiment, run_config

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_NUM_CLIENTS = flags.DEFINE_integer('num_clients', 1000, 'Clients.')
_ROUNDS = flags.DEFINE_integer('rounds', 200, 'Rounds.')
_EVAL_EVERY = flags.DEFINE_integer('eval_every', 10, 'Evaluate every client every N rounds.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed.')
_RUNS_DIR = flags.DEFINE_string('runs_dir', 'runs/selffl_mnist', 'Where the runs go.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/selffl_mnist', 'Result path prefix (.json, .md, .png).')


def main(argv):
    del argv
    common = dict(
        dataset=f'npz:{_MNIST.value}',
        partition='ds3',
        num_clients=_NUM_CLIENTS.value,
        model='logistic',
        rounds=_ROUNDS.value,
        eval_every=_EVAL_EVERY.value,
        client_fraction=0.1,
        batch_size=10,
        client_learning_rate=0.03,
        seed=_SEED.value,
    )
    runs = {
        'fedavg': dict(algorithm='fedavg', local_steps=20),
        'selffl': dict(algorithm='selffl', selffl_max_steps=40, selffl_default_steps=20),
    }
    results, curves = {}, {}
    for name, extra in runs.items():
        config = run_config.ExperimentConfig.from_dict(
            {'output_dir': os.path.join(_RUNS_DIR.value, name), **common, **extra}
        )
        start = time.monotonic()
        result = experiment.run_experiment(config, overwrite=True, log=lambda line: None)
        seconds = time.monotonic() - start
        results[name] = dict(
            seconds=seconds,
            summary={m: {k: 100 * v for k, v in s.items() if k != 'num_clients'} for m, s in result.summary.items()},
        )
        for row in result.rounds:
            if 'test_global_model_accuracy_weighted_mean' in row:
                point = curves.setdefault(row['round'], {'round': row['round']})
                point[f'{name} global'] = 100 * row['test_global_model_accuracy_weighted_mean']
                if 'test_personalized_model_accuracy_weighted_mean' in row:
                    point[f'{name} personalized'] = 100 * row['test_personalized_model_accuracy_weighted_mean']
        print(name, f'{seconds:.0f}s', results[name]['summary'], flush=True)
    curves = [curves[r] for r in sorted(curves)]
    series = [k for k in curves[-1] if k != 'round']
    reports.plot_curves(
        curves,
        'round',
        series,
        _OUT.value + '.png',
        f'Non-IID MNIST, {_NUM_CLIENTS.value} clients, C = 0.1',
        'weighted per-client test accuracy (%)',
    )
    with open(_OUT.value + '.json', 'w') as f:
        json.dump({'settings': common, 'runs': runs, 'results': results, 'curves': curves}, f, indent=1)
    lines = [
        f'# Self-FL vs FedAvg: non-IID MNIST, {_NUM_CLIENTS.value} clients, {_ROUNDS.value} rounds',
        '',
        'Two digits per client (ds3, cyclic), log-normal sizes, logistic regression, C = 0.1, batch 10, '
        'eta 0.03; FedAvg 20 local steps, Self-FL at most 40. Accuracy in %, per-client test splits.',
        'Command: `uv run python benchmarks/selffl_mnist.py '
        f'--num_clients={_NUM_CLIENTS.value} --rounds={_ROUNDS.value}`',
        '',
        '| algorithm | model | weighted mean | mean | std | worst 10% | top 10% by samples | minutes |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for name, r in results.items():
        for model, s in r['summary'].items():
            lines.append(
                f'| {name} | {model} | {s["weighted_mean"]:.1f} | {s["mean"]:.1f} | {s["std"]:.1f} | '
                f'{s["worst_10"]:.1f} | {s["top_10_by_samples"]:.1f} | {r["seconds"] / 60:.1f} |'
            )
    lines += ['', f'![curves]({os.path.basename(_OUT.value)}.png)', '']
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines))
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
