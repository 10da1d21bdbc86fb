"""Pipeline parallelism under DeepSpeed's names (``deepspeed.pipe``): write the model as a list of layers,
cut it into stages with ``PipelineModule``, and ``zero8.initialize(model=pipeline_module, config=...)``
returns an engine whose ``train_batch(data_iter)`` runs a 1F1B schedule over gradient_accumulation_steps
micro-batches, each stage's optimizer being zero8's sharded 8-bit optimizer over that stage's
data-parallel ranks. See docs/PIPELINE.md.

    layers = [LayerSpec(Embed, vocab, d), *[LayerSpec(Block, d) for _ in range(n)], LayerSpec(Head, d, vocab)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=cross_entropy)
    engine, _, _, _ = zero8.initialize(model=model, config="ds_config.json")
    loss = engine.train_batch(data_iter)   # data_iter yields (inputs, labels) micro-batches
"""

from __future__ import annotations

from .module import (
    LayerModule,
    LayerSpec,
    PipelineError,
    PipelineModule,
    TiedLayerSpec,
    partition_balanced,
    partition_uniform,
)
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, PipelineParallelGrid, ProcessTopology

__all__ = [
    "LayerModule",
    "LayerSpec",
    "PipelineError",
    "PipelineModule",
    "TiedLayerSpec",
    "ProcessTopology",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "partition_balanced",
    "partition_uniform",
]
