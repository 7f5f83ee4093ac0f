"""Next-character prediction: ids, sequences, the scored positions, the GRU grid, masked losses."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_federated.python.simulation.baselines.shakespeare import char_prediction_preprocessing

from tff_pfl import losses, models
from tff_pfl.computations import distillation, local_training
from tff_pfl.data import client_data, text
from tff_pfl.models import stacked

IGNORED = client_data.IGNORED_LABEL


def test_vocabulary_is_tffs():
    assert text.VOCAB_SIZE == 90 and len(text.CHAR_VOCAB) == 86
    assert (text.PAD, text.OOV, text.BOS, text.EOS) == (0, 87, 88, 89)
    # Ids of a snippet equal TFF's own tokenizer (an independent implementation), BOS/EOS framed.
    snippet = "Hark! 'Tis the knocking\nat the south entry. Ça va? [Exit.]"
    tokenize = char_prediction_preprocessing._build_tokenize_fn(split_length=len(snippet.encode()) + 3)
    theirs = tokenize({'snippets': tf.constant(snippet.encode())}).numpy()
    mine = np.concatenate([[text.BOS], text.char_ids(snippet), [text.EOS]])
    np.testing.assert_array_equal(theirs[: len(mine)], mine)
    assert (text.char_ids('Ç') == text.OOV).all() and len(text.char_ids('Ç')) == 2  # two UTF-8 bytes


def test_sequences_against_a_hand_computation():
    a, b, c, d = (text.CHAR_VOCAB.index(ch) + 1 for ch in 'abcd')
    x, y = text.snippet_examples(['ab', 'abcd', '', 'abcdabcd'], sequence_length=4)
    # 'ab': [BOS a b EOS 0] -> one piece; EOS and pad targets are not scored.
    # 'abcd': [BOS a b c d | EOS 0 0 0 0]: the second piece scores nothing and is dropped.
    # '': [BOS EOS 0 0 0] scores nothing. 'abcdabcd': 10 ids -> two pieces of 5.
    expected_x = [
        [text.BOS, a, b, text.EOS],
        [text.BOS, a, b, c],
        [text.BOS, a, b, c],
        [a, b, c, d],
    ]
    expected_y = [
        [a, b, IGNORED, IGNORED],
        [a, b, c, d],
        [a, b, c, d],
        [b, c, d, IGNORED],
    ]
    np.testing.assert_array_equal(x, expected_x)
    np.testing.assert_array_equal(y, expected_y)
    assert x.dtype == np.int32 and y.dtype == np.int32
    assert text.decode(x[3]) == 'abcd' and text.decode([text.OOV, a]) == '?a'
    empty_x, empty_y = text.snippet_examples([], sequence_length=4)
    assert empty_x.shape == (0, 4) and empty_y.shape == (0, 4)
    with pytest.raises(ValueError, match='sequence_length'):
        text.snippet_examples(['a'], sequence_length=0)


def _numpy_masked_cross_entropy(logits, y):
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    keep = y != IGNORED
    picked = np.take_along_axis(log_p, np.maximum(y, 0)[..., None], axis=-1)[..., 0]
    return -(picked * keep).sum() / keep.sum(), keep.sum()


def test_losses_and_accuracy_count_only_scored_positions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 7)).astype(np.float32)
    y = rng.integers(0, 7, size=(3, 5)).astype(np.int32)
    y[0, 3:] = IGNORED
    y[2, 1] = IGNORED
    expected, counted = _numpy_masked_cross_entropy(logits, y)
    got = losses.hard_cross_entropy(tf.constant(logits), tf.constant(y))
    assert got.numpy() == pytest.approx(expected, rel=1e-5)
    assert client_data.count_labels(tf.constant(y)).numpy() == counted == 12
    stats = local_training.batch_stats(got, tf.constant(logits), tf.constant(y), client_data.count_labels(y))
    hits = ((logits.argmax(-1) == y) & (y != IGNORED)).sum()
    assert stats.num_correct.numpy() == hits and stats.num_examples.numpy() == 12
    # PersFL's hard term is the same mean; lambda = 1 leaves the soft term, averaged over the same positions.
    assert losses.hard_cross_entropy(tf.constant(logits), tf.constant(y)).numpy() == pytest.approx(expected, rel=1e-5)
    teacher = rng.normal(size=(3, 5, 7)).astype(np.float32)
    t = 2.0
    p = np.exp(teacher / t) / np.exp(teacher / t).sum(-1, keepdims=True)
    log_q = logits / t - np.log(np.exp(logits / t).sum(-1, keepdims=True))
    kl = (p * (np.log(p) - log_q)).sum(-1)
    keep = y != IGNORED
    soft = losses.persfl_loss(tf.constant(logits), tf.constant(teacher), tf.constant(y), t, 1.0)
    assert soft.numpy() == pytest.approx(t * t * (kl * keep).sum() / keep.sum(), rel=1e-5)
    # Classification labels keep the plain batch mean.
    flat_logits, flat_y = logits[:, 0], np.maximum(y[:, 0], 0)
    plain = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=flat_y, logits=flat_logits))
    assert losses.hard_cross_entropy(tf.constant(flat_logits), tf.constant(flat_y)).numpy() == plain.numpy()


def _random_weights(model, rng):
    for variable in model.trainable_weights:
        variable.assign(rng.normal(scale=0.3, size=variable.shape).astype(np.float32))


def test_stacked_gru_equals_keras():
    rng = np.random.default_rng(1)
    first, second = models.get('char_gru')((12,), 90), models.get('char_gru')((12,), 90)
    _random_weights(first, rng)  # biases too: the recurrent and the input bias must both be right
    _random_weights(second, rng)
    x = rng.integers(0, 90, size=(5, 12)).astype(np.int32)
    weights = [tf.stack([a, b]) for a, b in zip(first.trainable_weights, second.trainable_weights)]
    got = stacked.forward(stacked.plan(first), weights, tf.constant(x)).numpy()
    np.testing.assert_allclose(got[0], first(x).numpy(), atol=2e-5)
    np.testing.assert_allclose(got[1], second(x).numpy(), atol=2e-5)
    masked = tf.keras.Sequential([tf.keras.layers.Embedding(90, 8, mask_zero=True)])
    masked.build((None, 12))
    with pytest.raises(ValueError, match='mask_zero'):
        stacked.plan(masked)
    backwards = tf.keras.Sequential([tf.keras.layers.GRU(4, return_sequences=True, go_backwards=True)])
    backwards.build((None, 12, 3))
    with pytest.raises(ValueError, match='go_backwards'):
        stacked.plan(backwards)


def test_grid_accuracy_counts_scored_characters():
    """PersFL's validation accuracy over a GRU grid: characters right / characters scored."""
    rng = np.random.default_rng(2)
    model = models.get('char_gru')((6,), 90)
    _random_weights(model, rng)
    x = rng.integers(1, 87, size=(9, 6)).astype(np.int32)
    y = rng.integers(1, 87, size=(9, 6)).astype(np.int32)
    y[:, 4:] = IGNORED
    predicted = model(x).numpy().argmax(-1)
    y[:, :2] = predicted[:, :2]  # some right answers
    val = client_data.ClientSplit(tf.constant(x), tf.constant(y), client_data.INT32)
    weights = [tf.stack([w, w]) for w in model.trainable_weights]
    correct = distillation._stacked_accuracy(stacked.plan(model), weights, val, batch_size=12).numpy()
    expected = ((predicted == y) & (y != IGNORED)).sum()
    np.testing.assert_array_equal(correct, [expected, expected])
    assert client_data.count_labels(val.labels).numpy() == 36


def test_generate_follows_the_model():
    """A model that always puts its mass on 'e' writes 'eee...'; specials are never drawn."""
    e = text.CHAR_VOCAB.index('e') + 1

    class Fixed(tf.keras.Model):
        def call(self, x, training=False):
            logits = np.full((x.shape[0], x.shape[1], text.VOCAB_SIZE), -50.0, np.float32)
            logits[..., e] = 0.0
            logits[..., text.EOS] = 50.0  # the end of the snippet is not a character to write
            return tf.constant(logits)

    assert text.generate(Fixed(), 'To b', 5, temperature=0.5) == 'eeeee'
    model = models.get('char_gru')((text.SEQUENCE_LENGTH,), text.VOCAB_SIZE)
    sample = text.generate(model, 'x' * 100, 3, seed=1)  # prompts longer than a sequence keep their end
    assert len(sample) == 3 and sample == text.generate(model, 'x' * 100, 3, seed=1)
    with pytest.raises(ValueError, match='temperature'):
        text.generate(model, 'a', 1, temperature=0)
