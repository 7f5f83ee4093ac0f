"""A learnable cross-device population for the scale benchmarks, written once and read as `clients:DIR`.

Synthetic(0, 0) of FedProx with `heterogeneity` h (`sources.synthetic_fedprox_clients`):
client k labels its data with W_k = sqrt(1 - h) W_0 + sqrt(h) W_k' (W_0 shared by every
client), 60 features, 10 classes, `EXAMPLES` = 4 training, 1 validation and 1 test example
per client, so that 1,000,000 clients fit in memory and on disk. Used by
`scale_population.py --data=shared` and `scale_resume.py`.
"""

import json
import os
import tempfile
import time

import numpy as np

EXAMPLES = (4, 1, 1)  # train, validation, test examples of every client
SEED = 0  # the generator's seed: the population, apart from the run seed
NUM_CLASSES = 10
DESCRIPTION = (
    "Synthetic(0,0) with heterogeneity h (W_k = sqrt(1-h) W_0 + sqrt(h) W_k'), 6 examples per client "
    '(4 train, 1 validation, 1 test), read as clients:DIR'
)


def root(directory: str, heterogeneity: float, num_clients) -> str:
    """Where the population of `num_clients` with `heterogeneity` lives under `directory`."""
    return os.path.abspath(os.path.join(directory, f'shared_h{heterogeneity:g}_n{num_clients}'))


def dataset(population: str) -> str:
    """The `--dataset` spec of a population written by `write`."""
    return f'clients:{os.path.join(population, "clients")}'


def write(population: str, num_clients: int, heterogeneity: float) -> dict:
    """Writes the population once (nothing if it exists), streamed: one client in memory at a time.

    `sources.synthetic_fedprox_clients(0, 0, heterogeneity=h, examples_per_client=6, seed=SEED)`;
    each client's first 4 examples train, the 5th validates, the 6th tests (the examples of a
    client are i.i.d.). Written twice in the same pass:
    - `clients/`: the library's per-client source (`clients:DIR`, docs/data.md): `manifest.json`
      and one `<id>.npz` per client in the Keras layout with its own validation split; what the
      runs name as their dataset, and what `tff-pfl-train --dataset=clients:DIR` reads;
    - `client_data/`: the same clients through the library's `client_data_writer.ClientDataWriter`, byte
      for byte what `pipeline.prepare` writes from `clients:DIR` into a run (`prepare_natural`:
      the clients in id order, their own splits, the source id beside), and `histogram.npy`.
      `prepare_linked` hard-links these files into a run instead of converting the npz files
      again (about 1.3 ms per client: 22 min at 1,000,000 clients).
    A staging directory is renamed into place, so a population exists only complete.

    Returns:
      `written.json`: the population's size, heterogeneity and the seconds it took to write.
    """
    from tff_pfl.data import client_data, client_data_writer, sources

    info = os.path.join(population, 'written.json')
    if not os.path.exists(population):
        os.makedirs(os.path.dirname(population), exist_ok=True)
        staging = tempfile.mkdtemp(prefix='.staging.', dir=os.path.dirname(population))
        start = time.monotonic()
        clients_dir = os.path.join(staging, 'clients')
        os.mkdir(clients_dir)
        ids, histogram = [], np.zeros((num_clients, NUM_CLASSES), np.int64)
        generator = sources.synthetic_fedprox_clients(
            0.0, 0.0, num_clients, seed=SEED, heterogeneity=heterogeneity, examples_per_client=sum(EXAMPLES)
        )
        cuts = np.cumsum(EXAMPLES)[:-1]
        with client_data_writer.ClientDataWriter(
            os.path.join(staging, 'client_data'), feature_shape=(60,), encoding=client_data.FLOAT32
        ) as writer:
            for index, (x, y) in enumerate(generator):
                client = f'c{index:07d}'
                splits = dict(zip(client_data.SPLITS, zip(np.split(x, cuts), np.split(y, cuts))))
                np.savez(
                    os.path.join(clients_dir, f'{client}.npz'),
                    **{f'{part}_{split}': a for split, xy in splits.items() for part, a in zip('xy', xy)},
                )
                writer.add_client(splits, source_id=client)
                histogram[index] = np.bincount(y, minlength=NUM_CLASSES)
                ids.append(client)
            writer.finish(NUM_CLASSES)
        with open(os.path.join(clients_dir, 'manifest.json'), 'w') as f:
            description = f'{DESCRIPTION}, h = {heterogeneity:g}, generator seed {SEED}'
            manifest = dict(format='npz', task='classification', num_classes=NUM_CLASSES, clients=ids)
            json.dump(dict(manifest, description=description), f)
        np.save(os.path.join(staging, 'histogram.npy'), histogram)
        with open(os.path.join(staging, 'written.json'), 'w') as f:
            json.dump(dict(num_clients=num_clients, heterogeneity=heterogeneity, seconds=time.monotonic() - start), f)
        os.rename(staging, population)
    with open(info) as f:
        return json.load(f)


def prepare_linked(prepare):
    """`pipeline.prepare`, but a population's client files are hard-linked from its `client_data/`.

    Any other dataset goes to `prepare`. The run's `config.json` still names `clients:DIR`, and
    its client files are those `prepare` would write, byte for byte (tests/test_shared_population.py).
    """
    from tff_pfl.data import client_data, pipeline

    def prepare_from_population(root, *, dataset, num_clients, **kwargs):
        population = os.path.dirname(dataset.partition(':')[2])
        cache = os.path.join(population, 'client_data')
        if not (dataset.startswith('clients:') and os.path.isdir(cache)):
            return prepare(root, dataset=dataset, num_clients=num_clients, **kwargs)
        os.makedirs(root)
        for name in os.listdir(cache):
            os.link(os.path.join(cache, name), os.path.join(root, name))
        spec = client_data.load_client_data_spec(root)
        if spec.num_clients != num_clients or kwargs.get('partition_name') != 'natural':
            raise ValueError(f'{dataset}: the population holds {spec.num_clients} clients, not {num_clients}')
        histogram = np.load(os.path.join(population, 'histogram.npy'))
        return pipeline.PreparedData(spec=spec, class_histogram=histogram, source_name=dataset)

    return prepare_from_population
