"""FSDP1's state-dict and optimizer-state static methods, as the wrapper class offers them, built on
`state_dict_type`, `optim_state_dict` and `optim_state_dict_to_load`.

[Note: FSDP1's optimizer-state methods]
FSDP1 grew one method per (FULL / SHARDED) x (save / load) pair before ``optim_state_dict`` and
``optim_state_dict_to_load`` replaced them; our two functions already speak every form (keyed by
original FQN, full tensors under FULL_STATE_DICT, ``DTensor``s under SHARDED_STATE_DICT), so each old
method is one of them under the matching state-dict type:
- ``full_optim_state_dict(model, optim, rank0_only=True)``: FULL, ``rank0_only`` as asked;
- ``sharded_optim_state_dict``: SHARDED (values are ``DTensor``s, where FSDP1 gave ``ShardedTensor``s);
- ``shard_full_optim_state_dict`` / ``flatten_sharded_optim_state_dict``: ``optim_state_dict_to_load``
  of the dict every rank holds;
- ``scatter_full_optim_state_dict``: rank 0's dict is broadcast, then loaded as above;
- ``rekey_optim_state_dict``: FQN keys <-> the positions a plain optimizer uses.
They need the optimizer itself (FSDP1's deprecated ``optim_input`` is refused, naming ``optim``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._comm._collectives import comm_device
from fsdp_composable._common_utils import _get_fsdp_states
from fsdp_composable._names._fsdp1_names import as_ours
from fsdp_composable._state._optim_utils import optim_state_dict, optim_state_dict_to_load
from fsdp_composable._state._state_dict_settings import _config, _holder, _kind, _set_setting
from fsdp_composable._state._state_dict_utils import _CONFIG_TYPES, state_dict_type
from fsdp_composable._state._torch_interop import _take_back_state_hook
from fsdp_composable.api import FullStateDictConfig, ShardedStateDictConfig, StateDictConfig, StateDictType

__all__ = ["OptimStateKeyType", "StateDictSettings"]


class OptimStateKeyType(enum.Enum):
    """How an optimizer state dict names parameters: by FQN, or by position (a plain optimizer)."""

    PARAM_NAME = enum.auto()
    PARAM_ID = enum.auto()


@dataclass(frozen=True)
class StateDictSettings:
    """What `set_state_dict_type` set (and returns the previous of): FSDP1's triple. The optimizer's
    config is ours (``FullStateDictConfig`` or ``ShardedStateDictConfig``), or ``None`` where optimizer
    state dicts follow the model's config (no ``optim_state_dict_config`` was given)."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: Optional[StateDictConfig] = None


