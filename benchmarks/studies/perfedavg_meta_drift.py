"""Why Per-FedAvg's meta model can score 10 % while its adapted models score 83-86 %: one client's local work.

On Table 2's setting (`benchmarks/suites/ktpfl_fmnist_table2.toml`: Fashion-MNIST,
`kt_case1` 450/150, 20 clients, `fedavg_cnn`, batch 32, E = 5, beta = 0.01,
alpha = 0.01; the script takes the partition and these settings from the suite's
Per-FedAvg run) Per-FedAvg's meta model w ended at 9.99 % (20 clients) and
9.95 % (100 clients) on seed 0, with a training loss of about 500, while the
models adapted from it by one alpha-step scored 85.33 % and 82.81 %. On seed 1
with 100 clients the meta model stayed at 85.56 % (adapted 86.34 %). This
script repeats one round's local work of a client from the same starting
point, in eager TensorFlow, independently of the process (Algorithm 1 of the
paper, as `tests/test_baselines.py` checks the process against): per meta
step, w~ = w - alpha grad f(w; D), then w <- w - beta grad f(w~; D'), on two
consecutive batches of the client's epoch permutations. It records the meta
loss f(w; D) (what the round's `train_loss` reports) and the adapted loss
f(w~; D') (what the update descends), for several alpha, beside plain SGD at
the same rate (FedAvg's client). At the end it evaluates on the client's test
split the meta model and the model adapted by one alpha-step on the client's
whole training split (as the process's evaluation does).

    uv run --locked python benchmarks/studies/perfedavg_meta_drift.py

Writes benchmarks/studies/results/perfedavg_meta_drift.{md,json,png}.
"""

import json
import os
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

from tff_pfl import models, reports
from tff_pfl.computations import local_training
from tff_pfl.data import client_data
from tff_pfl.program import experiment, run_config
from tff_pfl_bench import bench_parse

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ALPHAS = flags.DEFINE_list('alphas', ['0', '0.001', '0.01', '0.03'], 'Per-FedAvg alpha values (0: no inner step).')
_CLIENTS = flags.DEFINE_list('clients', ['0', '10'], 'Client indices (0-9: first group, 10-19: second).')
_SEED = flags.DEFINE_integer('seed', 0, 'Partition, initialization and batch-order seed.')
_PARTITION = flags.DEFINE_string('partition', 'c20', "The suite's partition.")
_WORK_DIR = flags.DEFINE_string('work_dir', os.path.join(REPO, 'runs', 'perfedavg_meta_drift'), 'Partition cache.')
_OUT = flags.DEFINE_string(
    'out',
    os.path.join(REPO, 'benchmarks', 'studies', 'results', 'perfedavg_meta_drift'),
    'Report path, without extension.',
)

SUITE = os.path.join(REPO, 'benchmarks', 'suites', 'ktpfl_fmnist_table2.toml')
WINDOW = 20  # steps per mean in the report's loss columns


def _prepare(seed: int) -> tuple[client_data.ClientDataSpec, run_config.ExperimentConfig]:
    """The suite's Per-FedAvg run of `--partition` and `seed`: its partition (written once) and its settings."""
    suite = bench_parse.load_suite(SUITE)
    runs = suite.select(seeds=[seed], algorithms=['Per-FedAvg'], partitions=[_PARTITION.value])
    if not runs:
        raise app.UsageError(f'{SUITE} has no Per-FedAvg run of partition {_PARTITION.value!r} and seed {seed}')
    run = runs[0]
    out = os.path.join(_WORK_DIR.value, f'{_PARTITION.value}_seed{seed}')
    config = suite.config(run.partition, run.algorithm, seed, out).validate()
    if os.path.isdir(os.path.join(out, 'client_data')):
        return client_data.load_client_data_spec(os.path.join(out, 'client_data')), config
    return experiment.prepare_run(config, out)[0], config


def _loss_and_grads(model, x, y):
    with tf.GradientTape() as tape:
        loss, _ = local_training.supervised_loss(model, x, tf.convert_to_tensor(y))  # the processes' own loss
    return float(loss), tape.gradient(loss, model.trainable_variables)


def _accuracy(model, x, y) -> float:
    return float(np.mean(np.argmax(model(x, training=False).numpy(), axis=1) == y))


