"""Fine-tuning whose number of epochs is chosen on the validation split (TF code).

`finetune_on_validation` trains a model epoch by epoch with
`local_training.train` and keeps the weights of the best validation accuracy
(`local_training.evaluate`): FedAvg-FT's personalization.
"""

import tensorflow as tf

from tff_pfl.computations import local_training, model_weights
from tff_pfl.data import client_data


def finetune_on_validation(
    model: tf.keras.Model,
    train_split: client_data.ClientSplit,
    val_split: client_data.ClientSplit,
    *,
    max_epochs: int,
    batch_size,
    learning_rate,
    seed: tf.Tensor,
    loss_fn: local_training.LossFn = local_training.supervised_loss,
):
    """Fine-tunes `model` epoch by epoch; keeps the epoch count best on validation.

    Evaluates the model on `val_split` before fine-tuning and after each of
    `max_epochs` epochs of SGD on `train_split` (epoch `e` uses the
    permutation of seed `seed + [e, 0]`), and returns the weights of the best
    validation accuracy (the earliest on ties, so 0 epochs wins when nothing
    helps). `model` ends with the last epoch's weights.

    Args:
      model: the Keras model, holding the starting weights.
      train_split: the client's training split.
      val_split: the client's validation split.
      max_epochs: the largest number of epochs tried (a Python int >= 0).
      batch_size: SGD examples per step.
      learning_rate: SGD step size.
      seed: int64 tensor of shape [2].
      loss_fn: the loss minimized, as for `local_training.train`.

    Returns:
      `(weights, epochs, val_accuracies)`: the chosen weights, the chosen
      number of epochs (int32) and the validation accuracy after each number
      of epochs (float32 [max_epochs + 1]).
    """

    def accuracy_now():
        stats = local_training.evaluate(model, val_split)
        return stats.num_correct / tf.maximum(stats.num_examples, 1.0)

    best = model_weights.get_weights(model)
    with tf.control_dependencies(best):
        best_accuracy = accuracy_now()
    best_epochs = tf.constant(0, tf.int32)
    accuracies = [best_accuracy]
    for epoch in range(1, max_epochs + 1):
        with tf.control_dependencies(best + [best_accuracy, best_epochs]):
            stats = local_training.train(
                model,
                train_split,
                epochs=1,
                batch_size=batch_size,
                learning_rate=learning_rate,
                seed=seed + tf.constant([epoch, 0], tf.int64),
                loss_fn=loss_fn,
            )
        with tf.control_dependencies(list(stats)):
            current = model_weights.get_weights(model)
            with tf.control_dependencies(current):
                accuracy = accuracy_now()
        better = accuracy > best_accuracy
        best = [tf.where(better, c, b) for c, b in zip(current, best)]
        best_accuracy = tf.where(better, accuracy, best_accuracy)
        best_epochs = tf.where(better, epoch, best_epochs)
        accuracies.append(accuracy)
    return best, best_epochs, tf.stack(accuracies)
