"""Model builders: architectures as the papers state them."""

import numpy as np
import pytest
import tensorflow as tf

from tff_pfl import models


def _params(model):
    return int(sum(np.prod(w.shape) for w in model.trainable_weights))


def test_mnist_dnn_is_784_100_10():
    model = models.get('mnist_dnn')((28, 28, 1), 10)
    assert [w.shape.as_list() for w in model.trainable_weights] == [[784, 100], [100], [100, 10], [10]]
    assert model(tf.zeros([2, 28, 28, 1])).shape == (2, 10)


def test_persfl_cnn_on_cifar_shapes():
    model = models.get('persfl_cnn')((32, 32, 3), 10)
    # conv 5x5x3x6, conv 5x5x6x16, then 400-120-84-10.
    assert _params(model) == (5 * 5 * 3 * 6 + 6) + (5 * 5 * 6 * 16 + 16) + (400 * 120 + 120) + (120 * 84 + 84) + (
        84 * 10 + 10
    )
    assert model(tf.zeros([2, 32, 32, 3])).shape == (2, 10)


def test_persfl_cnn_on_mnist_projects_to_400():
    model = models.get('persfl_cnn')((28, 28, 1), 10)
    dense_shapes = [w.shape.as_list() for w in model.trainable_weights if len(w.shape) == 2]
    assert dense_shapes == [[256, 400], [400, 120], [120, 84], [84, 10]]


def test_logistic_regression_and_registry():
    model = models.get('logistic')((60,), 10)
    assert _params(model) == 60 * 10 + 10
    assert models.names() == [
        'alexnet_small',
        'gaussian_mean',
        'lenet',
        'logistic',
        'mnist_dnn',
        'persfl_cnn',
        'resnet_small',
        'shufflenet_small',
    ]
    with pytest.raises(ValueError, match='unknown model'):
        models.get('resnet999')
    with pytest.raises(ValueError, match='image inputs'):
        models.persfl_cnn((784,), 10)


def test_builders_return_fresh_models():
    builder = models.get('mnist_dnn')
    a, b = builder((784,), 10), builder((784,), 10)
    assert a.trainable_weights[0] is not b.trainable_weights[0]


def test_seeded_initial_weights_are_reproducible_across_processes():
    import subprocess
    import sys

    script = (
        'import random; random.seed(None); import numpy as np; '
        'from tff_pfl import models\n'
        'with models.seeded(4):\n'
        '    m = models.mnist_dnn((5,), 3)\n'
        'print(float(np.sum(m.get_weights()[0])))'
    )
    outputs = {
        subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert len(outputs) == 1, outputs


def test_seeded_restores_python_and_numpy_generators():
    import random

    random.seed(1)
    np.random.seed(1)
    expected = (random.random(), np.random.rand())
    random.seed(1)
    np.random.seed(1)
    with models.seeded(99):
        models.mnist_dnn((5,), 3)
    assert (random.random(), np.random.rand()) == expected


@pytest.mark.parametrize('name', ['lenet', 'alexnet_small', 'resnet_small', 'shufflenet_small'])
def test_heterogeneous_architectures(name):
    model = models.get(name)((28, 28, 1), 10)
    assert model(tf.zeros([3, 28, 28, 1])).shape == (3, 10)
    assert not model.non_trainable_weights
    # A gradient reaches every weight.
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.random.normal([2, 28, 28, 1])) ** 2)
    assert all(g is not None for g in tape.gradient(loss, model.trainable_weights))


@pytest.mark.parametrize(
    'shape, want',
    [
        ((28, 28, 1), models.PAPER_IMAGE_ARCHITECTURES),
        ((32, 32, 3), models.PAPER_IMAGE_ARCHITECTURES),
        ((16, 16, 1), models.PAPER_IMAGE_ARCHITECTURES),
        ((15, 15, 1), models.VECTOR_ARCHITECTURES),  # too small for LeNet's two conv + pool stages
        ((6, 6, 1), models.VECTOR_ARCHITECTURES),
        ((784,), models.VECTOR_ARCHITECTURES),
        ((60,), models.VECTOR_ARCHITECTURES),
        ((4,), models.VECTOR_ARCHITECTURES),
    ],
)
def test_default_architectures_build_on_the_shapes_they_are_chosen_for(shape, want):
    assert models.PAPER_IMAGE_ARCHITECTURES == ('lenet', 'alexnet_small', 'resnet_small', 'shufflenet_small')
    assert models.VECTOR_ARCHITECTURES == ('logistic', 'mnist_dnn')
    chosen = models.default_architectures(shape)
    assert chosen == want
    for name in chosen:
        model = models.get(name)(shape, 10)
        assert model(tf.zeros([2, *shape])).shape == (2, 10)


def test_lenet_needs_16x16():
    with pytest.raises(ValueError), tf.Graph().as_default():
        models.get('lenet')((15, 15, 1), 10)
