"""Local distillation of a teacher into a student, over a hyper-parameter grid.

PersFL's stage 2 trains, for every (temperature T, imitation lambda) of a
grid, a student initialised with the teacher's weights, and keeps the one with
the best validation accuracy. Here the G candidates are trained together:
their weights are stacked along a leading dimension and a single
`tf.while_loop` steps all of them on the same batches (`models.stacked`), so
the grid costs one loop instead of G sequential trainings. Every candidate
sees the same batch order, so the result equals training them one by one
(tests/test_distillation.py; speed-up in benchmarks/results/distillation_grid.md).
"""

import collections
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tff_pfl import losses
from tff_pfl.computations import local_training
from tff_pfl.data import client_data
from tff_pfl.models import stacked

GridResult = collections.namedtuple('GridResult', ['weights', 'val_accuracy', 'best'])


def grid_candidates(temperatures: Sequence[float], imitations: Sequence[float]) -> list[tuple[float, float]]:
    """The (T, lambda) pairs to train, without duplicates.

    T has no effect at the two ends of lambda, so each appears once (with the
    first temperature): with lambda = 0 the soft term vanishes; with lambda = 1
    only the soft term is left, and since every student starts from the
    teacher's weights its gradient is exactly zero: the student stays the
    teacher. Order: lambda ascending, then T ascending; on equal validation
    accuracy the earlier candidate wins, i.e. the one that imitates the
    teacher least.

    Args:
      temperatures: the grid's temperatures T (> 0).
      imitations: the grid's imitation weights lambda, in [0, 1].

    Returns:
      The list of `(T, lambda)` pairs, in the order above.

    Raises:
      ValueError: on an empty grid, T <= 0 or lambda outside [0, 1].
    """
    temperatures = sorted(set(float(t) for t in temperatures))
    imitations = sorted(set(float(i) for i in imitations))
    if not temperatures or not imitations:
        raise ValueError('the distillation grid needs at least one temperature and one imitation value')
    if temperatures[0] <= 0:
        raise ValueError(f'temperatures must be > 0, got {temperatures}')
    if imitations[0] < 0 or imitations[-1] > 1:
        raise ValueError(f'imitation values (lambda) must be in [0, 1], got {imitations}')
    candidates = []
    for imitation in imitations:
        if imitation in (0.0, 1.0):
            candidates.append((temperatures[0], imitation))
        else:
            candidates.extend((t, imitation) for t in temperatures)
    return candidates


def _stacked_accuracy(layers, weights, data: client_data.ClientSplit, batch_size=1000):
    """Per-candidate number of correct predictions on a whole split, [G]."""
    if data.labels.shape.rank > 1:  # sequences: as many positions per pass as `batch_size` examples
        batch_size = max(1, batch_size // int(np.prod(data.labels.shape[1:])))
    num_examples = data.num_examples
    num_models = tf.shape(weights[0])[0]

    def body(start, correct):
        stop = tf.minimum(start + batch_size, num_examples)
        x, y = data.slice(start, stop)
        logits = stacked.forward(layers, weights, x)
        hits = tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), y[tf.newaxis])  # ignored labels never hit
        return stop, correct + tf.reduce_sum(tf.cast(hits, tf.float32), axis=list(range(1, hits.shape.rank)))

    _, correct = tf.while_loop(lambda start, _: start < num_examples, body, (tf.constant(0), tf.zeros([num_models])))
    return correct


def distill_grid(
    layers: list,
    teacher_weights: Sequence[tf.Tensor],
    train: client_data.ClientSplit,
    val: client_data.ClientSplit,
    *,
    temperatures: tf.Tensor,
    imitations: tf.Tensor,
    config: local_training.TrainingConfig,
    seed: tf.Tensor,
    soft: str = 'kl',
) -> GridResult:
    """Trains one student per (T, lambda) from the teacher, all at once (TF code).

    Args:
      layers: `models.stacked.plan(model)` of the architecture.
      teacher_weights: O_k, the teacher's weights (also every student's start).
      train: the client's training split (students are trained on it).
      val: the client's validation split (the grid is chosen on it).
      temperatures: float32 [G], T of each candidate.
      imitations: float32 [G], lambda of each candidate.
      config: distillation epochs, batch size and learning rate.
      seed: int64 [2] stateless seed of the batch order (shared by all G).
      soft: 'kl' (PersFL, Eq. 3) or 'ce' (PersFL-GD, Eq. 7); a `losses.SOFT_LOSSES` name.

    Returns:
      `GridResult(weights, val_accuracy, best)`: the G trained students
      (stacked), their validation accuracies [G], and the index of the best
      (first on ties).
    """
    num_models = tf.shape(temperatures)[0]
    teacher_stack = [w[tf.newaxis] for w in teacher_weights]
    students = [tf.repeat(w, num_models, axis=0) for w in teacher_stack]
    steps = _Steps(train, config, seed)
    trained = _train_stack(
        layers, teacher_stack, students, train, steps, 0, steps.total, temperatures, imitations, soft
    )
    val_accuracy = _val_accuracy(layers, trained, val)
    best = tf.argmax(val_accuracy, output_type=tf.int32)  # first maximum on ties
    return GridResult(trained, val_accuracy, best)


