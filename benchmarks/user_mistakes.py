"""A new user's mistakes with the Python API, each made again on Fashion-MNIST: what each gives.

    uv run --locked python benchmarks/user_mistakes.py --out=benchmarks/results/user_mistakes

Every row is one input a user wrote (the model, the data, the ids, the arguments) and what the
library does with it: refused in one line (the exception's type and message, raised before any
round), or taken (what a round then gives). The refused rows build no process and run no round;
the taken rows that need a round run one FedAvg round on a TFF worker this script starts. The
same rows are tests (tests/test_builder_inputs.py, tests/test_models.py, tests/test_batch_norm.py);
this script makes them on real data, as the user did. Writes `<out>.md` and `<out>.json`.
"""

import argparse
import collections
import json
import tempfile

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedavg, persfl
from tff_pfl import runtime
from tff_pfl.data import federated
from tff_pfl.program import evaluation, training_loop

SETTINGS = fedavg.FedAvgSettings(batch_size=32, client_learning_rate=0.05)


def stores():
    """Six 'stores' of Fashion-MNIST, three classes each, under the user's own ids: (x, y) per store."""
    with np.load('../shared/data/fashion_mnist.npz') as f:
        x, y = (f['x_train'][::30] / 255.0).astype(np.float32), f['y_train'][::30].astype(np.int32)
    return {f'store_{k}': (x[np.isin(y, [k, k + 2, k + 4])], y[np.isin(y, [k, k + 2, k + 4])]) for k in range(6)}


