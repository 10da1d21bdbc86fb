"""zero8.deepspeed: zero8's 8-bit optimizers inside DeepSpeed's engine, DeepSpeed's universal checkpoints both
ways, and the Hugging Face Trainer recipe (docs/DEEPSPEED.md)::

    opt = zero8.deepspeed.optimizer(model, "AdamW8bit", lr=3e-4)            # names, 32-bit embeddings
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)

    python -m zero8.deepspeed to-universal <checkpoint tag> <output tag>     # for ds_to_universal's loads

- ``optimizer`` / ``optimizer_class``: zero8.optim's classes with the model's names and the embedding rule.
  Under ZeRO stage 1, 2 and 3 every zero8.optim optimizer steps DeepSpeed's flat partitions by parameter
  (zero8.optim.partition): per-parameter ``min_8bit_size``, overrides, blocks on parameter boundaries.
- ``trainer_optimizer_cls_and_kwargs``: ``optimizer_cls_and_kwargs=`` for the Hugging Face Trainer.
- ``to_universal`` (zero8.deepspeed.universal): a DeepSpeed ZeRO checkpoint holding zero8's states, or a
  zero8 engine checkpoint, as a DeepSpeed universal checkpoint (float32 ``exp_avg``/``exp_avg_sq``).
- ``read_checkpoint`` (zero8.deepspeed.universal): the per-parameter float32 weights and states of a DeepSpeed
  ZeRO-1/2 or universal checkpoint; ``zero8.initialize``'s engine loads such a checkpoint through it.
DeepSpeed itself is imported only by the functions that read DeepSpeed's pickled files.
"""

from __future__ import annotations

from .optimizer import embedding_weights, optimizer, optimizer_class, trainer_optimizer_cls_and_kwargs
from .universal import read_checkpoint, to_universal

__all__ = [
    "embedding_weights",
    "optimizer",
    "optimizer_class",
    "read_checkpoint",
    "to_universal",
    "trainer_optimizer_cls_and_kwargs",
]