# ---------------------------------------------------------------------------- state-dict type
def set_state_dict_type(
    module: nn.Module,
    sd_type: StateDictType,
    state_dict_config: Optional[StateDictConfig] = None,
    optim_state_dict_config: Any = None,
) -> StateDictSettings:
    """Set, until changed, what ``state_dict()`` and `optim_state_dict` return for every state under
    ``module``; returns the previous settings. Checked as `state_dict_type` checks its arguments."""
    sd_type = as_ours("set_state_dict_type argument 'state_dict_type'", sd_type)
    state_dict_config = as_ours("set_state_dict_type argument 'state_dict_config'", state_dict_config)
    optim_config = optim_config_of(optim_state_dict_config, sd_type)
    with state_dict_type(module, sd_type, state_dict_config):
        pass  # the context manager's checks: a StateDictType, its config, a fully_shard state below
    previous = get_state_dict_type(module)
    config = state_dict_config if state_dict_config is not None else _CONFIG_TYPES[sd_type]()
    _set_setting(_get_fsdp_states(module), sd_type, config, optim_config)  # root-wide once initialised
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings of every state under ``module``; they must agree."""
    states = _get_fsdp_states(module)
    if not states:
        raise ValueError(
            f"get_state_dict_type: no fully_shard state on this {type(module).__name__} or its submodules; "
            "call fully_shard(module) or wrap it first"
        )
    settings = {(_kind(s), _config_of(_kind(s), _config(s)), _holder(s).optim_state_dict_config) for s in states}
    if len(settings) > 1:
        raise ValueError(
            f"get_state_dict_type: the states under this {type(module).__name__} have different state-dict "
            f"settings {sorted((t.name, repr(c), repr(o)) for t, c, o in settings)}; set one with set_state_dict_type"
        )
    ((sd_type, config, optim_config),) = settings
    return StateDictSettings(sd_type, config, optim_config)


def _config_of(sd_type: StateDictType, config: Optional[StateDictConfig]) -> StateDictConfig:
    return config if config is not None else _CONFIG_TYPES[sd_type]()


def optim_config_of(
    optim_config: Any, sd_type: Any, where: str = "set_state_dict_type"
) -> Optional[StateDictConfig]:
    """FSDP1's second config, for optimizer state dicts (torch's ``FullOptimStateDictConfig`` or
    ``ShardedOptimStateDictConfig``), as our config of the same type: its ``offload_to_cpu`` and, for
    FULL, ``rank0_only`` are what `optim_state_dict` follows, as in FSDP1 (whose defaults offload the
    optimizer state and not the model's). None: optimizer state dicts follow the model's config."""
    if optim_config is None:
        return None
    offload = getattr(optim_config, "offload_to_cpu", None)
    rank0 = getattr(optim_config, "rank0_only", False)
    if not isinstance(offload, bool) or not isinstance(rank0, bool):
        raise TypeError(
            f"{where} argument 'optim_state_dict_config' must be torch's FullOptimStateDictConfig or "
            f"ShardedOptimStateDictConfig (or None), got {type(optim_config).__name__}"
        )
    if sd_type is StateDictType.FULL_STATE_DICT:
        return FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0)
    if rank0:
        raise ValueError(
            f"{where}: optim_state_dict_config.rank0_only=True needs StateDictType.FULL_STATE_DICT, got "
            f"{sd_type}; leave rank0_only out"
        )
    return ShardedStateDictConfig(offload_to_cpu=offload)  # LOCAL: optim_state_dict refuses it anyway


# ---------------------------------------------------------------------------- optimizer state
def _need_optim(where: str, optim: Any, optim_input: Any) -> torch.optim.Optimizer:
    if optim_input is not None:
        raise ValueError(
            f"{where}: optim_input (deprecated in torch FSDP1) is not supported; pass optim=<the optimizer>"
        )
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(f"{where}: optim must be the torch.optim.Optimizer, got {type(optim).__name__}")
    return optim


def full_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None, rank0_only: bool = True, group: Any = None
) -> dict[str, Any]:
    """`optim_state_dict` under FULL_STATE_DICT (``rank0_only``: other ranks get ``{}``)."""
    optim = _need_optim("full_optim_state_dict", optim, optim_input)
    _check_group("full_optim_state_dict", group)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=rank0_only)):
        return optim_state_dict(model, optim)


def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group: Any = None) -> dict[str, Any]:
    """`optim_state_dict` under SHARDED_STATE_DICT: ``DTensor`` values."""
    _check_group("sharded_optim_state_dict", group)
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
        return optim_state_dict(model, optim)


def shard_full_optim_state_dict(
    full_optim_state_dict: Mapping[str, Any], model: nn.Module, optim_input: Any = None, optim: Any = None
) -> dict[str, Any]:
    """The full dict (every rank holds it) as ``optim.load_state_dict`` takes it here. Without ``optim``,
    for an optimizer built over ``model.parameters()``, as FSDP1 assumes."""
    where = "shard_full_optim_state_dict"
    osd = _by_name(full_optim_state_dict, model, _optional_optim(where, optim, optim_input))
    return optim_state_dict_to_load(model, optim, osd) if optim is not None else _to_load_without(where, model, osd)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: Mapping[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """A SHARDED dict (from `sharded_optim_state_dict`) as ``optim.load_state_dict`` takes it here."""
    optim = _need_optim("flatten_sharded_optim_state_dict", optim, None)
    return optim_state_dict_to_load(model, optim, sharded_optim_state_dict)


def scatter_full_optim_state_dict(
    full_optim_state_dict: Optional[Mapping[str, Any]],
    model: nn.Module,
    optim_input: Any = None,
    optim: Any = None,
    group: Optional[dist.ProcessGroup] = None,
) -> dict[str, Any]:
    """Rank 0's full dict (other ranks' argument is ignored), broadcast over ``group`` (default: all
    ranks) and converted for this rank's ``optim`` (without it: for an optimizer built over
    ``model.parameters()``, as FSDP1 assumes). A collective: call it on every rank."""
    optim = _optional_optim("scatter_full_optim_state_dict", optim, optim_input)
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    src = dist.get_global_rank(group, 0)
    box: list[Any] = [None]
    if dist.get_rank() == src:
        if not isinstance(full_optim_state_dict, Mapping):
            box = [TypeError(f"got {type(full_optim_state_dict).__name__} on rank 0, not the full dict")]
        else:
            try:
                box = [_by_name(full_optim_state_dict, model, optim)]
            except (TypeError, ValueError) as e:  # sent, so that every rank raises it
                box = [e]
    states = _get_fsdp_states(model)  # on the units' device, not the current CUDA device
    device = comm_device(group, states[0].device if states else None)
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    if isinstance(box[0], Exception):  # raised on every rank, not only where the input was wrong
        raise type(box[0])(
            f"scatter_full_optim_state_dict: {box[0]}; pass full_optim_state_dict(model, optim) on rank 0"
        )
    if optim is None:
        return _to_load_without("scatter_full_optim_state_dict", model, box[0])
    return optim_state_dict_to_load(model, optim, box[0])


def _optional_optim(where: str, optim: Any, optim_input: Any) -> Optional[torch.optim.Optimizer]:
    return None if optim is None and optim_input is None else _need_optim(where, optim, optim_input)


def _to_load_without(where: str, model: nn.Module, osd: Mapping[str, Any]) -> dict[str, Any]:
    """FSDP1's ``optim=None``: for an optimizer built over ``model.parameters()``. That optimizer is not
    known here, so its load hook cannot slice the state: the result holds this rank's slices already."""
    template = _template_optim(where, model, osd)
    out = optim_state_dict_to_load(model, template, osd)
    return _take_back_state_hook(template, out) or out


