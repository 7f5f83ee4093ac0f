"""One builder contract: every `build_<algo>_process` takes client_optimizer, server_optimizer,
model_aggregator, loss and metrics, uses each where its algorithm has a place for it, and refuses it in one line
(naming the argument and why) where it has none."""

import collections
import collections.abc
import functools
import importlib
import inspect
import os
import pkgutil
import re

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import processes
from processes import (
    apfl,
    ditto,
    fedala,
    fedamp,
    fedavg,
    fedbabu,
    fedbn,
    feddbe,
    feddf,
    fedfomo,
    fedper,
    fedproto,
    fedrep,
    fedrod,
    kdpdfl,
    ktpfl,
    ktpfl_homo,
    lgfedavg,
    local,
    perfedavg,
    persfl,
    pfedhn,
    pfedme,
    selffl,
)
from tff_pfl import models
from tff_pfl.computations import building_blocks, local_training, template
from tff_pfl.data import client_data, federated

LOCAL = dict(local_steps=2, batch_size=8, client_learning_rate=0.1)
EPOCH = dict(local_epochs=1, batch_size=16, client_learning_rate=0.1)
PUBLIC = dict(public_examples=40, public_batch=20, public_distill_batch_size=10)


def _own_model(fn, builder, spec):
    """The model of an entry that needs more than one Keras layer: `fn` itself where it is a FunctionalModel (which
    such a builder refuses, `FUNCTIONAL`), else a function of `builder`'s model that reads `spec` only when called,
    so a builder given a wrong `spec` refuses it before any model is built."""
    if isinstance(fn, tff.learning.models.FunctionalModel):
        return fn
    return lambda: builder(spec.feature_shape, spec.num_classes)