class _Steps:
    """The batch schedule every candidate shares: E epochs of seeded permutations (TF code)."""

    def __init__(self, train, config, seed):
        self.batch_size = int(config.batch_size)
        self.batches_per_epoch = (train.num_examples + self.batch_size - 1) // self.batch_size
        self.total = int(config.epochs) * self.batches_per_epoch
        self.permutations = local_training.epoch_permutations(seed, config.epochs, train.num_examples)
        self.learning_rate = tf.constant(config.learning_rate, tf.float32)
        self.num_examples = train.num_examples


def _train_stack(layers, teacher_stack, students, train, steps, first, last, temperatures, imitations, soft):
    """SGD steps `first` .. `last` - 1 of the shared schedule on every stacked candidate (TF code)."""

    def body(step, *weights):
        epoch = step // steps.batches_per_epoch
        start = (step % steps.batches_per_epoch) * steps.batch_size
        stop = tf.minimum(start + steps.batch_size, steps.num_examples)
        x, y = train.gather(steps.permutations[epoch, start:stop])
        teacher_logits = stacked.forward(layers, teacher_stack, x)[0]
        with tf.GradientTape() as tape:
            tape.watch(weights)
            student_logits = stacked.forward(layers, list(weights), x, training=True)
            # Candidates are independent: the gradient of the sum is each one's own.
            loss = tf.reduce_sum(losses.persfl_loss(student_logits, teacher_logits, y, temperatures, imitations, soft))
        grads = tape.gradient(loss, weights)
        return (step + 1,) + tuple(w - steps.learning_rate * g for w, g in zip(weights, grads))

    result = tf.while_loop(lambda step, *_: step < last, body, (tf.convert_to_tensor(first),) + tuple(students))
    return list(result[1:])


def _val_accuracy(layers, weights, val):
    return _stacked_accuracy(layers, weights, val) / tf.maximum(client_data.count_labels(val.labels), 1.0)


# Successive halving (`distill_halving`): each rung keeps the best third of its candidates, and the
# rungs end after 1/9, 1/3 and all of the grid's SGD steps.
HALVING_RATE = 3
HALVING_RUNGS = 3


