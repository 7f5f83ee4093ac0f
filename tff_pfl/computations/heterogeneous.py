"""Clients with different architectures behind one TFF type (TF code).

TFF gives every client the same type, while KT-pFL's clients run different
models. A client's state therefore holds its architecture id and its weights
packed into one float vector, zero-padded to the largest architecture's size;
inside the client computation `dispatch` builds every registered architecture,
unpacks the vector into the client's own one and runs the work there through
`tf.switch_case`. Only fixed-shape values (soft predictions) need to leave
the client, so the round's type says exactly what is exchanged.

`train_packed`, `evaluate_packed` and `build_personalized_evaluation` run
local training and evaluation on a client's own architecture (KT-pFL,
FedDF).

`PublicKnowledge` holds the settings KT-pFL and FedDF share, with the same
meaning in both: the clients' architectures and the distillation on
unlabeled public data.
"""

import collections
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import models
from tff_pfl import settings as settings_lib
from tff_pfl.computations import local_training, model_weights, template
from tff_pfl.data import client_data

_setting = settings_lib.setting


@dataclasses.dataclass(frozen=True)
class PublicKnowledge(settings_lib.Settings):
    """Client architectures and distillation on unlabeled public data (KT-pFL, FedDF).

    Defaults: Zhang et al. 2021 (KT-pFL), Appendix B.2, heterogeneous models,
    EMNIST / Fashion-MNIST column ("for all the methods"); see
    docs/algorithms/ktpfl.md.
    """

    architectures: tuple[str, ...] = _setting(
        (),
        'Client model names, assigned to clients in turn (empty: chosen from the data: lenet, alexnet_small, '
        'resnet_small, shufflenet_small for images [H, W, C] of at least 16x16, else logistic, mnist_dnn).',
    )
    public_examples: int = _setting(
        3000, '|D_r|, examples set aside as unlabeled public data before partitioning (no client holds them).'
    )
    public_dataset: str = _setting(
        '',
        'Source of the public data, as --dataset (KT-pFL: MNIST for Fashion-MNIST clients); empty: set aside from '
        '--dataset.',
    )
    public_batch: int | None = _setting(
        None, 'P, public examples drawn each round, the same for every client and the server (unset: all of them).'
    )
    public_temperature: float = _setting(
        10.0, 'T, the softmax temperature of the soft predictions and of distillation on the public data.'
    )
    public_distill_batch_size: int = _setting(
        256, 'Mini-batch size of distillation on the public batch (KT-pFL: each client; FedDF: the server).'
    )
    public_distill_learning_rate: float = _setting(
        0.01,
        'eta_2, the SGD learning rate of distillation on the public batch (KT-pFL: each client; FedDF: the server).',
    )

    def _checks(self):
        known = models.names()
        unknown = [a for a in self.architectures if a not in known]
        return super()._checks() + [
            (
                not unknown,
                f'architectures: unknown model {unknown[0] if unknown else ""!r}; known: {", ".join(known)}',
            ),
            (self.public_examples >= 1, f'public_examples must be >= 1, got {self.public_examples}'),
            (
                self.public_batch is None or self.public_batch >= 1,
                f'public_batch must be >= 1, got {self.public_batch}',
            ),
            (
                self.public_batch is None or self.public_batch <= self.public_examples,
                f'public_batch ({self.public_batch}) must be <= public_examples ({self.public_examples})',
            ),
            (self.public_temperature > 0, f'public_temperature must be > 0, got {self.public_temperature}'),
            (
                self.public_distill_batch_size >= 1,
                f'public_distill_batch_size must be >= 1, got {self.public_distill_batch_size}',
            ),
            (
                self.public_distill_learning_rate > 0,
                f'public_distill_learning_rate must be > 0, got {self.public_distill_learning_rate}',
            ),
        ]


def _why_not(name: str, feature_shape: Sequence[int], num_classes: int) -> str | None:
    """Why model `name` cannot classify examples of `feature_shape` into `num_classes`, or None."""
    try:
        with tf.Graph().as_default():
            model = models.get(name)(feature_shape, num_classes)
    except ValueError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return first if len(first) <= 120 else first[:117] + '...'
    if model.output_shape[-1] != num_classes:
        return f'it has {model.output_shape[-1]} outputs, the data {num_classes} classes'
    return None


def public_batch_for(settings: PublicKnowledge, spec) -> int:
    """P, checked against the partition's public data.

    Args:
      settings: the algorithm's settings (`public_batch`).
      spec: the `client_data.ClientDataSpec` of the partition on disk.

    Returns:
      `settings.public_batch`, or every public example of the partition
      when it is unset.

    Raises:
      ValueError: one line, if the partition has no public data or fewer
        public examples than `public_batch`.
    """
    if not spec.public_size:
        raise ValueError('no public data in the partition: prepare it with public_examples > 0')
    if settings.public_batch is None:
        return spec.public_size
    if settings.public_batch > spec.public_size:
        raise ValueError(
            f"public_batch={settings.public_batch} exceeds the partition's {spec.public_size} public examples"
        )
    return settings.public_batch


