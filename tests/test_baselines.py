"""Each baseline's round against a float64 numpy re-implementation of the paper's update.

The problem: three clients of a tiny linearly generated task, a dense ReLU
network (mnist_dnn: 4 -> 100 -> 3). Every test runs one round (or a round
and the personalization stage) through TFF and replays it in numpy with the
same example order; then checks what crosses from CLIENTS to SERVER. Then:
with `local_steps` = 3 every algorithm's clients take exactly 3 local steps
(its kind of step), and bad settings are refused in one line.
"""

import functools

import numpy as np
import pytest

from processes import apfl, ditto, fedavg, fedper, local, perfedavg, pfedme
from tests import numpy_reference as ref
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl import settings as settings_lib
from tff_pfl.computations import audit, local_training

SEED = 11
# The local training of most tests: 2 epochs of batch 8 at learning rate 0.2.
LOCAL = dict(local_epochs=2, batch_size=8, client_learning_rate=0.2)
CONFIG = local.LocalSettings(**LOCAL).training_config()  # the same, as the numpy replay reads it


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    spec = make_linear_problem(tmp_path_factory.mktemp('baselines') / 'data')
    model_fn = functools.partial(models.mnist_dnn, spec.feature_shape, spec.num_classes)
    return spec, model_fn


def _start(process, spec, clients=None):
    state = process.initialize()
    clients = clients or spec.client_ids
    return state, [process.initial_client_state(c) for c in clients]


def _initial(process):
    return ref.as_float64(process.initialize()['model'])


def _client_sgd(spec, client_id, params, config, round_num=0, salt=0, grad_fn=None):
    x, y = ref.read(spec, client_id)
    per_epoch, batch = ref.batch_stream(SEED, client_id, round_num, len(y), config.epochs, config.batch_size, salt)
    return ref.sgd(params, x, y, config, batch, ref.num_steps(config, per_epoch), grad_fn), len(y)


def _uploads(process):
    """`(intrinsic uris, the types they take from the clients, as one string)`."""
    crossing = audit.clients_to_server_values(process.next)
    return {uri for uri, _ in crossing}, ' '.join(str(t) for _, t in crossing)


def test_local_only_trains_each_client_alone(problem, tff_runtime):
    spec, model_fn = problem
    process = local.build_local_process(spec, model_fn, local.LocalSettings(**LOCAL), seed=SEED)
    state, clients = _start(process, spec)
    init = ref.as_float64(clients[0]['model'])
    for other in clients[1:]:  # every client starts from the same model
        ref.assert_close(other['model'], init, atol=0, rtol=0)
    output = process.next(state, clients)
    for client_id, client_state in zip(spec.client_ids, output.client_states):
        expected, _ = _client_sgd(spec, client_id, init, CONFIG)
        ref.assert_close(client_state['model'], expected)
    evaluation = process.evaluate(output.state, output.client_states)
    x, y = ref.read(spec, spec.client_ids[1], 'test')
    assert float(evaluation[1]['personalized_model']['accuracy']) == pytest.approx(
        ref.accuracy(ref.as_float64(output.client_states[1]['model']), x, y)
    )
    # Only the metric sums leave the clients; no model crosses.
    crossing = audit.clients_to_server_values(process.next)
    assert [uri for uri, _ in crossing] == ['federated_sum']
    assert 'float32[4,100]' not in str(crossing[0][1])


def test_fedavg_finetune_picks_epochs_on_validation(problem, tff_runtime):
    spec, model_fn = problem
    settings = fedavg.FedAvgFTSettings(**LOCAL, finetune_epochs=3)
    tune = local_training.TrainingConfig(epochs=1, batch_size=8, learning_rate=0.2)  # batch_size, client lr
    process = fedavg.build_fedavg_process(spec, model_fn, settings, seed=SEED)
    state, clients = _start(process, spec)
    output = process.next(state, clients)
    before = process.evaluate(output.state, output.client_states)
    for e in before:  # before fine-tuning the personalized model is the global one
        assert float(e['personalized_model']['accuracy']) == float(e['global_model']['accuracy'])
    personalized = process.personalize(output.state, output.client_states)
    global_weights = ref.as_float64(output.state['model'])
    chosen = []
    for client_id, client_state in zip(spec.client_ids, personalized):
        x, y = ref.read(spec, client_id)
        xv, yv = ref.read(spec, client_id, 'val')
        params, accuracies = global_weights, [ref.accuracy(global_weights, xv, yv)]
        best, best_epochs = params, 0
        for epoch in range(1, 4):
            per_epoch, batch = ref.batch_stream(SEED, client_id, 1, len(y), 1, 8, salt=2, offset=[epoch, 0])
            params = ref.sgd(params, x, y, tune, batch, per_epoch)
            accuracies.append(ref.accuracy(params, xv, yv))
            if accuracies[-1] > accuracies[best_epochs]:
                best, best_epochs = params, epoch
        np.testing.assert_allclose(client_state['finetune_val_accuracy'], accuracies, atol=1e-6)
        assert int(client_state['finetune_epochs']) == best_epochs
        ref.assert_close(client_state['personalized'], best, atol=5e-5)
        chosen.append(best_epochs)
    assert len(set(chosen)) > 1 or chosen[0] > 0  # the choice is made per client, not fixed at 0


