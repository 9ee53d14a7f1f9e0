"""torch.distributed.fsdp's enums and configs (FSDP1's ``ShardingStrategy``, ``MixedPrecision``,
``CPUOffload``, ``BackwardPrefetch``, ``StateDictType`` and the state-dict configs) as ours.

[Note: torch's FSDP1 objects]
FSDP1 scripts import these from ``torch.distributed.fsdp``; ours have the same member names and the
same public fields, so an argument of torch's class is translated to ours where it enters (the
wrapper's constructor, `fully_shard`, `state_dict_type` and ``set_state_dict_type``). torch's classes
are recognised by module and class name and read by attribute: the package does not import
torch.distributed.fsdp. Private fields torch adds are honoured where ours behave the same and refused,
naming the field, where they would not:
- ``MixedPrecision._module_classes_to_ignore``: BatchNorm modules always get their own
  full-precision unit here, which is torch's default (``(_BatchNorm,)``); any other value is refused.
- ``ShardedStateDictConfig._use_dtensor``: sharded state dicts always hold DTensors here, so both
  values give DTensors (torch's default, False, would give ShardedTensors).
"""

from __future__ import annotations

import enum
from typing import Any

from torch import nn

from fsdp_composable.api import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)

__all__: list[str] = []

_TORCH_MODULE = "torch.distributed.fsdp"

_ENUMS: tuple[type[enum.Enum], ...] = (ShardingStrategy, BackwardPrefetch, StateDictType)

# ours, by class name, with the fields read from torch's object of that name
_CONFIGS: dict[str, tuple[type, tuple[str, ...]]] = {
    "MixedPrecision": (
        MixedPrecision,
        (
            "param_dtype",
            "reduce_dtype",
            "buffer_dtype",
            "keep_low_precision_grads",
            "cast_forward_inputs",
            "cast_root_forward_inputs",
        ),
    ),
    "CPUOffload": (CPUOffload, ("offload_params",)),
    "FullStateDictConfig": (FullStateDictConfig, ("offload_to_cpu", "rank0_only")),
    "ShardedStateDictConfig": (ShardedStateDictConfig, ("offload_to_cpu",)),
    "LocalStateDictConfig": (LocalStateDictConfig, ("offload_to_cpu",)),
}


def is_torch_fsdp1(value: Any) -> bool:
    """Whether ``value`` is an object of one of torch.distributed.fsdp's classes."""
    return type(value).__module__.startswith(_TORCH_MODULE)


def as_ours(where: str, value: Any) -> Any:
    """``value`` as our enum member or config when it is torch.distributed.fsdp's of the same name;
    anything else unchanged (the caller checks its type). ``where`` names the argument in errors."""
    if not is_torch_fsdp1(value):
        return value
    name = type(value).__name__
    for ours in _ENUMS:
        if name == ours.__name__ and isinstance(value, enum.Enum):
            member = getattr(ours, value.name, None)
            if member is None:
                raise ValueError(
                    f"{where}: torch.distributed.fsdp.{name}.{value.name} has no equivalent; use one of "
                    f"{', '.join(m.name for m in ours)}"
                )
            return member
    if name not in _CONFIGS:
        return value
    cls, fields = _CONFIGS[name]
    if name == "MixedPrecision":
        _check_classes_to_ignore(where, value)
    return cls(**{field: getattr(value, field) for field in fields})


def _check_classes_to_ignore(where: str, value: Any) -> None:
    """Refuse what ``_module_classes_to_ignore`` asks unless it is torch's default (see the Note)."""
    classes = getattr(value, "_module_classes_to_ignore", (nn.modules.batchnorm._BatchNorm,))
    if tuple(classes) != (nn.modules.batchnorm._BatchNorm,):
        raise ValueError(
            f"{where}: torch.distributed.fsdp.MixedPrecision(_module_classes_to_ignore={classes!r}) has no "
            "equivalent: every BatchNorm module (and only those) gets its own full-precision unit here; leave "
            "_module_classes_to_ignore at its default (a CustomPolicy can give other modules units with "
            "mixed_precision=None)"
        )
