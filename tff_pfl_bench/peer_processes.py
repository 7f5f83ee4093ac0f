"""TFF's own processes as benchmark peers (`bench_peers`): how they are trained and evaluated.

The client data read from the run's partition on disk, the models of the
project's `tff_pfl.models` registry, the rounds (sampled as
`training_loop.run` samples them, checkpointed as our runs are), and each
peer's process built, run and scored: `tff_fed_recon` (`run_fed_recon`) and
`tff_fedavg_pers_eval` (`run_fedavg_pers_eval`).
"""

import collections
import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import losses, models
from tff_pfl.computations import audit, model_weights
from tff_pfl.data import client_data
from tff_pfl.program import checkpoints, evaluation, experiment, run_config, training_loop
from tff_pfl_bench import peer_scoring

# Intermediate evaluations (the curve) of FedRecon reconstruct every client's head, one TFF call
# per client: only for partitions of at most this many clients; larger ones are scored at the end.
CURVE_CLIENTS = 100
# A peer's checkpoints are our runs' (`checkpoints.RunCheckpoints`, in the run directory's
# `checkpoints/`), with the global model's weights (`process.get_model_weights`) as the server
# state and no client states. TFF's server state besides the weights is that of plain SGD and of a
# mean: nothing carried between rounds, so the weights put back by `process.set_model_weights`
# continue the run exactly.
_NO_CLIENTS = checkpoints.ClientRows(ids=[], rows=np.arange(0), leaves=[], complete=True, row_bytes=0)


# ----------------------------------------------------------------------------
# The client data.


@dataclasses.dataclass
class Clients:
    """Every client's splits in memory, from the run's partition on disk."""

    spec: client_data.ClientDataSpec
    splits: dict  # split -> list of (x, y), in spec.client_ids order

    @property
    def ids(self) -> list:
        return list(self.spec.client_ids)

    def input_spec(self, batched: bool = True):
        x, y = self.splits['train'][0]
        lead = [None] if batched else []
        return (
            tf.TensorSpec(lead + list(x.shape[1:]), tf.as_dtype(x.dtype)),
            tf.TensorSpec(lead + list(y.shape[1:]), tf.int32),
        )

    def scored(self, split: str) -> list:
        """Scored labels per client (examples; for text, characters)."""
        return [int(np.sum(y >= 0)) for _, y in self.splits[split]]


def load_clients(spec: client_data.ClientDataSpec) -> Clients:
    splits = {
        split: [client_data.read_split_numpy(spec, c, split) for c in spec.client_ids]
        for split in ('train', 'val', 'test')
    }
    return Clients(spec, splits)


def prepare_data(config: run_config.ExperimentConfig, out: str, log: Callable[[str], None]) -> Clients:
    """Writes the run's client data, config.json and partition summary as `run_experiment` does.

    Args:
      config: the peer's validated configuration.
      out: the run directory (created; must be empty or absent).
      log: receives the data line.

    Returns:
      The clients' splits, read back from the files written.
    """
    os.makedirs(out, exist_ok=True)
    prepared, spec = experiment.write_client_data(config, out, out)  # the same partition.csv
    log(experiment.data_line(config, prepared, spec))
    return load_clients(spec)


def _permutation(seed: int, round_num: int, index: int, n: int, epochs: int = 1) -> np.ndarray:
    """`epochs` seeded permutations of range(n), one after another."""
    rng = np.random.default_rng([seed, 0x9E37, round_num, index])
    return np.concatenate([rng.permutation(n) for _ in range(epochs)])


def _dataset(x, y, batch_size: int | None = None) -> tf.data.Dataset:
    data = tf.data.Dataset.from_tensor_slices((x, y))
    return data if batch_size is None else data.batch(batch_size)


# ----------------------------------------------------------------------------
# Models.


def _keras_fn(config: run_config.ExperimentConfig, clients: Clients) -> Callable[[], tf.keras.Model]:
    builder = models.get(config.model_name())
    spec = clients.spec

    def keras_model():
        with models.seeded(config.seed):  # initial weights (and the reconstructed head's) fixed by the seed
            return builder(spec.feature_shape, spec.num_classes)

    return keras_model


def _learning_model_fn(keras_fn, input_spec):
    def model_fn():
        return tff.learning.models.from_keras_model(
            keras_fn(), loss=peer_scoring.ScoredCrossEntropy(), input_spec=input_spec, metrics=peer_scoring.metrics()
        )

    return model_fn