def in_turn(names: Sequence[str], num_clients: int) -> tuple[str, ...]:
    """`names` given to clients 0 .. num_clients - 1 in turn.

    Args:
      names: the names to hand out, non-empty.
      num_clients: how many clients receive one.

    Returns:
      One name per client: client i gets `names[i % len(names)]`.
    """
    return tuple(names[i % len(names)] for i in range(num_clients))


def client_architectures(architectures: Sequence[str], spec) -> tuple[str, ...]:
    """Each client's model name: `architectures` in turn, or the data's default.

    Args:
      architectures: model names (`tff_pfl.models`), assigned to the clients
        in turn; empty: `models.default_architectures(spec.feature_shape)`.
      spec: the `client_data.ClientDataSpec` (feature shape, classes, clients).

    Returns:
      One model name per client, in `spec.client_ids` order.

    Raises:
      ValueError: one line, naming `--architectures` and the data's shape, if
        one of the models cannot take the data.
    """
    names = tuple(architectures) or models.default_architectures(spec.feature_shape)
    shape = tuple(int(d) for d in spec.feature_shape)
    for name in dict.fromkeys(names):
        problem = _why_not(name, shape, spec.num_classes)
        if problem:
            raise ValueError(f'architectures: {name} cannot take features of shape {shape}: {problem}')
    return in_turn(names, spec.num_clients)


class Architectures:
    """A fixed list of model builders, addressed by index.

    Attributes:
      model_fns: no-arg builders.
      sizes: number of parameters of each.
      max_size: the packed vector's length.
    """

    def __init__(self, model_fns: Sequence[Callable[[], tf.keras.Model]]):
        self.model_fns = list(model_fns)
        self.shapes = []
        with tf.Graph().as_default():
            for fn in self.model_fns:
                model = fn()
                model_weights.check_logits(model)
                if model.non_trainable_weights:
                    raise ValueError(model_weights.non_trainable_refusal(model))
                self.shapes.append([tuple(v.shape) for v in model.trainable_weights])
        self.sizes = [int(sum(np.prod(s) for s in shapes)) for shapes in self.shapes]
        self.max_size = max(self.sizes)

    def pack(self, weights) -> tf.Tensor:
        """Weights -> float32 [max_size] (zero-padded).

        Args:
          weights: one architecture's trainable weights, in Keras order.

        Returns:
          The weights flattened, concatenated and zero-padded to `max_size`.
        """
        flat = tf.concat([tf.reshape(w, [-1]) for w in weights], axis=0)
        return tf.pad(flat, [[0, self.max_size - tf.shape(flat)[0]]])

    def unpack(self, index: int, packed: tf.Tensor) -> list:
        """float32 [max_size] -> the weights of architecture `index`.

        Args:
          index: the architecture's index (a Python int).
          packed: a vector made by `pack` for that architecture.

        Returns:
          The list of the architecture's weight tensors, in Keras order.
        """
        weights, offset = [], 0
        for shape in self.shapes[index]:
            size = int(np.prod(shape))
            weights.append(tf.reshape(packed[offset : offset + size], shape))
            offset += size
        return weights

    def dispatch(self, arch_id: tf.Tensor, packed: tf.Tensor, work: Callable):
        """Runs `work(model)` on the client's own architecture.

        Every architecture's model is built (variables cannot be created inside
        a branch); the branch of `arch_id` loads `packed` into its model and
        returns `work(model)`, whose structure must not depend on the
        architecture.

        Args:
          arch_id: int32 scalar, the client's architecture index.
          packed: float32 [max_size], the client's packed weights.
          work: `model -> nest of tensors` (TF code), run on the loaded model.

        Returns:
          What `work` returns.
        """
        built = [fn() for fn in self.model_fns]

        def branch(index):
            def run():
                model = built[index]
                with tf.control_dependencies(
                    [v.assign(w) for v, w in zip(model.trainable_weights, self.unpack(index, packed))]
                ):
                    return work(model)

            return run

        return tf.switch_case(arch_id, [branch(i) for i in range(len(built))])

    def initial_packed(self, seed: int) -> tf.Tensor:
        """[num_architectures, max_size]: each architecture's seeded initial weights.

        Args:
          seed: the run seed; architecture `i` is built under `seed + i`.

        Returns:
          A float32 tensor whose row `i` is `pack` of architecture `i`'s
          initial weights.
        """
        rows = []
        for index, fn in enumerate(self.model_fns):
            with models.seeded(seed + index):
                rows.append(self.pack(fn().trainable_weights))
        return tf.stack(rows)


def for_clients(architectures: Sequence[str], spec) -> tuple['Architectures', list[int]]:
    """The distinct architectures of a partition's clients, and each client's index into them.

    Args:
      architectures: one model name (`tff_pfl.models`) per client, in
        `spec.client_ids` order.
      spec: the `client_data.ClientDataSpec` (feature shape, classes, clients).

    Returns:
      `(Architectures over the sorted distinct names, per-client indices)`.

    Raises:
      ValueError: if there is not exactly one architecture per client.
    """
    if len(architectures) != spec.num_clients:
        raise ValueError(f'need one architecture per client ({spec.num_clients}), got {len(architectures)}')
    names = sorted(set(architectures))
    archs = Architectures([lambda n=n: models.get(n)(spec.feature_shape, spec.num_classes) for n in names])
    return archs, [names.index(a) for a in architectures]


