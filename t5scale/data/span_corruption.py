"""T5's span-corruption objective, as tf.data operations for seqio tasks.

The mT5 recipe (Xue et al. 2021, following Raffel et al. 2020, section 3.1.4): the token stream
of all documents is concatenated and cut into chunks of `raw_length` tokens; in each chunk 15% of
the tokens, in spans of mean length 3, become noise. The inputs keep the clean tokens and put one
sentinel in place of each noise span; the targets hold each noise span after its sentinel.
Sentinels are the vocabulary's extra ids, counted down from its last id:

    tokens   a b c d e f g h       (noise: c d, g)
    inputs   a b <X0> e f <X1> h
    targets  <X0> c d <X1> g <X2>

`raw_length` is chosen so that the corrupted inputs, plus EOS, fill `inputs_length` exactly; the
targets' length then follows. For the mT5 pretraining input length of 1024 that is 1,137 raw
tokens and 229 target tokens, which is where the 1024/229 of the pretraining lengths come from.

Written for t5scale from the description in the papers; every random choice comes from seqio's
per-example seeds, so the stream is the same for the same seed. Imports TensorFlow: only the
corpus pipeline imports this module.
"""

from __future__ import annotations

import dataclasses

from t5scale.data.tf_setup import seqio, tf

NOISE_DENSITY = 0.15
MEAN_NOISE_SPAN_LENGTH = 3.0


@dataclasses.dataclass(frozen=True)
class SpanLengths:
    """Lengths of one span-corruption example, before and after corruption (EOS included)."""

    raw: int
    inputs: int
    targets: int


def _noise_counts(raw_length: int, density: float, mean_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) in a chunk of `raw_length` tokens; at least one of each."""
    noise = min(max(round(raw_length * density), 1), raw_length - 1)
    spans = max(round(noise / mean_span), 1)
    return noise, spans


def span_lengths(
    inputs_length: int,
    density: float = NOISE_DENSITY,
    mean_span: float = MEAN_NOISE_SPAN_LENGTH,
) -> SpanLengths:
    """The longest raw chunk whose corrupted inputs plus EOS fit `inputs_length`."""
    if inputs_length < 3:
        raise ValueError(f"span corruption needs inputs of at least 3 tokens, got {inputs_length}")

    def corrupted(raw: int) -> tuple[int, int]:
        noise, spans = _noise_counts(raw, density, mean_span)
        return raw - noise + spans + 1, noise + spans + 1  # inputs, targets; +1 for EOS

    raw = inputs_length
    while corrupted(raw + 1)[0] <= inputs_length:
        raw += 1
    inputs, targets = corrupted(raw)
    return SpanLengths(raw=raw, inputs=inputs, targets=targets)


def _random_segmentation(total, segments, seed):
    """Split `total` items into `segments` non-empty runs at random; returns the run lengths."""
    # Choose segments-1 distinct cut points among the total-1 gaps between items.
    gaps = tf.random.experimental.stateless_shuffle(tf.range(1, total), seed=seed)
    cuts = tf.sort(gaps[: segments - 1])
    bounds = tf.concat([[0], cuts, [total]], axis=0)
    return bounds[1:] - bounds[:-1]


def noise_mask(length, seeds, density: float, mean_span: float):
    """A boolean mask over `length` tokens: spans of noise alternating with clean spans.

    The chunk starts with clean tokens, as in T5. `seeds` holds two stateless seeds.
    """
    length_f = tf.cast(length, tf.float32)
    noise = tf.clip_by_value(tf.cast(tf.round(length_f * density), tf.int32), 1, length - 1)
    spans = tf.maximum(tf.cast(tf.round(tf.cast(noise, tf.float32) / mean_span), tf.int32), 1)
    noise_runs = _random_segmentation(noise, spans, seeds[0])
    clean_runs = _random_segmentation(length - noise, spans, seeds[1])
    runs = tf.reshape(tf.stack([clean_runs, noise_runs], axis=1), [-1])  # clean, noise, clean, …
    run_of_token = tf.repeat(tf.range(tf.size(runs)), runs)
    return tf.equal(run_of_token % 2, 1)


def replace_spans_with_sentinels(tokens, mask, vocab_size):
    """Drop the masked tokens, putting one sentinel where each masked span began."""
    previous = tf.concat([[False], mask[:-1]], axis=0)
    starts = tf.logical_and(mask, tf.logical_not(previous))
    sentinels = vocab_size - tf.cumsum(tf.cast(starts, tokens.dtype))  # first span: last id
    tokens = tf.where(starts, sentinels, tokens)
    return tf.boolean_mask(tokens, tf.logical_not(tf.logical_and(mask, previous)))


def corrupt(tokens, seeds, vocab_size: int, density: float, mean_span: float):
    """One chunk of tokens → {'inputs', 'targets'} as in the module docstring."""
    mask = noise_mask(tf.size(tokens), seeds, density, mean_span)
    return {
        "inputs": replace_spans_with_sentinels(tokens, mask, vocab_size),
        "targets": replace_spans_with_sentinels(tokens, tf.logical_not(mask), vocab_size),
    }


def span_corruption(
    dataset,
    sequence_length: dict[str, int],
    output_features: dict,
    density: float = NOISE_DENSITY,
    mean_span: float = MEAN_NOISE_SPAN_LENGTH,
):
    """seqio preprocessor: tokenized 'targets' documents → span-corrupted chunks.

    Documents are concatenated and cut into chunks that corrupt to exactly the task's input
    length (the last chunk of a finite stream may be shorter). EOS is added afterwards by
    seqio's `append_eos_after_trim`.
    """
    lengths = span_lengths(sequence_length["inputs"], density, mean_span)
    vocab_size = output_features["targets"].vocabulary.vocab_size
    chunks = dataset.map(lambda ex: ex["targets"]).unbatch().batch(lengths.raw)
    chunks = chunks.filter(lambda c: tf.size(c) >= 2)  # a lone token cannot hold a span of each
    return _corrupt_each(chunks, vocab_size, density, mean_span)


@seqio.map_over_dataset(num_seeds=2)
@tf.autograph.experimental.do_not_convert  # plain tensor ops: autograph only costs tracing time
def _corrupt(tokens, seeds, vocab_size: int, density: float, mean_span: float):
    return corrupt(tokens, seeds, vocab_size, density, mean_span)


def _corrupt_each(chunks, vocab_size: int, density: float, mean_span: float):
    return _corrupt(chunks, vocab_size=vocab_size, density=density, mean_span=mean_span)