def _builders(work=LOCAL):
    """builder name -> (build(spec, model_fn, **keywords), the contract keywords it uses); `work`: the local work."""
    c, s, a, lo, m = building_blocks.CONTRACT_KEYWORDS
    return {
        'build_fedavg_process': (
            lambda spec, fn, **kw: fedavg.build_fedavg_process(spec, fn, fedavg.FedAvgSettings(**work), **kw),
            {c, s, a, lo, m},
        ),
        'build_persfl_process': (
            lambda spec, fn, **kw: persfl.build_persfl_process(
                spec, fn, persfl.PersFLSettings(**work, temperatures=(1.0,), imitations=(0.5,)), **kw
            ),
            {c, s, a, m},
        ),
        'build_ditto_process': (
            lambda spec, fn, **kw: ditto.build_ditto_process(spec, fn, ditto.DittoSettings(**work), **kw),
            {c, s, a, lo, m},
        ),
        'build_fedper_process': (
            lambda spec, fn, **kw: fedper.build_fedper_process(
                spec,
                _own_model(fn, models.mnist_dnn, spec),
                fedper.FedPerSettings(**work),
                **kw,
            ),
            {c, s, a, lo, m},
        ),
        'build_fedrep_process': (
            lambda spec, fn, **kw: fedrep.build_fedrep_process(
                spec,
                _own_model(fn, models.mnist_dnn, spec),
                fedrep.FedRepSettings(**work, fedrep_head_epochs=1),
                **kw,
            ),
            {s, a, lo, m},
        ),
        'build_fedrod_process': (
            lambda spec, fn, **kw: fedrod.build_fedrod_process(
                spec, _own_model(fn, models.mnist_dnn, spec), fedrod.FedRoDSettings(**work), **kw
            ),
            {s, a, lo, m},
        ),
        'build_feddbe_process': (
            lambda spec, fn, **kw: feddbe.build_feddbe_process(
                spec, _own_model(fn, models.mnist_dnn, spec), feddbe.FedDBESettings(**work), **kw
            ),
            {s, a, lo, m},
        ),
        'build_fedproto_process': (
            lambda spec, fn, **kw: fedproto.build_fedproto_process(
                spec, _own_model(fn, models.mnist_dnn, spec), fedproto.FedProtoSettings(**work), **kw
            ),
            {c, lo, m},
        ),
        'build_fedbabu_process': (
            lambda spec, fn, **kw: fedbabu.build_fedbabu_process(
                spec,
                _own_model(fn, models.mnist_dnn, spec),
                fedbabu.FedBABUSettings(**work, fedbabu_finetune_epochs=1),
                **kw,
            ),
            {s, a, lo, m},
        ),
        'build_fedala_process': (
            lambda spec, fn, **kw: fedala.build_fedala_process(
                spec,
                _own_model(fn, models.mnist_dnn, spec),
                fedala.FedALASettings(**work, fedala_start_passes=2),
                **kw,
            ),
            {c, s, a, lo, m},
        ),
        'build_lgfedavg_process': (
            lambda spec, fn, **kw: lgfedavg.build_lgfedavg_process(
                spec,
                _own_model(fn, models.mnist_dnn, spec),
                lgfedavg.LGFedAvgSettings(**work),
                **kw,
            ),
            {c, s, a, lo, m},
        ),
        'build_fedbn_process': (
            lambda spec, fn, **kw: fedbn.build_fedbn_process(
                spec,
                _own_model(fn, models.mnist_dnn_bn, spec),
                fedbn.FedBNSettings(**work),
                **kw,
            ),
            {c, s, a, lo, m},
        ),
        'build_local_process': (
            lambda spec, fn, **kw: local.build_local_process(spec, fn, local.LocalSettings(**work), **kw),
            {c, lo, m},
        ),
        'build_apfl_process': (
            lambda spec, fn, **kw: apfl.build_apfl_process(spec, fn, apfl.APFLSettings(**work), **kw),
            {s, a, lo, m},
        ),
        'build_perfedavg_process': (
            lambda spec, fn, **kw: perfedavg.build_perfedavg_process(spec, fn, **kw),
            {s, a, lo, m},
        ),
        'build_pfedme_process': (
            lambda spec, fn, **kw: pfedme.build_pfedme_process(spec, fn, **kw),
            {s, a, lo, m},
        ),
        'build_selffl_process': (
            lambda spec, fn, **kw: selffl.build_selffl_process(spec, fn, **kw),
            {s, lo, m},
        ),
        'build_ktpfl_process': (
            lambda spec, fn, **kw: ktpfl.build_ktpfl_process(
                spec, ktpfl.KTpFLSettings(**work, **PUBLIC, architectures=('logistic',)), **kw
            ),
            {c, lo, m},
        ),
        'build_ktpfl_homogeneous_process': (
            lambda spec, fn, **kw: ktpfl_homo.build_ktpfl_homogeneous_process(
                spec, fn, ktpfl_homo.KTpFLHomoSettings(**work), **kw
            ),
            {c, lo, m},
        ),
        'build_feddf_process': (
            lambda spec, fn, **kw: feddf.build_feddf_process(
                spec, feddf.FedDFSettings(**work, **PUBLIC, architectures=('logistic',)), **kw
            ),
            {c, lo, m},
        ),
        'build_fedamp_process': (
            lambda spec, fn, **kw: fedamp.build_fedamp_process(spec, fn, fedamp.FedAMPSettings(**work), **kw),
            {c, lo, m},
        ),
        'build_pfedhn_process': (
            lambda spec, fn, **kw: pfedhn.build_pfedhn_process(
                spec, fn, pfedhn.PFedHNSettings(pfedhn_local_steps=2, batch_size=8, client_learning_rate=0.1), **kw
            ),
            {c, s, lo, m},
        ),
        'build_fedfomo_process': (
            lambda spec, fn, **kw: fedfomo.build_fedfomo_process(spec, fn, fedfomo.FedFomoSettings(**work), **kw),
            {c, lo, m},
        ),
        'build_kdpdfl_process': (
            lambda spec, fn, **kw: kdpdfl.build_kdpdfl_process(spec, fn, kdpdfl.KDPDFLSettings(**work), **kw),
            {c, lo, m},
        ),
    }


VALUES = {
    'client_optimizer': lambda: tff.learning.optimizers.build_adam(0.01),
    'server_optimizer': lambda: tff.learning.optimizers.build_sgdm(1.0, momentum=0.9),
    'model_aggregator': lambda: tff.aggregators.MeanFactory(),
    'loss': lambda: tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    'metrics': lambda: {'top3': functools.partial(tf.keras.metrics.sparse_top_k_categorical_accuracy, k=3)},
}


USERS = ('ann', 'ben', 'cat')


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    """A user's `tff.simulation.datasets.ClientData` (3 clients, 3 classes) and public data, as the builders take it."""
    return make_data(str(tmp_path_factory.mktemp('contract')))


