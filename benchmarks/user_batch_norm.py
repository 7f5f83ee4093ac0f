"""A user's own BatchNormalization model, ClientData and Keras AUC through FedAvg, FedBN, PersFL, Local and
Ditto, and FedAvg and Ditto (its personal models on the devices) under TFF's `train_model`, stopped before
round 6 and resumed, against uninterrupted runs.

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

from processes import ditto, fedavg, fedbn, local, persfl
from tff_pfl import runtime
from tff_pfl.computations import device_state
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


def program(process, initial, spec, root, crash_before=None, templates=None):
    """`train_model` for ROUNDS rounds under `root`; with `crash_before`, the job dies asking for that round.

    Returns the saved versions, the final server state's leaves and, with `templates` (client id -> its initial
    state, made in the synchronous context: the client states are on the devices, `DeviceStatesDataSource`),
    every client's latest state's leaves.
    """
    devices = templates is not None

    class Killed(Exception):
        pass

    base = tff_programs.DeviceStatesIterator if devices else tff_programs.ClientIdsIterator

    class Iterator(base):
        def select(self, k=None):
            if crash_before is not None and self._round + 1 == crash_before:
                raise Killed(f'killed before round {crash_before}')
            return super().select(k)

    if devices:
        source = tff_programs.DeviceStatesDataSource(spec.client_ids, os.path.join(root, 'devices'), seed=0)
        source.iterator = lambda: Iterator(spec.client_ids, 0, os.path.join(root, 'devices'), restored=False)
    else:
        source = tff_programs.ClientIdsDataSource(spec.client_ids, seed=0)
        source.iterator = lambda: Iterator(spec.client_ids, 0)
    states = tff.program.FileProgramStateManager(os.path.join(root, 'state'), keep_total=ROUNDS + 1)
    run = tff.learning.programs.train_model(
        train_process=tff_programs.learning_process(process),
        train_data_source=source,
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
    leaves = [np.asarray(w) for w in saved.state['model']]
    if devices:
        for device in source.latest():
            if os.path.exists(device['state_file']):
                state = device_state.load(device['state_file'], templates[device['client_id']])
                leaves += [np.asarray(v) for v in device_state.flatten(state) if np.asarray(v).dtype.kind == 'f']
    return versions, leaves


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
        runs = [
            ('FedAvg', fedavg.build_fedavg_process, fedavg.FedAvgSettings, 'global_model'),
            ('FedBN', fedbn.build_fedbn_process, fedbn.FedBNSettings, 'personalized_model'),
            ('PersFL', persfl.build_persfl_process, persfl.PersFLSettings, 'personalized_model'),
            ('Local', local.build_local_process, local.LocalSettings, 'personalized_model'),
            ('Ditto', ditto.build_ditto_process, ditto.DittoSettings, 'personalized_model'),
        ]
        for name, build, settings_class, model in runs:
            process = build(spec, model_fn, settings_class(**settings), metrics=auc)
            result = training_loop.run(process, spec.client_ids, rounds=ROUNDS, client_fraction=1.0, seed=0)
            out[name] = per_client(spec, result, model)
        programs = [
            ('FedAvg', fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(**settings)), False),
            ('Ditto', ditto.build_ditto_process(spec, model_fn, ditto.DittoSettings(**settings)), True),
        ]
        for name, process, devices in programs:
            # Made in the synchronous context: the saved state's structure, the client states' templates.
            initial = (process.device.initialize if devices else process.initialize)()
            templates = {c: process.initial_client_state(c) for c in spec.client_ids} if devices else None
            with tempfile.TemporaryDirectory() as root, tff_programs.native_context(rt):
                whole_versions, whole = program(
                    process, initial, spec, os.path.join(root, 'whole'), templates=templates
                )
                killed_versions, _ = program(
                    process, initial, spec, os.path.join(root, 'resumed'), crash_before=6, templates=templates
                )
                resumed_versions, resumed = program(
                    process, initial, spec, os.path.join(root, 'resumed'), templates=templates
                )
            out[f'program_{name}'] = {
                'uninterrupted_versions': whole_versions,
                'killed_versions': killed_versions,
                'resumed_versions': resumed_versions,
                'tensors_compared': len(whole),
                'max_abs_difference': float(max(np.abs(a - b).max() for a, b in zip(whole, resumed, strict=True))),
            }
    names = ('FedAvg', 'FedBN', 'PersFL', 'Local', 'Ditto')
    lines = [
        "# A user's BatchNormalization model through FedAvg, FedBN, PersFL, Local, Ditto and TFF's train_model",
        '',
        f'Eight stores of Fashion-MNIST (3 classes each), model Dense 64 - BatchNormalization - ReLU - Dense 10, '
        f'{ROUNDS} rounds, every store every round (train_model: 4 a round), batch 32, lr 0.05; PersFL scores its '
        'personalized models after its distillation grid; Local and Ditto score personal models with their own moving '
        'statistics; '
        '`uv run --locked python benchmarks/user_batch_norm.py --out=benchmarks/results/user_batch_norm`.',
        '',
        '| store | ' + ' | '.join(f'{n} accuracy % | {n} AUC' for n in names) + ' |',
        '|---|' + '---:|---:|' * len(names),
    ]
    for user in sorted(out['FedAvg']):
        cells = [f'{out[n][user]["accuracy"]:.2f} | {out[n][user]["auc"]:.4f}' for n in names]
        lines.append(f'| {user} | ' + ' | '.join(cells) + ' |')
    for name in names:
        values = list(out[name].values())
        out[f'{name}_mean'] = {k: float(np.mean([v[k] for v in values])) for k in ('accuracy', 'auc')}
    means = [f'{out[f"{n}_mean"]["accuracy"]:.2f} | {out[f"{n}_mean"]["auc"]:.4f}' for n in names]
    lines += ['| mean | ' + ' | '.join(means) + ' |', '']
    for name, what in [('FedAvg', 'the final models'), ('Ditto', 'the final global models and every personal model')]:
        p = out[f'program_{name}']
        lines.append(
            f'train_model ({name}): uninterrupted, saved rounds {p["uninterrupted_versions"]}; killed before round 6, '
            f'saved {p["killed_versions"]}; resumed, saved {p["resumed_versions"]}; largest difference between '
            f'{what} of the two runs ({p["tensors_compared"]} tensors): {p["max_abs_difference"]}.'
        )
    with open(f'{args.out}.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    with open(f'{args.out}.json', 'w') as f:
        json.dump(out, f, indent=1)
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
