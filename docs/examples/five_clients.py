"""Five clients as tf.data datasets, a Keras model, FedAvg and PersFL, per-client accuracy by the clients' ids."""

import numpy as np
import tensorflow as tf

from processes import fedavg, persfl
from tff_pfl import runtime
from tff_pfl.data import federated
from tff_pfl.program import training_loop

with np.load('../shared/data/mnist.npz') as f:
    x, y = f['x_train'][::6] / 255.0, f['y_train'][::6]
datasets = {f'hospital_{k}': tf.data.Dataset.from_tensor_slices((x[y // 2 == k], y[y // 2 == k])) for k in range(5)}
spec = federated.from_federated_data(datasets)


def model_fn():
    return tf.keras.Sequential([tf.keras.layers.Flatten(input_shape=(28, 28)), tf.keras.layers.Dense(10)])


with runtime.local_runtime():
    for build, settings in [
        (fedavg.build_fedavg_process, fedavg.FedAvgSettings()),
        (persfl.build_persfl_process, persfl.PersFLSettings()),
    ]:
        process = build(spec, model_fn, settings)
        result = training_loop.run(
            process, spec.client_ids, rounds=10, client_fraction=1.0, seed=0, source_ids=spec.source_ids
        )
        model = 'personalized_model' if 'personalized_model' in result.summary else 'global_model'
        print(type(settings).__name__, {row['source_id']: round(row[f'{model}_accuracy'], 3) for row in result.clients})