def _reconstruction_model_fn(keras_fn, input_spec):
    def model_fn():
        keras_model = keras_fn()
        head = keras_model.layers[-1]
        if not isinstance(head, tf.keras.layers.Dense):
            raise ValueError(f'tff_fed_recon needs a model whose last layer is Dense, got {type(head).__name__}')
        return tff.learning.models.ReconstructionModel.from_keras_model_and_layers(
            keras_model, global_layers=keras_model.layers[:-1], local_layers=[head], input_spec=input_spec
        )

    return model_fn


def _keras_accuracies(keras_model, weights, clients: Clients, split: str = 'test') -> list:
    """`(accuracy, scored)` of each client's split under `weights` (Keras, outside TFF)."""
    keras_model.set_weights(weights)
    xs = [x for x, _ in clients.splits[split]]
    logits = keras_model.predict(np.concatenate(xs), batch_size=512, verbose=0)
    result, start = [], 0
    for x, y in clients.splits[split]:
        predicted = np.argmax(logits[start : start + len(x)], axis=-1)
        start += len(x)
        scored = y >= 0
        count = int(scored.sum())
        result.append((float(np.sum((predicted == y) & scored)) / max(count, 1), count))
    return result


def _summary_row(rows: list, model: str, evaluations: Sequence[tuple]) -> None:
    rows[-1][f'test_{model}_accuracy_mean'] = float(np.mean([a for a, _ in evaluations]))


# ----------------------------------------------------------------------------
# The rounds.


def _communication(comp, **extra) -> dict:
    try:
        return dict(audit.communication_bytes(comp), **extra)
    except ValueError as e:
        return dict(extra, error=' '.join(str(e).split()))


def _sampler(config, clients):
    """`(rng, sample)`: each round's clients, drawn as `training_loop.run` draws them (same generator, same seed)."""
    rng = np.random.default_rng([config.seed, 0x5A3D])
    return rng, lambda: training_loop.sample_clients(rng, clients.ids, config.schedule.client_fraction)


def _train_data(config, clients, round_num, sampled, epochs):
    index = {c: i for i, c in enumerate(clients.ids)}
    data = []
    for c in sampled:
        x, y = clients.splits['train'][index[c]]
        order = _permutation(config.seed, round_num, index[c], len(x), epochs)
        data.append(_dataset(x[order], y[order], config.settings.batch_size))
    return data


def _round_row(round_num, sampled, metrics, seconds) -> collections.OrderedDict:
    train = metrics.get('client_work', {}).get('train', {})
    row = collections.OrderedDict(round=round_num, num_clients=len(sampled))
    if 'loss' in train:
        row['train_loss'] = float(train['loss'])
    if 'accuracy' in train:
        row['train_accuracy'] = float(train['accuracy'])
    row['round_seconds'] = seconds
    return row


def _evaluate_now(config, round_num: int, last: bool) -> bool:
    return last or bool(config.evaluation.eval_every and round_num % config.evaluation.eval_every == 0)


def _result(clients, evaluations: Sequence[Mapping], rows, diverged_round) -> training_loop.RunResult:
    client_rows, summary = evaluation.summarize_evaluation(clients.ids, evaluations)
    return training_loop.RunResult(
        state=None, client_states={}, rounds=rows, clients=client_rows, summary=summary, diverged_round=diverged_round
    )


