"""The DeepSpeed-style training engine: ``zero8.initialize(model=..., config=...)`` wraps a torch model
around zero8's ZeRO stage 1/2 sharded optimizer (``_C.ShardedOptimizer``). The model's trainable
parameters become zero-copy views into the optimizer's working buffer, and (fp32) their ``.grad`` views
into its gradient buffer, so autograd accumulates straight into C++ memory; post-accumulate-grad hooks
report each gradient as ready, so stage 2 reduces full buckets while backward is still running.

    engine, optimizer, _, lr_scheduler = zero8.initialize(model=model, model_parameters=model.parameters(),
                                                          config="ds_config.json")
    for batch in data:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

Names, signatures and return values follow deepspeed.initialize / DeepSpeedEngine; differences are
listed in ``initialize``'s docstring.

The package, by job: ``entry`` (initialize, init_distributed, add_config_arguments), ``training`` (the
engine: setup, forward / backward / step, hooks, statistics), ``pipeline`` (the engine of a
zero8.pipe.PipelineModule: train_batch / eval_batch over each stage's plain engine), ``checkpoint`` (save /
load, the model-states file, the 16-bit model), ``pipeline_checkpoint`` (the pipeline's tags), ``optimizer``
(the returned Zero8Optimizer), ``params`` (which parameters train in which param and hyper groups),
``client_optim`` (client optimizers and param groups as C++ hyperparameters), ``config_view`` (how the
engine reads its config), ``device`` (CPU or the rank's GPU, the backend for it, the CUDA stream order),
``world`` (the world communicator).
"""

from __future__ import annotations

from .checkpoint import MODEL_STATES_FILE
from .device import local_device  # noqa: F401  (zero8.engine.local_device(): the rank's GPU)
from .entry import add_config_arguments, init_distributed, initialize  # noqa: F401
from .optimizer import Zero8Optimizer
from .pipeline import PipelineEngine
from .training import ROUTE_ENCODE, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_TRAIN, Zero8Engine  # noqa: F401
from .world import world_comm

__all__ = ["initialize", "Zero8Engine", "PipelineEngine", "Zero8Optimizer", "MODEL_STATES_FILE", "world_comm"]
