"""KT-pFL and its Table 1 baselines on MNIST with heterogeneous client models.

20 clients, four architectures assigned in turn (LeNet, small AlexNet, small
ResNet, small ShuffleNetV2: five clients each), KT-pFL's two non-IID
settings (`kt_case1`: two groups with opposite per-class counts; `kt_case2`:
two random classes per client), public data an unlabeled slice of MNIST set
aside before partitioning. Methods: FedMD, FedDF and pFedDF (one run: the
prototypes, and the prototypes fine-tuned locally), Sim-pFL, TopK-pFL and
KT-pFL (the paper's c update and the released code's). Every method of one
case shares the partition (same seed).

Writes <out>.md / .json, learning curves <out>_<case>.png, the learned c
<out>_<case>_c.png and the communication figure <out>_communication.png.

    uv run python benchmarks/ktpfl_mnist.py
"""

import csv
import json
import os
import shutil
import time

import numpy as np
from absl import app, flags

from processes import feddf, ktpfl
from tff_pfl import reports
from tff_pfl.program import experiment, run_config

_MNIST = flags.DEFINE_string('mnist', '../shared/data/mnist.npz', 'Keras-layout MNIST file.')
_CASES = flags.DEFINE_list('cases', ['kt_case1', 'kt_case2'], 'Partitions to run.')
_METHODS = flags.DEFINE_list(
    'methods', ['fedmd', 'pfeddf', 'sim_pfl', 'topk_pfl', 'ktpfl', 'ktpfl_released'], 'Methods to run.'
)
_ROUNDS = flags.DEFINE_integer('rounds', 30, 'Rounds.')
_LOCAL_EPOCHS = flags.DEFINE_integer('local_epochs', 2, 'E (the paper: 20).')
_CASE1_COUNTS = flags.DEFINE_list('case1_counts', ['150', '50'], 'Case 1 per-class counts (the paper: 450,150).')
_CASE2_PER_CLASS = flags.DEFINE_integer('case2_per_class', 150, 'Case 2 examples per class (the paper: 300).')
_PUBLIC_EXAMPLES = flags.DEFINE_integer('public_examples', 10000, 'Unlabeled public MNIST examples.')
_PUBLIC_BATCH = flags.DEFINE_integer('public_batch', 1000, 'Public examples per round (the paper: 3000).')
_LR = flags.DEFINE_float('learning_rate', 0.05, 'eta_1 = eta_2 (the paper: 0.01 with E = 20).')
_EVAL_EVERY = flags.DEFINE_integer('eval_every', 5, 'Evaluate every client every N rounds.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed.')
_RUNS_DIR = flags.DEFINE_string('runs_dir', 'runs/ktpfl_mnist', 'Where the runs go.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/ktpfl_mnist', 'Result path prefix.')
_REPORT_ONLY = flags.DEFINE_bool('report_only', False, 'Rewrite the report from <out>.json and the runs, run nothing.')

# method -> (algorithm, its settings class, its own settings, [(label, model reported by evaluate)])
METHODS = {
    'fedmd': ('ktpfl', ktpfl.KTpFLSettings, dict(kt_c_update='fedmd'), [('FedMD', 'personalized_model')]),
    'pfeddf': (
        'pfeddf',
        feddf.PFedDFSettings,
        {},
        [('FedDF', 'global_model'), ('pFedDF', 'personalized_model')],
    ),
    'sim_pfl': ('ktpfl', ktpfl.KTpFLSettings, dict(kt_c_update='similarity'), [('Sim-pFL', 'personalized_model')]),
    'topk_pfl': ('ktpfl', ktpfl.KTpFLSettings, dict(kt_c_update='topk'), [('TopK-pFL', 'personalized_model')]),
    'ktpfl': ('ktpfl', ktpfl.KTpFLSettings, dict(kt_c_update='paper'), [('KT-pFL', 'personalized_model')]),
    'ktpfl_released': (
        'ktpfl',
        ktpfl.KTpFLSettings,
        dict(kt_c_update='released'),
        [('KT-pFL (released code)', 'personalized_model')],
    ),
}
# Names of the settings in results written before the settings redesign (benchmarks/results/ktpfl_mnist.json).
_RENAMED = {
    'distill_epochs': 'kt_distill_epochs',
    'distill_batch_size': 'public_distill_batch_size',
    'distill_learning_rate': 'public_distill_learning_rate',
    'kt_temperature': 'public_temperature',
    'finetune_epochs': 'pfeddf_finetune_epochs',
}
PAPER_TABLE_1 = {  # EMNIST / Fashion-MNIST, non-IID 1 and 2 (the paper has no MNIST column)
    'FedMD': (71.37, 70.15, 68.02, 66.10),
    'FedDF': (71.92, 72.79, 70.32, 70.83),
    'pFedDF': (78.59, 75.72, 72.69, 73.45),
    'Sim-pFL': (82.72, 74.42, 72.82, 72.71),
    'TopK-pFL': (83.00, 73.91, 72.24, 73.39),
    'KT-pFL': (84.65, 76.30, 75.48, 75.60),
}


