"""Our FedAvg under TFF's own program loop: `tff.learning.programs.train_model`, stopped and resumed."""

import asyncio
import csv
import functools
import os

import numpy as np
import pytest
import tensorflow_federated as tff

from processes import fedavg, fedper
from tests.conftest import make_linear_problem
from tff_pfl import models
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
    state_manager = tff.program.FileProgramStateManager(os.path.join(root, 'state'), keep_total=10)
    metrics_manager = tff.program.CSVFileReleaseManager(os.path.join(root, 'metrics.csv'), key_fieldname='round')
    source = tff_programs.ClientIdsDataSource(spec.client_ids, seed=11)
    if crash_at is not None:
        source = CrashingSource(spec.client_ids, 11, crash_at)
    program = tff.learning.programs.train_model(
        train_process=tff_programs.learning_process(process),
        train_data_source=source,
        train_per_round_clients=2,
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


def test_a_process_whose_clients_keep_state_or_without_a_global_model_is_refused_in_one_line(problem):
    spec, model_fn = problem
    dnn = functools.partial(models.mnist_dnn, spec.feature_shape, spec.num_classes)
    with pytest.raises(ValueError, match='^FedPer|has no global model'):
        tff_programs.learning_process(fedper.build_fedper_process(spec, dnn))
    from processes import ditto

    with pytest.raises(ValueError, match=r'^process: its clients keep .* between rounds'):
        tff_programs.learning_process(ditto.build_ditto_process(spec, model_fn))