def make_data(cache_dir):
    """(spec, model_fn) of `data`, written under `cache_dir`."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 3))
    examples = {}
    for user, n in zip(USERS, (40, 30, 35)):
        x = rng.normal(size=(n, 6)).astype(np.float32)
        examples[user] = collections.OrderedDict(x=x, y=np.argmax(x @ w, axis=1).astype(np.int32))
    spec = federated.from_federated_data(
        tff.simulation.datasets.TestClientData(examples),
        cache_dir=cache_dir,
        public=rng.normal(size=(40, 6)).astype(np.float32),
    )
    return spec, functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)


def test_every_builder_of_the_processes_package_is_in_the_contract_table():
    found = set()
    for module_info in pkgutil.iter_modules(processes.__path__):
        module = importlib.import_module(f'processes.{module_info.name}')
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith('build_') and name.endswith('_process') and fn.__module__ == module.__name__:
                found.add(name)
                parameters = inspect.signature(fn).parameters
                for keyword in building_blocks.CONTRACT_KEYWORDS:
                    assert keyword in parameters, f'{name} has no {keyword}'
                    assert parameters[keyword].kind is inspect.Parameter.KEYWORD_ONLY
                    assert parameters[keyword].default is None
    missing = found - set(_builders())
    assert not missing, f'builders with no entry in _builders() here: {sorted(missing)}'
    assert found == set(_builders())
    takes_model = {b for b in found if 'model_fn' in inspect.signature(getattr(_module_of(b), b)).parameters}
    missing = takes_model - set(FUNCTIONAL)
    assert not missing, (
        f'builders with no entry in FUNCTIONAL here (a FunctionalModel taken or refused): {sorted(missing)}'
    )
    assert takes_model == set(FUNCTIONAL)


def _fedavg_weights(spec, model_fn, learning_rate=LOCAL['client_learning_rate'], **keywords):
    settings = fedavg.FedAvgSettings(**{**LOCAL, 'client_learning_rate': learning_rate})
    process = fedavg.build_fedavg_process(spec, model_fn, settings, **keywords)
    state, _, metrics = process.next(process.initialize(), process.initial_client_states(spec.client_ids))
    return np.concatenate([np.ravel(w) for w in state['model']]), metrics


def test_fedavgs_round_with_a_keras_loss_and_with_twice_the_cross_entropy(data, tff_runtime):
    """Keras's cross-entropy on logits is the default loss; twice it is the default at twice the rate, bit for bit
    (SGD: w - eta * 2g = w - 2eta * g, and doubling is exact in floating point)."""
    spec, model_fn = data
    default, default_metrics = _fedavg_weights(spec, model_fn)
    keras, _ = _fedavg_weights(spec, model_fn, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    np.testing.assert_allclose(keras, default, atol=1e-6, rtol=0)

    def twice(labels, logits):
        return 2.0 * tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    doubled, doubled_metrics = _fedavg_weights(spec, model_fn, loss=twice)
    at_twice_the_rate, _ = _fedavg_weights(spec, model_fn, learning_rate=2 * LOCAL['client_learning_rate'])
    np.testing.assert_array_equal(doubled, at_twice_the_rate)
    assert np.abs(doubled - default).max() > 1e-3
    # The first step's loss is seen before any step: twice the default's.
    assert float(doubled_metrics['train_loss']) > float(default_metrics['train_loss'])


@pytest.mark.parametrize(
    'loss, message',
    [
        (
            tf.keras.losses.SparseCategoricalCrossentropy(),
            r'^loss: SparseCategoricalCrossentropy has from_logits=False',
        ),
        (
            tf.keras.losses.CategoricalCrossentropy(from_logits=True),
            r'^loss: CategoricalCrossentropy fails on integer labels \[2\] and logits \[2, 3\]: ',
        ),
        (
            lambda y, logits: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)),
            r'^loss: <lambda> must return one value per label \(shape \[2\] for labels \[2\]\), got shape \[\]',
        ),
    ],
    ids=['from_logits_false', 'one_hot', 'already_a_mean'],
)
def test_a_loss_that_cannot_train_on_logits_and_integer_labels_is_refused_in_one_line(data, loss, message):
    spec, model_fn = data
    with pytest.raises(ValueError, match=message) as raised:
        fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(**LOCAL), loss=loss)
    assert '\n' not in str(raised.value)


@pytest.mark.parametrize(
    'metrics, error, message',
    [
        ({'accuracy': lambda y, logits: logits[..., 0]}, ValueError, r"^metrics: 'accuracy' cannot name a metric"),
        ({'bad name': lambda y, logits: logits[..., 0]}, ValueError, r"^metrics: 'bad name' cannot name a metric"),
        ({'mean': lambda y, logits: tf.reduce_mean(logits)}, ValueError, r"^metrics\['mean'\]: <lambda> must return"),
        ([lambda y, logits: logits[..., 0]], TypeError, r'^metrics must be a mapping name -> function'),
    ],
    ids=['reported_name', 'not_identifier', 'not_per_label', 'not_mapping'],
)
def test_bad_metrics_are_refused_in_one_line(data, metrics, error, message):
    spec, model_fn = data
    with pytest.raises(error, match=message) as raised:
        fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(**LOCAL), metrics=metrics)
    assert '\n' not in str(raised.value)


def test_a_loss_that_is_not_callable_is_a_type_error(data):
    spec, model_fn = data
    with pytest.raises(TypeError, match=r'^loss must be a tf.keras.losses.Loss or a function'):
        local.build_local_process(spec, model_fn, local.LocalSettings(**LOCAL), loss='mse')


def test_a_loss_is_the_mean_of_its_values_over_the_labels_that_count():
    """A sequence batch with ignored positions, against numpy: the values at label -1 are left out of the mean."""
    rng = np.random.default_rng(3)
    labels = np.array([[1, 2, -1, -1], [0, -1, 2, 1]], np.int32)
    features = rng.normal(size=(2, 4, 3)).astype(np.float32)

    class Identity(tf.keras.Model):
        def call(self, x, training=False):
            return x

    def squared(y, logits):  # not cross-entropy: the values must be the user's
        return tf.reduce_sum(tf.square(logits - tf.one_hot(y, 3)), axis=-1)

    loss, logits = local_training.loss_from(squared)(Identity(), tf.constant(features), tf.constant(labels))
    counted = labels >= 0
    expected = (np.square(features - np.eye(3)[np.maximum(labels, 0)]).sum(-1) * counted).sum() / counted.sum()
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    np.testing.assert_array_equal(logits.numpy(), features)


def test_a_metric_is_summed_over_the_labels_that_count_in_every_batch():
    """metric_sums against numpy on a sequence split cut into batches of 2: positions labelled -1 are left out,
    and its mean over evaluate's count of labels is a Keras cross-entropy's mean where evaluate's loss is."""
    rng = np.random.default_rng(4)
    features = rng.normal(size=(5, 4, 3)).astype(np.float32)
    labels = rng.integers(0, 3, size=(5, 4)).astype(np.int32)
    labels[rng.random(size=(5, 4)) < 0.3] = -1
    split = client_data.ClientSplit(tf.constant(features), tf.constant(labels))

    class Identity(tf.keras.Model):
        def call(self, x, training=False):
            return x

    def margin(y, logits):
        return tf.reduce_max(logits, axis=-1) - tf.gather(logits, y, batch_dims=y.shape.rank)

    metrics = local_training.metrics_from(
        {'margin': margin, 'ce': tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    )
    model = Identity()
    sums = local_training.metric_sums(model, split, metrics, batch_size=2)
    stats = local_training.evaluate(model, split, batch_size=2)
    counted = labels >= 0
    picked = np.take_along_axis(features, np.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(float(sums['margin']), ((features.max(-1) - picked) * counted).sum(), rtol=1e-5)
    assert float(stats.num_examples) == counted.sum()
    np.testing.assert_allclose(float(sums['ce']), float(stats.loss_sum), rtol=1e-5)


@pytest.mark.parametrize(
    'builder, keyword',
    [
        (b, k)
        for b, (_, uses) in sorted(_builders().items())
        for k in building_blocks.CONTRACT_KEYWORDS
        if k not in uses
    ],
)
def test_a_keyword_the_algorithm_has_no_place_for_is_refused_in_one_line(data, builder, keyword):
    spec, model_fn = data
    build, _ = _builders()[builder]
    with pytest.raises(ValueError, match=rf'^{builder} takes no {keyword}: \S') as raised:
        build(spec, model_fn, **{keyword: VALUES[keyword]()})
    assert '\n' not in str(raised.value)


def _ktpfl_homo_params(spec, model_fn, **keywords):
    process = ktpfl_homo.build_ktpfl_homogeneous_process(
        spec, model_fn, ktpfl_homo.KTpFLHomoSettings(**LOCAL), **keywords
    )
    state = process.initialize()
    _, clients, _ = process.next(state, process.initial_client_states(spec.client_ids))
    return np.stack([np.asarray(c['params']) for c in clients])


def _ditto_personal(spec, model_fn, **keywords):
    process = ditto.build_ditto_process(spec, model_fn, ditto.DittoSettings(**LOCAL), **keywords)
    state = process.initialize()
    _, clients, _ = process.next(state, process.initial_client_states(spec.client_ids))
    return np.concatenate([np.ravel(w) for c in clients for w in c['personal']])


@pytest.mark.parametrize('run', [_ditto_personal, _ktpfl_homo_params], ids=['ditto', 'ktpfl_homo'])
def test_the_client_optimizer_trains_the_clients_models(data, tff_runtime, run):
    """TFF's SGD at the settings' rate gives the default round; Adam gives another one."""
    spec, model_fn = data
    default = run(spec, model_fn)
    sgd = run(spec, model_fn, client_optimizer=tff.learning.optimizers.build_sgdm(LOCAL['client_learning_rate']))
    adam = run(spec, model_fn, client_optimizer=tff.learning.optimizers.build_adam(0.05))
    np.testing.assert_allclose(sgd, default, atol=1e-6, rtol=0)
    assert np.abs(adam - default).max() > 1e-3


# The builders that take a model function, and what a FunctionalModel does there.
FUNCTIONAL = {
    'build_fedavg_process': None,
    'build_ditto_process': None,
    'build_local_process': None,
    'build_apfl_process': None,
    'build_perfedavg_process': None,
    'build_pfedme_process': None,
    'build_selffl_process': None,
    'build_ktpfl_homogeneous_process': None,
    'build_fedamp_process': None,
    'build_pfedhn_process': None,
    'build_fedfomo_process': None,
    'build_persfl_process': "model_fn: PersFL's distillation grid cannot train 'functional_model'",
    'build_fedper_process': 'model_fn: FedPer splits the model into shared and personal Keras layers and '
    "'functional_model' has no Keras layers",
    'build_fedrep_process': 'model_fn: FedRep splits the model into shared and personal Keras layers and '
    "'functional_model' has no Keras layers",
    'build_fedrod_process': 'model_fn: FedRoD splits the model into shared and personal Keras layers and '
    "'functional_model' has no Keras layers",
    'build_feddbe_process': 'model_fn: FedDBE splits the model into shared and personal Keras layers and '
    "'functional_model' has no Keras layers",
    'build_fedproto_process': "model_fn: FedProto reads the embedding between the model's Keras layers and "
    "'functional_model' has no Keras layers",
    'build_fedbabu_process': 'model_fn: FedBABU splits the model into shared and personal Keras layers and '
    "'functional_model' has no Keras layers",
    'build_fedala_process': 'model_fn: FedALA mixes the top fedala_layers Keras layers element-wise and '
    "'functional_model' has no Keras layers",
    'build_lgfedavg_process': 'model_fn: LG-FedAvg splits the model into shared and personal Keras layers and '
    "'functional_model' has no Keras layers",
    'build_fedbn_process': 'model_fn: FedBN keeps the BatchNormalization layers on the clients and '
    "'functional_model' has no Keras layers",
    'build_kdpdfl_process': "model_fn: KD-PDFL's logit distances run the neighbours' models stacked and cannot run",
}


@pytest.mark.parametrize('builder', sorted(FUNCTIONAL))
def test_a_functional_model_is_taken_or_refused_in_one_line(data, builder):
    spec, model_fn = data
    build, _ = _builders()[builder]
    input_spec = (tf.TensorSpec([None, *spec.feature_shape], tf.float32), tf.TensorSpec([None], tf.int32))
    functional = tff.learning.models.functional_model_from_keras(
        model_fn(), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), input_spec
    )
    refusal = FUNCTIONAL[builder]
    if refusal is None:
        process = build(spec, functional)
        assert process.initialize.type_signature.result.placement is tff.SERVER
    else:
        with pytest.raises(ValueError, match=f'^{refusal}') as raised:
            build(spec, functional)
        assert '\n' not in str(raised.value)


@pytest.mark.parametrize('builder', sorted(_builders()))
def test_every_builder_takes_every_keyword_it_uses_and_trains_and_evaluates_a_users_client_data(
    data, tff_runtime, builder
):
    """Built with every contract keyword it uses (a user's optimizers and aggregator, a loss of the user's, which
    building traces: called beyond `local_training.loss_from`'s one try on the spec's shapes), one round runs and
    the evaluation reports three metrics of the user's: Keras's cross-entropy is the reported loss, top-3 of 3
    classes is 1, a Keras metric object's accuracy is the reported accuracy."""
    spec, model_fn = data
    build, uses = _builders()[builder]
    calls = []

    def counted(labels, logits):
        calls.append(1)
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    user_metrics = {
        'keras_ce': tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        'top3': functools.partial(tf.keras.metrics.sparse_top_k_categorical_accuracy, k=3),
        'keras_acc': tf.keras.metrics.SparseCategoricalAccuracy(),
    }
    keywords = {k: VALUES[k]() for k in uses if k not in ('loss', 'metrics')}
    if 'loss' in uses:
        keywords['loss'] = counted
    process = build(spec, model_fn, metrics=user_metrics, **keywords)
    assert process.initialize.type_signature.result.placement is tff.SERVER
    if 'loss' in uses:
        assert len(calls) > 1  # 1: local_training.loss_from's try on the spec's shapes
    state, clients = process.initialize(), process.initial_client_states(spec.client_ids)
    if isinstance(process, template.ServerlessProcess):  # KD-PDFL: one interval of local work
        clients, _ = process.local_work(clients, [2] * spec.num_clients, np.int32(0))
    else:
        state, clients, _ = process.next(state, clients)
    results = federated.by_user_id(spec, process.evaluate(state, clients))
    assert tuple(results) == USERS
    for result in results.values():
        for name, model in result.items():
            if isinstance(model, collections.abc.Mapping) and 'accuracy' in model:
                assert 0.0 <= float(model['accuracy']) <= 1.0, name
                assert list(model)[-3:] == ['keras_ce', 'top3', 'keras_acc'], name
                np.testing.assert_allclose(float(model['keras_ce']), float(model['loss']), rtol=1e-5, err_msg=name)
                assert float(model['top3']) == 1.0, name
                np.testing.assert_allclose(float(model['keras_acc']), float(model['accuracy']), rtol=1e-5, err_msg=name)


@pytest.mark.parametrize('settings', [kdpdfl.ServerlessFedAvgSettings, kdpdfl.ServerlessLocalSettings])
def test_kdpdfls_modes_without_logit_distances_take_a_functional_model(data, settings):
    spec, model_fn = data
    input_spec = (tf.TensorSpec([None, *spec.feature_shape], tf.float32), tf.TensorSpec([None], tf.int32))
    functional = tff.learning.models.functional_model_from_keras(
        model_fn(), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), input_spec
    )
    process = kdpdfl.build_kdpdfl_process(spec, functional, settings(**LOCAL))
    assert process.mode == kdpdfl.mode_of(settings())