def _read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def coefficient_structure(run_dir):
    """Mean learned c[n, m] (n != m) by how many dominant classes clients n and m share.

    A client's dominant classes are those it holds more examples of than its
    mean per class (case 1: its group's five, case 2: its two).

    Returns:
      `{shared dominant classes: (mean c, number of pairs)}` from the run's
      partition.csv and knowledge_coefficients.csv.
    """
    partition_rows = _read_csv(os.path.join(run_dir, 'partition.csv'))
    classes = []
    for r in partition_rows:
        counts = {k: int(v) for k, v in r.items() if k.startswith('class_')}
        mean = sum(counts.values()) / len(counts)
        classes.append({k for k, v in counts.items() if v > mean})
    c_rows = _read_csv(os.path.join(run_dir, 'knowledge_coefficients.csv'))
    c = np.array([[float(v) for k, v in r.items() if k != 'client_id'] for r in c_rows])
    by_shared = {}
    for n in range(len(c)):
        for m in range(len(c)):
            if n != m:
                by_shared.setdefault(len(classes[n] & classes[m]), []).append(c[n, m])
    return {k: (float(np.mean(v)), len(v)) for k, v in sorted(by_shared.items())}


def main(argv):
    del argv
    if _REPORT_ONLY.value:
        with open(_OUT.value + '.json') as f:
            data = json.load(f)
        _write_report(data)
        return
    counts = tuple(int(c) for c in _CASE1_COUNTS.value)
    common = dict(dataset=f'npz:{_MNIST.value}', num_clients=20, rounds=_ROUNDS.value, eval_every=_EVAL_EVERY.value)
    by_case = {'kt_case1': dict(kt_case1_counts=counts), 'kt_case2': dict(examples_per_class=_CASE2_PER_CLASS.value)}
    # Local training and the public data, the same for every method.
    shared = dict(
        local_epochs=_LOCAL_EPOCHS.value,
        batch_size=128,
        client_learning_rate=_LR.value,
        architectures=('lenet', 'alexnet_small', 'resnet_small', 'shufflenet_small'),
        public_examples=_PUBLIC_EXAMPLES.value,
        public_batch=_PUBLIC_BATCH.value,
        public_distill_batch_size=256,
        public_distill_learning_rate=_LR.value,
        public_temperature=10.0,
    )
    own = {
        'ktpfl': dict(kt_distill_epochs=1, kt_coefficient_learning_rate=0.1, kt_rho=0.7),
        'pfeddf': dict(feddf_distill_epochs=1, pfeddf_finetune_epochs=_LOCAL_EPOCHS.value),
    }
    results, curves, communication = {}, {}, {}
    started = time.monotonic()
    for case in _CASES.value:
        for method in _METHODS.value:
            algorithm, settings_class, extra, reported = METHODS[method]
            out_dir = os.path.join(_RUNS_DIR.value, case, method)
            config = run_config.make_config(
                output_dir=out_dir,
                algorithm=algorithm,
                partition=case,
                **common,
                **by_case[case],
                settings=settings_class(**shared, **own[algorithm], **extra),
            )
            start = time.monotonic()
            result = experiment.run_experiment(config, overwrite=True, log=lambda line: None)
            seconds = time.monotonic() - start
            for label, model in reported:
                summary = result.summary[model]
                results.setdefault(label, {})[case] = dict(
                    mean=100 * summary['mean'],
                    std=100 * summary['std'],
                    worst_10=100 * summary['worst_10'],
                    minutes=seconds / 60,
                )
                for row in result.rounds:
                    key = f'test_{model}_accuracy_mean'
                    if key in row:
                        point = curves.setdefault(case, {}).setdefault(row['round'], {'round': row['round']})
                        point[label] = 100 * row[key]
            comm = _read_csv(os.path.join(out_dir, 'communication.csv'))[0]
            communication[method] = {k: float(v) for k, v in comm.items()}
            if method == 'ktpfl':
                shutil.copyfile(os.path.join(out_dir, 'knowledge_coefficients.png'), f'{_OUT.value}_{case}_c.png')
                shutil.copyfile(os.path.join(out_dir, 'knowledge_coefficients.csv'), f'{_OUT.value}_{case}_c.csv')
            print(
                case,
                method,
                f'{seconds / 60:.1f} min',
                {label: round(results[label][case]['mean'], 2) for label, _ in reported},
                flush=True,
            )
    total_minutes = (time.monotonic() - started) / 60

    for case, points in curves.items():
        rows = [points[r] for r in sorted(points)]
        series = [label for label in results if label in rows[-1]]
        reports.plot_curves(
            rows,
            'round',
            series,
            f'{_OUT.value}_{case}.png',
            f'MNIST {case}: 20 heterogeneous clients',
            'mean per-client test accuracy (%)',
        )

    # Fig. 5: megabytes per client over the run, soft predictions vs parameters.
    rounds = _ROUNDS.value
    kt = communication.get('ktpfl') or next(v for k, v in communication.items() if k != 'pfeddf')
    soft_mb = (kt['soft_prediction_bytes_up_per_client'] + kt['soft_target_bytes_down_per_client']) * rounds / 1e6
    param_mb = 2 * kt['parameter_bytes_per_client_mean'] * rounds / 1e6
    figure = {
        'KT-pFL: soft predictions up + targets down': soft_mb,
        'parameter exchange (mean of the four models), up + down': param_mb,
    }
    if 'pfeddf' in communication:
        d = communication['pfeddf']
        figure['FedDF: parameters up + down, logits up'] = (
            (d['parameter_bytes_up_per_client'] + d['parameter_bytes_down_per_client'] + d['logit_bytes_up_per_client'])
            * rounds
            / 1e6
        )
    reports.plot_client_bars(
        list(figure),
        {'MB per client': list(figure.values())},
        f'{_OUT.value}_communication.png',
        f'Traffic per client over {rounds} rounds (P = {_PUBLIC_BATCH.value})',
        'MB',
    )

    settings = dict(
        common,
        **shared,
        **own['ktpfl'],
        **own['pfeddf'],
        kt_case1_counts=counts,
        examples_per_class=_CASE2_PER_CLASS.value,
        seed=_SEED.value,
        cases=_CASES.value,
        methods=_METHODS.value,
        rounds=rounds,
    )
    data = {
        'settings': settings,
        'results': results,
        'communication': communication,
        'communication_mb_per_client': figure,
        'curves': curves,
        'total_minutes': total_minutes,
    }
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(data, f, indent=1, default=str)
    _write_report(data)