def train_packed(
    archs: Architectures,
    arch_id: tf.Tensor,
    packed: tf.Tensor,
    data,
    config: local_training.TrainingConfig,
    *,
    seed: tf.Tensor,
    outputs: Callable | None = None,
    optimizer: tff.learning.optimizers.Optimizer | None = None,
    loss_fn: local_training.LossFn = local_training.supervised_loss,
) -> tuple:
    """Local SGD (or `optimizer`) on the client's own architecture, from packed weights (TF code).

    Args:
      archs: the `Architectures`.
      arch_id: int32 scalar, the client's architecture index.
      packed: float32 `[max_size]`, the weights to start from.
      data: the client's training split (`client_data.read_split`).
      config: the `local_training.TrainingConfig` (E epochs or exactly
        `max_steps` SGD steps, batch size, learning rate).
      seed: the batch-order seed (`local_training.client_seed`).
      outputs: optional `model -> nest of tensors` (TF code), run on the
        trained model, e.g. its predictions on the public batch.
      optimizer: optional client optimizer (`local_training.train`); None:
        SGD at `config.learning_rate`.
      loss_fn: the loss minimized (`local_training.loss_from`).

    Returns:
      `(params, outputs, stats)`: the packed trained weights, what `outputs`
      returned (None without it) and the training's `local_training.Stats`.
    """

    def work(model):
        stats = local_training.train_with(model, data, config, seed=seed, optimizer=optimizer, loss_fn=loss_fn)
        with tf.control_dependencies(list(stats)):
            if outputs is None:
                return archs.pack(model.trainable_weights), stats
            return archs.pack(model.trainable_weights), outputs(model), stats

    result = archs.dispatch(arch_id, packed, work)
    params, extra, stats = (result[0], None, result[1]) if outputs is None else result
    return params, extra, local_training.Stats(*stats)


def evaluate_packed(
    archs: Architectures, arch_id: tf.Tensor, packed: tf.Tensor, data, metrics: local_training.Metrics = ()
) -> collections.OrderedDict:
    """A client's loss and accuracy with packed weights of its own architecture (TF code).

    Args:
      archs: the `Architectures`.
      arch_id: int32 scalar, the client's architecture index.
      packed: float32 `[max_size]`, the weights to evaluate.
      data: the split to evaluate on (`client_data.read_split`).
      metrics: a user's extra metrics (`local_training.metrics_from`).

    Returns:
      `template.client_metrics`: `<loss, accuracy, num_examples, ...metrics>`.
    """
    return archs.dispatch(arch_id, packed, lambda model: evaluate_model(model, data, metrics))


def evaluate_model(model: tf.keras.Model, data, metrics: local_training.Metrics = ()) -> collections.OrderedDict:
    """`template.client_metrics` of a model on a split, with a user's extra metrics (TF code).

    Args:
      model: the Keras model, holding the weights to evaluate.
      data: the split to evaluate on.
      metrics: a user's extra metrics (`local_training.metrics_from`).

    Returns:
      `<loss, accuracy, num_examples, ...metrics>`.
    """
    stats = local_training.evaluate(model, data)
    extra = local_training.metric_sums(model, data, metrics) if metrics else None
    return template.client_metrics(local_training.Stats(*stats), extra)


def build_personalized_evaluation(
    spec,
    archs: Architectures,
    client_state_type: tff.Type,
    split: str | None = None,
    metrics: local_training.Metrics = (),
) -> tff.Computation:
    """Each client's evaluation of the model its state holds (`params`, packed).

    The client's architecture is its state's `architecture`; a state without
    one has the single architecture of `archs` (index 0).

    Args:
      spec: the `client_data.ClientDataSpec` of the partition on disk.
      archs: the `Architectures`.
      client_state_type: the client state type, with `client_id` and
        `params` (and optionally `architecture`).
      split: which split to evaluate on; None: `spec.evaluation_split` (the
        test split, or the validation split of a validation curve).
      metrics: a user's extra metrics (`local_training.metrics_from`).

    Returns:
      A `tff.tensorflow.computation` `client_state ->
      <personalized_model=<loss, accuracy, num_examples>>`.
    """
    split = spec.evaluation_split if split is None else split
    per_client = 'architecture' in [name for name, _ in tff.structure.iter_elements(client_state_type)]

    @tff.tensorflow.computation(client_state_type)
    def evaluate_client(state):
        data = client_data.read_split(spec, state['client_id'], split)
        architecture = state['architecture'] if per_client else tf.constant(0)
        return collections.OrderedDict(
            personalized_model=evaluate_packed(archs, architecture, state['params'], data, metrics)
        )

    return evaluate_client
