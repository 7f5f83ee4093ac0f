"""What each registered image model costs to train here, and what a KT-pFL round would cost.

For every model: parameters, float32 bytes, and the seconds of one local-training
epoch over 2,250 examples of 28x28x1 random data (a client of KT-pFL's Table 1,
Non-IID case 1: 450 x 5 + 150 x 5 = 3,000 examples, 75% for training) at batch
128 (KT-pFL's heterogeneous setting) and at batch 32 (its homogeneous setting),
plus the seconds of the forward pass over 3,000 public examples at batch 256
(the soft predictions each client uploads).

How it is measured: one process, plain TensorFlow; the data sit in memory as
tensors; one `tf.function` runs `k` SGD steps (forward, softmax cross-entropy,
gradient, `assign_sub`) on full batches sliced from them, as the project's
local training does. After tracing and one warm-up call, `k` is chosen so that a
timed call lasts about `--target_seconds` (at most one epoch of steps), the call
is repeated `--repeats` times and the median seconds per example, times the
examples, gives the epoch (the last partial batch counted pro rata). Wall-clock
and process CPU seconds are both recorded: the machine's 2 cores are shared, so
wall time depends on the load (recorded before and after); CPU seconds less so.

From these, the compute of one round, clients one after another:

* KT-pFL Table 1 (heterogeneous): 20 clients, five of each of LeNet, AlexNet,
  ResNet-18, ShuffleNetV2; each trains 20 epochs on its 2,250 examples at batch
  128, computes soft predictions on 3,000 public examples, and distils once over
  them (R = 1; costed at the batch-128 training rate per example);
* KT-pFL Table 2 (homogeneous): 20 clients of McMahan's CNN (`fedavg_cnn`),
  20 epochs on 2,250 examples at batch 32.

Non-IID case 2 (two classes x 300 examples, 450 for training) is also given:
its local training is 1/5 of case 1's. TFF's own per-round cost (about
0.014 s measured for FedAvg here), file reads and evaluation are not included.

    uv run --locked python benchmarks/model_cost.py
"""

import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

from tff_pfl import models

_MODELS = flags.DEFINE_list(
    'models',
    list(dict.fromkeys(models.PAPER_IMAGE_ARCHITECTURES + ('fedavg_cnn',) + models.PAPER_SIZE_IMAGE_ARCHITECTURES)),
    'Registered models to measure (default: every image model of the papers, small and paper-size).',
)
_TARGET_SECONDS = flags.DEFINE_float('target_seconds', 2.0, 'About how long one timed call lasts.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed calls per measurement (the median is kept).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/model_cost', 'Result path prefix (.json, .md).')

SHAPE, NUM_CLASSES, LEARNING_RATE, TEMPERATURE = (28, 28, 1), 10, 0.01, 10.0
TRAIN_EXAMPLES = 2250  # KT-pFL Table 1 client, case 1: 3,000 x 75%
CASE2_TRAIN_EXAMPLES = 450  # case 2: 2 classes x 300 x 75%
PUBLIC_EXAMPLES, PUBLIC_BATCH = 3000, 256
LOCAL_EPOCHS, CLIENTS_PER_ARCHITECTURE = 20, 5
TABLE1_SETS = {
    'paper-size (lenet, alexnet, resnet18, shufflenet_v2)': models.PAPER_SIZE_IMAGE_ARCHITECTURES,
    'small CPU variants (lenet, alexnet_small, resnet_small, shufflenet_small)': models.PAPER_IMAGE_ARCHITECTURES,
    'paper-size, alexnet_small for alexnet': ('lenet', 'alexnet_small', 'resnet18', 'shufflenet_v2'),
}


