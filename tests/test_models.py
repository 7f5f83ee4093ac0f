"""Model builders: architectures as the papers state them."""

import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        'alexnet',
        'alexnet_small',
        'char_gru',
        'fedavg_cnn',
        'gaussian_mean',
        'lenet',
        'logistic',
        'mnist_dnn',
        'mnist_dnn_bn',
        'persfl_cnn',
        'pfllib_cnn',
        'resnet18',
        'resnet_small',
        'shufflenet_small',
        'shufflenet_v2',
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


@pytest.mark.parametrize(
    'name',
    [
        'lenet',
        'alexnet_small',
        'resnet_small',
        'shufflenet_small',
        'fedavg_cnn',
        'alexnet',
        'resnet18',
        'shufflenet_v2',
    ],
)
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


# The paper-size models. Expected parameter counts are written out layer by
# layer here, independently of the builders, and checked against published counts.


def _conv(k, c_in, c_out, bias=True):
    return k * k * c_in * c_out + (c_out if bias else 0)


def _norm(c):  # batch norm's (or group norm's) trainable scale and offset
    return 2 * c


def _dense(n_in, n_out):
    return n_in * n_out + n_out


def _resnet18_params(in_channels, num_classes):
    total = _conv(3, in_channels, 64, bias=False) + _norm(64)
    c_in = 64
    for c_out, first_stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            total += _conv(3, c_in, c_out, False) + _norm(c_out) + _conv(3, c_out, c_out, False) + _norm(c_out)
            if block == 0 and (first_stride != 1 or c_in != c_out):
                total += _conv(1, c_in, c_out, False) + _norm(c_out)
            c_in = c_out
    return total + _dense(512, num_classes)


def _shufflenet_v2_params(in_channels, num_classes):
    def depthwise(c):
        return 3 * 3 * c

    total = _conv(3, in_channels, 24, bias=False) + _norm(24)
    c_in = 24
    for c_out, repeats in ((116, 4), (232, 8), (464, 4)):
        half = c_out // 2
        # stride-2 unit: left = dw(c_in) + 1x1 c_in->half; right = 1x1 c_in->half, dw(half), 1x1 half->half.
        total += depthwise(c_in) + _norm(c_in) + _conv(1, c_in, half, False) + _norm(half)
        total += _conv(1, c_in, half, False) + _norm(half) + depthwise(half) + _norm(half)
        total += _conv(1, half, half, False) + _norm(half)
        # stride-1 units: the right half only.
        unit = 2 * (_conv(1, half, half, False) + _norm(half)) + depthwise(half) + _norm(half)
        total += (repeats - 1) * unit
        c_in = c_out
    return total + _conv(1, 464, 1024, False) + _norm(1024) + _dense(1024, num_classes)


def test_fedavg_cnn_is_mcmahans_cnn():
    model = models.get('fedavg_cnn')((28, 28, 1), 10)
    want = _conv(5, 1, 32) + _conv(5, 32, 64) + _dense(7 * 7 * 64, 512) + _dense(512, 10)
    assert _params(model) == want == 1_663_370  # McMahan et al. 2017, Section 3
    assert [w.shape.as_list() for w in model.trainable_weights if len(w.shape) == 2] == [[3136, 512], [512, 10]]
    assert model(tf.zeros([2, 28, 28, 1])).shape == (2, 10)
    assert model.layers[-1].get_config()['activation'] == 'linear'  # logits


def test_pfllib_cnn_is_pfllibs_fedavg_cnn():
    model = models.get('pfllib_cnn')((28, 28, 1), 10)
    # 'valid' 5x5 convolutions and 2x2 pools: 28 -> 24 -> 12 -> 8 -> 4, so 4 * 4 * 64 = 1,024 features.
    want = _conv(5, 1, 32) + _conv(5, 32, 64) + _dense(4 * 4 * 64, 512) + _dense(512, 10)
    assert _params(model) == want == 582_026
    assert [w.shape.as_list() for w in model.trainable_weights if len(w.shape) == 2] == [[1024, 512], [512, 10]]
    assert model(tf.zeros([2, 28, 28, 1])).shape == (2, 10)
    assert model.layers[-1].get_config()['activation'] == 'linear'  # logits
    with pytest.raises(ValueError, match='at least 16x16'):
        models.get('pfllib_cnn')((15, 15, 1), 10)


