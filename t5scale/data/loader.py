"""Batches for the training step: each host reads its own shard, a thread keeps some ready.

`Batches` gives an iterator of global jax.Arrays laid out as the step wants them
(`batch_sharding`): for the synthetic source, random batches with no TensorFlow, the same global
batch for a seed and step on any number of processes (each keeps its devices' slices); for a
corpus or mC4, seqio's span-corruption pipeline over this process's shard (seqio ShardInfo from
the process index and count), packed by seqio's EncDecFeatureConverter, its host-local rows
assembled into global arrays with `jax.make_array_from_process_local_data`.

The stream is a function of the seed: `position` counts the batches handed out, and a loader
started with `start=position` continues the same stream (it replays the pipeline up to there —
cheap beside the training step it feeds).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding

from t5scale.data.batch import Batch
from t5scale.data.config import DataConfig, check_vocabulary
from t5scale.data.corpus import scan_corpus
from t5scale.data.synthetic import synthetic_batch
from t5scale.errors import DataError
from t5scale.startup import absl_quiet


def _local_batch_size(global_batch: int) -> int:
    if global_batch % jax.process_count():
        raise DataError(
            f"global batch {global_batch} is not divisible by the {jax.process_count()} processes"
        )
    return global_batch // jax.process_count()


def register(config: DataConfig, vocab_size: int) -> str:
    """Check the vocabulary and corpus and register the seqio mixture; return its name.

    Everything that can be wrong with the user's data is found here, before any tf.data work.
    """
    check_vocabulary(config.vocabulary)  # before TensorFlow's import, which takes seconds
    from t5scale.data import tasks  # TensorFlow and seqio: only runs that read text

    vocab = tasks.vocabulary(config)
    if vocab.vocab_size > vocab_size:
        raise DataError(
            f"vocabulary {config.vocabulary!r} has {vocab.vocab_size} ids with its "
            f"{config.extra_ids} sentinels, more than the model's vocab_size {vocab_size}"
        )
    if config.source == "corpus":
        corpus = scan_corpus(
            config.corpus_dir, config.languages, config.max_line_bytes, config.holdout_every
        )
        return tasks.register_corpus(corpus, config, vocab)
    return tasks.register_mc4(config, vocab)


def seqio_dataset(
    config: DataConfig,
    global_batch: int,
    seed: int,
    split: str,
    vocab_size: int,
    shard: tuple[int, int] | None = None,
    mixture: str | None = None,
):
    """Shard (index, count) — by default this process's — of the packed span-corruption stream.

    A tf.data.Dataset of batches of global_batch / count rows.
    """
    from t5scale.data import tasks  # TensorFlow and seqio: only runs that read text

    name = mixture or register(config, vocab_size)
    index, count = shard or (jax.process_index(), jax.process_count())
    if global_batch % count:
        raise DataError(f"global batch {global_batch} is not divisible by {count} data shards")
    try:
        with absl_quiet():  # the error is reported below, in one line
            return _get_dataset(config, name, global_batch // count, seed, split, (index, count))
    except (KeyError, FileNotFoundError, AssertionError) as error:
        if config.source != "mc4":
            raise
        raise DataError(
            f"mC4 ({tasks.MC4_TFDS_NAME}) is not prepared in tfds_data_dir "
            f"{config.tfds_data_dir!r}: {str(error).strip(chr(34))}"
        ) from None


# seqio hands out per-preprocessor seeds from module-level state while a pipeline is built, so
# two pipelines built at once (training and validation, each on its loader thread) would mix
# their seeds: builds take turns.
_BUILD_LOCK = threading.Lock()


def _get_dataset(config: DataConfig, name: str, rows: int, seed: int, split: str, shard):
    """seqio.get_dataset's steps, but the validation split never cached in memory.

    seqio caches small splits in memory; the validation loss reads only its first batches, and
    TensorFlow warns on stderr about every cache abandoned part-read.
    """
    from t5scale.data.tf_setup import seqio  # TensorFlow: only runs that read text

    lengths = {"inputs": config.input_length, "targets": config.target_length}
    with _BUILD_LOCK:
        dataset = seqio.get_mixture_or_task(name).get_dataset(
            lengths,
            split=split,
            use_cached=False,
            shuffle=split == "train",
            seed=seed,
            shard_info=seqio.ShardInfo(*shard),
            num_epochs=None if split == "train" else 1,
            try_in_mem_cache=split == "train",
        )
        dataset = seqio.EncDecFeatureConverter(pack=True)(dataset, task_feature_lengths=lengths)
    return dataset.batch(rows, drop_remainder=True)


def host_batches(
    config: DataConfig,
    global_batch: int,
    seed: int,
    vocab_size: int,
    split: str = "train",
    shard: tuple[int, int] | None = None,
) -> Iterator[Batch]:
    """This process's rows of each batch, as numpy arrays: shard (index, count) of the stream
    (default: this process's of all processes; `data_shard` where processes share rows).

    The data are checked here, in the caller's thread, so that bad data fail at start; the
    tf.data pipeline itself (tens of seconds of tracing for many languages) is built on the
    first `next`, which `Batches` calls on its own thread while the step compiles.
    """
    if config.source == "synthetic":
        return _synthetic_rows(config, global_batch, seed, vocab_size)
    mixture = register(config, vocab_size)
    if shard is None:
        _local_batch_size(global_batch)
    return _seqio_rows(config, global_batch, seed, vocab_size, split, mixture, shard)


def data_shard(
    sharding: NamedSharding, global_batch: int, process: int | None = None
) -> tuple[int, int]:
    """(index, count): this process's block of a batch's rows among the distinct blocks the
    processes hold. Processes whose devices hold the same rows (pipeline stages across hosts,
    a tensor axis across a host's processes) read the same shard of the stream, so that each
    row is one row everywhere; a DataError where a process's rows are not one block.
    `process`: this process, or another's index."""
    held: dict[int, list[tuple[int, int]]] = {}
    for device, index in sharding.devices_indices_map((global_batch,)).items():
        start, stop, _ = index[0].indices(global_batch)
        held.setdefault(device.process_index, []).append((start, stop))
    blocks = {}
    for owner, spans in held.items():
        spans = sorted(set(spans))
        if any(a[1] != b[0] for a, b in zip(spans, spans[1:], strict=False)):
            raise DataError(
                f"process {owner} holds rows {spans} of the batch, not one block: this mesh's "
                "batch cannot be read per process"
            )
        blocks[owner] = (spans[0][0], spans[-1][1])
    distinct = sorted(set(blocks.values()))
    mine = blocks[jax.process_index() if process is None else process]
    return distinct.index(mine), len(distinct)


def _seqio_rows(config, global_batch, seed, vocab_size, split, mixture, shard):
    dataset = seqio_dataset(
        config, global_batch, seed, split, vocab_size, shard=shard, mixture=mixture
    )
    for batch in dataset.as_numpy_iterator():
        yield Batch.of_features(batch).map(lambda feature: feature.astype(np.int32))


def _synthetic_rows(config: DataConfig, global_batch: int, seed: int, vocab_size: int):
    rows = _local_batch_size(global_batch)
    start = jax.process_index() * rows
    step = 0
    while True:  # every process makes the whole batch and keeps its own rows
        batch = synthetic_batch(config, global_batch, vocab_size, seed, step)
        yield batch.map(lambda feature: feature[start : start + rows])
        step += 1


def _synthetic_batches(config: DataConfig, global_batch: int, seed: int, vocab_size: int):
    for step in itertools.count():
        yield synthetic_batch(config, global_batch, vocab_size, seed, step)


class Batches:
    """Global batches from a background thread, `prefetch` ahead; `position` = batches taken."""

    _DONE = object()

    def __init__(
        self,
        config: DataConfig,
        global_batch: int,
        seed: int,
        vocab_size: int,
        sharding,
        start: int = 0,
        split: str = "train",
    ):
        self.position = start
        self._whole = config.source == "synthetic"  # every process makes the global batch
        self._source = (
            _synthetic_batches(config, global_batch, seed, vocab_size)
            if self._whole
            else host_batches(
                config, global_batch, seed, vocab_size, split, data_shard(sharding, global_batch)
            )
        )
        self._sharding, self._global_batch = sharding, global_batch
        self._skip = start
        self._queue: queue.Queue = queue.Queue(maxsize=config.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="t5scale-data", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            for index, rows in enumerate(self._source):
                if self._stop.is_set():
                    return
                if index < self._skip:
                    continue
                batch = rows.map(self._global_array)
                while not self._stop.is_set():
                    try:
                        self._queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            self._queue.put(self._DONE)
        except BaseException as error:  # handed to the consumer, raised in the main thread
            self._queue.put(error)

    def _global_array(self, rows: np.ndarray) -> jax.Array:
        if self._whole:
            return jax.make_array_from_callback(rows.shape, self._sharding, lambda i: rows[i])
        shape = (self._global_batch, *rows.shape[1:])
        return jax.make_array_from_process_local_data(self._sharding, rows, shape)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Batch:
        item = self._queue.get()
        if item is self._DONE:
            self._queue.put(self._DONE)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self.position += 1
        return item

    def close(self) -> None:
        self._stop.set()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._thread.join(timeout=5)
