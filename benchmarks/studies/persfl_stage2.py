"""What limits PersFL's stage 2: the distillation settings, measured on validation data only.

MNIST and Fashion-MNIST, partition DS-1 (4 classes per client), 10 clients,
the MNIST DNN, stage 1 as in benchmarks/suites/persfl_mnist.toml (100 FedAvg
rounds, batch 32, learning rate 0.05, one local epoch, every client every
round). Stage 1 runs once per dataset and seed, through the library's own
PersFL process (`processes.persfl`), and gives three teachers per client:

  optimal     the process's optimal teacher O_k (Alg. 1, after `personalize`
              also weighed the final global model: what stage 2 starts from);
  final       the final global model (the paper's Table 4 ablation);
  best_local  the client's own model after its local epoch of a stage-1 round
              (G_{r-1} trained on its data), the one of lowest validation
              loss over the rounds, the criterion of O_k. Re-trained here in
              plain TF with the round's seed; the script checks that these
              models average to the next global model.

Stage 2 is then re-run from those teachers for many settings (`RUNS`): a
vectorized grid trainer like `distillation.distill_grid` (same loss
`losses.persfl_loss`, same batches), extended with momentum SGD and Adam, that
records every candidate's validation accuracy after every epoch. The script
checks that its SGD run at the default settings gives the library's own
`personalize` result (candidate accuracies and choice).

Measurement, validation only: each client's validation split is cut in two
seeded halves; the candidate (T, lambda) chosen on one half is scored on the
other, both ways round, and the two scores pooled ("cross-fitted validation
accuracy"): an estimate of the accuracy of the model the grid picks
without the optimism of scoring the best candidate on the data that picked it
(that number is reported too, as "in-sample"). Test data are read only with --final, for one
configuration chosen beforehand.

    uv run --locked python benchmarks/studies/persfl_stage2.py --seeds=0,1
    uv run --locked python benchmarks/studies/persfl_stage2.py --seeds=0,1 --final=default:5

Stage 1 and every stage-2 run are cached under --work_dir (a rerun only adds
what is missing); the report is written from the cache.
"""

import collections
import functools
import json
import os
import shutil
import sys
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

from processes import persfl
from tff_pfl import losses, models, reports, runtime
from tff_pfl.computations import distillation, local_training, model_weights
from tff_pfl.data import client_data, pipeline
from tff_pfl.models import stacked
from tff_pfl.program import client_states

DATASETS = collections.OrderedDict(
    [('mnist', '../shared/data/mnist.npz'), ('fashion_mnist', '../shared/data/fashion_mnist.npz')]
)
TEACHERS = ('optimal', 'final', 'best_local')
OPTIMIZERS = ('sgd', 'momentum', 'adam')

# Stage 2's settings of each run; `epochs` is the longest, every shorter count is read off the same run.
_SGD = dict(teacher='optimal', optimizer='sgd', learning_rate=0.01, batch_size=32, grid='default')
RUNS = collections.OrderedDict(
    [
        # The library's defaults (SGD, 0.01, batch 32), followed to 20 epochs, on an extended grid.
        ('default', dict(_SGD, epochs=20, grid='extended')),
        ('sgd_lr0.03', dict(_SGD, learning_rate=0.03, epochs=10)),
        ('adam_lr0.001', dict(_SGD, optimizer='adam', learning_rate=1e-3, epochs=10)),
        ('teacher_final', dict(_SGD, teacher='final', epochs=10)),
        ('teacher_best_local', dict(_SGD, teacher='best_local', epochs=10)),
        ('sgd_lr0.1', dict(_SGD, learning_rate=0.1, epochs=10)),
        ('sgd_lr0.003', dict(_SGD, learning_rate=0.003, epochs=10)),
        ('momentum0.9_lr0.003', dict(_SGD, optimizer='momentum', learning_rate=0.003, epochs=10)),
        ('adam_lr0.0001', dict(_SGD, optimizer='adam', learning_rate=1e-4, epochs=10)),
        ('batch128', dict(_SGD, batch_size=128, epochs=10)),
        ('batch10', dict(_SGD, batch_size=10, epochs=5)),
    ]
)
# Candidates added to the default grid in the 'extended' run: small lambda, low T.
EXTRA_CANDIDATES = [(t, 0.1) for t in (1.0, 2.0, 3.0, 5.0, 9.0)] + [
    (t, lam) for t in (2.0, 3.0) for lam in (0.25, 0.5, 0.75)
]
EPOCH_COLUMNS = (1, 2, 3, 5, 10, 15, 20)
MOMENTUM, BETA_1, BETA_2, EPSILON = 0.9, 0.9, 0.999, 1e-7  # Keras' Adam defaults