def _train(config, clients, process, state, log, evaluate, epochs, out, resume):
    """The rounds: sampling, `process.next`, evaluations every `eval_every` rounds; returns the rows.

    With `resume`, the rounds continue after the newest checkpoint's, from its
    weights, sampler state and rows, so every later round samples and trains as
    an uninterrupted run does; a checkpoint is written every
    `config.checkpoints.checkpoint_every` rounds.
    """
    rng, sample = _sampler(config, clients)
    store = checkpoints.RunCheckpoints(os.path.join(out, 'checkpoints'))
    rows, diverged_round, evaluations, done = [], None, None, 0
    if resume:
        saved = store.load_latest(process.get_model_weights(state))
        state = process.set_model_weights(state, saved.server_state)
        rng.bit_generator.state = saved.rng_state
        rows = [collections.OrderedDict(row) for row in saved.rows]
        done = saved.round_num
        log(f'continuing from the round-{done} checkpoint')
    for round_num in range(done + 1, config.schedule.rounds + 1):
        started = time.monotonic()
        sampled = sample()
        data = _train_data(config, clients, round_num, sampled, epochs)
        output = process.next(state, data)
        state = output.state
        rows.append(_round_row(round_num, sampled, output.metrics, time.monotonic() - started))
        if config.schedule.stop_on_divergence and training_loop.diverged(rows[-1]):
            diverged_round = round_num
            log(training_loop.divergence_line(f'round {round_num}', rows[-1]))
        last = round_num == config.schedule.rounds or diverged_round is not None
        line = f'round {round_num}/{config.schedule.rounds}: train_loss {rows[-1].get("train_loss", math.nan):.4f}'
        if _evaluate_now(config, round_num, last):
            if last:
                log(f'round {round_num}: evaluating {len(clients.ids)} clients ...')
            evaluate_start = time.monotonic()
            evaluations = evaluate(state, rows, last)
            rows[-1]['eval_seconds'] = time.monotonic() - evaluate_start
            line += ''.join(f'  test_{k[5:]}' + f' {v:.4f}' for k, v in rows[-1].items() if k.startswith('test_'))
        log(
            line
            + f'  {rows[-1]["round_seconds"]:.2f}s'
            + (f' (+{rows[-1]["eval_seconds"]:.1f}s evaluation)' if 'eval_seconds' in rows[-1] else '')
        )
        if last:
            break
        if config.checkpoints.checkpoint_every and round_num % config.checkpoints.checkpoint_every == 0:
            weights = process.get_model_weights(state)
            store.save(round_num, weights, clients.ids, _NO_CLIENTS, rng.bit_generator.state, rows)
    return state, rows, evaluations, diverged_round


def run_fed_recon(config, clients, out, log, resume):
    """FedRecon rounds, then every client's head reconstructed on its train split, scored on test."""
    s = config.settings
    keras_fn = _keras_fn(config, clients)
    model_fn = _reconstruction_model_fn(keras_fn, clients.input_spec())
    process = tff.learning.algorithms.build_fed_recon(
        model_fn,
        loss_fn=peer_scoring.ScoredCrossEntropy,
        metrics_fn=peer_scoring.metrics,
        server_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=s.server_learning_rate),
        client_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=s.client_learning_rate),
        reconstruction_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=s.client_learning_rate),
        # TFF's default split (even batches reconstruct the head, odd batches train the global
        # layers), the global layers trained for local_epochs passes over theirs.
        dataset_split_fn=tff.learning.models.ReconstructionModel.build_dataset_split_fn(
            recon_epochs=1, post_recon_epochs=s.local_epochs, split_dataset=True
        ),
    )

    def eval_split(data):
        rows = data.unbatch()
        return rows.filter(peer_scoring.is_train_row).batch(s.batch_size), rows.filter(peer_scoring.is_test_row).batch(
            s.batch_size
        )

    evaluation = tff.learning.algorithms.build_fed_recon_eval(
        model_fn,
        loss_fn=peer_scoring.ScoredCrossEntropy,
        metrics_fn=peer_scoring.eval_metrics,
        reconstruction_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=s.client_learning_rate),
        dataset_split_fn=eval_split,
        metrics_aggregation_process=_collecting_process(len(clients.ids)),
    )
    eval_data = []
    for i in range(len(clients.ids)):
        (x, y), (xt, yt) = clients.splits['train'][i], clients.splits['test'][i]
        order = _permutation(config.seed, 0, i, len(x))
        eval_data.append(
            _dataset(
                np.concatenate([x[order], xt]), np.concatenate([y[order], peer_scoring.mark_test(yt, i)]), s.batch_size
            )
        )

    def reconstructed(state):
        eval_state = evaluation.set_model_weights(evaluation.initialize(), process.get_model_weights(state))
        metrics = evaluation.next(eval_state, eval_data).metrics['client_work']['eval']['current_round_metrics']
        position = _positions(metrics['client'][0], len(clients.ids))
        total, count = (np.asarray(v, np.float64) for v in metrics['accuracy'])
        return [(float(total[j] / max(count[j], 1.0)), int(round(float(count[j])))) for j in position]

    def evaluate(state, rows, last):
        if not last and len(clients.ids) > CURVE_CLIENTS:
            return None
        results = reconstructed(state)
        _summary_row(rows, 'personalized_model', results)
        return results

    state = process.initialize()
    state, rows, results, diverged_round = _train(config, clients, process, state, log, evaluate, 1, out, resume)
    evaluations = [{'personalized_model': {'accuracy': a, 'num_examples': n}} for a, n in results]
    communication = _communication(process.next, has_personalize=False)
    recon = _communication(evaluation.next)
    communication.update(
        reconstruction_bytes_down_per_client=recon.get('bytes_down_per_client'),
        reconstruction_bytes_up_per_client=recon.get('bytes_up_per_client'),
    )
    return _result(clients, evaluations, rows, diverged_round), communication