def test_fedper_averages_the_base_and_keeps_the_head(problem, tff_runtime):
    spec, model_fn = problem
    assert fedper.split_layers(model_fn, 1) == ([0, 1], [2, 3])  # the classifier's kernel and bias are personal
    process = fedper.build_fedper_process(spec, model_fn, fedper.FedPerSettings(**LOCAL, personal_layers=1), seed=SEED)
    state, clients = _start(process, spec)
    init = ref.as_float64(clients[0]['head'])
    base = _initial(process)
    output = process.next(state, clients)
    trained_bases, sizes = [], []
    for client_id, client_state in zip(spec.client_ids, output.client_states):
        trained, n = _client_sgd(spec, client_id, base + init, CONFIG)
        ref.assert_close(client_state['head'], trained[2:])
        trained_bases.append(trained[:2])
        sizes.append(n)
    ref.assert_close(output.state['model'], ref.weighted_mean(trained_bases, sizes))
    # The head's weights [100, 3] never reach the server; the base's do.
    _, uploaded = _uploads(process)
    assert 'float32[4,100]' in uploaded and 'float32[100,3]' not in uploaded


def test_fedper_refuses_personal_layers_that_leave_nothing_shared(problem):
    spec, model_fn = problem
    with pytest.raises(ValueError) as caught:
        fedper.build_fedper_process(spec, model_fn, fedper.FedPerSettings(personal_layers=2))
    assert str(caught.value) == (
        "personal_layers=2 leaves no shared layer: model 'mnist_dnn' has 2 layers with weights; "
        'FedPer needs at least personal_layers + 1 = 3'
    )
    logistic = functools.partial(models.get('logistic'), spec.feature_shape, spec.num_classes)
    with pytest.raises(ValueError) as caught:
        fedper.split_layers(logistic, 1)
    assert str(caught.value) == (
        "personal_layers=1 leaves no shared layer: model 'logistic_regression' has 1 layer with weights; "
        'FedPer needs at least personal_layers + 1 = 2'
    )


def test_ditto_personal_model_is_pulled_towards_the_global(problem, tff_runtime):
    spec, model_fn = problem
    lam = 0.5
    settings = ditto.DittoSettings(**LOCAL, ditto_lambda=lam, personal_epochs=1)
    personal_config = local_training.TrainingConfig(epochs=1, batch_size=8, learning_rate=0.2)
    assert settings.personal_training_config() == personal_config
    process = ditto.build_ditto_process(spec, model_fn, settings, seed=SEED)
    state, clients = _start(process, spec)
    # Two rounds, so that v_k and w differ when the pull is applied.
    first = process.next(state, clients)
    global_weights = ref.as_float64(first.state['model'])
    output = process.next(first.state, first.client_states)
    trained, sizes = [], []
    for client_id, before, after in zip(spec.client_ids, first.client_states, output.client_states):
        w_k, n = _client_sgd(spec, client_id, global_weights, CONFIG, round_num=1)
        trained.append(w_k)
        sizes.append(n)
        pull = lambda v: [lam * (a - b) for a, b in zip(v, global_weights)]  # noqa: E731
        v_k, _ = _client_sgd(
            spec, client_id, ref.as_float64(before['personal']), personal_config, round_num=1, salt=1, grad_fn=pull
        )
        ref.assert_close(after['personal'], v_k)
    ref.assert_close(output.state['model'], ref.weighted_mean(trained, sizes))
    assert _uploads(process)[0] <= {'federated_sum', 'federated_weighted_mean', 'federated_mean'}


