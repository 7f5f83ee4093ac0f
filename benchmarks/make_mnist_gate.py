"""Writes tests/data/mnist_gate.npz, the learning gate's data (tests/test_learning_gate.py).

A seeded sample of the real MNIST file in ../shared/data (docs/data.md gives
its provenance), in the same Keras layout: 1,600 of its training images and
400 of its test images, uint8, kept in their original order.

    uv run --locked python benchmarks/make_mnist_gate.py ../shared/data/mnist.npz
"""

import os
import sys

import numpy as np

TRAIN, TEST, SEED = 1600, 400, 0


def main(source: str) -> None:
    data = np.load(source)
    rng = np.random.default_rng(SEED)
    train = np.sort(rng.choice(len(data['y_train']), TRAIN, replace=False))
    test = np.sort(rng.choice(len(data['y_test']), TEST, replace=False))
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tests', 'data', 'mnist_gate.npz')
    np.savez_compressed(
        out,
        x_train=data['x_train'][train],
        y_train=data['y_train'][train],
        x_test=data['x_test'][test],
        y_test=data['y_test'][test],
    )
    print(f'wrote {out}')


if __name__ == '__main__':
    main(sys.argv[1] if len(sys.argv) > 1 else '../shared/data/mnist.npz')