def _template_optim(where: str, model: nn.Module, osd: Mapping[str, Any]) -> torch.optim.Optimizer:
    """FSDP1's ``optim=None``: the optimizer is taken to be built over ``model.parameters()``, in the
    saved dict's param groups; nothing steps it, it only says which parameters come where."""
    groups = osd.get("param_groups") if isinstance(osd, Mapping) else None
    params = list(model.parameters())
    if not isinstance(groups, (list, tuple)) or len(groups) <= 1:
        return torch.optim.Optimizer([{"params": params}], {})
    by_fqn = dict(model.named_parameters())
    missing = [f for g in groups for f in g.get("params", []) if f not in by_fqn]
    if missing:
        raise ValueError(
            f"{where}: the state dict has {len(groups)} param groups and parameter {missing[0]!r} is not a "
            f"parameter of this {type(model).__name__} (flat parameters): pass optim=<the optimizer>"
        )
    return torch.optim.Optimizer([{"params": [by_fqn[f] for f in g["params"]]} for g in groups], {})


def _by_name(
    osd: Mapping[str, Any], model: nn.Module, optim: Optional[torch.optim.Optimizer]
) -> Mapping[str, Any]:
    """A dict keyed by position (a plain optimizer's) re-keyed by FQN; one keyed by FQN as it is."""
    state = osd.get("state", {}) if isinstance(osd, Mapping) else {}
    if any(isinstance(k, int) for k in state):
        return rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model, optim=optim)
    return osd


def _check_group(where: str, group: Any) -> None:
    if group is not None:
        raise ValueError(f"{where}: group is not supported; the model's own process groups are used")


def rekey_optim_state_dict(
    optim_state_dict: Mapping[str, Any],
    optim_state_key_type: Any,
    model: nn.Module,
    optim_input: Any = None,
    optim: Optional[torch.optim.Optimizer] = None,
) -> dict[str, Any]:
    """Name parameters by FQN (``PARAM_NAME``) or by position (``PARAM_ID``, as a plain optimizer over
    ``model`` does). Positions follow ``optim``'s param groups, or ``model.parameters()`` without it."""
    if optim_input is not None:
        raise ValueError("rekey_optim_state_dict: optim_input is not supported; pass optim=<the optimizer>")
    key_type = getattr(optim_state_key_type, "name", None)
    if key_type not in OptimStateKeyType.__members__:
        raise TypeError(
            "rekey_optim_state_dict: optim_state_key_type must be OptimStateKeyType.PARAM_NAME or PARAM_ID, "
            f"got {optim_state_key_type!r}"
        )
    names = _names_in_order(model, optim)
    to_name = key_type == "PARAM_NAME"
    position = {name: i for i, name in enumerate(names)}

    def rekey(key: Any) -> Any:
        if to_name and isinstance(key, int):
            if not 0 <= key < len(names):
                raise ValueError(
                    f"rekey_optim_state_dict: parameter position {key} is out of range 0..{len(names) - 1}"
                )
            return names[key]
        if not to_name and isinstance(key, str):
            if key not in position:
                raise ValueError(
                    f"rekey_optim_state_dict: '{key}' is not a parameter FQN of this {type(model).__name__}"
                )
            return position[key]
        return key

    return {
        "state": {rekey(k): v for k, v in optim_state_dict["state"].items()},
        "param_groups": [{**g, "params": [rekey(k) for k in g["params"]]} for g in optim_state_dict["param_groups"]],
    }


def _names_in_order(model: nn.Module, optim: Optional[torch.optim.Optimizer]) -> list[str]:
    fqn_of = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    params = [p for g in optim.param_groups for p in g["params"]] if optim is not None else list(model.parameters())
    missing = [i for i, p in enumerate(params) if id(p) not in fqn_of]
    if missing:
        raise ValueError(
            f"rekey_optim_state_dict: the optimizer's parameters at positions {missing[:3]} are not parameters "
            f"of this {type(model).__name__}; pass the model the optimizer was built on"
        )
    return [fqn_of[id(p)] for p in params]