def test_pfedme_round_matches_algorithm_1(problem, tff_runtime):
    spec, model_fn = problem
    lam, k, personal_lr, beta = 5.0, 3, 0.05, 1.5
    settings = pfedme.PFedMeSettings(
        batch_size=8,
        client_learning_rate=0.05,
        local_steps=4,  # R
        pfedme_lambda=lam,
        pfedme_inner_steps=k,
        pfedme_personal_learning_rate=personal_lr,
        pfedme_beta=beta,
    )
    config = settings.training_config()
    process = pfedme.build_pfedme_process(spec, model_fn, settings, seed=SEED)
    state, clients = _start(process, spec)
    w_global = _initial(process)
    output = process.next(state, clients)
    locals_ = []
    for client_id, client_state in zip(spec.client_ids, output.client_states):
        x, y = ref.read(spec, client_id)
        per_epoch, batch = ref.batch_stream(SEED, client_id, 0, len(y), config.epochs, config.batch_size)
        w, theta = [p.copy() for p in w_global], [p.copy() for p in w_global]
        assert ref.num_steps(config, per_epoch) == 4
        for r in range(4):
            idx = batch(r)
            for _ in range(k):
                _, grads = ref.loss_and_grads(theta, x[idx], y[idx])
                theta = [t - personal_lr * (g + lam * (t - a)) for t, g, a in zip(theta, grads, w)]
            w = [a - config.learning_rate * lam * (a - t) for a, t in zip(w, theta)]
        ref.assert_close(client_state['personalized'], theta)
        locals_.append(w)
    mean = ref.weighted_mean(locals_, [1, 1, 1])  # uniform over the sampled clients
    ref.assert_close(output.state['model'], [(1 - beta) * a + beta * m for a, m in zip(w_global, mean)])


@pytest.mark.parametrize('variant', ['fo', 'hf'])
def test_perfedavg_round_matches_algorithm_1(problem, tff_runtime, variant):
    spec, model_fn = problem
    alpha, delta, beta = 0.3, 1e-3, 0.1
    if variant == 'hf':
        settings = perfedavg.PerFedAvgHFSettings(
            batch_size=8, client_learning_rate=beta, local_steps=3, perfedavg_alpha=alpha, perfedavg_delta=delta
        )
    else:
        settings = perfedavg.PerFedAvgSettings(
            batch_size=8, client_learning_rate=beta, local_steps=3, perfedavg_alpha=alpha
        )
    assert perfedavg.variant_of(settings) == variant  # the settings type is the variant
    process = perfedavg.build_perfedavg_process(spec, model_fn, settings, seed=SEED)
    state, clients = _start(process, spec)
    w_global = _initial(process)
    output = process.next(state, clients)
    assert float(output.metrics['mean_local_steps']) == 3.0  # tau meta steps
    per_step = 3 if variant == 'hf' else 2
    trained = []
    for client_id in spec.client_ids:
        x, y = ref.read(spec, client_id)
        # tau = 3 meta steps of `per_step` batches each: the stream holds 3 * per_step epochs.
        _, batch = ref.batch_stream(SEED, client_id, 0, len(y), 3 * per_step, settings.batch_size)
        w = [p.copy() for p in w_global]
        for s in range(3):
            d1, d2 = batch(per_step * s), batch(per_step * s + 1)
            _, g = ref.loss_and_grads(w, x[d1], y[d1])
            w_tilde = [a - alpha * b for a, b in zip(w, g)]
            _, outer = ref.loss_and_grads(w_tilde, x[d2], y[d2])
            if variant == 'hf':
                d3 = batch(per_step * s + 2)
                _, plus = ref.loss_and_grads([a + delta * b for a, b in zip(w, outer)], x[d3], y[d3])
                _, minus = ref.loss_and_grads([a - delta * b for a, b in zip(w, outer)], x[d3], y[d3])
                outer = [o - alpha * (p - m) / (2 * delta) for o, p, m in zip(outer, plus, minus)]
            w = [a - beta * o for a, o in zip(w, outer)]
        trained.append(w)
    ref.assert_close(output.state['model'], ref.weighted_mean(trained, [1, 1, 1]), atol=1e-4)
    # Evaluation: the global model after one gradient step of size alpha on the whole training split.
    w_new = ref.as_float64(output.state['model'])
    evaluation = process.evaluate(output.state, output.client_states)
    for client_id, e in zip(spec.client_ids, evaluation):
        x, y = ref.read(spec, client_id)
        xt, yt = ref.read(spec, client_id, 'test')
        _, g = ref.loss_and_grads(w_new, x, y)
        adapted = [a - alpha * b for a, b in zip(w_new, g)]
        assert float(e['personalized_model']['accuracy']) == pytest.approx(ref.accuracy(adapted, xt, yt))
        assert float(e['global_model']['accuracy']) == pytest.approx(ref.accuracy(w_new, xt, yt))


