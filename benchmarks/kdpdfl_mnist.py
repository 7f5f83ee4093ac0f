"""KD-PDFL and its serverless baselines on MNIST (the shape of the paper's Table I, Figs. 3-5).

Labels per client from a symmetric Dirichlet(0.1) (at most four labels),
15-100 training and 100 test examples per client from its own distribution
(`kd_dirichlet`), the LeNet-style CNN, T_ex = 5 slots per exchange, about 5
reachable neighbours per star (Rayleigh fading). Methods: local learning,
decentralized FedAvg, FedAvg+ (exchanges stop at `--finetune_from_slot`,
then local fine-tuning) and KD-PDFL; M = 10, 20, 40. Every method of one M
shares the partition and the star/neighbour draws (same seed).

Also: accuracy against the number of neighbours (Fig. 4: M = 20, every peer
reachable, the cap varied) and the collaboration graph W for a grid of
(mu_1, mu_2) (Fig. 5: M = 10), including mu_1 = mu_2 = 0.

    uv run python benchmarks/kdpdfl_mnist.py
"""

import json
import os
import time

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import (
    app,  # noqa: E402
    flags,  # noqa: E402
)

from tff_pfl import reports  # noqa: E402
from tff_pfl.program import algorithms, experiment, run_config  # noqa: E402

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_CLIENTS = flags.DEFINE_list('num_clients', ['10', '20', '40'], 'M values of the table.')
_SLOTS = flags.DEFINE_integer('slots', 250, 'Time slots per run.')
_T_EX = flags.DEFINE_integer('exchange_interval', 5, 'T_ex.')
_FINETUNE_FROM = flags.DEFINE_integer('finetune_from_slot', 150, 'FedAvg+: slot from which clients fine-tune.')
_LR = flags.DEFINE_float('learning_rate', 0.05, 'Local SGD learning rate.')
_MU1 = flags.DEFINE_float('mu1', 1.0, 'mu_1 of the table runs.')
_MU2 = flags.DEFINE_float('mu2', 1.0, 'mu_2 of the table runs.')
_CAPS = flags.DEFINE_list('neighbour_caps', ['1', '3', '5', '10'], 'Fig. 4 caps (M = 20).')
_MU_GRID = flags.DEFINE_list('mu_grid', ['0', '1', '10'], 'Fig. 5: values of mu_1 and of mu_2 (M = 10).')
_PARTS = flags.DEFINE_list('parts', ['table', 'neighbours', 'mu_grid'], 'What to run.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed.')
_RUNS_DIR = flags.DEFINE_string('runs_dir', 'runs/kdpdfl_mnist', 'Where the runs go.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/kdpdfl_mnist', 'Result path prefix.')

METHODS = {  # label -> (algorithm, config overrides)
    'Local learning': ('kdpdfl_local', {}),
    'FedAvg': ('kdpdfl_fedavg', {}),
    'FedAvg+': ('kdpdfl_fedavg_plus', {}),
    'KD-PDFL': ('kdpdfl', {}),
    'KD-PDFL, neighbours keep their models': ('kdpdfl', {'kd_broadcast': 'keep'}),
}
PAPER_EMNIST = {  # Table I, EMNIST, T_ex = 5: mean +- std for M = 10, 20, 40
    'Local learning': ('0.697±0.209',) * 3,
    'FedAvg': ('0.764±0.119', '0.784±0.108', '0.824±0.142'),
    'FedAvg+': ('0.771±0.104', '0.806±0.123', '0.841±0.136'),
    'KD-PDFL': ('0.787±0.108', '0.835±0.116', '0.870±0.082'),
}


