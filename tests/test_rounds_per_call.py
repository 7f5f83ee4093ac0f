"""Several rounds a TFF call: the numbers of one round a call, fewer calls, checkpoints between calls."""

import functools

import numpy as np
import pytest
import tensorflow_federated as tff

from processes import fedavg, persfl
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.program import checkpoints as checkpoints_lib
from tff_pfl.program import client_states, training_loop


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    spec = make_linear_problem(tmp_path_factory.mktemp('calls') / 'data', num_clients=3)
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    return spec, model_fn


@pytest.fixture(scope='module')
def fedavg_process(problem):
    spec, model_fn = problem
    settings = fedavg.FedAvgSettings(local_epochs=1, batch_size=8, client_learning_rate=0.3)
    return fedavg.build_fedavg_process(spec, model_fn, settings, seed=1)


def _untimed(rows):
    return [{k: v for k, v in row.items() if not k.endswith('_seconds')} for row in rows]


def _assert_same_run(got, want):
    assert _untimed(got.rounds) == _untimed(want.rounds)
    assert got.clients == want.clients
    for a, b in zip(tff.structure.flatten(got.state), tff.structure.flatten(want.state)):
        np.testing.assert_array_equal(a, b)
    assert list(got.client_states) == list(want.client_states)
    for c in want.client_states:
        for a, b in zip(
            tff.structure.flatten(got.client_states[c]), tff.structure.flatten(want.client_states[c]), strict=True
        ):
            np.testing.assert_array_equal(a, b)


def _calls(monkeypatch):
    """Records the `count` of every several-rounds call of the driver's store."""
    counts = []
    original = client_states.ClientStateStore.run_rounds

    def run_rounds(self, process, state, client_ids, count):
        counts.append(count)
        return original(self, process, state, client_ids, count)

    monkeypatch.setattr(client_states.ClientStateStore, 'run_rounds', run_rounds)
    return counts


def test_several_rounds_is_next_called_in_turn(fedavg_process, problem, tff_runtime):
    """The computation itself: its type, and the state after `next` twice, bit for bit."""
    spec, _ = problem
    process = fedavg_process
    two = process.several_rounds(2)
    state_type, client_states_type = process.next.type_signature.parameter
    assert two.type_signature.parameter[0].is_equivalent_to(state_type)
    assert two.type_signature.parameter[1].is_equivalent_to(client_states_type)
    metrics_type = process.next.type_signature.result[2]
    assert [t for _, t in tff.structure.iter_elements(two.type_signature.result[2])] == [metrics_type] * 2
    assert process.several_rounds(2) is two  # built once
    start = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    once = process.next(start, clients)
    twice = process.next(once.state, once.client_states)
    got = two(start, clients)
    for a, b in zip(tff.structure.flatten(got.state), tff.structure.flatten(twice.state)):
        np.testing.assert_array_equal(a, b)
    assert dict(got.metrics[0]) == dict(once.metrics) and dict(got.metrics[1]) == dict(twice.metrics)
    with pytest.raises(ValueError, match='count must be >= 1, got 0'):
        process.several_rounds(0)


def test_a_run_of_three_rounds_a_call_is_the_run_of_one(fedavg_process, problem, tff_runtime, monkeypatch, tmp_path):
    spec, _ = problem
    kwargs = dict(rounds=7, client_fraction=1.0, seed=5, eval_every=3, checkpoint_every=3, log=lambda line: None)
    one = training_loop.run(
        fedavg_process,
        spec.client_ids,
        checkpoints=checkpoints_lib.RunCheckpoints(str(tmp_path / 'one')),
        **kwargs,
    )
    counts = _calls(monkeypatch)
    lines = []
    three = training_loop.run(
        fedavg_process,
        spec.client_ids,
        checkpoints=checkpoints_lib.RunCheckpoints(str(tmp_path / 'three')),
        rounds_per_call=3,
        **dict(kwargs, log=lines.append),
    )
    # Rounds 1-3 and 4-6 in one call each; the last round alone is a call of `next`.
    assert counts == [3, 3]
    _assert_same_run(three, one)
    assert [r['round'] for r in three.rounds] == list(range(1, 8))
    evaluated = [r['round'] for r in three.rounds if 'test_global_model_accuracy_mean' in r]
    assert evaluated == [3, 6, 7]
    # A call's rounds share its time.
    seconds = [r['round_seconds'] for r in three.rounds]
    assert seconds[0] == seconds[1] == seconds[2] and seconds[3] == seconds[4] == seconds[5]
    assert len(lines) == 7 and lines[-1].startswith('round 7/7')
    # Checkpoints between calls, as the one-round run wrote them.
    assert checkpoints_lib.RunCheckpoints(str(tmp_path / 'three')).check()[0] == 6