_DATASETS = flags.DEFINE_list('datasets', list(DATASETS), 'Datasets: ' + ', '.join(DATASETS) + '.')
_SEEDS = flags.DEFINE_list('seeds', ['0', '1'], 'Run seeds (partition, stage 1, batch order).')
_RUNS = flags.DEFINE_list('runs', list(RUNS), 'Stage-2 runs (names of RUNS), in the order they are computed.')
_ROUNDS = flags.DEFINE_integer('rounds', 100, 'Stage-1 FedAvg rounds.')
_WORK_DIR = flags.DEFINE_string('work_dir', 'runs/persfl_stage2', 'Cache of stage 1 and of the stage-2 runs.')
_OUT = flags.DEFINE_string('out', 'benchmarks/studies/results/persfl_stage2', 'Result path prefix (.md, .json, .png).')
_FINAL = flags.DEFINE_string(
    'final',
    '',
    'RUN:EPOCHS, e.g. default:5: re-train this one configuration and report its test accuracy '
    '(the grid chosen per client on the whole validation split, as PersFL does). Empty: no test data read.',
)
_TIME_BUDGET = flags.DEFINE_float(
    'time_budget_minutes', 0.0, 'Stop starting new stage-2 runs after this many minutes (0: no limit).'
)


def _fail(message: str):
    print(f'persfl_stage2: {message}', file=sys.stderr)
    sys.exit(2)


def _check_flags():
    """The flags as typed values; one line and exit 2 on a bad one."""
    for name in _DATASETS.value:
        if name not in DATASETS:
            _fail(f'unknown dataset {name!r}; known: {", ".join(DATASETS)}')
        if not os.path.isfile(DATASETS[name]):
            _fail(f'{DATASETS[name]} not found (run from the repository root)')
    try:
        seeds = [int(s) for s in _SEEDS.value]
    except ValueError:
        _fail(f'--seeds must be integers, got {",".join(_SEEDS.value)}')
    if not seeds or min(seeds) < 0:
        _fail('--seeds must be non-negative integers')
    unknown = [r for r in _RUNS.value if r not in RUNS]
    if unknown:
        _fail(f'unknown run {unknown[0]!r}; known: {", ".join(RUNS)}')
    if _ROUNDS.value < 1:
        _fail(f'--rounds must be >= 1, got {_ROUNDS.value}')
    final = None
    if _FINAL.value:
        name, _, epochs = _FINAL.value.partition(':')
        if name not in RUNS or not epochs.isdigit() or not 1 <= int(epochs) <= RUNS[name]['epochs']:
            _fail(f'--final must be RUN:EPOCHS with a known run and 1 <= EPOCHS <= its epochs, got {_FINAL.value!r}')
        final = (name, int(epochs))
    return seeds, final


# ----------------------------------------------------------------------------- stage 1


def _stage1_settings():
    # Stage 1 of benchmarks/suites/persfl_mnist.toml; stage 2's fields at their defaults.
    return persfl.PersFLSettings(batch_size=32, client_learning_rate=0.05, local_epochs=1).validate()


def _model_fn(spec):
    return functools.partial(models.get('mnist_dnn'), spec.feature_shape, spec.num_classes)


def _stack(per_client):
    """[clients][layers] arrays -> [layers] arrays of shape [clients, ...]."""
    return [np.stack([w[i] for w in per_client]) for i in range(len(per_client[0]))]


def run_stage1(unit_dir: str, dataset: str, seed: int, rounds: int) -> None:
    """FedAvg with PersFL's teachers through the library's process, then the best local models; cached.

    Writes `unit_dir/client_data/` and `unit_dir/stage1.npz` (teachers, their
    rounds, the library's own stage-2 result, and checks).
    """
    spec = pipeline.prepare(
        os.path.join(unit_dir, 'client_data'),
        dataset=f'npz:{DATASETS[dataset]}',
        partition_name='ds1',
        num_clients=10,
        seed=seed,
        split_fractions=(0.6, 0.2, 0.2),
        partition_params={'k': 4},
    ).spec
    model_fn = _model_fn(spec)
    settings = _stage1_settings()
    ids = list(spec.client_ids)
    start = time.perf_counter()
    with runtime.local_runtime(max_concurrent_computation_calls=2, log_path=os.path.join(unit_dir, 'worker.log')):
        process = persfl.build_persfl_process(spec, model_fn, settings, seed=seed)
        store = client_states.ClientStateStore(process, ids)
        state = process.initialize()
        global_models = [[np.asarray(w) for w in state['model']]]
        for _ in range(rounds):
            state, _ = store.run_round(process, state, ids)
            global_models.append([np.asarray(w) for w in state['model']])
        final_round = int(state['round_num'])
        store.personalize(process, state)
        states = store.all()
    stage1_seconds = time.perf_counter() - start
    print(f'{dataset} seed {seed}: stage 1 and the library stage 2 in {stage1_seconds:.0f} s', flush=True)
    start = time.perf_counter()
    best_local, best_local_round, average_error = _best_local_models(spec, model_fn, settings, seed, global_models)
    best_local_seconds = time.perf_counter() - start
    print(f'{dataset} seed {seed}: best local models in {best_local_seconds:.0f} s', flush=True)
    arrays = {}
    for name, per_client in (
        ('optimal', [[np.asarray(w) for w in s['teacher']] for s in states]),
        ('final', [global_models[-1]] * len(ids)),
        ('best_local', best_local),
    ):
        for i, leaf in enumerate(_stack(per_client)):
            arrays[f'{name}_{i}'] = leaf
    np.savez(
        os.path.join(unit_dir, 'stage1.npz'),
        **arrays,
        optimal_round=np.array([int(s['teacher_round']) for s in states]),
        best_local_round=np.array(best_local_round),
        library_grid_val_accuracy=np.stack([np.asarray(s['grid_val_accuracy']) for s in states]),
        library_temperature=np.array([float(s['temperature']) for s in states]),
        library_imitation=np.array([float(s['imitation']) for s in states]),
        final_round=np.array(final_round),
        local_average_error=np.array(average_error),
        stage1_seconds=np.array(stage1_seconds),
        best_local_seconds=np.array(best_local_seconds),
    )


