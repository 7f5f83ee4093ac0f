"""Our FedAvg under TFF's own program loop: `tff.learning.programs.train_model`, stopped and resumed."""

import asyncio
import csv
import functools
import os

import numpy as np
import pytest
import tensorflow_federated as tff

from processes import ditto, fedavg, fedper, ktpfl_homo, pfedhn
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.computations import device_state
from tff_pfl.program import tff_programs

SETTINGS = fedavg.FedAvgSettings(local_epochs=1, batch_size=8, client_learning_rate=0.3)
ROUNDS = 4


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    spec = make_linear_problem(tmp_path_factory.mktemp('programs') / 'data', num_clients=3)
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    return spec, model_fn


class Crash(Exception):
    pass


class CrashingIterator(tff_programs.ClientIdsIterator):
    """Fails the program when it asks for round `at`'s clients (0-based), as a job killed between rounds."""

    def __init__(self, client_ids, seed, at):
        super().__init__(client_ids, seed)
        self._at = at

    def select(self, k=None):
        if self._round == self._at:
            raise Crash(f'killed before round {self._at + 1}')
        return super().select(k)


class CrashingSource(tff_programs.ClientIdsDataSource):
    def __init__(self, client_ids, seed, at):
        super().__init__(client_ids, seed)
        self._at = at

    def iterator(self):
        return CrashingIterator(self._client_ids, self._seed, self._at)


def _train(process, spec, root, total_rounds, *, crash_at=None):
    """`train_model` for `total_rounds` with a file state manager and a CSV release manager under `root`."""
    source = tff_programs.ClientIdsDataSource(spec.client_ids, seed=11)
    if crash_at is not None:
        source = CrashingSource(spec.client_ids, 11, crash_at)
    return _run_train_model(process, source, root, total_rounds, 2, crash_at)


def _run_train_model(process, source, root, total_rounds, per_round, crash_at):
    """`train_model` of `process` on `source`; its state and metrics under `root`; the state manager."""
    state_manager = tff.program.FileProgramStateManager(os.path.join(root, 'state'), keep_total=10)
    metrics_manager = tff.program.CSVFileReleaseManager(os.path.join(root, 'metrics.csv'), key_fieldname='round')
    program = tff.learning.programs.train_model(
        train_process=tff_programs.learning_process(process),
        train_data_source=source,
        train_per_round_clients=per_round,
        train_total_rounds=total_rounds,
        program_state_manager=state_manager,
        model_output_manager=tff.program.MemoryReleaseManager(),
        train_metrics_manager=metrics_manager,
        evaluation_manager=None,
        evaluation_periodicity=1,
    )
    if crash_at is None:
        asyncio.run(program)
    else:
        with pytest.raises(Crash):
            asyncio.run(program)
    return state_manager


def _final_model(process, state_manager):
    structure = tff.learning.programs.ProgramState(process.initialize(), 0, 0, None)
    saved, version = asyncio.run(state_manager.load_latest(structure))
    return version, [np.asarray(w) for w in saved.state['model']]


def test_train_model_runs_fedavg_and_a_stopped_run_resumes_to_the_same_model(problem, tff_runtime, tmp_path):
    spec, model_fn = problem
    process = fedavg.build_fedavg_process(spec, model_fn, SETTINGS, seed=3)
    with tff_programs.native_context(tff_runtime):
        whole = _train(process, spec, str(tmp_path / 'whole'), ROUNDS)
        _train(process, spec, str(tmp_path / 'resumed'), ROUNDS, crash_at=2)
        stopped = tff.program.FileProgramStateManager(str(tmp_path / 'resumed' / 'state'))
        assert asyncio.run(stopped.get_versions())[-1] < ROUNDS
        resumed = _train(process, spec, str(tmp_path / 'resumed'), ROUNDS)
    whole_version, whole_model = _final_model(process, whole)
    resumed_version, resumed_model = _final_model(process, resumed)
    assert whole_version == resumed_version == ROUNDS
    for a, b in zip(whole_model, resumed_model):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(whole_model[0], np.asarray(process.initialize()['model'][0]))  # it trained
    with open(tmp_path / 'whole' / 'metrics.csv') as f:
        rows = list(csv.DictReader(f))
    # One row per round; TFF's task manager releases them concurrently, so not always in order.
    assert sorted(int(r['round']) for r in rows) == list(range(1, ROUNDS + 1))
    assert all(int(r['model_metrics/num_clients']) == 2 for r in rows), rows[0].keys()  # as TFF rehomes them
    assert all(0.0 < float(r['model_metrics/train_accuracy']) <= 1.0 for r in rows)
    # The same rounds by hand: process.next on the same sampled ids gives the same model.
    state = process.initialize()
    iterator = tff_programs.ClientIdsDataSource(spec.client_ids, seed=11).iterator()
    for _ in range(ROUNDS):
        state = process.next(state, [process.initial_client_state(c) for c in iterator.select(2)]).state
    for a, b in zip(whole_model, state['model']):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_ids_iterator_restored_from_bytes_picks_what_the_original_would():
    iterator = tff_programs.ClientIdsDataSource(['a', 'b', 'c', 'd'], seed=5).iterator()
    iterator.select(2)
    restored = tff_programs.ClientIdsIterator.from_bytes(iterator.to_bytes())
    assert [restored.select(2) for _ in range(3)] == [iterator.select(2) for _ in range(3)]
    with pytest.raises(ValueError, match='k must be between 1 and 4'):
        iterator.select(5)