def halving_survivors(num_candidates: int, rate: int = HALVING_RATE, rungs: int = HALVING_RUNGS) -> list[int]:
    """How many candidates train in each rung of `distill_halving`.

    Args:
      num_candidates: G.
      rate: eta, each rung keeps ceil(n / eta) of its n candidates.
      rungs: the number of rungs.

    Returns:
      `[G, ceil(G / eta), ...]`, one count per rung.
    """
    counts = [int(num_candidates)]
    for _ in range(rungs - 1):
        counts.append(-(-counts[-1] // rate))
    return counts


def distill_halving(
    layers: list,
    teacher_weights: Sequence[tf.Tensor],
    train: client_data.ClientSplit,
    val: client_data.ClientSplit,
    *,
    temperatures: tf.Tensor,
    imitations: tf.Tensor,
    config: local_training.TrainingConfig,
    seed: tf.Tensor,
    soft: str = 'kl',
) -> GridResult:
    """The grid searched by successive halving on the validation split (TF code).

    Every candidate follows the grid's own schedule (same batches, same
    steps), but only while it stays among the best: after 1/9 of the steps
    the candidates are ranked on validation and the best third (ties: the
    earlier candidate) go on; after 1/3 of the steps the best third of those;
    the survivors finish all the steps, and the best of them on validation is
    chosen. A survivor's weights are exactly the grid's for that candidate,
    so whenever the grid's choice survives both cuts the two choose the same
    student. The 23 candidates of the default grid cost 23/9 + 8 (1/3 - 1/9)
    + 3 (1 - 1/3) = 6.3 full trainings instead of 23.

    Args:
      layers: as in `distill_grid`.
      teacher_weights: as in `distill_grid`.
      train: as in `distill_grid`.
      val: as in `distill_grid`.
      temperatures: float32 [G], as in `distill_grid`; G must be static.
      imitations: float32 [G], as in `distill_grid`.
      config: as in `distill_grid`.
      seed: as in `distill_grid`.
      soft: as in `distill_grid`.

    Returns:
      A `GridResult` over the G candidates: each one's weights and validation
      accuracy when it was last trained (at the rung where it was cut, or at
      the end), and the index of the chosen one.
    """
    counts = halving_survivors(int(temperatures.shape[0]))
    teacher_stack = [w[tf.newaxis] for w in teacher_weights]
    students = [tf.repeat(w, counts[0], axis=0) for w in teacher_stack]
    steps = _Steps(train, config, seed)
    index = tf.range(counts[0])  # the original candidate of each stacked slot
    every = [tf.identity(w) for w in students]
    val_accuracy = tf.zeros([counts[0]])
    first = tf.constant(0)
    for rung in range(len(counts)):
        last = tf.maximum(steps.total // HALVING_RATE ** (len(counts) - 1 - rung), 1)
        last = tf.minimum(tf.maximum(last, first), steps.total)
        students = _train_stack(
            layers, teacher_stack, students, train, steps, first, last, temperatures, imitations, soft
        )
        accuracy = _val_accuracy(layers, students, val)
        slots = index[:, tf.newaxis]
        val_accuracy = tf.tensor_scatter_nd_update(val_accuracy, slots, accuracy)
        every = [tf.tensor_scatter_nd_update(e, slots, w) for e, w in zip(every, students)]
        if rung + 1 < len(counts):
            keep = tf.sort(tf.math.top_k(accuracy, k=counts[rung + 1]).indices)  # top_k: lower index first on ties
            students = [tf.gather(w, keep) for w in students]
            temperatures, imitations, index = (tf.gather(t, keep) for t in (temperatures, imitations, index))
        first = last
    best = tf.gather(index, tf.argmax(accuracy, output_type=tf.int32))  # survivors in order: first on ties
    return GridResult(every, val_accuracy, best)


def distill_sequential(layers, teacher_weights, train, val, *, temperatures, imitations, config, seed, soft='kl'):
    """The same grid, one candidate after another (reference and benchmark).

    Each candidate is a one-model `distill_grid`; control dependencies chain
    them so they run strictly in sequence.

    Args:
      layers: as in `distill_grid`.
      teacher_weights: as in `distill_grid`.
      train: as in `distill_grid`.
      val: as in `distill_grid`.
      temperatures: float32 [G], as in `distill_grid`; G must be static.
      imitations: float32 [G], as in `distill_grid`.
      config: as in `distill_grid`.
      seed: as in `distill_grid` (every candidate gets the same batch order).
      soft: as in `distill_grid`.

    Returns:
      A `GridResult` like `distill_grid`'s.
    """
    trained, accuracies, previous = [], [], []
    for g in range(int(temperatures.shape[0])):
        with tf.control_dependencies(previous):
            one = distill_grid(
                layers,
                teacher_weights,
                train,
                val,
                temperatures=temperatures[g : g + 1],
                imitations=imitations[g : g + 1],
                config=config,
                seed=seed,
                soft=soft,
            )
        trained.append(one.weights)
        accuracies.append(one.val_accuracy)
        previous = [one.val_accuracy]
    weights = [tf.concat([t[i] for t in trained], axis=0) for i in range(len(trained[0]))]
    val_accuracy = tf.concat(accuracies, axis=0)
    return GridResult(weights, val_accuracy, tf.argmax(val_accuracy, output_type=tf.int32))


def candidate_arrays(candidates):
    """(T, lambda) pairs -> float32 arrays `(temperatures, imitations)`.

    Args:
      candidates: a sequence of `(T, lambda)` pairs (e.g. `grid_candidates`).

    Returns:
      `(temperatures, imitations)`, two float32 arrays of shape [G].
    """
    array = np.asarray(candidates, np.float32).reshape(-1, 2)
    return array[:, 0], array[:, 1]


def distill_towards(model, inputs, targets, *, temperature, epochs, batch_size, learning_rate, seed):
    """Trains `model` towards fixed soft targets on unlabeled inputs (TF code).

    The loss is T^2 times the batch mean of KL(target || softmax(model(x) /
    T)), the distillation step of KT-pFL (Eq. 6) and of FedDF's server. The
    T^2 factor (Hinton et al. 2015) keeps the step on the scale of a
    cross-entropy step: the KL's gradient in the logits shrinks like 1/T^2,
    and at T = 10 without it the distillation had no measurable effect (see
    docs/algorithms/ktpfl.md). SGD through
    `local_training.train`: the "labels" handed to it are row numbers into
    `targets`, so inputs and targets are batched together.

    Args:
      model: the student (trained in place).
      inputs: float32 `[P, ...]`, the unlabeled inputs.
      targets: float32 `[P, C]`, one probability vector per input.
      temperature: T of the student's softmax.
      epochs: passes over the P inputs.
      batch_size: inputs per step.
      learning_rate: SGD step size.
      seed: int64 `[2]` stateless seed of the batch order.

    Returns:
      The mean KL (without the T^2 factor) over the examples seen (before
      each step), scalar.
    """
    rows = tf.range(tf.shape(targets)[0], dtype=tf.int32)
    scale = tf.square(tf.cast(temperature, tf.float32))

    def kl_loss(student, x, batch_rows):
        p = tf.gather(targets, batch_rows)
        log_q = tf.nn.log_softmax(student(x, training=True) / temperature, axis=-1)
        kl = tf.reduce_sum(p * (tf.math.log(tf.maximum(p, 1e-8)) - log_q), axis=-1)
        return scale * tf.reduce_mean(kl), log_q

    stats = local_training.train(
        model,
        client_data.ClientSplit(inputs, rows),
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=learning_rate,
        seed=seed,
        loss_fn=kl_loss,
    )
    return stats.loss_sum / tf.maximum(stats.num_examples, 1.0) / scale