def _best_local_models(spec, model_fn, settings, seed, global_models):
    """Each client's locally trained model of every round, kept where its validation loss is lowest.

    Round r's client model is G_{r-1} after the client's local epoch, with the
    batch order of the process's `client_training` (`client_seed(seed, r - 1,
    client)`). Returns the kept weights per client, their rounds (1-based),
    and the largest difference between the sample-weighted average of a
    round's client models and the next global model (0 up to float error when
    the re-training is exact).
    """
    model = model_fn()
    config = settings.training_config()
    ids = list(spec.client_ids)
    trained_sum = [[np.zeros_like(w, dtype=np.float64) for w in global_models[0]] for _ in global_models[1:]]
    best, best_round, weights_total = [], [], 0.0

    def local_round_fn(client_id, train, val):
        @tf.function(autograph=False)
        def local_round(weights, round_num):
            model_weights.assign_weights(model, weights)
            local_training.train_with(
                model, train, config, seed=local_training.client_seed(seed, round_num, tf.constant(client_id))
            )
            stats = local_training.evaluate(model, val)
            return model_weights.get_weights(model), stats.loss_sum / stats.num_examples

        return local_round

    for client_id in ids:
        train = client_data.read_split(spec, tf.constant(client_id), 'train')
        val = client_data.read_split(spec, tf.constant(client_id), 'val')
        local_round = local_round_fn(client_id, train, val)
        n = float(train.num_examples)
        weights_total += n
        lowest, kept, kept_round = np.inf, None, -1
        for r in range(1, len(global_models)):
            trained, loss = local_round([tf.constant(w) for w in global_models[r - 1]], tf.constant(r - 1))
            trained = [w.numpy() for w in trained]
            for acc, w in zip(trained_sum[r - 1], trained):
                acc += n * w
            if float(loss) < lowest:  # strictly lower, as Alg. 1 line 6
                lowest, kept, kept_round = float(loss), trained, r
        best.append(kept)
        best_round.append(kept_round)
    error = max(
        float(np.max(np.abs(s / weights_total - g)))
        for sums, nxt in zip(trained_sum, global_models[1:])
        for s, g in zip(sums, nxt)
    )
    return best, best_round, error


def _load_stage1(unit_dir):
    data = np.load(os.path.join(unit_dir, 'stage1.npz'))
    out = {k: data[k] for k in data.files}
    for name in TEACHERS:
        count = len([k for k in out if k.startswith(name + '_') and k[len(name) + 1 :].isdigit()])
        out[name] = [out.pop(f'{name}_{i}') for i in range(count)]
    return out


# ----------------------------------------------------------------------------- stage 2


def _halves(num_examples: int, seed: int, client: int):
    order = np.random.default_rng([seed, client, 0x57A6E2]).permutation(num_examples)
    half = num_examples // 2
    return np.sort(order[:half]), np.sort(order[half:])


def _update(optimizer, learning_rate, weights, grads, slots, step):
    """One optimizer step on stacked weights (every candidate its own, elementwise)."""
    if optimizer == 'sgd':
        return tuple(w - learning_rate * g for w, g in zip(weights, grads)), slots
    if optimizer == 'momentum':  # heavy ball, as tf.keras SGD(momentum=0.9) at a constant rate
        velocity = tuple(MOMENTUM * v + g for v, g in zip(slots, grads))
        return tuple(w - learning_rate * v for w, v in zip(weights, velocity)), velocity
    count = len(weights)
    first, second = slots[:count], slots[count:]
    t = tf.cast(step + 1, tf.float32)
    first = tuple(BETA_1 * m + (1.0 - BETA_1) * g for m, g in zip(first, grads))
    second = tuple(BETA_2 * v + (1.0 - BETA_2) * tf.square(g) for v, g in zip(second, grads))
    scale = learning_rate * tf.sqrt(1.0 - BETA_2**t) / (1.0 - BETA_1**t)
    new = tuple(w - scale * m / (tf.sqrt(v) + EPSILON) for w, m, v in zip(weights, first, second))  # as Keras
    return new, first + second