def test_a_process_whose_clients_keep_state_without_a_device_form_is_refused_in_one_line(problem):
    spec, model_fn = problem
    with pytest.raises(ValueError, match=r'^process: its clients keep .* between rounds and it has no device form'):
        tff_programs.learning_process(pfedhn.build_pfedhn_process(spec, model_fn))
    dnn = functools.partial(models.mnist_dnn, spec.feature_shape, spec.num_classes)
    fedper_learning = tff_programs.learning_process(fedper.build_fedper_process(spec, dnn))  # heads on the devices
    assert fedper_learning.next.type_signature.parameter[1] == tff.FederatedType(np.str_, tff.CLIENTS)
    with pytest.raises(TypeError, match='^process must be a PersonalizedProcess'):
        tff_programs.learning_process(fedper_learning)


# Clients that keep state (Ditto's personal models; KT-pFL's two phases a round), on their devices.


def _train_on_devices(process, spec, root, total_rounds, *, crash_at=None, per_round=2):
    """`train_model` of `process`'s device form, client states under `root/devices`; the data source."""
    source = tff_programs.DeviceStatesDataSource(spec.client_ids, os.path.join(root, 'devices'), seed=11)
    if crash_at is not None:

        class CrashingDevices(tff_programs.DeviceStatesIterator):
            def select(self, k=None):
                if self._round == crash_at:
                    raise Crash(f'killed before round {crash_at + 1}')
                return super().select(k)

        fresh = source.iterator
        source.iterator = lambda: CrashingDevices.from_bytes(fresh().to_bytes())
    _run_train_model(process, source, root, total_rounds, per_round, crash_at)
    return source


def _outcome(process, root, source):
    """The last saved round, its server state and every client's latest state (in a synchronous context)."""
    structure = tff.learning.programs.ProgramState(process.device.initialize(), 0, 0, None)
    state_manager = tff.program.FileProgramStateManager(os.path.join(root, 'state'))
    saved, version = asyncio.run(state_manager.load_latest(structure))
    states = {}
    for device in source.latest():
        initial = process.initial_client_state(device['client_id'])
        exists = os.path.exists(device['state_file'])
        states[device['client_id']] = device_state.load(device['state_file'], initial) if exists else initial
    return version, saved.state, states, source


def _leaves(value):
    return [np.asarray(leaf) for leaf in device_state.flatten(value)]