def test_resnet18_parameters_and_cifar_stem():
    model = models.get('resnet18')((28, 28, 1), 10)
    assert _params(model) == _resnet18_params(1, 10) == 11_172_810
    # The usual CIFAR-10 ResNet-18 count (3 input channels, batch norm's trainable weights).
    assert _params(models.resnet18((32, 32, 3), 10)) == _resnet18_params(3, 10) == 11_173_962
    convs = [layer for layer in model.layers if isinstance(layer, tf.keras.layers.Conv2D)]
    assert convs[0].kernel_size == (3, 3) and convs[0].strides == (1, 1)
    assert len(convs) == 1 + 16 + 3  # stem, 8 blocks x 2, 3 projection shortcuts
    assert not any(isinstance(layer, tf.keras.layers.MaxPool2D) for layer in model.layers)
    # Feature maps 28 -> 28 (stage 1) -> 14 -> 7 -> 4.
    spatial = sorted({conv.output.shape[1] for conv in convs}, reverse=True)
    assert spatial == [28, 14, 7, 4]
    assert convs[-1].output.shape[-1] == 512


def test_shufflenet_v2_parameters_and_stages():
    model = models.get('shufflenet_v2')((28, 28, 1), 10)
    assert _params(model) == _shufflenet_v2_params(1, 10) == 1_263_422
    # torchvision's shufflenet_v2_x1_0 (3 channels, 1000 classes) has 2,278,604 parameters.
    assert _params(models.shufflenet_v2((32, 32, 3), 1000)) == _shufflenet_v2_params(3, 1000) == 2_278_604
    concats = [layer for layer in model.layers if isinstance(layer, tf.keras.layers.Concatenate)]
    assert [c.output.shape[1:] for c in concats] == ([(14, 14, 116)] * 4 + [(7, 7, 232)] * 8 + [(4, 4, 464)] * 4)
    stem = next(layer for layer in model.layers if isinstance(layer, tf.keras.layers.Conv2D))
    assert stem.strides == (1, 1) and stem.output.shape[1:] == (28, 28, 24)
    assert not any(isinstance(layer, tf.keras.layers.MaxPool2D) for layer in model.layers)
    # Group normalisation: 4 groups, 2 where the channels are not a multiple of 4 (58).
    groups = {(n.groups, n.input_shape[-1]) for n in model.layers if isinstance(n, tf.keras.layers.GroupNormalization)}
    assert (2, 58) in groups and all(c % g == 0 and g == (4 if c % 4 == 0 else 2) for g, c in groups)


def test_alexnet_parameters_and_feature_map():
    model = models.get('alexnet')((28, 28, 1), 10)
    convs = _conv(3, 1, 64) + _conv(3, 64, 192) + _conv(3, 192, 384) + _conv(3, 384, 256) + _conv(3, 256, 256)
    assert _params(model) == convs + _dense(256, 4096) + _dense(4096, 4096) + _dense(4096, 10) == 20_125_386

    # 28 -> 14 (stride-2 conv) -> 7 -> 3 -> 1: 256 features, as in KT-pFL's code; 2x2x256 on 32x32.
    def features(m):
        return next(layer for layer in m.layers if isinstance(layer, tf.keras.layers.Flatten)).output.shape[-1]

    assert features(model) == 256
    assert features(models.alexnet((32, 32, 3), 10)) == 2 * 2 * 256
    with pytest.raises(ValueError, match='at least 8x8'):
        models.alexnet((7, 7, 1), 10)


def test_paper_size_architectures_are_registered_and_fresh_per_call():
    # Shapes, weights and gradients of each: test_heterogeneous_architectures.
    assert models.PAPER_SIZE_IMAGE_ARCHITECTURES == ('lenet', 'alexnet', 'resnet18', 'shufflenet_v2')
    assert set(models.PAPER_SIZE_IMAGE_ARCHITECTURES) <= set(models.names())
    for name in ('fedavg_cnn', 'resnet18'):
        a, b = models.get(name)((28, 28, 1), 10), models.get(name)((28, 28, 1), 10)
        assert a.trainable_weights[0] is not b.trainable_weights[0]


def test_char_gru_parameters_and_shapes():
    model = models.get('char_gru')((80,), 90)
    gru = 3 * (8 * 256 + 256 * 256 + 2 * 256)  # kernel, recurrent kernel, input and recurrent biases
    assert model.count_params() == 90 * 8 + gru + 256 * 90 + 90 == 228_138
    assert model(np.zeros((2, 80), np.int32)).shape == (2, 80, 90)
    assert not model.non_trainable_weights
    with pytest.raises(ValueError, match='sequences of ids'):
        models.get('char_gru')((28, 28, 1), 10)


# --- logits out: a model ending in probabilities is refused at build time -----------------------


