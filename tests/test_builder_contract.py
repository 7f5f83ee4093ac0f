"""One builder contract: every `build_<algo>_process` takes client_optimizer, server_optimizer and
model_aggregator, uses each where its algorithm has a place for it, and refuses it in one line
(naming the argument and why) where it has none."""

import collections
import collections.abc
import functools
import importlib
import inspect
import os
import pkgutil

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import processes
from processes import apfl, ditto, fedavg, feddf, fedper, kdpdfl, ktpfl, local, perfedavg, persfl, pfedme, selffl
from tff_pfl import models
from tff_pfl.computations import building_blocks, template
from tff_pfl.data import federated

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


USERS = ('ann', 'ben', 'cat')


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    """A user's `tff.simulation.datasets.ClientData` (3 clients, 3 classes) and public data, as the builders take it."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 3))
    examples = {}
    for user, n in zip(USERS, (40, 30, 35)):
        x = rng.normal(size=(n, 6)).astype(np.float32)
        examples[user] = collections.OrderedDict(x=x, y=np.argmax(x @ w, axis=1).astype(np.int32))
    spec = federated.from_federated_data(
        tff.simulation.datasets.TestClientData(examples),
        cache_dir=str(tmp_path_factory.mktemp('contract')),
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
    'build_fedper_process': 'model_fn: FedPer splits the model into shared and personal Keras layers and '
    "'functional_model' has no Keras layers",
    'build_kdpdfl_process': "model_fn: KD-PDFL's logit distances run the neighbours' models stacked and cannot run",
}


@pytest.mark.parametrize('builder', sorted(FUNCTIONAL))
def test_a_functional_model_is_taken_or_refused_in_one_line(data, builder):
    spec, model_fn = data
    build, _ = _builders()[builder]
    if builder == 'build_fedper_process':  # its table entry builds a two-layer model of its own
        model_fn = functools.partial(models.mnist_dnn, spec.feature_shape, spec.num_classes)

        def build(spec, fn):
            return fedper.build_fedper_process(spec, fn, fedper.FedPerSettings(**LOCAL))

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
def test_every_builder_trains_and_evaluates_a_users_client_data_by_their_ids(data, tff_runtime, builder):
    spec, model_fn = data
    build, _ = _builders()[builder]
    process = build(spec, model_fn)
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
    assert len(rows) == len(algorithms.names())
    assert {r['algorithm'] for r in rows} == set(algorithms.names())
    c, _, a = building_blocks.CONTRACT_KEYWORDS
    builders = _builders()
    for row in rows:
        name, builder = row['algorithm'], row['builder']
        _, uses = builders[builder]
        takes_model = 'model_fn' in inspect.signature(getattr(_module_of(builder), builder)).parameters
        assert (row['Keras fn'] == 'yes') == takes_model, name
        assert row['ClientData'].startswith('yes'), name  # test_every_builder_trains_and_evaluates_...
        assert row['client Adam'].startswith('yes' if c in uses else 'no: '), name
        assert row['model_aggregator'].startswith('yes' if a in uses else 'no: '), name
        if not takes_model:
            assert row['FunctionalModel'].startswith('no: '), name
        elif name in ('kdpdfl_fedavg', 'kdpdfl_fedavg_plus', 'kdpdfl_local'):
            assert row['FunctionalModel'] == 'yes', name  # test_kdpdfls_modes_without_logit_distances_...
        else:
            assert row['FunctionalModel'].startswith('yes' if FUNCTIONAL[builder] is None else 'no: '), name


def _module_of(builder):
    for module_info in pkgutil.iter_modules(processes.__path__):
        module = importlib.import_module(f'processes.{module_info.name}')
        if hasattr(module, builder):
            return module
    raise KeyError(builder)
