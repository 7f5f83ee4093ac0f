"""PersFL on MNIST, 10 clients, DS-1 / DS-2 / DS-3, several seeds, vs the paper.

Each run is one `tff-pfl-train` experiment (the same code path as the binary);
its global model after stage 1 is the FedAvg baseline, its personalized
models PersFL's. Rounds follow the paper's Table 7 (100 / 25 / 100). Writes a
markdown table next to the paper's Table 3 and a JSON of every run.

    uv run python benchmarks/persfl_mnist.py --seeds=0,1,2
"""

import json
import os
import statistics
import time

from absl import app
from absl import flags

from tff_pfl.program import experiment

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds.')
_SPLITS = flags.DEFINE_list('splits', ['ds1', 'ds2', 'ds3'], 'Partitions.')
_ALGORITHMS = flags.DEFINE_list('algorithms', ['persfl'], 'persfl and/or persfl_gd.')
_RUNS_DIR = flags.DEFINE_string('runs_dir', 'runs/persfl_mnist', 'Where the runs go.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/persfl_mnist', 'Result path prefix (.json, .md).')

ROUNDS = {'ds1': 100, 'ds2': 25, 'ds3': 100}  # the paper's Table 7, MNIST
PAPER = {  # Table 3, MNIST: mean per-client accuracy (std), FedAvg and PersFL
    'fedavg': {'ds1': (92.0, None), 'ds2': (85.5, None), 'ds3': (96.4, None)},
    'persfl': {'ds1': (98.6, 0.4), 'ds2': (88.0, 1.3), 'ds3': (99.4, 0.3)},
}
LOCAL = dict(local_epochs=1, batch_size=32, client_learning_rate=0.05,
             distill_epochs=5, distill_batch_size=32, distill_learning_rate=0.01)


def main(argv):
    del argv
    runs = []
    for algorithm in _ALGORITHMS.value:
        for split in _SPLITS.value:
            for seed in (int(s) for s in _SEEDS.value):
                out = os.path.join(_RUNS_DIR.value, f'{algorithm}-{split}-seed{seed}')
                config = experiment.ExperimentConfig(
                    output_dir=out, algorithm=algorithm, dataset=f'npz:{_MNIST.value}', partition=split,
                    num_clients=10, classes_per_client=4, dirichlet_alpha=0.9, model='mnist_dnn',
                    rounds=ROUNDS[split], eval_every=0, seed=seed, **LOCAL)
                start = time.monotonic()
                result = experiment.run_experiment(config, overwrite=True, log=lambda line: None)
                seconds = time.monotonic() - start
                summary = {k: {s: 100 * v[s] for s in ('mean', 'std', 'worst_10')} for k, v in result.summary.items()}
                chosen = [(row['temperature'], row['imitation'], row['teacher_round']) for row in result.clients]
                runs.append(dict(algorithm=algorithm, split=split, seed=seed, seconds=seconds, summary=summary,
                                 chosen=chosen, output_dir=out))
                print(algorithm, split, seed, f'{seconds:.0f}s',
                      {k: round(v['mean'], 2) for k, v in summary.items()}, flush=True)
    with open(_OUT.value + '.json', 'w') as f:
        json.dump({'local_settings': LOCAL, 'rounds': ROUNDS, 'runs': runs}, f, indent=1)

    def cell(values):
        if len(values) == 1:
            return f'{values[0]:.1f}'
        return f'{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}'

    lines = [
        '# PersFL on MNIST (10 clients): mean and std of per-client test accuracy (%)', '',
        f'Seeds {",".join(_SEEDS.value)}; rounds {ROUNDS}; local settings {LOCAL}; the paper\'s grid. '
        'Each cell: mean over seeds ± std over seeds of the run\'s statistic.',
        f'Command: `uv run python benchmarks/persfl_mnist.py --seeds={",".join(_SEEDS.value)} '
        f'--splits={",".join(_SPLITS.value)} --algorithms={",".join(_ALGORITHMS.value)}`', '',
        '| split | model | mean acc (ours) | std across clients (ours) | worst 10% (ours) | paper mean | paper std | minutes/run |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for algorithm in _ALGORITHMS.value:
        for split in _SPLITS.value:
            mine = [r for r in runs if r['algorithm'] == algorithm and r['split'] == split]
            for model, label in (('global_model', 'FedAvg (global)'), ('personalized_model', algorithm)):
                paper_mean, paper_std = PAPER['fedavg' if model == 'global_model' else 'persfl'][split]
                lines.append(
                    f'| {split.upper()} | {label} | {cell([r["summary"][model]["mean"] for r in mine])} | '
                    f'{cell([r["summary"][model]["std"] for r in mine])} | '
                    f'{cell([r["summary"][model]["worst_10"] for r in mine])} | {paper_mean} | '
                    f'{paper_std if paper_std is not None else ""} | '
                    f'{statistics.mean(r["seconds"] for r in mine) / 60:.1f} |')
    lines += ['', '## Chosen (T, lambda) and teacher rounds', '']
    for r in runs:
        lambdas = [c[1] for c in r['chosen']]
        rounds = [c[2] for c in r['chosen']]
        lines.append(f'- {r["algorithm"]} {r["split"]} seed {r["seed"]}: mean lambda {statistics.mean(lambdas):.2f}, '
                     f'T values {sorted(set(c[0] for c in r["chosen"]))}, teacher rounds {rounds}')
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