def test_a_personalized_algorithm_in_several_rounds_a_call(problem, tff_runtime):
    """PersFL keeps each round's best global model as the client's teacher: the same over 2 rounds a call."""
    spec, model_fn = problem
    settings = persfl.PersFLSettings(
        local_epochs=1, batch_size=8, distill_epochs=1, temperatures=(1.0, 5.0), imitations=(0.0, 0.5)
    )
    process = persfl.build_persfl_process(spec, model_fn, settings, seed=2)
    kwargs = dict(rounds=4, client_fraction=1.0, seed=3, eval_every=2, log=lambda line: None)
    one = training_loop.run(process, spec.client_ids, **kwargs)
    two = training_loop.run(process, spec.client_ids, rounds_per_call=2, **kwargs)
    _assert_same_run(two, one)


def test_a_run_resumed_with_another_rounds_per_call(fedavg_process, problem, tff_runtime, monkeypatch, tmp_path):
    """Interrupted after round 3 (checkpoint of round 2), resumed three rounds a call: round 3 alone, then 4-6."""
    spec, _ = problem
    kwargs = dict(rounds=6, client_fraction=1.0, seed=4, log=lambda line: None)
    whole = training_loop.run(fedavg_process, spec.client_ids, **kwargs)

    class Interrupted(Exception):
        pass

    def interrupt(row):
        if row['round'] == 3:
            raise Interrupted

    directory = str(tmp_path / 'checkpoints')
    with pytest.raises(Interrupted):
        training_loop.run(
            fedavg_process,
            spec.client_ids,
            checkpoints=checkpoints_lib.RunCheckpoints(directory),
            checkpoint_every=2,
            on_round=interrupt,
            **kwargs,
        )
    counts = _calls(monkeypatch)
    resumed = training_loop.run(
        fedavg_process,
        spec.client_ids,
        checkpoints=checkpoints_lib.RunCheckpoints(directory),
        checkpoint_every=0,
        rounds_per_call=3,
        **kwargs,
    )
    assert counts == [3]  # round 3 alone (a call of `next`), then rounds 4-6
    _assert_same_run(resumed, whole)


@pytest.mark.parametrize(
    'arguments, message',
    [
        (dict(rounds_per_call=0), 'rounds_per_call must be >= 1, got 0'),
        (
            dict(rounds_per_call=2, client_fraction=0.5),
            'rounds_per_call=2 runs the same clients in every round of a call: it needs client_fraction=1, got 0.5',
        ),
        (dict(rounds_per_call=2, device_state_dir='d'), 'rounds_per_call=2 keeps the client states in the driver'),
        (dict(rounds_per_call=2, eval_every=3), 'eval_every=3 is not a multiple of rounds_per_call=2'),
        (dict(rounds_per_call=4, checkpoint_every=2), 'checkpoint_every=2 is not a multiple of rounds_per_call=4'),
    ],
)
def test_run_refuses_what_several_rounds_a_call_cannot_keep(fedavg_process, problem, arguments, message, tmp_path):
    spec, _ = problem
    kwargs = dict(rounds=4, client_fraction=1.0, seed=1, log=lambda line: None)
    kwargs.update(arguments)
    with pytest.raises(ValueError) as raised:
        training_loop.run(fedavg_process, spec.client_ids, **kwargs)
    assert str(raised.value).startswith(message) and '\n' not in str(raised.value)
    assert '--' not in str(raised.value)  # Python arguments, not flags


def test_a_round_that_diverges_inside_a_call_stops_the_run_when_the_call_ends(problem, tff_runtime):
    """A learning rate of 1e38 overflows round 1 of a 2-round call: its row is the last, the models are scored."""
    spec, model_fn = problem
    settings = fedavg.FedAvgSettings(local_epochs=1, batch_size=8, client_learning_rate=1e38)
    process = fedavg.build_fedavg_process(spec, model_fn, settings, seed=1)
    lines = []
    stopped = training_loop.run(
        process,
        spec.client_ids,
        rounds=4,
        client_fraction=1.0,
        seed=5,
        stop_on_divergence=True,
        rounds_per_call=2,
        log=lines.append,
    )
    assert stopped.diverged_round == 1 and [r['round'] for r in stopped.rounds] == [1]
    assert not np.isfinite(stopped.rounds[0]['train_loss'])
    assert 'test_global_model_accuracy_mean' in stopped.rounds[0]  # evaluated as the last round
    assert lines[0].startswith('round 1: the mean training loss is inf: the run diverged and stops here')
    # The state is the call's last round's (round 2): its round number says so.
    assert int(stopped.state['round_num']) == 2
