"""A user's own BatchNormalization model, ClientData and Keras AUC through FedAvg and FedBN, and FedAvg under
TFF's `train_model`, stopped before round 6 and resumed, against an uninterrupted run.

    uv run --locked python benchmarks/user_batch_norm.py --out=benchmarks/results/user_batch_norm

Writes `<out>.md` (per-client accuracy and AUC of each run; the resumed and the uninterrupted
program's final models compared) and `<out>.json`.
"""

import argparse
import asyncio
import collections
import contextlib
import json
import os
import tempfile

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedavg, fedbn
from tff_pfl import runtime
from tff_pfl.data import federated
from tff_pfl.program import tff_programs, training_loop

ROUNDS = 10


def user_data():
    """Eight 'stores' of Fashion-MNIST, three classes each, as a TestClientData with the user's own ids."""
    with np.load('../shared/data/fashion_mnist.npz') as f:
        x, y = f['x_train'][::20] / 255.0, f['y_train'][::20]
    examples = collections.defaultdict(list)
    for i, label in enumerate(y):
        for k in range(8):
            if label in {k, (k + 3) % 10, (k + 6) % 10} and i % 3 == k % 3:
                examples[f'store_{k}'].append(i)
    return tff.simulation.datasets.TestClientData(
        {cid: collections.OrderedDict(pixels=x[idx], label=y[idx]) for cid, idx in examples.items()}
    )


def user_model(input_shape, num_classes):
    inputs = tf.keras.Input(tuple(input_shape))
    hidden = tf.keras.layers.Dense(64)(tf.keras.layers.Flatten()(inputs))
    hidden = tf.keras.layers.ReLU()(tf.keras.layers.BatchNormalization(name='user_bn')(hidden))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(hidden), name='user_bn_mlp')


def per_client(spec, result, model):
    users = federated.by_user_id(spec, result.clients)
    return {
        user: {'accuracy': round(100 * row[f'{model}_accuracy'], 2), 'auc': round(row[f'{model}_auc'], 4)}
        for user, row in users.items()
    }


def program(process, initial, spec, root, crash_before=None):
    """`train_model` for ROUNDS rounds under `root`; with `crash_before`, the job dies asking for that round."""

    class Killed(Exception):
        pass

    class Iterator(tff_programs.ClientIdsIterator):
        def select(self, k=None):
            if crash_before is not None and self._round + 1 == crash_before:
                raise Killed(f'killed before round {crash_before}')
            return super().select(k)

    class Source(tff_programs.ClientIdsDataSource):
        def iterator(self):
            return Iterator(self._client_ids, self._seed)

    states = tff.program.FileProgramStateManager(os.path.join(root, 'state'), keep_total=ROUNDS + 1)
    run = tff.learning.programs.train_model(
        train_process=tff_programs.learning_process(process),
        train_data_source=Source(spec.client_ids, seed=0),
        train_per_round_clients=4,
        train_total_rounds=ROUNDS,
        program_state_manager=states,
        model_output_manager=tff.program.MemoryReleaseManager(),
        train_metrics_manager=tff.program.CSVFileReleaseManager(
            os.path.join(root, 'metrics.csv'), key_fieldname='round'
        ),
        evaluation_manager=None,
        evaluation_periodicity=ROUNDS,
    )
    with contextlib.suppress(Killed):  # the killed job: its saved rounds stay on disk
        asyncio.run(run)
    versions = asyncio.run(states.get_versions())
    saved, _ = asyncio.run(states.load_latest(tff.learning.programs.ProgramState(initial, 0, 0, None)))
    return versions, [np.asarray(w) for w in saved.state['model']]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', required=True)
    args = parser.parse_args()
    spec = federated.from_federated_data(user_data())

    def model_fn():
        return user_model(spec.feature_shape, spec.num_classes)

    auc = {'auc': tf.keras.metrics.AUC(from_logits=True)}
    settings = dict(batch_size=32, client_learning_rate=0.05)
    out = {}
    with runtime.local_runtime() as rt:
        for name, process, model in [
            (
                'FedAvg',
                fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(**settings), metrics=auc),
                'global_model',
            ),
            (
                'FedBN',
                fedbn.build_fedbn_process(spec, model_fn, fedbn.FedBNSettings(**settings), metrics=auc),
                'personalized_model',
            ),
        ]:
            result = training_loop.run(process, spec.client_ids, rounds=ROUNDS, client_fraction=1.0, seed=0)
            out[name] = per_client(spec, result, model)
        process = fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(**settings))
        initial = process.initialize()  # the saved state's structure, read in the synchronous context
        with tempfile.TemporaryDirectory() as root, tff_programs.native_context(rt):
            whole_versions, whole = program(process, initial, spec, os.path.join(root, 'whole'))
            killed_versions, _ = program(process, initial, spec, os.path.join(root, 'resumed'), crash_before=6)
            resumed_versions, resumed = program(process, initial, spec, os.path.join(root, 'resumed'))
    out['program'] = {
        'uninterrupted_versions': whole_versions,
        'killed_versions': killed_versions,
        'resumed_versions': resumed_versions,
        'max_abs_difference': float(max(np.abs(a - b).max() for a, b in zip(whole, resumed))),
    }
    lines = [
        "# A user's BatchNormalization model through FedAvg, FedBN and TFF's train_model",
        '',
        f'Eight stores of Fashion-MNIST (3 classes each), model Dense 64 - BatchNormalization - ReLU - Dense 10, '
        f'{ROUNDS} rounds, every store every round (train_model: 4 a round), batch 32, lr 0.05; '
        '`uv run --locked python benchmarks/user_batch_norm.py --out=benchmarks/results/user_batch_norm`.',
        '',
        '| store | FedAvg accuracy % | FedAvg AUC | FedBN accuracy % | FedBN AUC |',
        '|---|---:|---:|---:|---:|',
    ]
    for user in sorted(out['FedAvg']):
        a, b = out['FedAvg'][user], out['FedBN'][user]
        lines.append(f'| {user} | {a["accuracy"]:.2f} | {a["auc"]:.4f} | {b["accuracy"]:.2f} | {b["auc"]:.4f} |')
    for name in ('FedAvg', 'FedBN'):
        values = list(out[name].values())
        out[f'{name}_mean'] = {k: float(np.mean([v[k] for v in values])) for k in ('accuracy', 'auc')}
    lines.append(
        f'| mean | {out["FedAvg_mean"]["accuracy"]:.2f} | {out["FedAvg_mean"]["auc"]:.4f} | '
        f'{out["FedBN_mean"]["accuracy"]:.2f} | {out["FedBN_mean"]["auc"]:.4f} |'
    )
    p = out['program']
    lines += [
        '',
        f'train_model (FedAvg): uninterrupted, saved rounds {p["uninterrupted_versions"]}; killed before round 6, '
        f'saved {p["killed_versions"]}; resumed, saved {p["resumed_versions"]}; largest difference between the two '
        f'final models: {p["max_abs_difference"]}.',
    ]
    with open(f'{args.out}.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    with open(f'{args.out}.json', 'w') as f:
        json.dump(out, f, indent=1)
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