def _write_report(data):
    settings = {_RENAMED.get(k, k): v for k, v in data['settings'].items()}
    results, figure = data['results'], data['communication_mb_per_client']
    rounds, total_minutes = settings['rounds'], data['total_minutes']
    counts = tuple(int(c) for c in settings['kt_case1_counts'])
    cases = list(settings['cases'])
    command = (
        'uv run python benchmarks/ktpfl_mnist.py'
        f' --rounds={rounds} --local_epochs={settings["local_epochs"]}'
        f' --case1_counts={",".join(map(str, counts))} --case2_per_class={settings["examples_per_class"]}'
        f' --public_batch={settings["public_batch"]} --learning_rate={settings["client_learning_rate"]}'
        f' --seed={settings["seed"]}'
    )
    lines = [
        f'# KT-pFL and baselines: MNIST, 20 heterogeneous clients, {rounds} rounds',
        '',
        f'Command: `{command}` ({total_minutes:.0f} minutes on 2 CPU cores).',
        '',
        'Four architectures in turn (lenet, alexnet_small, resnet_small, shufflenet_small), five clients each. '
        f'Case 1: clients 0-9 hold {counts[0]} examples of each digit 0-4 and {counts[1]} of each digit 5-9, '
        f'clients 10-19 the reverse; case 2: two random digits per client, {settings["examples_per_class"]} examples '
        'each. Every client splits its examples 60/20/20 into train/validation/test. '
        f'{settings["public_examples"]} MNIST examples, held by no client, are the unlabeled public data; '
        f'{settings["public_batch"]} are drawn per round. E = {settings["local_epochs"]}, '
        f'R = {settings["kt_distill_epochs"]}, batch {settings["batch_size"]} (private) '
        f'and {settings["public_distill_batch_size"]} (public), '
        f'eta_1 = eta_2 = {settings["client_learning_rate"]}, T = {settings["public_temperature"]:g}, '
        f'eta_3 = {settings["kt_coefficient_learning_rate"]}, rho = {settings["kt_rho"]}; '
        f'pFedDF fine-tunes {settings["pfeddf_finetune_epochs"]} epochs.',
        '',
        "Mean (std) of the per-client test accuracy (%) after the last round; the paper's Table 1 "
        '(EMNIST and Fashion-MNIST, its own full-size settings) for comparison.',
        '',
        '| method | ' + ' | '.join(cases) + ' | paper EMNIST 1 / 2 | paper FMNIST 1 / 2 |',
        '|---|' + '---|' * len(cases) + '---|---|',
    ]
    for label, by_case in results.items():
        cells = [f'{by_case[c]["mean"]:.2f} ({by_case[c]["std"]:.1f})' if c in by_case else '' for c in cases]
        paper = PAPER_TABLE_1.get(label)
        paper_cells = [f'{paper[0]} / {paper[1]}', f'{paper[2]} / {paper[3]}'] if paper else ['', '']
        lines.append(f'| {label} | ' + ' | '.join(cells + paper_cells) + ' |')
    base = os.path.basename(_OUT.value)
    lines += ['', '## Learning curves', '']
    lines += [f'![{case}]({base}_{case}.png)' for case in data['curves']]
    lines += [
        '',
        '## Learned knowledge coefficients (KT-pFL)',
        '',
        'Mean learned c[n, m] over client pairs n != m, by the number of dominant classes (more examples than '
        "the client's mean per class) the two clients share (from the run's partition.csv; 1/N = 0.05).",
        '',
        '| case | shared dominant classes | mean c[n, m] | pairs |',
        '|---|---|---|---|',
    ]
    for case in cases:
        run_dir = os.path.join(_RUNS_DIR.value, case, 'ktpfl')
        if os.path.exists(os.path.join(run_dir, 'knowledge_coefficients.csv')):
            for shared, (mean, pairs) in coefficient_structure(run_dir).items():
                lines.append(f'| {case} | {shared} | {mean:.4f} | {pairs} |')
    lines.append('')
    lines += [f'![{case} c]({base}_{case}_c.png)' for case in cases if os.path.exists(f'{_OUT.value}_{case}_c.png')]
    lines += ['', '## Communication (Fig. 5)', '', '| traffic per client over the run | MB |', '|---|---|']
    lines += [f'| {k} | {v:.2f} |' for k, v in figure.items()]
    lines += ['', f'![communication]({base}_communication.png)', '']
    reports.write_text_atomic(_OUT.value + '.md', '\n'.join(lines))
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