def test_apfl_round_matches_algorithm_1(problem, tff_runtime):
    spec, model_fn = problem
    alpha0, alpha_lr = 0.3, 0.5
    settings = apfl.APFLSettings(
        local_epochs=1, batch_size=8, client_learning_rate=0.2, apfl_alpha=alpha0, apfl_alpha_learning_rate=alpha_lr
    )
    config = settings.training_config()
    process = apfl.build_apfl_process(spec, model_fn, settings, seed=SEED)
    state, clients = _start(process, spec)
    w_global = _initial(process)
    output = process.next(state, clients)
    trained, sizes = [], []
    for client_id, client_state in zip(spec.client_ids, output.client_states):
        x, y = ref.read(spec, client_id)
        per_epoch, batch = ref.batch_stream(SEED, client_id, 0, len(y), config.epochs, config.batch_size)
        w, v, a = [p.copy() for p in w_global], [p.copy() for p in w_global], alpha0
        for i in range(ref.num_steps(config, per_epoch)):
            idx = batch(i)
            _, g_w = ref.loss_and_grads(w, x[idx], y[idx])
            mixed = [a * p + (1 - a) * q for p, q in zip(v, w)]
            _, g_mix = ref.loss_and_grads(mixed, x[idx], y[idx])
            a_grad = sum(float(np.sum((p - q) * g)) for p, q, g in zip(v, w, g_mix))
            w, v, a = (
                [p - config.learning_rate * g for p, g in zip(w, g_w)],
                [p - config.learning_rate * a * g for p, g in zip(v, g_mix)],
                float(np.clip(a - alpha_lr * a_grad, 0.0, 1.0)),
            )
        ref.assert_close(client_state['local'], v)
        assert float(client_state['alpha']) == pytest.approx(a, abs=1e-5)
        trained.append(w)
        sizes.append(len(y))
    ref.assert_close(output.state['model'], ref.weighted_mean(trained, sizes))
    # The personalized model mixes the client's v and alpha with the current global model.
    w_new = ref.as_float64(output.state['model'])
    evaluation = process.evaluate(output.state, output.client_states)
    for client_id, client_state, e in zip(spec.client_ids, output.client_states, evaluation):
        a = float(client_state['alpha'])
        mixed = [a * p + (1 - a) * q for p, q in zip(ref.as_float64(client_state['local']), w_new)]
        xt, yt = ref.read(spec, client_id, 'test')
        assert float(e['personalized_model']['accuracy']) == pytest.approx(ref.accuracy(mixed, xt, yt))
    # Neither v_i nor alpha_i crosses: the uploads are the w update, its weight and metric sums.
    uris, uploaded = _uploads(process)
    assert uris <= {'federated_sum', 'federated_weighted_mean', 'federated_mean'}
    assert uploaded.count('float32[4,100]') == 1 and 'alpha' not in uploaded


def test_per_client_evaluation_covers_unsampled_clients(problem, tff_runtime):
    """Every client is evaluated: a client that took part with its own v_k, one that never did with w."""
    spec, model_fn = problem
    process = ditto.build_ditto_process(spec, model_fn, ditto.DittoSettings(**LOCAL, ditto_lambda=0.1), seed=SEED)
    state, clients = _start(process, spec)
    output = process.next(state, clients[:1])  # only client 0 trains
    all_states = list(output.client_states) + clients[1:]
    evaluation = process.evaluate(output.state, all_states)
    init = ref.as_float64(clients[1]['personal'])
    w = ref.as_float64(output.state['model'])
    for index, (client_id, client_state, e) in enumerate(zip(spec.client_ids, all_states, evaluation)):
        xt, yt = ref.read(spec, client_id, 'test')
        personal = ref.as_float64(client_state['personal']) if index == 0 else w
        assert float(e['personalized_model']['accuracy']) == pytest.approx(ref.accuracy(personal, xt, yt))
        assert float(e['global_model']['accuracy']) == pytest.approx(ref.accuracy(w, xt, yt))
    ref.assert_close(all_states[2]['personal'], init, atol=0, rtol=0)  # untouched
    assert any(abs(a - b).max() > 1e-3 for a, b in zip(init, w))  # the two candidates differ