def _table(path, heading):
    """The rows of the first Markdown table after `heading`, as dicts by column name."""
    with open(path) as f:
        text = f.read()
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('| '))
    table = []
    for line in lines[start:]:
        if not line.startswith('|'):
            break
        table.append([cell.strip() for cell in line.strip('|').split('|')])
    columns, rows = table[0], table[2:]
    return [dict(zip(columns, row)) for row in rows]


def test_the_docs_table_of_what_each_algorithm_takes_is_what_the_builders_do():
    from tff_pfl.program import algorithms

    rows = _table(
        f'{os.path.dirname(__file__)}/../docs/architecture.md', '### What a TFF user brings, algorithm by algorithm'
    )
    missing = set(algorithms.names()) - {r['algorithm'] for r in rows}
    assert not missing, f"docs/architecture.md's table of what a TFF user brings has no row for {sorted(missing)}"
    assert sorted(r['algorithm'] for r in rows) == algorithms.names()
    c, _, a, lo, _ = building_blocks.CONTRACT_KEYWORDS
    builders = _builders()
    for row in rows:
        name, builder = row['algorithm'], row['builder']
        _, uses = builders[builder]
        takes_model = 'model_fn' in inspect.signature(getattr(_module_of(builder), builder)).parameters
        assert (row['Keras fn'] == 'yes') == takes_model, name
        assert row['ClientData'].startswith('yes'), name  # test_every_builder_trains_and_evaluates_...
        assert row['client Adam'].startswith('yes' if c in uses else 'no: '), name
        assert row['model_aggregator'].startswith('yes' if a in uses else 'no: '), name
        assert row['loss'].startswith('yes' if lo in uses else 'no: '), name
        if not takes_model:
            assert row['FunctionalModel'].startswith('no: '), name
        elif name in ('kdpdfl_fedavg', 'kdpdfl_fedavg_plus', 'kdpdfl_local'):
            assert row['FunctionalModel'] == 'yes', name  # test_kdpdfls_modes_without_logit_distances_...
        else:
            assert row['FunctionalModel'].startswith('yes' if FUNCTIONAL[builder] is None else 'no: '), name