def _assert_close(first, second):
    for a, b in zip(_leaves(first), _leaves(second), strict=True):
        if a.dtype.kind in 'SUO':
            assert a.astype(bytes).tolist() == b.astype(bytes).tolist()
        else:
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_train_model_keeps_dittos_personal_models_on_the_devices_and_a_killed_run_resumes_to_the_same_states(
    problem, tff_runtime, tmp_path
):
    spec, model_fn = problem
    process = ditto.build_ditto_process(spec, model_fn, ditto.DittoSettings(local_epochs=1, batch_size=8))
    stale = process.initial_client_state('client_00002')
    with tff_programs.native_context(tff_runtime):
        whole = _train_on_devices(process, spec, str(tmp_path / 'whole'), ROUNDS)
        _train_on_devices(process, spec, str(tmp_path / 'resumed'), ROUNDS, crash_at=2)
        # As a run killed inside round 3 leaves it: some devices already wrote round 3's states.
        for client_id in spec.client_ids:
            client_dir = tmp_path / 'resumed' / 'devices' / client_id
            client_dir.mkdir(parents=True, exist_ok=True)
            for name in ('00000002.state', '00000003.state'):
                device_state.save(str(client_dir / name), stale)
        resumed = _train_on_devices(process, spec, str(tmp_path / 'resumed'), ROUNDS)
    whole = _outcome(process, str(tmp_path / 'whole'), whole)
    resumed = _outcome(process, str(tmp_path / 'resumed'), resumed)
    assert whole[0] == resumed[0] == ROUNDS
    for a, b in zip(_leaves(whole[1]), _leaves(resumed[1])):
        np.testing.assert_array_equal(a, b)
    assert list(whole[2]) == list(resumed[2]) == list(spec.client_ids)
    for client_id in spec.client_ids:
        for a, b in zip(_leaves(whole[2][client_id]), _leaves(resumed[2][client_id])):
            np.testing.assert_array_equal(a, b)
    # The same rounds in process: process.next on the same sampled ids, the client states kept by id.
    state = process.initialize()
    states = {c: process.initial_client_state(c) for c in spec.client_ids}
    iterator = tff_programs.ClientIdsDataSource(spec.client_ids, seed=11).iterator()
    for _ in range(ROUNDS):
        ids = iterator.select(2)
        output = process.next(state, [states[c] for c in ids])
        state = output.state
        states.update(zip(ids, output.client_states))
    _assert_close(whole[1], state)
    trained = 0
    for client_id in spec.client_ids:
        _assert_close(whole[2][client_id], states[client_id])
        first = _leaves(process.initial_client_state(client_id))
        trained += not all(np.array_equal(a, b) for a, b in zip(first, _leaves(states[client_id])))
    assert trained >= 2  # personal models moved
    # The devices' own evaluation of their latest states, by id, as process.evaluate scores the same states.
    by_id = tff_programs.evaluate_clients(process, whole[1], whole[3])
    expected = process.evaluate(state, [states[c] for c in spec.client_ids])
    assert list(by_id) == list(spec.client_ids)
    for client_id, reference in zip(spec.client_ids, expected):
        got = by_id[client_id]['personalized_model']['accuracy']
        np.testing.assert_allclose(got, reference['personalized_model']['accuracy'], atol=1e-6)


def test_train_model_runs_ktpfls_two_phases_a_round_on_the_devices(problem, tff_runtime, tmp_path):
    spec, model_fn = problem
    process = ktpfl_homo.build_ktpfl_homogeneous_process(spec, model_fn)
    learning = tff_programs.learning_process(process)
    assert len(process.device.phases) == 2
    assert learning.get_model_weights.type_signature.result.is_equivalent_to(tff.StructType([]))  # the clients' models
    with tff_programs.native_context(tff_runtime):
        source = _train_on_devices(process, spec, str(tmp_path), 2, per_round=3)
    version, _, states, _ = _outcome(process, str(tmp_path), source)
    assert version == 2
    with open(tmp_path / 'metrics.csv') as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r['round']) for r in rows) == [1, 2]
    for client_id in spec.client_ids:
        first = _leaves(process.initial_client_state(client_id))
        assert not all(np.array_equal(a, b) for a, b in zip(first, _leaves(states[client_id])))


def test_a_fresh_run_refuses_a_state_dir_that_holds_states_and_bad_ids_are_refused(problem, tmp_path):
    spec, _ = problem
    client_dir = tmp_path / spec.client_ids[0]
    client_dir.mkdir()
    (client_dir / '00000000.state').write_bytes(b'x')
    iterator = tff_programs.DeviceStatesDataSource(spec.client_ids, str(tmp_path)).iterator()
    with pytest.raises(ValueError, match=r'^state_dir .* holds client states of an earlier run \(1 clients\)'):
        iterator.select(2)
    with pytest.raises(ValueError, match=r"^client_ids: 'a/b' cannot name a device directory"):
        tff_programs.DeviceStatesDataSource(['a/b'], str(tmp_path))
    with pytest.raises(ValueError, match='^keep must be at least 2'):
        tff_programs.DeviceStatesDataSource(spec.client_ids, str(tmp_path), keep=1)
    with pytest.raises(ValueError, match='^client_ids: not clients of this source: zz'):
        tff_programs.DeviceStatesDataSource(spec.client_ids, str(tmp_path)).latest(['zz'])


def test_a_device_keeps_its_newest_versions_and_starts_each_round_from_its_latest(tmp_path):
    iterator = tff_programs.DeviceStatesDataSource(['a'], str(tmp_path), keep=2).iterator()
    first = iterator.select(1)[0]
    assert first.endswith('a/00000000.state') and not os.path.exists(first)  # no state yet: the initial one
    for round_num in range(1, 4):
        with open(os.path.join(tmp_path, 'a', f'{round_num - 1:08d}.state'), 'w') as f:
            f.write(f'written in round {round_num - 1}')
        path = iterator.select(1)[0]
        with open(path) as f:
            assert f.read() == f'written in round {round_num - 1}'  # seeded with the latest
    assert sorted(os.listdir(tmp_path / 'a')) == ['00000002.state', '00000003.state']
