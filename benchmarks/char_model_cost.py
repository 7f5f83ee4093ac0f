"""What a next-character model costs to train here: the project's `char_gru` against TFF's baseline.

TFF's Shakespeare baseline model (`tff.simulation.baselines.shakespeare`,
`char_prediction_models.create_recurrent_model`: embedding 8, two LSTMs of 256
units, dense logits) against the project's `char_gru` (embedding 8, one GRU of
256, dense logits) and a 128-unit GRU: parameters, and seconds per training
sequence (80 characters) of plain-TensorFlow SGD steps on random ids at batch 4
and 10, the models measured in turn, round after round (`--repeats`), so that
they share the machine's load; the median over rounds is reported.

    uv run --locked python benchmarks/char_model_cost.py
"""

import json
import os
import platform
import statistics
import time

import numpy as np
import tensorflow as tf
from absl import app, flags
from tensorflow_federated.python.simulation.baselines.shakespeare import char_prediction_models

from tff_pfl import models
from tff_pfl.computations import local_training
from tff_pfl.data import text

_REPEATS = flags.DEFINE_integer('repeats', 5, 'Rounds of measurements (the median is kept).')
_STEPS = flags.DEFINE_integer('steps', 20, 'SGD steps per timed call.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/char_model_cost', 'Result path prefix (.json, .md).')

LENGTH, VOCAB = text.SEQUENCE_LENGTH, text.VOCAB_SIZE


def _gru(units):
    return tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=(LENGTH,), dtype='int32'),
            tf.keras.layers.Embedding(VOCAB, 8),
            tf.keras.layers.GRU(units, return_sequences=True),
            tf.keras.layers.Dense(VOCAB),
        ]
    )


BUILDERS = {
    'tff_baseline_lstm2x256': lambda: char_prediction_models.create_recurrent_model(VOCAB, LENGTH, mask_zero=False),
    'char_gru (gru 256)': lambda: models.get('char_gru')((LENGTH,), VOCAB),
    'gru 128': lambda: _gru(128),
}


def _timer(model, batch_size):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(1, VOCAB, size=(_STEPS.value * batch_size, LENGTH)).astype(np.int32))
    y = tf.constant(rng.integers(1, 87, size=(_STEPS.value * batch_size, LENGTH)).astype(np.int32))

    @tf.function
    def steps():
        for i in tf.range(_STEPS.value):
            xb, yb = x[i * batch_size : (i + 1) * batch_size], y[i * batch_size : (i + 1) * batch_size]
            with tf.GradientTape() as tape:
                loss, _ = local_training.supervised_loss(model, xb, yb)
            for v, g in zip(
                model.trainable_variables, local_training.dense_gradients(tape, loss, model.trainable_variables)
            ):
                v.assign_sub(0.1 * g)
        return loss

    steps()  # trace and warm up

    def timed():
        start = time.perf_counter()
        steps().numpy()
        return (time.perf_counter() - start) / (_STEPS.value * batch_size)

    return timed


def main(argv):
    del argv
    built = {name: build() for name, build in BUILDERS.items()}
    timers = {(name, b): _timer(m, b) for name, m in built.items() for b in (4, 10)}
    samples = {key: [] for key in timers}
    load_before = os.getloadavg()
    for _ in range(_REPEATS.value):
        for key, timed in timers.items():
            samples[key].append(timed())
    load_after = os.getloadavg()
    rows = []
    for name, model in built.items():
        row = {'model': name, 'parameters': int(model.count_params())}
        for b in (4, 10):
            row[f'ms_per_sequence_b{b}'] = 1000 * statistics.median(samples[(name, b)])
        rows.append(row)
    base = rows[0]
    for row in rows:
        row['time_vs_baseline_b4'] = row['ms_per_sequence_b4'] / base['ms_per_sequence_b4']
    result = dict(
        machine=f'{platform.machine()} {platform.system()}, {os.cpu_count()} cores',
        tensorflow=tf.__version__,
        load_before=load_before,
        load_after=load_after,
        repeats=_REPEATS.value,
        steps=_STEPS.value,
        rows=rows,
    )
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(result, f, indent=1)
    lines = [
        '# Next-character models: parameters and training time per sequence',
        '',
        'Command: `uv run --locked python benchmarks/char_model_cost.py`',
        '',
        f'Machine: {result["machine"]}, TensorFlow {tf.__version__}; load average (1, 5, 15 min) '
        f'{[round(v, 2) for v in load_before]} before, {[round(v, 2) for v in load_after]} after. Sequences of '
        f'{LENGTH} ids, plain-TensorFlow SGD steps, the models measured in turn over {_REPEATS.value} rounds of '
        f'{_STEPS.value} steps each; median milliseconds per training sequence.',
        '',
        '| model | parameters | ms / sequence, batch 4 | ms / sequence, batch 10 | time vs TFF baseline (batch 4) |',
        '|---|---:|---:|---:|---:|',
    ]
    for row in rows:
        lines.append(
            f'| {row["model"]} | {row["parameters"]:,} | {row["ms_per_sequence_b4"]:.2f} | '
            f'{row["ms_per_sequence_b10"]:.2f} | {row["time_vs_baseline_b4"]:.2f} |'
        )
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