def test_the_docs_table_of_which_builder_uses_which_keyword_is_what_the_builders_do():
    """docs/architecture.md's builder table names every registered module, and its yes / no is each builder's."""
    from tff_pfl.program import algorithms

    rows = _table(f'{os.path.dirname(__file__)}/../docs/architecture.md', '## One builder contract')
    by_module = {}
    for row in rows:
        for name in re.findall(r'[a-z_]+', re.sub(r'\([^)]*\)', '', row['builder'])):
            by_module[name] = row
    missing = set(algorithms.MODULE_NAMES) - set(by_module)
    assert not missing, f"docs/architecture.md's builder table (One builder contract) has no row for {sorted(missing)}"
    builders = _builders()
    for module in algorithms.modules():
        row = by_module[module.__name__.split('.')[-1]]
        for builder in (n for n in module.__all__ if n.startswith('build_')):
            _, uses = builders[builder]
            for keyword in ('client_optimizer', 'server_optimizer', 'model_aggregator'):
                assert row[keyword].startswith('yes' if keyword in uses else 'no: '), (builder, keyword)


def _module_of(builder):
    for module_info in pkgutil.iter_modules(processes.__path__):
        module = importlib.import_module(f'processes.{module_info.name}')
        if hasattr(module, builder):
            return module
    raise KeyError(builder)