def _timed(fn, steps, repeats):
    """Median wall and CPU seconds of `fn(steps)` over `repeats` calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn(tf.constant(steps)).numpy()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def measure(name, batch, forward_only, x, y):
    """Seconds per example of training (or forward) steps at `batch`.

    Args:
      name: registered model name.
      batch: batch size.
      forward_only: time the soft-prediction forward pass instead of SGD steps.
      x: examples `[N, 28, 28, 1]` (N >= batch).
      y: int32 labels `[N]`.

    Returns:
      A dict: wall and CPU seconds per example (medians), steps per timed call,
      and the seconds spent tracing plus warming up.
    """
    with models.seeded(0):
        model = models.get(name)(SHAPE, NUM_CLASSES)
    full_batches = x.shape[0] // batch

    @tf.function
    def run(steps):
        total = tf.constant(0.0)
        for step in tf.range(steps):
            start = (step % full_batches) * batch
            xb, yb = x[start : start + batch], y[start : start + batch]
            if forward_only:
                total += tf.reduce_sum(tf.nn.softmax(model(xb, training=False) / TEMPERATURE, axis=-1)[:, 0])
            else:
                with tf.GradientTape() as tape:
                    logits = model(xb, training=True)
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits))
                grads = tape.gradient(loss, model.trainable_weights)
                for variable, grad in zip(model.trainable_weights, grads):
                    variable.assign_sub(LEARNING_RATE * grad)
                total += loss
        return total

    start = time.perf_counter()
    run(tf.constant(1)).numpy()  # trace
    warm_wall, _ = _timed(run, 1, 1)
    setup = time.perf_counter() - start
    steps = int(min(-(-x.shape[0] // batch), max(1, round(_TARGET_SECONDS.value / max(warm_wall, 1e-6)))))
    wall, cpu = _timed(run, steps, _REPEATS.value)
    examples = steps * batch
    return {
        'wall_s_per_example': wall / examples,
        'cpu_s_per_example': cpu / examples,
        'steps_per_timed_call': steps,
        'trace_and_warmup_s': round(setup, 2),
    }


def _loadavg():
    return [round(v, 2) for v in os.getloadavg()]


def round_costs(results):
    """Per-round compute extrapolated from the per-model measurements.

    Args:
      results: `{model: measurement dict}` as built by `main`.

    Returns:
      `{round name: {'wall_min': ..., 'cpu_min': ..., 'case2_wall_min': ..., ...}}`.
    """
    rounds = {}

    def client(name, batch_key, examples, with_public):
        out = {}
        for kind in ('wall', 'cpu'):
            train = results[name][batch_key][f'{kind}_s_per_example']
            seconds = LOCAL_EPOCHS * examples * train
            if with_public:
                seconds += PUBLIC_EXAMPLES * results[name]['forward_256'][f'{kind}_s_per_example']
                seconds += PUBLIC_EXAMPLES * results[name]['train_128'][f'{kind}_s_per_example']  # R = 1
            out[kind] = seconds
        return out

    for label, names in TABLE1_SETS.items():
        if not all(n in results for n in names):
            continue
        for case, examples in (('case1', TRAIN_EXAMPLES), ('case2', CASE2_TRAIN_EXAMPLES)):
            per = {n: client(n, 'train_128', examples, True) for n in names}
            rounds[f'KT-pFL Table 1, {label}, {case}'] = {
                'clients': {n: CLIENTS_PER_ARCHITECTURE for n in names},
                'train_examples_per_client': examples,
                'wall_min': CLIENTS_PER_ARCHITECTURE * sum(p['wall'] for p in per.values()) / 60,
                'cpu_min': CLIENTS_PER_ARCHITECTURE * sum(p['cpu'] for p in per.values()) / 60,
                'per_client_wall_s': {n: round(p['wall'], 1) for n, p in per.items()},
            }
    if 'fedavg_cnn' in results:
        for case, examples in (('case1', TRAIN_EXAMPLES), ('case2', CASE2_TRAIN_EXAMPLES)):
            per = client('fedavg_cnn', 'train_32', examples, False)
            rounds[f'KT-pFL Table 2, 20 x fedavg_cnn, batch 32, {case}'] = {
                'clients': {'fedavg_cnn': 20},
                'train_examples_per_client': examples,
                'wall_min': 20 * per['wall'] / 60,
                'cpu_min': 20 * per['cpu'] / 60,
                'per_client_wall_s': {'fedavg_cnn': round(per['wall'], 1)},
            }
    return rounds


def write_markdown(path, report):
    """Writes the human-readable tables of `report`.

    Args:
      path: the .md file to write.
      report: the dict written to the .json file.
    """
    lines = [
        '# Model cost: parameters, seconds per local epoch, KT-pFL round extrapolations',
        '',
        f'Command: `{report["command"]}`',
        '',
        f'Machine: {report["machine"]["platform"]}, {report["machine"]["cores"]} cores (shared), '
        f'TensorFlow {report["machine"]["tensorflow"]}; load average (1, 5, 15 min) '
        f'{report["machine"]["loadavg_before"]} before, {report["machine"]["loadavg_after"]} after; '
        f'{report["elapsed_s"]:.0f} s in all.',
        '',
        'Data: 28x28x1 random inputs, 10 classes. Epoch = 2,250 examples (KT-pFL Table 1 client, '
        'Non-IID case 1: 3,000 examples, 75% for training). Plain `tf.function` SGD steps on in-memory '
        'tensors, median of '
        f'{report["settings"]["repeats"]} timed calls of about {report["settings"]["target_seconds"]} s each '
        'after tracing and one warm-up call; seconds per example x examples. Wall = elapsed time under '
        'the load above; CPU = process CPU seconds (both cores count).',
        '',
        '| model | parameters | MB (float32) | epoch b128 wall s | epoch b128 CPU s | epoch b32 wall s '
        '| epoch b32 CPU s | 3,000 forward b256 wall s |',
        '|---|---:|---:|---:|---:|---:|---:|---:|',
    ]
    for name, r in report['models'].items():
        lines.append(
            f'| {name} | {r["parameters"]:,} | {r["bytes"] / 1e6:.2f} '
            f'| {r["epoch_s"]["train_128"]["wall"]:.2f} | {r["epoch_s"]["train_128"]["cpu"]:.2f} '
            f'| {r["epoch_s"]["train_32"]["wall"]:.2f} | {r["epoch_s"]["train_32"]["cpu"]:.2f} '
            f'| {r["forward_3000_public_s"]["wall"]:.2f} |'
        )
    lines += [
        '',
        '## One round, extrapolated (clients one after another)',
        '',
        'Table 1 (heterogeneous): five clients per architecture, each 20 epochs at batch 128, soft '
        'predictions on 3,000 public examples and one distillation pass over them (costed at the '
        'batch-128 training rate). Table 2 (homogeneous): 20 `fedavg_cnn` clients, 20 epochs at batch 32, '
        'local training only. Case 1: 2,250 training examples per client; case 2 (two classes x 300): 450.',
        '',
        'Wall minutes are under the load recorded above. On an idle machine a round would take between '
        'CPU/2 (TensorFlow keeping both cores busy) and CPU minutes (one core): the last column.',
        '',
        '| round | wall min | CPU min | wall s per client | idle 2-core estimate, min |',
        '|---|---:|---:|---|---:|',
    ]
    for label, r in report['rounds'].items():
        per = ', '.join(f'{n} {s}' for n, s in r['per_client_wall_s'].items())
        lines.append(
            f'| {label} | {r["wall_min"]:.1f} | {r["cpu_min"]:.1f} | {per} '
            f'| {r["cpu_min"] / 2:.1f} - {r["cpu_min"]:.1f} |'
        )
    lines += [
        '',
    ]
    sizes = {n: report['models'][n]['bytes'] / 1e6 for n in ('alexnet', 'resnet18') if n in report['models']}
    if sizes:
        lines += [
            "The heterogeneous processes pack each client's weights into one float32 vector as long as the "
            "largest model's (`tff_pfl/computations/heterogeneous.py`), so every client state of a set is "
            + ', '.join(f'{mb:.1f} MB when `{n}` is the largest' for n, mb in sizes.items())
            + '.',
            '',
        ]
    with open(path, 'w') as f:
        f.write('\n'.join(lines))


def main(argv):
    del argv
    unknown = [n for n in _MODELS.value if n not in models.names()]
    if unknown:
        print(f'unknown models {unknown}; known: {", ".join(models.names())}', file=sys.stderr)
        sys.exit(2)
    if _TARGET_SECONDS.value <= 0 or _REPEATS.value < 1:
        print('--target_seconds must be > 0 and --repeats >= 1', file=sys.stderr)
        sys.exit(2)
    tf.get_logger().setLevel('ERROR')  # one tf.function per measurement: no retracing warnings
    began, load_before = time.perf_counter(), _loadavg()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((PUBLIC_EXAMPLES, *SHAPE), dtype=np.float32))
    y = tf.constant(rng.integers(0, NUM_CLASSES, PUBLIC_EXAMPLES).astype(np.int32))
    train_x, train_y = x[:TRAIN_EXAMPLES], y[:TRAIN_EXAMPLES]
    measured, report_models = {}, {}
    for name in _MODELS.value:
        with models.seeded(0):
            parameters = models.get(name)(SHAPE, NUM_CLASSES).count_params()
        measured[name] = {
            'train_128': measure(name, 128, False, train_x, train_y),
            'train_32': measure(name, 32, False, train_x, train_y),
            'forward_256': measure(name, PUBLIC_BATCH, True, x, y),
        }
        m = measured[name]
        report_models[name] = {
            'parameters': int(parameters),
            'bytes': int(parameters) * 4,
            'epoch_s': {
                key: {kind: m[key][f'{kind}_s_per_example'] * TRAIN_EXAMPLES for kind in ('wall', 'cpu')}
                for key in ('train_128', 'train_32')
            },
            'forward_3000_public_s': {
                kind: m['forward_256'][f'{kind}_s_per_example'] * PUBLIC_EXAMPLES for kind in ('wall', 'cpu')
            },
            'measurements': m,
        }
        e = report_models[name]['epoch_s']
        print(
            f'{name}: {parameters:,} params; epoch b128 {e["train_128"]["wall"]:.2f} s wall, '
            f'b32 {e["train_32"]["wall"]:.2f} s wall; load {_loadavg()}',
            flush=True,
        )
    report = {
        'command': 'uv run --locked python benchmarks/model_cost.py' + ''.join(f' {a}' for a in sys.argv[1:]),
        'machine': {
            'platform': f'{platform.machine()} {platform.system()}',
            'cores': os.cpu_count(),
            'tensorflow': tf.__version__,
            'loadavg_before': load_before,
            'loadavg_after': _loadavg(),
        },
        'settings': {
            'input_shape': list(SHAPE),
            'num_classes': NUM_CLASSES,
            'train_examples_per_client': TRAIN_EXAMPLES,
            'case2_train_examples_per_client': CASE2_TRAIN_EXAMPLES,
            'public_examples': PUBLIC_EXAMPLES,
            'public_batch': PUBLIC_BATCH,
            'local_epochs': LOCAL_EPOCHS,
            'learning_rate': LEARNING_RATE,
            'target_seconds': _TARGET_SECONDS.value,
            'repeats': _REPEATS.value,
        },
        'models': report_models,
        'rounds': round_costs(measured),
        'elapsed_s': time.perf_counter() - began,
    }
    os.makedirs(os.path.dirname(_OUT.value) or '.', exist_ok=True)
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(report, f, indent=2)
    write_markdown(_OUT.value + '.md', report)
    for label, r in report['rounds'].items():
        print(f'{label}: {r["wall_min"]:.1f} min wall, {r["cpu_min"]:.1f} CPU min', flush=True)


if __name__ == '__main__':
    app.run(main)
