"""One builder contract: every `build_<algo>_process` takes client_optimizer, server_optimizer and
model_aggregator, uses each where its algorithm has a place for it, and refuses it in one line
(naming the argument and why) where it has none."""

import functools
import importlib
import inspect
import pkgutil

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import processes
from processes import apfl, ditto, fedavg, feddf, fedper, kdpdfl, ktpfl, local, perfedavg, persfl, pfedme, selffl
from tff_pfl import models
from tff_pfl.computations import building_blocks
from tff_pfl.data import pipeline

LOCAL = dict(local_steps=2, batch_size=8, client_learning_rate=0.1)
PUBLIC = dict(public_examples=40, public_batch=20, public_distill_batch_size=10)


def _builders():
    """builder name -> (build(spec, model_fn, **keywords), the contract keywords it uses)."""
    c, s, a = building_blocks.CONTRACT_KEYWORDS
    return {
        'build_fedavg_process': (
            lambda spec, fn, **kw: fedavg.build_fedavg_process(spec, fn, fedavg.FedAvgSettings(**LOCAL), **kw),
            {c, s, a},
        ),
        'build_persfl_process': (
            lambda spec, fn, **kw: persfl.build_persfl_process(
                spec, fn, persfl.PersFLSettings(**LOCAL, temperatures=(1.0,), imitations=(0.5,)), **kw
            ),
            {c, s, a},
        ),
        'build_ditto_process': (
            lambda spec, fn, **kw: ditto.build_ditto_process(spec, fn, ditto.DittoSettings(**LOCAL), **kw),
            {c, s, a},
        ),
        'build_fedper_process': (
            lambda spec, fn, **kw: fedper.build_fedper_process(
                spec,
                functools.partial(models.mnist_dnn, spec.feature_shape, spec.num_classes),
                fedper.FedPerSettings(**LOCAL),
                **kw,
            ),
            {c, s, a},
        ),
        'build_local_process': (
            lambda spec, fn, **kw: local.build_local_process(spec, fn, local.LocalSettings(**LOCAL), **kw),
            {c},
        ),
        'build_apfl_process': (
            lambda spec, fn, **kw: apfl.build_apfl_process(spec, fn, apfl.APFLSettings(**LOCAL), **kw),
            {s, a},
        ),
        'build_perfedavg_process': (
            lambda spec, fn, **kw: perfedavg.build_perfedavg_process(spec, fn, **kw),
            {s, a},
        ),
        'build_pfedme_process': (
            lambda spec, fn, **kw: pfedme.build_pfedme_process(spec, fn, **kw),
            {s, a},
        ),
        'build_selffl_process': (
            lambda spec, fn, **kw: selffl.build_selffl_process(spec, fn, **kw),
            {s},
        ),
        'build_ktpfl_process': (
            lambda spec, fn, **kw: ktpfl.build_ktpfl_process(
                spec, ktpfl.KTpFLSettings(**LOCAL, **PUBLIC, architectures=('logistic',)), **kw
            ),
            {c},
        ),
        'build_ktpfl_homogeneous_process': (
            lambda spec, fn, **kw: ktpfl.build_ktpfl_homogeneous_process(
                spec, fn, ktpfl.KTpFLHomoSettings(**LOCAL), **kw
            ),
            {c},
        ),
        'build_feddf_process': (
            lambda spec, fn, **kw: feddf.build_feddf_process(
                spec, feddf.FedDFSettings(**LOCAL, **PUBLIC, architectures=('logistic',)), **kw
            ),
            {c},
        ),
        'build_kdpdfl_process': (
            lambda spec, fn, **kw: kdpdfl.build_kdpdfl_process(spec, fn, kdpdfl.KDPDFLSettings(**LOCAL), **kw),
            {c},
        ),
    }


VALUES = {
    'client_optimizer': lambda: tff.learning.optimizers.build_adam(0.01),
    'server_optimizer': lambda: tff.learning.optimizers.build_sgdm(1.0, momentum=0.9),
    'model_aggregator': lambda: tff.aggregators.MeanFactory(),
}


@pytest.fixture(scope='module')
def data(tiny_npz, tmp_path_factory):
    prepared = pipeline.prepare(
        str(tmp_path_factory.mktemp('contract') / 'data'),
        dataset=f'npz:{tiny_npz}',
        partition_name='iid',
        num_clients=3,
        seed=0,
        public_examples=40,
    )
    spec = prepared.spec
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
    assert found == set(_builders())


@pytest.mark.parametrize('builder', sorted(_builders()))
def test_a_builder_takes_every_keyword_it_uses(data, builder):
    spec, model_fn = data
    build, uses = _builders()[builder]
    process = build(spec, model_fn, **{k: VALUES[k]() for k in uses})
    assert process.initialize.type_signature.result.placement is tff.SERVER


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
    process = ktpfl.build_ktpfl_homogeneous_process(spec, model_fn, ktpfl.KTpFLHomoSettings(**LOCAL), **keywords)
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
    'build_persfl_process': "model_fn: PersFL's distillation grid cannot train 'functional_model'",
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