# Each algorithm's builder with `local_steps` = 3 (and its settings otherwise the defaults).
STEP_BUILDERS = {
    'local': lambda spec, model_fn, steps: local.build_local_process(
        spec, model_fn, local.LocalSettings(**steps), seed=SEED
    ),
    'fedper': lambda spec, model_fn, steps: fedper.build_fedper_process(
        spec, model_fn, fedper.FedPerSettings(**steps), seed=SEED
    ),
    'ditto': lambda spec, model_fn, steps: ditto.build_ditto_process(
        spec, model_fn, ditto.DittoSettings(**steps), seed=SEED
    ),
    'pfedme': lambda spec, model_fn, steps: pfedme.build_pfedme_process(
        spec, model_fn, pfedme.PFedMeSettings(**steps), seed=SEED
    ),
    'perfedavg_fo': lambda spec, model_fn, steps: perfedavg.build_perfedavg_process(
        spec, model_fn, perfedavg.PerFedAvgSettings(**steps), seed=SEED
    ),
    'perfedavg_hf': lambda spec, model_fn, steps: perfedavg.build_perfedavg_process(
        spec, model_fn, perfedavg.PerFedAvgHFSettings(**steps), seed=SEED
    ),
    'apfl': lambda spec, model_fn, steps: apfl.build_apfl_process(
        spec, model_fn, apfl.APFLSettings(**steps), seed=SEED
    ),
}


@pytest.mark.parametrize('algorithm', list(STEP_BUILDERS))
def test_local_steps_are_exactly_the_steps_taken(problem, tff_runtime, algorithm):
    """local_steps = 3: every client takes 3 local steps (its algorithm's kind), whatever its data size.

    Batch 32: the clients hold 37, 50 and 23 training examples, so one of them
    has a single batch per epoch (Per-FedAvg HF needs three per meta step).
    """
    spec, model_fn = problem
    process = STEP_BUILDERS[algorithm](spec, model_fn, dict(local_steps=3, batch_size=32))
    state, clients = _start(process, spec)
    output = process.next(state, clients)
    assert float(output.metrics['mean_local_steps']) == 3.0
    assert int(output.metrics['num_clients']) == 3
    if algorithm == 'ditto':  # local_steps bounds the personal model too
        assert float(output.metrics['mean_personal_steps']) == 3.0