def run_client(spec, config, client: int, alpha: float | None) -> dict:
    """One client's local round from a fresh model; alpha None: plain SGD (one batch a step).

    The batch size, beta (`client_learning_rate`), the epochs and the seed are the suite's.

    Returns:
      `meta_loss` and (Per-FedAvg) `adapted_loss` per step, and the test
      accuracy of the final w and of w adapted on the whole training split.
    """
    client_id = spec.client_ids[client]
    x, y = client_data.read_split_numpy(spec, client_id, 'train')
    x_test, y_test = client_data.read_split_numpy(spec, client_id, 'test')
    tf.keras.utils.set_random_seed(config.seed)
    model = models.get(config.model)(spec.feature_shape, spec.num_classes)
    settings = config.settings
    epochs = np.tile(np.arange(len(y)), (settings.local_epochs, 1))
    order = np.random.default_rng(config.seed).permuted(epochs, axis=1).ravel()
    batch, beta = settings.batch_size, settings.client_learning_rate
    batches = [order[i : i + batch] for i in range(0, order.size - batch + 1, batch)]
    per_step = 1 if alpha is None else 2
    meta, adapted = [], []
    for s in range(0, len(batches) - per_step + 1, per_step):
        loss, grads = _loss_and_grads(model, x[batches[s]], y[batches[s]])
        meta.append(loss)
        w = [tf.identity(v) for v in model.trainable_variables]
        if alpha is not None:
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(alpha * g)
            loss2, grads = _loss_and_grads(model, x[batches[s + 1]], y[batches[s + 1]])
            adapted.append(loss2)
        for v, wv, g in zip(model.trainable_variables, w, grads):
            v.assign(wv - beta * g)
    result = {'client': client_id, 'alpha': alpha, 'meta_loss': meta, 'adapted_loss': adapted}
    result['meta_test_accuracy'] = _accuracy(model, x_test, y_test)
    if alpha is not None:
        _, grads = _loss_and_grads(model, x, y)
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(alpha * g)
        result['adapted_test_accuracy'] = _accuracy(model, x_test, y_test)
    return result


def _label(r: dict) -> str:
    return 'SGD' if r['alpha'] is None else f'alpha {r["alpha"]:g}'


def _windows(values: list[float]) -> list[float]:
    return [float(np.mean(values[i : i + WINDOW])) for i in range(0, len(values), WINDOW)]


def write_report(results: list[dict], seconds: float) -> None:
    rows = []
    for r in results:
        rows.append(
            {
                'client': r['client'],
                'run': _label(r),
                'steps': len(r['meta_loss']),
                'meta loss, first 20': _windows(r['meta_loss'])[0],
                'meta loss, max 20': max(_windows(r['meta_loss'])),
                'meta loss, last 20': float(np.mean(r['meta_loss'][-WINDOW:])),
                'adapted loss, last 20': float(np.mean(r['adapted_loss'][-WINDOW:])) if r['adapted_loss'] else None,
                'test acc. of w (%)': 100 * r['meta_test_accuracy'],
                'test acc. adapted (%)': 100 * r['adapted_test_accuracy'] if 'adapted_test_accuracy' in r else None,
            }
        )
    first = results[0]['client']
    points = {}  # batches consumed at the end of a window -> {series: mean loss}
    for r in (r for r in results if r['client'] == first):
        per_step = 1 if r['alpha'] is None else 2
        for key, name in (('meta_loss', 'meta'), ('adapted_loss', 'adapted')):
            for i, v in enumerate(_windows(r[key])):
                batches = min((i + 1) * WINDOW, len(r[key])) * per_step
                points.setdefault(batches, {})[f'{_label(r)} {name}'] = v
    curve_rows = [{'batches': b, **points[b]} for b in sorted(points)]
    keys = list(dict.fromkeys(k for row in curve_rows for k in row if k != 'batches'))
    reports.plot_curves(
        curve_rows,
        'batches',
        keys,
        _OUT.value + '.png',
        f'{first}, one round from the same start: mean loss over {WINDOW} steps, meta (at w) and adapted (at w~)',
        'cross-entropy',
    )
    text = [
        '# Per-FedAvg: the meta model drifts while the adapted loss falls',
        '',
        __doc__.split('\n\n    uv run')[0].strip(),
        '',
        'Command:',
        '',
        '    uv run --locked python benchmarks/studies/perfedavg_meta_drift.py '
        f'--partition={_PARTITION.value} --seed={_SEED.value} --clients={",".join(_CLIENTS.value)} '
        f'--alphas={",".join(_ALPHAS.value)}',
        '',
        f'{len(results)} runs, {seconds:.0f} s. Losses are means over {WINDOW} consecutive steps '
        '(SGD takes one batch a step, Per-FedAvg two).',
        '',
        reports.markdown_table(rows, list(rows[0]), float_format='{:.2f}'),
        '',
        f'![losses]({os.path.basename(_OUT.value)}.png)',
        '',
    ]
    reports.write_text_atomic(_OUT.value + '.md', '\n'.join(text))
    reports.write_text_atomic(_OUT.value + '.json', json.dumps(results, indent=1) + '\n')


def main(argv):
    del argv
    os.makedirs(_WORK_DIR.value, exist_ok=True)
    spec, config = _prepare(_SEED.value)
    start = time.perf_counter()
    results = []
    for client in [int(c) for c in _CLIENTS.value]:
        for alpha in [None] + [float(a) for a in _ALPHAS.value]:
            r = run_client(spec, config, client, alpha)
            results.append(r)
            print(
                f'{r["client"]} {_label(r)}: meta loss last {WINDOW} {np.mean(r["meta_loss"][-WINDOW:]):.3f}, '
                f'test w {100 * r["meta_test_accuracy"]:.2f} %, {time.perf_counter() - start:.0f} s',
                flush=True,
            )
    write_report(results, time.perf_counter() - start)
    print(f'wrote {_OUT.value}.md')


if __name__ == '__main__':
    app.run(main)