def _batch_norm_mlp(spec):
    inputs = tf.keras.Input(spec.feature_shape)
    hidden = tf.keras.layers.BatchNormalization(name='norm')(tf.keras.layers.Dense(6)(inputs))
    hidden = tf.keras.layers.ReLU()(hidden)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(spec.num_classes)(hidden), name='user_bn')


# The builders that take the user's model_fn, less FedAvg and FedBN (tests/test_batch_norm.py trains them with
# BatchNormalization against TFF's own FedAvg) and FedPer (its table entry builds a model of its own), as are
# KT-pFL's and FedDF's (heterogeneous architectures by name).
COVERED_ELSEWHERE = {'build_fedavg_process', 'build_fedbn_process', 'build_fedper_process'}
OWN_MODEL_BUILDERS = sorted(set(_builders()) - COVERED_ELSEWHERE - {'build_ktpfl_process', 'build_feddf_process'})


@pytest.mark.parametrize('builder', OWN_MODEL_BUILDERS)
def test_every_builder_trains_and_evaluates_a_batch_norm_model_or_refuses_it_in_one_line(data, tff_runtime, builder):
    """A user's model with BatchNormalization: one round (or interval), personalization and an evaluation run,
    computations nested in others included (TFF does not run their variable initializers:
    `model_weights.fresh_weights`); FedAMP, FedFomo, pFedHN and homogeneous KT-pFL refuse it naming the layer."""
    spec, _ = data
    build, _ = _builders(EPOCH)[builder]  # an epoch of local work: steps and epochs run different loops
    try:
        process = build(spec, functools.partial(_batch_norm_mlp, spec))
    except ValueError as e:
        assert '\n' not in str(e) and "'norm'" in str(e), str(e)  # a refusal names the layer
        return
    state, clients = process.initialize(), process.initial_client_states(spec.client_ids)
    if isinstance(process, template.ServerlessProcess):
        clients, _ = process.local_work(clients, [2] * spec.num_clients, np.int32(0))
    else:
        state, clients, _ = process.next(state, clients)
    if getattr(process, 'personalize', None) is not None:
        clients = process.personalize(state, clients)
    for result in process.evaluate(state, clients):
        scored = [m for m in result.values() if isinstance(m, collections.abc.Mapping) and 'accuracy' in m]
        assert scored
        for model in scored:
            assert 0.0 <= float(model['accuracy']) <= 1.0 and np.isfinite(float(model['loss']))