def _collecting_process(num_clients: int) -> tff.templates.AggregationProcess:
    """The metrics aggregation of FedRecon's evaluation: every client's unfinalized metrics, not their sum.

    TFF's reservoir sampling (`tff.aggregators.UnweightedReservoirSamplingFactory`,
    as `build_personalization_eval_computation` collects its metrics) with room
    for every client; each client's `client` metric (`peer_scoring.ClientTag`) says whose
    metrics an entry is. The result is (this call's, this call's): the
    evaluation keeps no metrics across calls.
    """

    @tff.tensorflow.computation
    def unfinalized():
        metrics = peer_scoring.eval_metrics() + [
            tf.keras.metrics.MeanMetricWrapper(peer_scoring.ScoredCrossEntropy(), name='loss')
        ]
        return tff.learning.models.ReconstructionModel.read_metric_variables(metrics)

    metrics_type = unfinalized.type_signature.result
    sampling = tff.aggregators.UnweightedReservoirSamplingFactory(sample_size=num_clients).create(metrics_type)

    @tff.federated_computation
    def initialize():
        return tff.federated_value((), tff.SERVER)

    @tff.federated_computation(initialize.type_signature.result, tff.FederatedType(metrics_type, tff.CLIENTS))
    def next_fn(state, client_metrics):
        collected = sampling.next(sampling.initialize(), client_metrics).result
        return tff.templates.MeasuredProcessOutput(
            state=state,
            result=tff.federated_zip((collected, collected)),
            measurements=tff.federated_value((), tff.SERVER),
        )

    return tff.templates.AggregationProcess(initialize, next_fn)


def _positions(tags, num_clients: int) -> list:
    """Where each client's entry is among TFF's collected metrics, in client order (`peer_scoring.ClientTag`)."""
    tags = [int(round(float(t))) for t in np.atleast_1d(tags)]
    if sorted(tags) != list(range(1, num_clients + 1)):
        raise ValueError(f"TFF's collected metrics are not one entry per client ({len(tags)} of {num_clients})")
    return [tags.index(k + 1) for k in range(num_clients)]


def _personalize_fn(config, finetune_epochs: int):
    """TFF's personalize_fn: SGD epochs on the train split; validation and test after each.

    `test_data` holds the client's validation rows and its test rows
    (marked); the returned metrics hold, for 0 .. `finetune_epochs` epochs,
    the correct and scored counts on both.
    """
    s = config.settings

    def build():
        @tf.function
        def personalize(model, train_data, test_data):
            val = test_data.filter(peer_scoring.is_train_row).batch(512)
            test = test_data.filter(peer_scoring.is_test_row).batch(512)
            size = train_data.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1)

            def scores():
                out = collections.OrderedDict()
                for split, data in (('val', val), ('test', test)):
                    correct, scored = tf.constant(0.0), tf.constant(0.0)
                    for x, y in data:
                        c, n = peer_scoring.scored_counts(model.predict_on_batch(x, training=False), y)
                        correct, scored = correct + c, scored + n
                    out[f'{split}_correct'], out[f'{split}_scored'] = correct, scored
                return out

            metrics = collections.OrderedDict(epoch_0=scores())
            for epoch in range(1, finetune_epochs + 1):
                order = train_data.shuffle(tf.maximum(size, 1), seed=config.seed * 1000 + epoch)
                for x, y in order.batch(s.batch_size):
                    with tf.GradientTape() as tape:
                        loss = losses.hard_cross_entropy(
                            model.predict_on_batch(x, training=True), peer_scoring.label(y)
                        )
                    weights = model.trainable_variables
                    for v, g in zip(weights, tape.gradient(loss, weights)):
                        v.assign_sub(s.client_learning_rate * tf.convert_to_tensor(g))  # an embedding's are sparse
                metrics[f'epoch_{epoch}'] = scores()
            return metrics

        return personalize

    return build


@tf.function
def _baseline(model, test_data):
    """TFF's baseline_evaluate_fn: the received model on the test rows; whose they are (`peer_scoring.ClientTag`)."""
    correct, scored, client = tf.constant(0.0), tf.constant(0.0), tf.constant(0.0)
    for x, y in test_data.filter(peer_scoring.is_test_row).batch(512):
        c, n = peer_scoring.scored_counts(model.predict_on_batch(x, training=False), y)
        correct, scored = correct + c, scored + n
        client = tf.maximum(client, tf.cast(tf.reduce_max(peer_scoring.client_tag(y)), tf.float32))
    return collections.OrderedDict(correct=correct, scored=scored, client=client)