def _softmax_models(shape=(4,), classes=3):
    inputs = tf.keras.Input(shape)
    functional = tf.keras.Model(inputs, tf.keras.layers.Dense(classes, activation='softmax')(inputs), name='functional')
    return {
        'dense_softmax': tf.keras.Sequential(
            [tf.keras.Input(shape), tf.keras.layers.Dense(classes, activation='softmax')], name='dense_softmax'
        ),
        'softmax_layer': tf.keras.Sequential(
            [tf.keras.Input(shape), tf.keras.layers.Dense(classes), tf.keras.layers.Softmax()], name='softmax_layer'
        ),
        'activation_layer': tf.keras.Sequential(
            [tf.keras.Input(shape), tf.keras.layers.Dense(classes), tf.keras.layers.Activation('softmax')],
            name='activation_layer',
        ),
        'sigmoid': tf.keras.Sequential(
            [tf.keras.Input(shape), tf.keras.layers.Dense(classes, activation='sigmoid')], name='sigmoid'
        ),
        'functional': functional,
        'nested': tf.keras.Sequential([tf.keras.Input(shape), functional], name='nested'),
        # The same functions given as objects: tf.nn.softmax's __name__ is 'softmax_v2'.
        'tf_nn_softmax': tf.keras.Sequential(
            [tf.keras.Input(shape), tf.keras.layers.Dense(classes, activation=tf.nn.softmax, name='out')],
        ),
        'tf_sigmoid': tf.keras.Sequential(
            [tf.keras.Input(shape), tf.keras.layers.Dense(classes, activation=tf.sigmoid, name='out')],
        ),
        'lambda_softmax': tf.keras.Sequential(
            [tf.keras.Input(shape), tf.keras.layers.Dense(classes), tf.keras.layers.Lambda(tf.nn.softmax, name='out')]
        ),
        'functional_tf_nn_softmax': tf.keras.Model(inputs, tf.nn.softmax(tf.keras.layers.Dense(classes)(inputs))),
        'softmax_then_reshape': tf.keras.Sequential(
            [
                tf.keras.Input(shape),
                tf.keras.layers.Dense(classes, activation=tf.nn.softmax, name='out'),
                tf.keras.layers.Reshape((classes,)),
            ]
        ),
    }


PROBABILITY_MODELS = list(_softmax_models())
# Where the refusal can name the layer that computes the probabilities.
NAMED_LAYER = {'tf_nn_softmax': 'out', 'tf_sigmoid': 'out', 'lambda_softmax': 'out', 'softmax_then_reshape': 'out'}


@pytest.mark.parametrize('kind', PROBABILITY_MODELS)
def test_a_model_ending_in_probabilities_is_refused_in_one_line(kind):
    from tff_pfl.computations import model_weights

    with tf.Graph().as_default():
        model = _softmax_models()[kind]
        with pytest.raises(ValueError, match=r'ends in a (softmax|sigmoid) \(layer ') as caught:
            model_weights.check_logits(model)
    assert '\n' not in str(caught.value) and 'take logits' in str(caught.value)
    if kind in NAMED_LAYER:
        assert f"(layer '{NAMED_LAYER[kind]}')" in str(caught.value)


def _tff_softmax_model(kind):
    """A TFF model over a Keras model ending in a softmax, with the loss told so (from_logits=False)."""
    spec = (tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None], tf.int32))

    def keras_model():
        return tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3, activation=tf.nn.softmax)])

    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=False)
    if kind == 'variable_model':
        return lambda: tff.learning.models.from_keras_model(keras_model(), loss=loss, input_spec=spec)
    return tff.learning.models.functional_model_from_keras(keras_model(), loss, spec)


@pytest.mark.parametrize('kind', ['variable_model', 'functional_model'])
def test_a_tff_model_over_probabilities_is_refused_too(kind):
    from tff_pfl.computations import model_weights
    from tff_pfl.models import adapters

    model_fn = adapters.keras_model_fn(_tff_softmax_model(kind))
    with tf.Graph().as_default(), pytest.raises(ValueError, match=r'ends in a softmax \(layer ') as caught:
        model_weights.check_logits(model_fn())
    assert '\n' not in str(caught.value)


def test_logits_pass_the_check_log_softmax_included():
    from tff_pfl.computations import model_weights

    log_softmax = tf.keras.Sequential(
        [tf.keras.Input((4,)), tf.keras.layers.Dense(3), tf.keras.layers.Activation(tf.nn.log_softmax)]
    )
    model_weights.check_logits(log_softmax)
    model_weights.check_logits(tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)]))
    model_weights.check_logits(
        tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3), tf.keras.layers.Lambda(tf.nn.log_softmax)])
    )
    # A softmax inside the model, not at its output, is no concern.
    inputs = tf.keras.Input((4,))
    hidden = tf.keras.layers.Dense(3, activation=tf.nn.softmax)(inputs)
    model_weights.check_logits(tf.keras.Model(inputs, tf.keras.layers.Dense(3)(hidden)))


@pytest.mark.parametrize('name', models.names())
def test_every_registered_model_outputs_logits(name):
    from tff_pfl.computations import model_weights

    shape = (20,) if name == 'char_gru' else (28, 28, 1)
    model_weights.check_logits(models.get(name)(shape, 10))