def test_without_local_steps_the_epochs_count(problem, tff_runtime):
    """local_steps = 0: the steps are the epochs' batches (Ditto's personal model: personal_epochs)."""
    spec, model_fn = problem
    process = ditto.build_ditto_process(
        spec, model_fn, ditto.DittoSettings(local_epochs=2, personal_epochs=3, batch_size=32), seed=SEED
    )
    state, clients = _start(process, spec)
    output = process.next(state, clients)
    batches = [-(-n // 32) for n in (37, 50, 23)]  # per epoch: 2, 2, 1
    assert float(output.metrics['mean_local_steps']) == pytest.approx(2 * sum(batches) / 3)
    assert float(output.metrics['mean_personal_steps']) == pytest.approx(3 * sum(batches) / 3)


@pytest.mark.parametrize(
    'settings,message',
    [
        (local.LocalSettings(local_steps=-1), 'local_steps must be >= 0, got -1'),
        (local.LocalSettings(local_epochs=0), 'local_epochs must be >= 1, got 0'),
        (local.LocalSettings(batch_size=0), 'batch_size must be >= 1, got 0'),
        (fedper.FedPerSettings(personal_layers=0), 'personal_layers must be >= 1, got 0'),
        (fedper.FedPerSettings(server_learning_rate=0.0), 'server_learning_rate must be > 0, got 0.0'),
        (ditto.DittoSettings(ditto_lambda=-1.0), 'ditto_lambda must be >= 0, got -1.0'),
        (ditto.DittoSettings(personal_epochs=0), 'personal_epochs must be >= 1, got 0'),
        (
            ditto.DittoSettings(local_steps=5, personal_epochs=2),
            'personal_epochs=2 applies only with local_steps=0: with local_steps=5 both Ditto models take 5 steps',
        ),
        (pfedme.PFedMeSettings(pfedme_lambda=0.0), 'pfedme_lambda must be > 0, got 0.0'),
        (pfedme.PFedMeSettings(pfedme_inner_steps=0), 'pfedme_inner_steps must be >= 1, got 0'),
        (
            pfedme.PFedMeSettings(pfedme_personal_learning_rate=-0.1),
            'pfedme_personal_learning_rate must be > 0, got -0.1',
        ),
        (pfedme.PFedMeSettings(pfedme_beta=0.0), 'pfedme_beta must be > 0, got 0.0'),
        (pfedme.PFedMeSettings(local_epochs=3), 'give local_epochs or local_steps, not both'),
        (perfedavg.PerFedAvgSettings(perfedavg_alpha=0.0), 'perfedavg_alpha must be > 0, got 0.0'),
        (perfedavg.PerFedAvgHFSettings(perfedavg_delta=0.0), 'perfedavg_delta must be > 0, got 0.0'),
        (apfl.APFLSettings(apfl_alpha=1.5), r'apfl_alpha must be in \[0, 1\], got 1.5'),
        (apfl.APFLSettings(apfl_alpha_learning_rate=-0.01), 'apfl_alpha_learning_rate must be >= 0, got -0.01'),
        (apfl.APFLSettings(apfl_alpha='high'), "apfl_alpha must be a number, got 'high'"),
    ],
)
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(settings_lib.SettingsError, match=f'^{message}') as caught:
        settings.validate()
    assert '\n' not in str(caught.value)


def test_builders_validate_their_settings_first(problem):
    spec, model_fn = problem
    with pytest.raises(settings_lib.SettingsError, match='pfedme_lambda'):
        pfedme.build_pfedme_process(spec, model_fn, pfedme.PFedMeSettings(pfedme_lambda=0.0))
    with pytest.raises(settings_lib.SettingsError, match='apfl_alpha'):
        apfl.build_apfl_process(spec, model_fn, apfl.APFLSettings(apfl_alpha=1.5))
    with pytest.raises(settings_lib.SettingsError, match='ditto_lambda'):
        ditto.build_ditto_process(spec, model_fn, ditto.DittoSettings(ditto_lambda=-1.0))
    with pytest.raises(settings_lib.SettingsError, match='local_steps'):
        local.build_local_process(spec, model_fn, local.LocalSettings(local_steps=-2))
    with pytest.raises(settings_lib.SettingsError, match='finetune_epochs'):
        fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgFTSettings(finetune_epochs=-1))
    # The variant is the settings type: the HF step size exists in HF's settings only.
    with pytest.raises(TypeError, match=r'^build_perfedavg_process takes PerFedAvgSettings or PerFedAvgHFSettings'):
        perfedavg.build_perfedavg_process(spec, model_fn, ditto.DittoSettings())
    assert perfedavg.variant_of(perfedavg.PerFedAvgHFSettings()) == 'hf'
    assert perfedavg.variant_of(perfedavg.PerFedAvgSettings()) == 'fo'


def test_each_algorithm_has_exactly_the_settings_it_uses():
    local_training_fields = {'batch_size', 'client_learning_rate', 'local_epochs', 'local_steps'}
    assert set(local.LocalSettings.field_names()) == local_training_fields
    assert set(fedper.FedPerSettings.field_names()) == local_training_fields | {
        'server_learning_rate',
        'personal_layers',
    }
    assert set(ditto.DittoSettings.field_names()) == local_training_fields | {
        'server_learning_rate',
        'ditto_lambda',
        'personal_epochs',
    }
    # pFedMe and Per-FedAvg average uniformly with their own server step (beta) or none: no server_learning_rate.
    assert set(pfedme.PFedMeSettings.field_names()) == local_training_fields | {
        'pfedme_lambda',
        'pfedme_inner_steps',
        'pfedme_personal_learning_rate',
        'pfedme_beta',
    }
    assert set(perfedavg.PerFedAvgSettings.field_names()) == local_training_fields | {'perfedavg_alpha'}
    assert set(perfedavg.PerFedAvgHFSettings.field_names()) == local_training_fields | {
        'perfedavg_alpha',
        'perfedavg_delta',
    }
    assert set(apfl.APFLSettings.field_names()) == local_training_fields | {
        'server_learning_rate',
        'apfl_alpha',
        'apfl_alpha_learning_rate',
    }
    # pFedMe's defaults are the paper's MNIST settings: R = 20 local rounds of |D| = 20 at eta = 0.005.
    defaults = pfedme.PFedMeSettings()
    assert (defaults.local_steps, defaults.batch_size, defaults.client_learning_rate) == (20, 20, 0.005)