def _run(name, algorithm, **overrides):
    """Runs one method; `overrides` change common settings or the table's algorithm settings."""
    intervals = _SLOTS.value // _T_EX.value
    values = dict(
        dataset=f'npz:{_MNIST.value}',
        partition='kd_dirichlet',
        dirichlet_alpha=0.1,
        kd_split_sizes=(15, 100, 20, 100),
        model='lenet',
        rounds=intervals,
        eval_every=max(1, intervals // 25),
        seed=_SEED.value,
        # The table's algorithm settings. A slot of local work: one epoch of batch 10.
        exchange_interval=_T_EX.value,
        local_epochs=1,
        local_steps=0,
        batch_size=10,
        client_learning_rate=_LR.value,
        kd_mean_neighbours=5.0,
        kd_max_neighbours=5,
        kd_mu1=_MU1.value,
        kd_mu2=_MU2.value,
        kd_c_base=100.0,
        kd_distance_batch=32,
        finetune_from_slot=_FINETUNE_FROM.value,
    )
    values.update(overrides)
    unknown = set(values) - set(run_config.ExperimentConfig.common_fields()) - algorithms.all_setting_names()
    if unknown:
        raise ValueError(f'not a setting: {sorted(unknown)}')
    # Each method takes the settings it has: local learning has no neighbours, FedAvg no distances.
    own = set(run_config.ExperimentConfig.common_fields()) | set(algorithms.get(algorithm).settings.field_names())
    config = run_config.make_config(
        output_dir=os.path.join(_RUNS_DIR.value, name),
        algorithm=algorithm,
        **{k: v for k, v in values.items() if k in own},
    )
    start = time.monotonic()
    result = experiment.run_experiment(config, overwrite=True, log=lambda line: None)
    seconds = time.monotonic() - start
    summary = result.summary['personalized_model']
    print(name, f'{seconds / 60:.1f} min', f'mean {summary["mean"]:.3f} std {summary["std"]:.3f}', flush=True)
    return result, seconds, values


def main(argv):
    del argv
    started = time.monotonic()
    output = {'table': {}, 'curves': {}, 'neighbours': {}, 'mu_grid': {}, 'seconds': {}}
    lines_settings = None
    if 'table' in _PARTS.value:
        for m in (int(v) for v in _CLIENTS.value):
            for label, (algorithm, extra) in METHODS.items():
                name = algorithm + ('_keep' if extra else '')
                result, seconds, settings = _run(f'M{m}/{name}', algorithm, num_clients=m, **extra)
                lines_settings = settings
                s = result.summary['personalized_model']
                output['table'].setdefault(label, {})[m] = dict(mean=s['mean'], std=s['std'])
                output['seconds'][f'M{m}/{name}'] = seconds
                for row in result.rounds:
                    if 'test_personalized_model_accuracy_mean' in row:
                        curve = output['curves'].setdefault(str(m), {}).setdefault(row['slot'], {'slot': row['slot']})
                        curve[label] = 100 * row['test_personalized_model_accuracy_mean']
        for m, points in output['curves'].items():
            rows = [points[s] for s in sorted(points)]
            reports.plot_curves(
                rows,
                'slot',
                list(METHODS),
                f'{_OUT.value}_M{m}.png',
                f'MNIST, M = {m}, T_ex = {_T_EX.value}',
                'mean per-client test accuracy (%)',
            )
    if 'neighbours' in _PARTS.value:
        for cap in (int(v) for v in _CAPS.value):
            for label, algorithm in (('KD-PDFL', 'kdpdfl'), ('FedAvg', 'kdpdfl_fedavg')):
                result, seconds, _ = _run(
                    f'caps/{algorithm}_K{cap}',
                    algorithm,
                    num_clients=20,
                    kd_mean_neighbours=19.0,
                    kd_max_neighbours=cap,
                )
                s = result.summary['personalized_model']
                output['neighbours'].setdefault(label, {})[cap] = dict(mean=s['mean'], std=s['std'])
                output['seconds'][f'caps/{algorithm}_K{cap}'] = seconds
        rows = [
            {
                'neighbours': cap,
                **{label: 100 * output['neighbours'][label][cap]['mean'] for label in output['neighbours']},
            }
            for cap in (int(v) for v in _CAPS.value)
        ]
        reports.plot_curves(
            rows,
            'neighbours',
            list(output['neighbours']),
            f'{_OUT.value}_neighbours.png',
            'M = 20: accuracy against the neighbours per exchange',
            'mean per-client test accuracy (%)',
        )
    if 'mu_grid' in _PARTS.value:
        grid = [float(v) for v in _MU_GRID.value]
        fig, axes = plt.subplots(len(grid), len(grid), figsize=(3.2 * len(grid), 3.0 * len(grid)), squeeze=False)
        for a, mu1 in enumerate(grid):
            for b, mu2 in enumerate(grid):
                result, seconds, _ = _run(
                    f'mu/mu1_{mu1:g}_mu2_{mu2:g}', 'kdpdfl', num_clients=10, kd_mu1=mu1, kd_mu2=mu2
                )
                graph = np.stack([np.asarray(s['connectivity']) for s in result.client_states.values()])
                s = result.summary['personalized_model']
                output['mu_grid'][f'{mu1:g},{mu2:g}'] = dict(mean=s['mean'], std=s['std'], W=graph.tolist())
                output['seconds'][f'mu/mu1_{mu1:g}_mu2_{mu2:g}'] = seconds
                ax = axes[a][b]
                image = ax.imshow(graph, cmap='viridis', vmin=0)
                ax.set_title(f'mu1={mu1:g}, mu2={mu2:g}: acc {100 * s["mean"]:.1f}%', fontsize=9)
                ax.set_xticks([])
                ax.set_yticks([])
                fig.colorbar(image, ax=ax, fraction=0.046)
        fig.suptitle("Collaboration graph W (row i: client i's weights), M = 10")
        fig.tight_layout()
        fig.savefig(f'{_OUT.value}_W.png', dpi=100)
        plt.close(fig)
    total = (time.monotonic() - started) / 60
    output['settings'] = lines_settings
    output['total_minutes'] = total
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(output, f, indent=1, default=str)

    base = os.path.basename(_OUT.value)
    lines = [
        f'# KD-PDFL and baselines: MNIST, Dirichlet(0.1) labels, T_ex = {_T_EX.value}, {_SLOTS.value} slots',
        '',
        f'Command: `uv run python benchmarks/kdpdfl_mnist.py --slots={_SLOTS.value} '
        f'--learning_rate={_LR.value} --seed={_SEED.value}` ({total:.0f} minutes on 2 CPU cores).',
        '',
        'Each client: Dirichlet(0.1) label mix (at most 4 labels), 15-100 training, 20 validation and 100 test '
        'examples from its own mix; LeNet-style CNN, one local epoch (batch 10, lr '
        f'{_LR.value}) per slot; about 5 reachable neighbours per star, at most 5; mu_1 = {_MU1.value:g}, '
        f"mu_2 = {_MU2.value:g}, c_base = 100, distances on 32 of the star's training examples; FedAvg+ "
        f'fine-tunes from slot {_FINETUNE_FROM.value}. Per-client test accuracy, mean ± std over clients.',
        '',
    ]
    if output['table']:
        ms = sorted({m for by_m in output['table'].values() for m in by_m})
        lines += [
            '| method | ' + ' | '.join(f'M={m}' for m in ms) + ' | paper EMNIST M=10 / 20 / 40 |',
            '|---|' + '---|' * len(ms) + '---|',
        ]
        for label, by_m in output['table'].items():
            cells = [f'{by_m[m]["mean"]:.3f}±{by_m[m]["std"]:.3f}' for m in ms]
            paper = ' / '.join(PAPER_EMNIST[label]) if label in PAPER_EMNIST else ''
            lines.append(f'| {label} | ' + ' | '.join(cells) + f' | {paper} |')
        lines += ['', '## Accuracy against the slot (Fig. 3)', '']
        lines += [f'![M={m}]({base}_M{m}.png)' for m in output['curves']]
    if output['neighbours']:
        lines += [
            '',
            '## Accuracy against the number of neighbours (Fig. 4, M = 20)',
            '',
            '| neighbours per exchange | ' + ' | '.join(output['neighbours']) + ' |',
            '|---|' + '---|' * len(output['neighbours']),
        ]
        for cap in (int(v) for v in _CAPS.value):
            lines.append(
                f'| {cap} | '
                + ' | '.join(f'{output["neighbours"][label][cap]["mean"]:.3f}' for label in output['neighbours'])
                + ' |'
            )
        lines += ['', f'![neighbours]({base}_neighbours.png)']
    if output['mu_grid']:
        lines += [
            '',
            '## Collaboration graph for a grid of (mu_1, mu_2) (Fig. 5, M = 10)',
            '',
            '| mu_1, mu_2 | accuracy | mean w_ij | zero weights |',
            '|---|---|---|---|',
        ]
        for key, r in output['mu_grid'].items():
            graph = np.asarray(r['W'])
            off = graph[~np.eye(len(graph), dtype=bool)]
            lines.append(f'| {key} | {r["mean"]:.3f} | {off.mean():.3f} | {int((off == 0).sum())} of {off.size} |')
        lines += ['', f'![W]({base}_W.png)']
    lines.append('')
    reports.write_text_atomic(_OUT.value + '.md', '\n'.join(lines))
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