# KT-pFL, FedDF and pFedDF build their clients' models from registered names (--architectures), not
# from the model function a builder is given.
BY_NAME = {'feddf', 'pfeddf', 'ktpfl'}


def test_every_builder_given_a_model_refuses_one_ending_in_softmax(tmp_path):
    from tests.conftest import make_linear_problem
    from tff_pfl.program import algorithms, run_config

    spec = make_linear_problem(tmp_path / 'data', public_examples=12)

    def model_fn():  # two layers with weights: FedPer keeps one shared
        return tf.keras.Sequential(
            [
                tf.keras.Input(spec.feature_shape),
                tf.keras.layers.Dense(8, activation='relu'),
                tf.keras.layers.Dense(spec.num_classes, activation='softmax'),
            ],
            name='mine',
        )

    built = set()
    for name in algorithms.names():
        extra = {'architectures': ('logistic',)} if name == 'ktpfl' else {}
        config = run_config.make_config(output_dir='', algorithm=name, num_clients=3, **extra).validate()
        try:
            algorithms.build(name, config.settings, spec, model_fn, config)
        except ValueError as e:
            assert str(e).startswith("model 'mine' ends in a softmax (layer 'dense_1')"), (name, str(e))
        else:
            built.add(name)
    assert built == BY_NAME


USER_MODELS = (
    open(os.path.join(REPO, 'docs', 'examples', 'my_models.py')).read().replace("'small_mlp'", "'user_small_mlp'")
)


def test_register_makes_a_model_available_by_name_and_guards_the_built_in_ones():
    def builder(input_shape, num_classes):
        return models.logistic_regression(input_shape, num_classes)

    models.register('user_test_model', builder)
    try:
        assert 'user_test_model' in models.names()
        assert models.get('user_test_model') is builder
        with pytest.raises(ValueError, match="'user_test_model' is registered already; pass replace=True"):
            models.register('user_test_model', builder)
        models.register('user_test_model', builder, replace=True)
    finally:
        models.unregister('user_test_model')
    assert 'user_test_model' not in models.names()
    with pytest.raises(ValueError, match="'mnist_dnn' is a built-in model"):
        models.register('mnist_dnn', builder)
    with pytest.raises(ValueError, match='^name must be lower-case'):
        models.register('My Model', builder)
    with pytest.raises(TypeError, match='^builder must be a function'):
        models.register('user_not_callable', 3)
    with pytest.raises(ValueError, match='not a model registered by register'):
        models.unregister('logistic')


def test_model_modules_registers_a_users_model_for_model_and_architectures(tmp_path):
    from tff_pfl.program import run_config

    path = tmp_path / 'my_models.py'
    path.write_text(USER_MODELS)
    try:
        config = run_config.make_config(
            output_dir=str(tmp_path / 'run'), model='user_small_mlp', model_modules=(str(path),)
        ).validate()
        assert config.model_name() == 'user_small_mlp'
        run_config.make_config(
            output_dir=str(tmp_path / 'run'),
            algorithm='ktpfl',
            architectures=('user_small_mlp', 'logistic'),
            model_modules=(str(path),),
        ).validate()
    finally:
        models.unregister('user_small_mlp')
    with pytest.raises(run_config.ConfigError, match="unknown model 'user_small_mlp'"):
        run_config.make_config(output_dir=str(tmp_path / 'run'), model='user_small_mlp').validate()


@pytest.mark.parametrize(
    'module, message',
    [
        ('no_such_module_anywhere', "--model_modules: cannot import 'no_such_module_anywhere': ModuleNotFoundError"),
        ('missing.py', '--model_modules: no file missing.py'),
        ('broken.py', "--model_modules: cannot import 'broken.py': ZeroDivisionError: division by zero"),
    ],
)
def test_a_model_module_that_cannot_be_imported_is_one_line_and_exit_2(
    module, message, tmp_path, train_in_process, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'broken.py').write_text('1 / 0\n')
    code, stderr = train_in_process(f'--model_modules={module}', f'--output_dir={tmp_path / "run"}')
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith(f'tff-pfl-train: error: {message}'), lines[0]
    assert not (tmp_path / 'run').exists()


def test_tff_pfl_train_runs_a_users_registered_model(tmp_path, train_in_process):
    path = tmp_path / 'my_models.py'
    path.write_text(USER_MODELS)
    out = tmp_path / 'run'
    try:
        code, stderr = train_in_process(
            f'--model_modules={path}',
            '--model=user_small_mlp',
            '--rounds=2',
            '--num_clients=4',
            '--eval_every=0',
            f'--output_dir={out}',
        )
    finally:
        models.unregister('user_small_mlp')
    assert code == 0, stderr[-3000:]
    with open(out / 'config.json') as f:
        config = f.read()
    assert '"model": "user_small_mlp"' in config and 'my_models.py' in config
    assert 'small_mlp' in (out / 'report.md').read_text()