def make_trainer(layers, *, optimizer: str, learning_rate: float, batch_size: int):
    """`(epoch_fn, correct_fn)`: one epoch of the stacked grid, and per-candidate correct counts (TF code)."""
    rate = tf.constant(learning_rate, tf.float32)

    @tf.function(autograph=False, reduce_retracing=True)
    def epoch_fn(weights, slots, step, teacher, features, labels, permutation, temperatures, imitations, encoding):
        split = client_data.ClientSplit(features, labels, encoding)
        num_examples = split.num_examples
        batches = (num_examples + batch_size - 1) // batch_size

        def body(i, step, weights, slots):
            start = i * batch_size
            stop = tf.minimum(start + batch_size, num_examples)
            x, y = split.gather(permutation[start:stop])
            teacher_logits = stacked.forward(layers, list(teacher), x)[0]
            with tf.GradientTape() as tape:
                tape.watch(weights)
                student_logits = stacked.forward(layers, list(weights), x)
                loss = tf.reduce_sum(losses.persfl_loss(student_logits, teacher_logits, y, temperatures, imitations))
            grads = tape.gradient(loss, weights)
            weights, slots = _update(optimizer, rate, weights, grads, slots, step)
            return i + 1, step + 1, weights, slots

        _, step, weights, slots = tf.while_loop(
            lambda i, *_: i < batches, body, (tf.constant(0), step, tuple(weights), tuple(slots))
        )
        return weights, slots, step

    @tf.function(autograph=False, reduce_retracing=True)
    def correct_fn(weights, features, labels, encoding):
        x, y = client_data.ClientSplit(features, labels, encoding).slice(0, tf.shape(labels)[0])
        logits = stacked.forward(layers, list(weights), x)
        hits = tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), y[tf.newaxis, :])
        return tf.reduce_sum(tf.cast(hits, tf.int32), axis=1)

    return epoch_fn, correct_fn


def candidates_of(grid: str):
    base = distillation.grid_candidates(persfl.PersFLSettings().temperatures, persfl.PersFLSettings().imitations)
    return base + EXTRA_CANDIDATES if grid == 'extended' else base


def run_stage2(unit_dir: str, seed: int, run: dict, *, with_test: bool = False) -> dict:
    """One stage-2 configuration on every client; validation (and test) hits of every candidate after every epoch.

    Returns a dict of arrays: `hits_a`, `hits_b` (and `hits_test`) of shape
    [clients, epochs + 1, candidates] (epoch 0: the teacher), `n_a`, `n_b`
    (`n_test`) [clients], and `seconds`.
    """
    spec = client_data.load_client_data_spec(os.path.join(unit_dir, 'client_data'))
    stage1 = _load_stage1(unit_dir)
    with tf.Graph().as_default():
        layers = stacked.plan(_model_fn(spec)())
    candidates = candidates_of(run['grid'])
    temperatures, imitations = (tf.constant(a) for a in distillation.candidate_arrays(candidates))
    epoch_fn, correct_fn = make_trainer(
        layers, optimizer=run['optimizer'], learning_rate=run['learning_rate'], batch_size=run['batch_size']
    )
    encoding = spec.feature_encoding  # a Python string: decoding is chosen when tracing
    out = collections.defaultdict(list)
    start = time.perf_counter()
    for index, client_id in enumerate(spec.client_ids):
        cid = tf.constant(client_id)
        train = client_data.read_split(spec, cid, 'train')
        val = client_data.read_split(spec, cid, 'val')
        half_a, half_b = _halves(int(val.num_examples), seed, index)
        splits = {
            'a': (tf.gather(val.features, half_a), tf.gather(val.labels, half_a)),
            'b': (tf.gather(val.features, half_b), tf.gather(val.labels, half_b)),
        }
        if with_test:
            test = client_data.read_split(spec, cid, 'test')
            splits['test'] = (test.features, test.labels)
        teacher = tuple(tf.constant(w[index][np.newaxis]) for w in stage1[run['teacher']])
        weights = tuple(tf.repeat(w, len(candidates), axis=0) for w in teacher)
        slot_count = {'sgd': 0, 'momentum': 1, 'adam': 2}[run['optimizer']]
        slots = tuple(tf.zeros_like(w) for _ in range(slot_count) for w in weights)
        # The process's seed of this client's stage 2 (`client_personalize`), one permutation per epoch.
        seed_tensor = local_training.client_seed(seed, int(stage1['final_round']), cid, salt=1)
        permutations = local_training.epoch_permutations(seed_tensor, run['epochs'], train.num_examples)
        hits = {name: [correct_fn(weights, x, y, encoding).numpy()] for name, (x, y) in splits.items()}
        step = tf.constant(0)
        for epoch in range(run['epochs']):
            weights, slots, step = epoch_fn(
                weights,
                slots,
                step,
                teacher,
                train.features,
                train.labels,
                permutations[epoch],
                temperatures,
                imitations,
                encoding,
            )
            for name, (x, y) in splits.items():
                hits[name].append(correct_fn(weights, x, y, encoding).numpy())
        for name, (_, y) in splits.items():
            out[f'hits_{name}'].append(np.stack(hits[name]))
            out[f'n_{name}'].append(int(y.shape[0]))
    result = {k: np.asarray(v) for k, v in out.items()}
    result['seconds'] = np.array(time.perf_counter() - start)
    return result


# ----------------------------------------------------------------------------- selection and summaries


def _mask(candidates, subset: str):
    """Which candidates a grid subset keeps (see GRID_SUBSETS)."""
    default = set(candidates_of('default'))
    keep = {
        'default grid': lambda t, lam: (t, lam) in default,
        'lambda = 0 only (fine-tune the teacher)': lambda t, lam: lam == 0.0,
        'lambda > 0 only': lambda t, lam: (t, lam) in default and lam > 0.0,
        'T = 1 only': lambda t, lam: (t, lam) in default and t == 1.0,
        'lambda in {0, 0.25}': lambda t, lam: (t, lam) in default and lam in (0.0, 0.25),
        'extended grid (+ lambda 0.1, T 2, 3)': lambda t, lam: True,
    }[subset]
    return np.array([keep(t, lam) for t, lam in candidates])


