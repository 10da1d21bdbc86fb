"""How a client optimizer becomes the sharded optimizer's algorithm and hyperparameters. The translation
itself (a client optimizer's class and param groups read into a spec, param-group dicts turned into Hyper
values and back) is driven by the algorithm table in zero8.optim._algos; this module adds what is the
engine's own: per-parameter overrides and the rule for param groups given as model_parameters.
"""

from __future__ import annotations

import torch

from .._C import Zero8NotSupportedError
from ..optim import param_config
from ..optim._algos import GROUP_KEYS as _GROUP_KEYS
from ..optim._algos import client_optimizer_spec as _client_optimizer_spec  # noqa: F401  (re-exported)
from ..optim._algos import f32 as _f32
from ..optim._algos import group_from_hyper as _group_from_hyper  # noqa: F401
from ..optim._algos import hyper_for_group as _hyper_for_group  # noqa: F401
from ..optim._algos import hyper_from_group as _hyper_from_group  # noqa: F401
from ..optim._algos import hyper_with_overrides as _hyper_with_overrides  # noqa: F401

# Per-parameter overrides that choose the state format rather than a hyperparameter (master_weights: the
# engine keeps float32 masters of every parameter anyway).
_STATE_OVERRIDE_KEYS = ("optim_bits", "min_8bit_size", "master_weights")


def _param_overrides(p: torch.Tensor, client) -> dict:
    """Per-parameter settings of zero8.optim (GlobalOptimManager, e.g. a StableEmbedding weight, and the
    client optimizer's override_config)."""
    cfg: dict = dict(param_config(p))
    own = getattr(client, "_overrides", None)
    if own is not None and p in own:
        cfg.update(own[p])
    return cfg


def _check_group_overrides(groups: list[dict], resolved: dict) -> None:
    """model_parameters given as param-group dicts may set their own _GROUP_KEYS (e.g. weight_decay 0 for
    biases and norms); other hyperparameters must equal the optimizer's."""
    for i, g in enumerate(groups):
        for k, v in g.items():
            if k == "params" or k not in resolved or k in _GROUP_KEYS:
                continue
            want = resolved[k]
            same = (tuple(float(a) for a in v) == tuple(want)) if k == "betas" else (
                v == want or (isinstance(v, (int, float)) and _f32(float(v)) == want))
            if not same:
                raise Zero8NotSupportedError(
                    f"model_parameters[{i}].{k}: {v!r} differs from the optimizer's {want!r}; zero8's param "
                    f"groups may set their own {', '.join(_GROUP_KEYS)} only"
                )
