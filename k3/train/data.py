"""Glue between `k3.data` and the trainer: corpus -> tokenizer -> packed streams -> loaders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from k3.config import ConfigError, K3Config
from k3.data.loader import Batch, PackedLoader, iter_val_batches
from k3.data.packing import prepare_data as prepare_streams
from k3.data.packing import unigram_entropy
from k3.train.config import TrainConfig


@dataclass
class TrainData:
    tokenizer: Any
    loader: PackedLoader
    val_batches: list[Batch]
    unigram_entropy: float
    train_tokens: int


def _check_splits_fit(cfg: TrainConfig, train_tokens: int, val_tokens: int) -> None:
    """Every stage's step (tokens_per_step / seq_len rows of seq_len + 1 tokens) must fit in the train
    split, checked up front: a corpus too small for a later stage must not stop the run at its switch.
    The validation split needs one row of eval_seq_len."""
    if val_tokens - 1 < cfg.eval_seq_len:
        raise ConfigError(
            f"the validation split has {val_tokens:,} tokens, fewer than one row of eval_seq_len="
            f"{cfg.eval_seq_len:,}; raise val_fraction or lower eval_seq_len with --config, or pass a larger "
            f"corpus with --data")
    for st in cfg.stages:
        rows, need = (train_tokens - 1) // st.seq_len, max(1, cfg.tokens_per_step // st.seq_len)
        if rows < need:
            raise ConfigError(
                f"the train split has {train_tokens:,} tokens: {rows} rows of {st.seq_len:,}, but a step of the "
                f"{st.seq_len:,}-token stage needs {need} (tokens_per_step={cfg.tokens_per_step:,}); pass a larger "
                f"corpus with --data, or lower tokens_per_step / the stage lengths with --config")


def prepare_data(cfg: TrainConfig, model_config: K3Config, log: Callable[[str], None]) -> TrainData:
    vocab = cfg.vocab_size or model_config.text_config.vocab_size
    prep = prepare_streams(cfg.data, cache_dir=cfg.cache_dir, tokenizer=cfg.tokenizer, vocab_size=vocab,
                           val_fraction=cfg.val_fraction, split_seed=cfg.seed)
    if prep.tokenizer.vocab_size != model_config.text_config.vocab_size:
        raise ConfigError(f"tokenizer vocab {prep.tokenizer.vocab_size} != model vocab_size "
                         f"{model_config.text_config.vocab_size}; set vocab_size in the model overrides")
    if prep.val is None:
        raise ConfigError("the corpus is too small for a validation split (need >= 2 documents)")
    _check_splits_fit(cfg, prep.train.num_tokens, prep.val.num_tokens)
    first = cfg.stages[0].seq_len
    loader = PackedLoader(prep.train, first, cfg.tokens_per_step // first, seed=cfg.seed)
    # Validation at one fixed length for the whole run, so the curve is comparable across stages; a
    # validation forward holds no more tokens than a training micro-batch.
    bs = max(1, (cfg.micro_batch_tokens or cfg.tokens_per_step) // cfg.eval_seq_len)
    val = list(iter_val_batches(prep.val, cfg.eval_seq_len, bs, cfg.eval_tokens))
    h = unigram_entropy(prep.train)
    log(f"data: {prep.num_train_docs} train / {prep.num_val_docs} val documents, {prep.train.num_tokens:,} train "
        f"tokens, {sum(b.num_tokens for b in val):,} val tokens, unigram entropy {h:.3f} nats/token")
    reads = cfg.max_steps * cfg.tokens_per_step
    epochs = reads / max(1, prep.train.num_tokens)
    log(f"data: this run reads {reads:,} tokens, {epochs:.2f} epochs of the train split"
        + (" (repeated data: pass a larger corpus with --data)" if epochs > 4 else ""))
    return TrainData(prep.tokenizer, loader, val, h, prep.train.num_tokens)