GRID_SUBSETS = (
    'default grid',
    'lambda = 0 only (fine-tune the teacher)',
    'lambda > 0 only',
    'T = 1 only',
    'lambda in {0, 0.25}',
    'extended grid (+ lambda 0.1, T 2, 3)',
)


def _pick(scores, mask):
    """First best allowed index of `scores` [..., G] (ties: the earlier candidate)."""
    return np.argmax(np.where(mask, scores, -1), axis=-1)


def crossfit(result, epochs, mask=None):
    """Per-client cross-fitted validation accuracy at a fixed epoch count (or None: the best epoch per client).

    Returns `(accuracy [clients], chosen (epoch, candidate) on the whole
    validation split [clients] x 2, in-sample accuracy [clients])`.
    """
    hits_a, hits_b = result['hits_a'], result['hits_b']
    n_a, n_b = result['n_a'].astype(float), result['n_b'].astype(float)
    clients, last, count = hits_a.shape[0], hits_a.shape[1] - 1, hits_a.shape[2]
    mask = np.ones(count, bool) if mask is None else mask
    if epochs is None:  # choose (epoch >= 1, candidate) jointly; ties: fewer epochs, then grid order
        a, b = hits_a[:, 1:].reshape(clients, -1), hits_b[:, 1:].reshape(clients, -1)
        flat_mask = np.tile(mask, last)
        offset = 1
    else:
        a, b = hits_a[:, epochs], hits_b[:, epochs]
        flat_mask = mask
        offset = None
    rows = np.arange(clients)
    from_a, from_b = _pick(a / n_a[:, None], flat_mask), _pick(b / n_b[:, None], flat_mask)
    accuracy = (b[rows, from_a] + a[rows, from_b]) / (n_a + n_b)
    full = (a + b) / (n_a + n_b)[:, None]
    chosen = _pick(full, flat_mask)
    in_sample = full[rows, chosen]
    if offset is None:
        chosen_pair = np.stack([np.full(clients, epochs), chosen], axis=1)
    else:
        chosen_pair = np.stack([chosen // count + offset, chosen % count], axis=1)
    return accuracy, chosen_pair, in_sample


def summarize(units, run_names):
    """The numbers of the report, per dataset: mean over clients, then over seeds (in %)."""
    summary = collections.OrderedDict()
    for dataset, seeds in units.items():
        per = collections.OrderedDict()
        for name in run_names:
            results = [seeds[s]['runs'][name] for s in seeds if name in seeds[s]['runs']]
            if not results:
                continue
            run = RUNS[name]
            entry = {'config': run, 'seeds': len(results), 'epochs': {}}
            for e in [0, *range(1, run['epochs'] + 1), None]:
                values = [crossfit(r, e, _mask(candidates_of(run['grid']), 'default grid')) for r in results]
                key = 'per_client' if e is None else str(e)
                entry['epochs'][key] = {
                    'crossfit': 100 * float(np.mean([v[0].mean() for v in values])),
                    'crossfit_per_seed': [100 * float(v[0].mean()) for v in values],
                    'in_sample': 100 * float(np.mean([v[2].mean() for v in values])),
                }
                if e is None:
                    entry['epochs'][key]['chosen_epochs'] = [int(x) for v in values for x in v[1][:, 0]]
            entry['seconds'] = float(np.mean([float(r['seconds']) for r in results]))
            per[name] = entry
        summary[dataset] = per
    return summary


def grid_table(units, epochs):
    """Grid subsets of the 'default' run (extended grid) at `epochs`: cross-fitted accuracy per dataset."""
    rows = []
    candidates = candidates_of('extended')
    for subset in GRID_SUBSETS:
        row = {'grid': subset, 'candidates': int(_mask(candidates, subset).sum())}
        for dataset, seeds in units.items():
            results = [seeds[s]['runs']['default'] for s in seeds if 'default' in seeds[s]['runs']]
            if results:
                row[dataset] = 100 * float(
                    np.mean([crossfit(r, epochs, _mask(candidates, subset))[0].mean() for r in results])
                )
        rows.append(row)
    return rows


def chosen_distribution(units, run_name, epochs):
    """How often each lambda (and T, for 0 < lambda < 1) is chosen on the whole validation split."""
    out = collections.OrderedDict()
    run = RUNS[run_name]
    candidates = candidates_of(run['grid'])
    mask = _mask(candidates, 'default grid')
    for dataset, seeds in units.items():
        lambdas, temps = collections.Counter(), collections.Counter()
        for s in seeds:
            result = seeds[s]['runs'].get(run_name)
            if result is None:
                continue
            _, chosen, _ = crossfit(result, epochs, mask)
            for index in chosen[:, 1]:
                t, lam = candidates[index]
                lambdas[lam] += 1
                if 0 < lam < 1:
                    temps[t] += 1
        out[dataset] = {
            'lambda': {f'{k:g}': v for k, v in sorted(lambdas.items())},
            'T (0 < lambda < 1)': {f'{k:g}': v for k, v in sorted(temps.items())},
        }
    return out


# ----------------------------------------------------------------------------- report


def _cached_minutes(units):
    seconds = 0.0
    for seeds in units.values():
        for unit in seeds.values():
            seconds += float(unit['stage1']['stage1_seconds']) + float(unit['stage1'].get('best_local_seconds', 0.0))
            seconds += sum(float(r['seconds']) for r in unit['runs'].values())
    return seconds / 60


def _checks(units):
    rows = []
    for dataset, seeds in units.items():
        for seed, unit in seeds.items():
            stage1 = unit['stage1']
            row = {
                'dataset': dataset,
                'seed': seed,
                'local models vs next global (max abs)': float(stage1['local_average_error']),
                'optimal teacher round (mean)': float(np.mean(stage1['optimal_round'])),
                'best local round (mean)': float(np.mean(stage1['best_local_round'])),
            }
            result = unit['runs'].get('default')
            if result is not None:
                count = len(candidates_of('default'))
                mine = (result['hits_a'][:, 5, :count] + result['hits_b'][:, 5, :count]) / (
                    result['n_a'] + result['n_b']
                )[:, None]
                library = stage1['library_grid_val_accuracy']
                row['grid vs library, epoch 5 (max abs)'] = float(np.max(np.abs(mine - library)))
                row['same choice as library'] = f'{int(np.sum(np.argmax(mine, 1) == np.argmax(library, 1)))}/10'
            rows.append(row)
    return rows


# Paired comparisons against the default (run 'default', E=5, default grid): (label, run, epochs, grid subset).
PAIRED = (
    ('E=10', 'default', 10, 'default grid'),
    ('E=20', 'default', 20, 'default grid'),
    ('lambda = 0 only, E=5', 'default', 5, 'lambda = 0 only (fine-tune the teacher)'),
    ('teacher final, E=5', 'teacher_final', 5, 'default grid'),
    ('teacher best_local, no stage 2', 'teacher_best_local', 0, 'default grid'),
    ('teacher best_local, E=5', 'teacher_best_local', 5, 'default grid'),
    ('SGD lr 0.03, E=5', 'sgd_lr0.03', 5, 'default grid'),
    ('momentum 0.9 lr 0.003, E=5', 'momentum0.9_lr0.003', 5, 'default grid'),
    ('Adam lr 1e-4, E=5', 'adam_lr0.0001', 5, 'default grid'),
    ('Adam lr 1e-3, E=5', 'adam_lr0.001', 5, 'default grid'),
    ('batch 10, E=5', 'batch10', 5, 'default grid'),
    ('batch 128, E=5', 'batch128', 5, 'default grid'),
)


def paired_table(units):
    """Each comparison minus the default, per dataset and seed (points of cross-fitted validation accuracy)."""
    rows = []
    for label, name, epochs, subset in PAIRED:
        row = {'variant - default (E=5)': label}
        diffs = []
        for dataset, seeds in units.items():
            for seed, unit in seeds.items():
                if 'default' not in unit['runs'] or name not in unit['runs']:
                    continue
                base = crossfit(unit['runs']['default'], 5, _mask(candidates_of('extended'), 'default grid'))[0]
                result = unit['runs'][name]
                mask = _mask(candidates_of(RUNS[name]['grid']), subset)
                diff = 100 * float(crossfit(result, epochs, mask)[0].mean() - base.mean())
                row[f'{dataset} s{seed}'] = diff
                diffs.append(diff)
        if diffs:
            row['mean'] = float(np.mean(diffs))
            row['units > 0'] = f'{sum(d > 0 for d in diffs)}/{len(diffs)}'
            rows.append(row)
    return rows


def _noise_line(seeds, per):
    """The binomial standard error of one cell, and the optimism of in-sample validation accuracy."""
    results = [seeds[s]['runs']['default'] for s in seeds if 'default' in seeds[s]['runs']]
    if not results or 'default' not in per:
        return ''
    total = np.mean([float(np.sum(r['n_a'] + r['n_b'])) for r in results])
    p = per['default']['epochs']['5']['crossfit'] / 100
    se = 100 * np.sqrt(p * (1 - p) / total / len(results))
    five = per['default']['epochs']['5']
    return (
        f'{total:.0f} validation examples per seed (all clients); binomial standard error of one cell about '
        f'{se:.2f} points (differences between runs on the same examples vary less). In-sample validation '
        f'accuracy of default at E=5: {five["in_sample"]:.2f} (cross-fitted {five["crossfit"]:.2f}).'
    )


def _epoch_rows(summary, dataset):
    per = summary[dataset]
    default5 = per['default']['epochs']['5']['crossfit'] if 'default' in per else None
    rows = []
    for name, entry in per.items():
        run = entry['config']
        row = {
            'run': name,
            'teacher': run['teacher'],
            'optimizer': run['optimizer'],
            'lr': f'{run["learning_rate"]:g}',
            'batch': run['batch_size'],
            'seeds': entry['seeds'],
            'E=0 (teacher)': entry['epochs']['0']['crossfit'],
        }
        best = None
        for e in EPOCH_COLUMNS:
            if str(e) in entry['epochs']:
                value = entry['epochs'][str(e)]['crossfit']
                row[f'E={e}'] = value
        for e in range(1, run['epochs'] + 1):
            value = entry['epochs'][str(e)]['crossfit']
            if best is None or value > best[1]:
                best = (e, value)
        row['E per client'] = entry['epochs']['per_client']['crossfit']
        row['best fixed E'] = f'{best[1]:.2f} (E={best[0]})'
        if default5 is not None:
            row['best - default'] = best[1] - default5
        row['s / run'] = entry['seconds']
        rows.append(row)
    return rows


def write_report(units, summary, out, final):
    columns = ['run', 'teacher', 'optimizer', 'lr', 'batch', 'seeds', 'E=0 (teacher)']
    columns += [f'E={e}' for e in EPOCH_COLUMNS] + ['E per client', 'best fixed E', 'best - default', 's / run']
    seeds_text = ', '.join(str(s) for s in next(iter(units.values())))
    lines = [
        '# PersFL stage 2: what limits it (validation only)',
        '',
        'MNIST and Fashion-MNIST, DS-1 (4 classes per client), 10 clients, MNIST DNN; stage 1 as in '
        '`benchmarks/suites/persfl_mnist.toml` (100 FedAvg rounds, batch 32, lr 0.05, 1 local epoch), run once per '
        f'dataset and seed (seeds {seeds_text}) through the library process; every stage-2 variant starts from '
        'its teachers. Script: `benchmarks/studies/persfl_stage2.py` (its docstring has the protocol).',
        '',
        '    uv run --locked python benchmarks/studies/persfl_stage2.py --seeds='
        + ','.join(_SEEDS.value)
        + (f' --final={_FINAL.value}' if _FINAL.value else ''),
        '',
        f'Compute (sums over the cache; 2 cores shared with other jobs): {_cached_minutes(units):.1f} min for '
        f'stage 1 and the stage-2 runs'
        + (f', {sum(r["seconds"] for r in final) / 60:.1f} min for the test evaluation.' if final else '.'),
        '',
        "**Metric**: cross-fitted validation accuracy (%): each client's validation split is cut in two "
        'halves; the (T, lambda) candidate chosen on one half is scored on the other, both ways, pooled; '
        'mean over the 10 clients, then over seeds. No test data are used to choose anything. '
        '"default" is the library\'s stage 2 (SGD, lr 0.01, batch 32, optimal teacher, the 7 x 5 grid); '
        'its E=5 column is what `PersFLSettings()` does. "E per client" chooses the epoch count too, per '
        'client, on validation, with the grid. "best fixed E" is the highest of a run\'s E columns (picked after the '
        'fact, so itself slightly optimistic); "best - default" is it minus default at E=5.',
        '',
        '## Checks',
        '',
        reports.markdown_table(_checks(units), list(_checks(units)[0]), '{:.3g}'),
        '',
        "Local models vs next global: the best-local teachers are re-trained in plain TF with the rounds' seeds; "
        'their sample-weighted average is compared with the next global model of the process (largest weight '
        "difference). Grid vs library: this script's SGD grid at 5 epochs against the validation accuracies of "
        "the library's own `personalize` (same teacher, batches and candidates). The differences that are not "
        "float32 rounding come from the TFF worker's different floating-point order (the worker and this "
        'process run the same TF ops).',
        '',
        'Conclusions: [docs/algorithms/persfl.md, What limits stage 2 (measured)]'
        '(../../../docs/algorithms/persfl.md#what-limits-stage-2-measured).',
    ]
    for dataset in summary:
        lines += [
            '',
            f'## {dataset}: cross-fitted validation accuracy (%) per run and distillation epochs E',
            '',
            _noise_line(units[dataset], summary[dataset]),
            '',
            reports.markdown_table(_epoch_rows(summary, dataset), columns, '{:.2f}'),
            '',
            f'![{dataset}](persfl_stage2_{dataset}.png)',
        ]
    paired = paired_table(units)
    lines += [
        '',
        '## Paired differences from the default, per dataset and seed (points)',
        '',
        'Same clients, same validation examples: each variant minus `default` at E=5 (cross-fitted).',
        '',
        reports.markdown_table(paired, list(paired[0]) if paired else [], '{:+.2f}'),
    ]
    lines += ['', '## The grid: subsets of the default run (SGD, lr 0.01, batch 32, optimal teacher)', '']
    for epochs in (5, 20):
        rows = grid_table(units, epochs)
        lines += [
            f'E = {epochs}:',
            '',
            reports.markdown_table(rows, ['grid', 'candidates', *units], '{:.2f}'),
            '',
        ]
    lines += ['## Chosen lambda and T (whole validation split, as PersFL chooses), clients x seeds', '']
    for run_name, epochs in (('default', 5), ('default', 20)):
        for dataset, dist in chosen_distribution(units, run_name, epochs).items():
            lines.append(
                f'- {run_name}, E={epochs}, {dataset}: lambda {dist["lambda"]}; T where 0 < lambda < 1: '
                f'{dist["T (0 < lambda < 1)"]}'
            )
    if final is not None:
        lines += ['', '## Test accuracy of the chosen configuration (read once, after the choice)', '']
        lines.append(reports.markdown_table(final, [k for k in final[0] if k != 'seconds'], '{:.2f}'))
        lines += [
            '',
            "Test accuracy: mean over clients of each client's test accuracy (the bench suites' Avg. Acc.).",
        ]
    lines += [
        '',
        'In-sample validation accuracy (the chosen candidate scored on the data that chose it, what '
        '`personalized_val_accuracy` reports) is in the JSON (`in_sample`); it is higher than the cross-fitted '
        'number by the optimism of choosing the best of many.',
        '',
    ]
    reports.write_text_atomic(out + '.md', '\n'.join(lines))


def plot(summary, out):
    for dataset, per in summary.items():
        rows = []
        for e in range(0, 21):
            row = {'epochs': e}
            for name, entry in per.items():
                if str(e) in entry['epochs']:
                    row[name] = entry['epochs'][str(e)]['crossfit']
            rows.append(row)
        reports.plot_curves(
            rows,
            'epochs',
            list(per),
            f'{os.path.dirname(out)}/persfl_stage2_{dataset}.png',
            f'PersFL stage 2 on {dataset} DS-1: cross-fitted validation accuracy',
            'validation accuracy (%)',
        )


def final_test(units_dirs, final):
    """Test accuracy of one configuration: the grid chosen per client on the whole validation split.

    Cached per dataset and seed in `<unit>/final_<run>_E<epochs>.json`.
    """
    name, epochs = final
    run = dict(RUNS[name], epochs=epochs, grid='default')  # only what the choice uses
    rows = []
    for (dataset, seed), unit_dir in units_dirs.items():
        path = os.path.join(unit_dir, f'final_{name}_E{epochs}.json')
        if os.path.exists(path):
            with open(path) as f:
                rows.append(json.load(f))
            continue
        result = run_stage2(unit_dir, seed, run, with_test=True)
        mask = _mask(candidates_of(run['grid']), 'default grid')
        _, chosen, in_sample = crossfit(result, epochs, mask)
        test = result['hits_test'][np.arange(len(chosen)), epochs, chosen[:, 1]] / result['n_test']
        rows.append(
            {
                'dataset': dataset,
                'seed': seed,
                'configuration': f'{name}, E={epochs}',
                'val (in-sample)': 100 * float(in_sample.mean()),
                'test': 100 * float(test.mean()),
                'test std across clients': 100 * float(test.std()),
                'seconds': float(result['seconds']),
            }
        )
        with open(path, 'w') as f:
            json.dump(rows[-1], f)
        print(rows[-1], flush=True)
    return rows


def main(argv):
    del argv
    seeds, final = _check_flags()
    runtime.install_sigterm_handler()
    start_all = time.perf_counter()
    units, unit_dirs = collections.OrderedDict(), collections.OrderedDict()
    for seed in seeds:  # seed-major: a time budget leaves whole seeds
        for dataset in _DATASETS.value:
            unit_dir = os.path.abspath(os.path.join(_WORK_DIR.value, f'{dataset}_seed{seed}'))
            unit_dirs[(dataset, seed)] = unit_dir
            if not os.path.exists(os.path.join(unit_dir, 'stage1.npz')):
                if os.path.exists(os.path.join(unit_dir, 'client_data')):  # a stage 1 that did not finish
                    shutil.rmtree(os.path.join(unit_dir, 'client_data'))
                os.makedirs(unit_dir, exist_ok=True)
                run_stage1(unit_dir, dataset, seed, _ROUNDS.value)
            unit = {'stage1': _load_stage1(unit_dir), 'runs': collections.OrderedDict()}
            for name in _RUNS.value:
                path = os.path.join(unit_dir, f'run_{name}.npz')
                if not os.path.exists(path):
                    minutes = (time.perf_counter() - start_all) / 60
                    if _TIME_BUDGET.value and minutes > _TIME_BUDGET.value:
                        print(f'{dataset} seed {seed} {name}: skipped (time budget)', flush=True)
                        continue
                    result = run_stage2(unit_dir, seed, RUNS[name])
                    np.savez(path, **result)
                    print(f'{dataset} seed {seed} {name}: {float(result["seconds"]):.0f} s', flush=True)
                data = np.load(path)
                unit['runs'][name] = {k: data[k] for k in data.files}
            units.setdefault(dataset, collections.OrderedDict())[seed] = unit
    final_rows = final_test(unit_dirs, final) if final else None
    summary = summarize(units, _RUNS.value)
    total = time.perf_counter() - start_all
    os.makedirs(os.path.dirname(_OUT.value) or '.', exist_ok=True)
    plot(summary, _OUT.value)
    write_report(units, summary, _OUT.value, final_rows)
    payload = {
        'protocol': 'cross-fitted validation accuracy (%), mean over clients then seeds; see the .md',
        'seeds': seeds,
        'runs': summary,
        'grid_subsets': {str(e): grid_table(units, e) for e in (5, 20)},
        'chosen': {f'default_E{e}': chosen_distribution(units, 'default', e) for e in (5, 20)},
        'checks': _checks(units),
        'paired': paired_table(units),
        'final_test': final_rows,
        'compute_minutes': _cached_minutes(units) + sum(r['seconds'] for r in final_rows or []) / 60,
        'invocation_minutes': total / 60,
    }
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(payload, f, indent=1, default=lambda o: o.tolist() if hasattr(o, 'tolist') else str(o))
    print(open(_OUT.value + '.md').read())


if __name__ == '__main__':
    app.run(main)