def run_fedavg_pers_eval(config, clients, out, log, resume):
    """TFF's FedAvg rounds, then TFF's personalization evaluation of the final model on every client."""
    s = config.settings
    keras_fn = _keras_fn(config, clients)
    model_fn = _learning_model_fn(keras_fn, clients.input_spec())
    process = tff.learning.algorithms.build_weighted_fed_avg(
        model_fn,
        client_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=s.client_learning_rate),
        server_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=s.server_learning_rate),
    )
    keras_model = keras_fn()
    state = process.initialize()
    # The project's initial model for this seed (`model_weights.initial_weights`), as our FedAvg starts.
    initial = [w.numpy() for w in model_weights.initial_weights(keras_fn, config.seed)]
    state = process.set_model_weights(state, tff.learning.models.ModelWeights(trainable=initial, non_trainable=[]))

    def evaluate(state, rows, last):
        results = _keras_accuracies(keras_model, process.get_model_weights(state).trainable, clients)
        _summary_row(rows, 'global_model', results)
        return results

    state, rows, _, diverged_round = _train(config, clients, process, state, log, evaluate, s.local_epochs, out, resume)
    weights = process.get_model_weights(state)
    np.savez(os.path.join(out, 'global_weights.npz'), *weights.trainable)

    personalization = tff.learning.algorithms.build_personalization_eval_computation(
        model_fn,
        collections.OrderedDict(finetune=_personalize_fn(config, s.finetune_epochs)),
        _baseline,
        max_num_clients=len(clients.ids),  # every client's metrics (the default keeps 100)
    )
    data = []
    for i in range(len(clients.ids)):
        (x, y), (xv, yv), (xt, yt) = (clients.splits[split][i] for split in ('train', 'val', 'test'))
        data.append(
            collections.OrderedDict(
                train_data=_dataset(x, y),
                test_data=_dataset(np.concatenate([xv, xt]), np.concatenate([yv, peer_scoring.mark_test(yt, i)])),
            )
        )
    log(f'personalizing {len(clients.ids)} clients (TFF personalization evaluation) ...')
    started = time.monotonic()
    metrics = personalization(weights, data)
    rows[-1]['personalize_seconds'] = time.monotonic() - started
    evaluations = _by_client(metrics, clients, s.finetune_epochs)
    rows[-1]['test_personalized_model_accuracy_mean'] = float(
        np.mean([e['personalized_model']['accuracy'] for e in evaluations])
    )
    rows[-1]['test_global_model_accuracy_mean'] = float(np.mean([e['global_model']['accuracy'] for e in evaluations]))
    communication = _communication(process.next, has_personalize=True)
    personalize = _communication(personalization)
    communication.update(
        personalize_bytes_down_per_client=personalize.get('bytes_down_per_client'),
        personalize_bytes_up_per_client=personalize.get('bytes_up_per_client'),
    )
    return _result(clients, evaluations, rows, diverged_round), communication


def _by_client(metrics, clients, finetune_epochs: int) -> list:
    """TFF's collected metrics (in its order) -> one evaluation per client, in client order.

    Each client's entry is found by its `client` tag (`peer_scoring.mark_test`); its
    fine-tuned model is the epoch count best on validation, the earliest on
    ties (`fine_tuning.finetune_on_validation`'s rule).
    """
    baseline, tuned = metrics['baseline_metrics'], metrics['finetune']
    evaluations = []
    for j in _positions(baseline['client'], len(clients.ids)):
        val = [float(np.atleast_1d(tuned[f'epoch_{e}']['val_correct'])[j]) for e in range(finetune_epochs + 1)]
        best = int(np.argmax(val))  # the first of equal counts: the fewest epochs
        chosen = tuned[f'epoch_{best}']
        scored = float(np.atleast_1d(baseline['scored'])[j])
        test_scored = float(np.atleast_1d(chosen['test_scored'])[j])
        evaluations.append(
            collections.OrderedDict(
                global_model=collections.OrderedDict(
                    accuracy=float(np.atleast_1d(baseline['correct'])[j]) / max(scored, 1.0),
                    num_examples=int(round(scored)),
                ),
                personalized_model=collections.OrderedDict(
                    accuracy=float(np.atleast_1d(chosen['test_correct'])[j]) / max(test_scored, 1.0),
                    num_examples=int(round(test_scored)),
                    finetune_epochs=best,
                ),
            )
        )
    return evaluations