def logits_model():
    return tf.keras.Sequential([tf.keras.Input((28, 28)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(10)])


def dense_softmax():
    return tf.keras.Sequential(
        [tf.keras.Input((28, 28)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(10, activation=tf.nn.softmax)]
    )


def lambda_softmax():
    layers = [tf.keras.Input((28, 28)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(10)]
    return tf.keras.Sequential([*layers, tf.keras.layers.Lambda(tf.nn.softmax)])


def functional_softmax():
    inputs = tf.keras.Input((28, 28))
    return tf.keras.Model(inputs, tf.nn.softmax(tf.keras.layers.Dense(10)(tf.keras.layers.Flatten()(inputs))))


def batch_norm_model():
    inputs = tf.keras.Input((28, 28))
    hidden = tf.keras.layers.Dense(32)(tf.keras.layers.Flatten()(inputs))
    hidden = tf.keras.layers.ReLU()(tf.keras.layers.BatchNormalization(name='store_bn')(hidden))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(10)(hidden), name='store_bn_mlp')


def dropout_model():
    return tf.keras.Sequential(
        [
            tf.keras.Input((28, 28)),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(32, activation='relu'),
            tf.keras.layers.Dropout(0.2, name='store_dropout'),
            tf.keras.layers.Dense(10),
        ]
    )


INPUT_SPEC = (tf.TensorSpec([None, 28, 28], tf.float32), tf.TensorSpec([None], tf.int32))


def tff_model_on_probabilities():
    """`from_keras_model` of a softmax model with the Keras loss on probabilities (from_logits=False)."""
    return tff.learning.models.from_keras_model(
        dense_softmax(), loss=tf.keras.losses.SparseCategoricalCrossentropy(), input_spec=INPUT_SPEC
    )


class ZeroLoss(tf.keras.losses.Loss):
    def call(self, y_true, y_pred):
        return tf.reduce_sum(y_pred, axis=-1) * 0.0


def outcome(fn):
    """('refused', 'Type: message') for an exception, else ('taken', what fn returned)."""
    try:
        return 'taken', fn()
    except (TypeError, ValueError) as e:
        return 'refused', f'{type(e).__name__}: {e}'


def rows(cache):
    data = stores()
    spec = federated.from_federated_data(data, cache_dir=cache)

    def with_label(store, label):
        x, y = data[store]
        return {**data, store: (x, np.where(np.arange(len(y)) == 0, label, y).astype(np.int32))}

    def build(model_fn, **keywords):
        fedavg.build_fedavg_process(spec, model_fn, SETTINGS, **keywords)
        return 'built'

    def one_hot():
        return {k: (x, np.eye(10, dtype=np.int32)[y]) for k, (x, y) in data.items()}

    def written(clients):
        return federated.from_federated_data(clients, cache_dir=cache)

    tiny = {**data, 'store_tiny': (data['store_0'][0][:2], data['store_0'][1][:2])}
    user_client_data = tff.simulation.datasets.TestClientData(
        {k: collections.OrderedDict(x=x, y=y) for k, (x, y) in data.items()}
    )
    zero_loss = tff.learning.models.functional_model_from_keras(logits_model(), ZeroLoss(), INPUT_SPEC)
    return spec, [
        (1, '`Dense(10, activation=tf.nn.softmax)` as the model', lambda: build(dense_softmax)),
        (1, '`Lambda(tf.nn.softmax)` as the last layer', lambda: build(lambda_softmax)),
        (1, 'a functional model ending in `tf.nn.softmax(...)`', lambda: build(functional_softmax)),
        (1, '`from_keras_model` of a softmax model, loss from_logits=False', lambda: build(tff_model_on_probabilities)),
        (
            2,
            'label -1 for one example of store_1',
            lambda: written(with_label('store_1', -1)),
        ),
        (3, 'a label 11 with a 10-logit model', lambda: build_on(with_label('store_2', 11), logits_model, cache)),
        (
            3,
            'integer one-hot labels, y of shape (n, 10)',
            lambda: written(one_hot()),
        ),
        (
            5,
            'a store with 2 examples (no test data given)',
            lambda: written(tiny),
        ),
        (6, 'a `ClientData` where the spec goes', lambda: fedavg.build_fedavg_process(user_client_data, logits_model)),
        (6, "`model_aggregator='mean'`", lambda: build(logits_model, model_aggregator='mean')),
        (6, '`model_aggregator=tff.aggregators.MeanFactory` (the class)', lambda: build_class(spec)),
        (6, '`seed=None`', lambda: build(logits_model, seed=None)),
        (7, 'a model with BatchNormalization (FedAvg)', lambda: build(batch_norm_model)),
        (7, "Dropout in PersFL's model", lambda: persfl_build(spec, dropout_model)),
        (8, '`metrics={"auc": tf.keras.metrics.AUC(from_logits=True)}`', lambda: build(logits_model, metrics=auc())),
        (8, 'a FunctionalModel whose own loss is 0 for every example', lambda: build(zero_loss)),
    ]


def auc():
    return {'auc': tf.keras.metrics.AUC(from_logits=True)}


def build_on(data, model_fn, cache):
    spec = federated.from_federated_data(data, cache_dir=cache)
    fedavg.build_fedavg_process(spec, model_fn, SETTINGS)
    return 'built'


def build_class(spec):
    fedavg.build_fedavg_process(spec, logits_model, SETTINGS, model_aggregator=tff.aggregators.MeanFactory)
    return 'built'


def persfl_build(spec, model_fn):
    persfl.build_persfl_process(spec, model_fn, persfl.PersFLSettings(batch_size=32))
    return 'built'


def rounds_taken(spec):
    """The taken rows that need rounds: the user's ids in `initial_client_states`, a BN model and a Keras AUC, and
    the two result shapes (`training_loop.run`'s rows and `client_rows` of `process.evaluate`)."""
    process = fedavg.build_fedavg_process(spec, batch_norm_model, SETTINGS, metrics=auc())
    users = list(spec.source_ids)
    state, clients, _ = process.next(process.initialize(), process.initial_client_states(users[::-1]))
    state, clients, _ = process.next(state, clients)
    own_loop = evaluation.client_rows(spec, process.evaluate(state, clients))
    result = training_loop.run(
        process, spec.client_ids, rounds=2, client_fraction=1.0, seed=0, source_ids=spec.source_ids, log=lambda _: None
    )
    by_user = {
        row['source_id']: {
            'accuracy': round(100 * row['global_model_accuracy'], 2),
            'auc': round(row['global_model_auc'], 4),
        }
        for row in own_loop
    }
    unknown = outcome(lambda: process.initial_client_states(['store_0', 'store_9']))
    return {
        'initial_client_states(users reversed), two rounds of process.next, by user id': by_user,
        'initial_client_states([store_0, store_9])': unknown,
        'row keys: process.evaluate via client_rows': sorted(own_loop[0]),
        'row keys: training_loop.run(...).clients': sorted(result.clients[0]),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', required=True)
    args = parser.parse_args()
    tf.keras.utils.set_random_seed(0)  # the user's models' initial weights: the probe losses quoted in two rows
    with tempfile.TemporaryDirectory() as cache:
        spec, cases = rows(cache)
        table = []
        for item, what, fn in cases:
            verdict, detail = outcome(fn)
            table.append({'item': item, 'input': what, 'verdict': verdict, 'detail': str(detail)})
            print(item, what, verdict, str(detail)[:160], flush=True)
        with runtime.local_runtime():
            taken = rounds_taken(spec)
    assert all('\n' not in row['detail'] for row in table), 'a refusal of more than one line'
    with open(f'{args.out}.json', 'w') as f:
        json.dump({'rows': table, 'rounds': taken}, f, indent=1)
    lines = [
        "# A new user's mistakes with the Python API, made again on Fashion-MNIST",
        '',
        '`uv run --locked python benchmarks/user_mistakes.py --out=benchmarks/results/user_mistakes`:',
        "six stores of three classes each under the user's ids (`store_0` ... `store_5`), every 30th",
        'Fashion-MNIST training image. Item: 1 a softmax model, 2 a negative label, 3 labels against the',
        "model's width, 5 a tiny client, 6 a wrong object in an argument, 7 non-trainable weights and",
        "PersFL's layers, 8 Keras metric objects and a model's own loss, 4 and 9 (ids, row shape) below.",
        '',
        "| item | the user's input | what happens |",
        '|---|---|---|',
    ]
    for row in table:
        detail = row['detail'].replace('|', '\\|')
        lines.append(f'| {row["item"]} | {row["input"]} | {row["verdict"]}: `{detail}` |')
    users = taken['initial_client_states(users reversed), two rounds of process.next, by user id']
    lines += [
        '',
        'Taken, and run (FedAvg, the BatchNormalization model, a Keras AUC, two rounds of `process.next` on',
        "`initial_client_states` of the user's ids in reverse order; global model per store, scored with a fresh",
        "model's moving statistics as TFF's FedAvg keeps them; two rounds show that it runs, not what it reaches:",
        '[user_batch_norm.md](user_batch_norm.md) trains such a model for 10 rounds):',
        '',
        '| store | accuracy % | AUC |',
        '|---|---|---|',
        *[f'| {user} | {v["accuracy"]:.2f} | {v["auc"]:.4f} |' for user, v in users.items()],
        '',
        f"`initial_client_states(['store_0', 'store_9'])`: {taken['initial_client_states([store_0, store_9])'][0]}: "
        f'`{taken["initial_client_states([store_0, store_9])"][1]}`',
        '',
        'One row shape (item 9): `client_rows(spec, process.evaluate(...))` and `training_loop.run(...).clients`',
        'have the same keys: '
        + (
            '**yes**'
            if taken['row keys: process.evaluate via client_rows'] == taken['row keys: training_loop.run(...).clients']
            else '**no**'
        )
        + f' (`{", ".join(taken["row keys: process.evaluate via client_rows"])}`).',
        '',
    ]
    with open(f'{args.out}.md', 'w') as f:
        f.write('\n'.join(lines))


if __name__ == '__main__':
    main()
