"""`device_state.next_from_phases`: the in-process `next` made from a round's phases.

A tiny hand-made round (a server total and per-client values) checked against
numpy, one phase and two; then the builders whose `next` is derived from
their phase agree with their device form on the server state and metrics
types.
"""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedavg, feddf, local
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.computations import device_state

SERVER_STATE = tff.StructWithPythonType([('total', np.float32), ('round_num', np.int32)], collections.OrderedDict)
CLIENT_STATE = tff.StructWithPythonType([('client_id', np.str_), ('value', np.float32)], collections.OrderedDict)
IDS = ['a', 'b', 'c']
VALUES = [1.5, -2.0, 4.25]


def _phase(name, scale, metric_names):
    """A hand-made phase: `value <- scale * value + total + round_num` on each client.

    The server broadcasts `<total, round_num>`, keeps the sum of the clients'
    new values as its total, advances the round and reports the sum and the
    mean of the new values under `metric_names`.
    """

    @tff.tensorflow.computation(SERVER_STATE)
    def broadcast(state):
        return collections.OrderedDict(total=state['total'], round_num=state['round_num'])

    @tff.tensorflow.computation(broadcast.type_signature.result, CLIENT_STATE)
    def client_step(value, client_state):
        new = scale * client_state['value'] + value['total'] + tf.cast(value['round_num'], tf.float32)
        return collections.OrderedDict(
            upload=new, client_state=collections.OrderedDict(client_id=client_state['client_id'], value=new)
        )

    @tff.tensorflow.computation(SERVER_STATE, np.float32)
    def server_update(state, total):
        return collections.OrderedDict(total=total, round_num=state['round_num'] + 1)

    @tff.tensorflow.computation(np.float32, np.float32)
    def report(total, mean):
        return collections.OrderedDict(zip(metric_names, (total, mean)))

    def finish(state, outputs):
        total = tff.federated_sum(outputs.upload)
        mean = tff.federated_mean(outputs.upload)
        return tff.federated_map(server_update, (state, total)), tff.federated_map(report, (total, mean))

    return device_state.Phase(name, broadcast, client_step, finish)


def _reference(phases, total, round_num, values):
    """numpy: the round of `(scale, metric_names)` phases; returns (total, round_num, values, metrics)."""
    metrics = collections.OrderedDict()
    for scale, names in phases:
        values = [np.float32(scale) * np.float32(v) + np.float32(total) + np.float32(round_num) for v in values]
        total = np.sum(np.array(values, np.float32))
        round_num += 1
        metrics.update(zip(names, (total, np.mean(np.array(values, np.float32)))))
    return total, round_num, values, metrics


def _run(next_fn, total, round_num):
    state = collections.OrderedDict(total=np.float32(total), round_num=np.int32(round_num))
    clients = [collections.OrderedDict(client_id=c, value=np.float32(v)) for c, v in zip(IDS, VALUES)]
    return next_fn(state, clients)


def _check(output, expected):
    total, round_num, values, metrics = expected
    np.testing.assert_allclose(output.state['total'], total, rtol=1e-6)
    assert output.state['round_num'] == round_num
    assert [np.asarray(s['client_id']).item().decode() for s in output.client_states] == IDS
    np.testing.assert_allclose([s['value'] for s in output.client_states], values, rtol=1e-6)
    assert list(output.metrics) == list(metrics)
    for name, value in metrics.items():
        np.testing.assert_allclose(output.metrics[name], value, rtol=1e-6)


def test_one_phase_is_the_phase_in_process(tff_runtime):
    next_fn = device_state.next_from_phases(
        tff.FederatedType(SERVER_STATE, tff.SERVER), CLIENT_STATE, [_phase('next', 2.0, ('sum', 'mean'))]
    )
    output = _run(next_fn, total=0.5, round_num=3)
    assert output._fields == ('state', 'client_states', 'metrics')
    _check(output, _reference([(2.0, ('sum', 'mean'))], 0.5, 3, VALUES))


def test_phases_run_in_order_and_a_later_metric_replaces_an_earlier_one(tff_runtime):
    phases = [_phase('first', 2.0, ('sum', 'first_mean')), _phase('second', -0.5, ('sum', 'second_mean'))]
    next_fn = device_state.next_from_phases(SERVER_STATE, CLIENT_STATE, phases)  # an unplaced S is placed
    output = _run(next_fn, total=0.5, round_num=3)
    expected = _reference([(2.0, ('sum', 'first_mean')), (-0.5, ('sum', 'second_mean'))], 0.5, 3, VALUES)
    assert list(expected[3]) == ['sum', 'first_mean', 'second_mean']
    _check(output, expected)


def test_no_phase_is_refused():
    with pytest.raises(ValueError, match='at least one phase'):
        device_state.next_from_phases(SERVER_STATE, CLIENT_STATE, [])


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    spec = make_linear_problem(tmp_path_factory.mktemp('device_state') / 'data', public_examples=20)
    return spec, functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)


BUILDERS = {
    'fedavg': lambda spec, model_fn: fedavg.build_fedavg_process(
        spec, model_fn, fedavg.FedAvgSettings(local_epochs=1, batch_size=8)
    ),
    'local': lambda spec, model_fn: local.build_local_process(spec, model_fn, local.LocalSettings(local_epochs=1)),
    'feddf': lambda spec, model_fn: feddf.build_feddf_process(
        spec,
        feddf.FedDFSettings(
            local_epochs=1, batch_size=8, public_examples=20, public_batch=10, architectures=('logistic',)
        ),
    ),
}


@pytest.mark.parametrize('name', sorted(BUILDERS))
def test_the_derived_next_has_the_device_rounds_types(problem, name):
    """In process and on devices, the round takes and returns the same server state and reports the same metrics."""
    spec, model_fn = problem
    process = BUILDERS[name](spec, model_fn)
    (phase,) = process.device.phases.values()
    next_type, phase_type = process.next.type_signature, phase.type_signature
    server_state_type = process.initialize.type_signature.result
    assert next_type.parameter[0].is_equivalent_to(server_state_type)
    assert phase_type.parameter[0].is_equivalent_to(server_state_type)
    assert next_type.result.state.is_equivalent_to(phase_type.result.state)
    assert next_type.result.metrics.is_equivalent_to(phase_type.result.metrics)
    client_states = tff.FederatedType(process.client_state_type, tff.CLIENTS)
    assert next_type.parameter[1].is_equivalent_to(client_states)
    assert next_type.result.client_states.is_equivalent_to(client_states)
