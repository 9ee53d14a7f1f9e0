# ruff: noqa: E501
"""The bad-input cases and their recording, shared by test_bad_inputs.py (constructors, policies,
configs) and test_bad_runtime_inputs.py (unshard_params, no_sync, clipping, state dicts).

Each case runs one mistake and records ``(exception type name, message)`` (or ``("<accepted>", "")``
when nothing is raised). The cases that need a process group run in two calls to a 2-rank gloo pool
(`constructor_cases`, `runtime_cases`), cached across the tests of both files; the test functions
compare each case with its expected text. A case whose current behaviour falls short (internal error,
silent acceptance, a message that names the wrong argument) is listed in `KNOWN_GAPS` with the message
it should have; its expectation pins the current behaviour so that improving the library shows up
there. docs/errors.md quotes these files.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Optional

import expecttest
import torch
import torch.distributed as dist
from models import Block, TinyGPT
from torch import nn

from fsdp_composable import (
    CPUOffload,
    CustomPolicy,
    FullStateDictConfig,
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardedStateDictConfig,
    ShardingStrategy,
    SizeBasedPolicy,
    StateDictType,
    clip_grad_norm_,
    fully_shard,
    no_sync,
    register_fsdp_forward_method,
    state_dict_type,
    unshard_params,
)

Outcome = tuple[str, str]
ACCEPTED = "<accepted>"

# [Note: known gaps]
# Cases whose current behaviour is an internal error, a silent acceptance, or a message that names the
# wrong argument or gives the wrong advice. The test pins what happens today; the value is the message
# the case should raise instead. When the library is fixed, accept the new expectation and drop the entry.
KNOWN_GAPS: dict[str, str] = {}  # every gap found so far is closed; add new ones here with the message they need


# ---------------------------------------------------------------------------- recording
def _normalise(text: str) -> str:
    return re.sub(r"0x[0-9a-fA-F]+", "0x...", text)


def _outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recording whatever the library raises is the point
        return type(e).__name__, _normalise(str(e))
    return ACCEPTED, ""


def _enter(cm: Any) -> None:
    with cm:
        pass


def _warns(fn: Callable[[], Any]) -> Callable[[], None]:
    """Run ``fn`` with UserWarnings raised as errors, so that the case records the warning."""

    def run() -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", category=UserWarning)
            fn()

    return run


class _Cases:
    """Collects outcomes by case name; a name may be recorded once."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Outcome] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> None:
        assert name not in self.outcomes, name
        self.outcomes[name] = _outcome(fn)


# ---------------------------------------------------------------------------- models
def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _lin() -> nn.Linear:
    return nn.Linear(4, 4)


class _NoReset(nn.Module):
    """A module with a parameter but no ``reset_parameters``: cannot be materialised from meta."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def _meta_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4, device="meta"), _NoReset(torch.device("meta")))


class _Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


class _UnshardsInForward(nn.Module):
    """Calls ``unshard_params`` on its root from inside forward: not allowed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.root: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.root is not None
        with unshard_params(self.root):
            pass
        return self.lin(x)


class _NoSyncInForward(_UnshardsInForward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.root is not None
        with no_sync(self.root):
            pass
        return self.lin(x)


def _holder(inner: nn.Module) -> nn.Sequential:
    outer = nn.Sequential(inner)
    object.__setattr__(inner, "root", outer)  # a plain attribute: registering it would make a cycle
    return outer


# ---------------------------------------------------------------------------- constructor cases
def constructor_cases() -> dict[str, Outcome]:
    """Bad arguments of fully_shard, FullyShardedDataParallel, the policies and the configs."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    case = _Cases()
    world = dist.group.WORLD
    # module
    case("fully_shard/module_str", lambda: fully_shard("model"))  # type: ignore[arg-type]
    case("fully_shard/module_class", lambda: fully_shard(nn.Linear))  # type: ignore[arg-type]
    # policy
    case("fully_shard/policy_int", lambda: fully_shard(_gpt(), 5))
    case("fully_shard/policy_set_of_classes", lambda: fully_shard(_gpt(), {Block}))
    case("fully_shard/policy_process_group_positional", lambda: fully_shard(_gpt(), world))
    case("fully_shard/policy_module_class", lambda: fully_shard(_gpt(), Block))
    case("fully_shard/policy_policy_class", lambda: fully_shard(_gpt(), ModuleWrapPolicy))
    case("fully_shard/policy_callable_returns_none", lambda: fully_shard(_gpt(), lambda m: None))
    case(
        "fully_shard/policy_callable_returns_dict",
        lambda: fully_shard(
            _gpt(), lambda m: {"strategy": ShardingStrategy.NO_SHARD} if isinstance(m, Block) else False
        ),
    )
    case("fully_shard/policy_matches_nothing", _warns(lambda: fully_shard(_gpt(), ModuleWrapPolicy({nn.Conv2d}))))
    # process_group
    case("fully_shard/process_group_str", lambda: fully_shard(_gpt(), process_group="gloo"))
    case("fully_shard/process_group_int", lambda: fully_shard(_gpt(), process_group=0))
    case("fully_shard/process_group_list", lambda: fully_shard(_gpt(), process_group=[world]))
    case("fully_shard/process_group_pair_not_hybrid", lambda: fully_shard(_gpt(), process_group=(world, world)))
    case(
        "fully_shard/hybrid_without_replicate_group",
        lambda: fully_shard(_gpt(), process_group=world, strategy=ShardingStrategy.HYBRID_SHARD),
    )
    case(
        "fully_shard/hybrid_overlapping_groups",
        lambda: fully_shard(_gpt(), process_group=(world, world), strategy=ShardingStrategy.HYBRID_SHARD),
    )
    mesh3 = init_device_mesh("cpu", (1, 1, 2))
    case("fully_shard/process_group_3d_mesh", lambda: fully_shard(_gpt(), process_group=mesh3))
    mesh2 = init_device_mesh("cpu", (1, 2))
    case("fully_shard/process_group_2d_mesh_not_hybrid", lambda: fully_shard(_gpt(), process_group=mesh2))
    singles = [dist.new_group([0]), dist.new_group([1])]  # collective: every rank creates both
    other_rank_only = singles[1 - dist.get_rank()]
    case("fully_shard/process_group_without_this_rank", lambda: fully_shard(_gpt(), process_group=other_rank_only))
    # strategy
    case("fully_shard/strategy_str", lambda: fully_shard(_gpt(), strategy="FULL_SHARD"))  # type: ignore[arg-type]
    case("fully_shard/strategy_none", lambda: fully_shard(_gpt(), strategy=None))  # type: ignore[arg-type]
    case(
        "fully_shard/strategy_torch_fsdp_enum",
        lambda: fully_shard(_gpt(), strategy=torch_fsdp.ShardingStrategy.HYBRID_SHARD),  # type: ignore[arg-type]
    )
    # mixed_precision
    case("fully_shard/mixed_precision_dtype", lambda: fully_shard(_gpt(), mixed_precision=torch.float16))  # type: ignore[arg-type]
    case(
        "fully_shard/mixed_precision_dict",
        lambda: fully_shard(_gpt(), mixed_precision={"param_dtype": torch.float16}),  # type: ignore[arg-type]
    )
    case(
        "fully_shard/mixed_precision_torch_fsdp",
        lambda: fully_shard(_gpt(), mixed_precision=torch_fsdp.MixedPrecision(_module_classes_to_ignore=())),  # type: ignore[arg-type]
    )
    # cpu_offload
    case("fully_shard/cpu_offload_bool", lambda: fully_shard(_gpt(), cpu_offload=True))  # type: ignore[arg-type]
    case(
        "fully_shard/cpu_offload_torch_fsdp",
        lambda: fully_shard(_gpt(), cpu_offload=torch_fsdp.CPUOffload(offload_params=1)),  # type: ignore[arg-type]
    )
    # ignored_modules
    gpt = _gpt()
    case("fully_shard/ignored_modules_single_module", lambda: fully_shard(gpt, ignored_modules=gpt.head))  # type: ignore[arg-type]
    case("fully_shard/ignored_modules_contains_str", lambda: fully_shard(_gpt(), ignored_modules=["head"]))  # type: ignore[list-item]
    gpt2 = _gpt()
    case("fully_shard/ignored_modules_contains_parameter", lambda: fully_shard(gpt2, ignored_modules=[gpt2.pos]))  # type: ignore[list-item]
    gpt3 = _gpt()
    case("fully_shard/ignored_modules_contains_root", lambda: fully_shard(gpt3, ignored_modules=[gpt3]))
    case("fully_shard/ignored_modules_not_submodule", lambda: fully_shard(_gpt(), ignored_modules=[_lin()]))
    # device_id (an int means a CUDA device; these cases assume no CUDA, see test_device_id)
    case("fully_shard/device_id_str", lambda: fully_shard(_gpt(), device_id="cpu"))  # type: ignore[arg-type]
    case("fully_shard/device_id_float", lambda: fully_shard(_gpt(), device_id=0.0))  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        case("fully_shard/device_id_int_without_cuda", lambda: fully_shard(_gpt(), device_id=0))
        case("fully_shard/device_id_negative", lambda: fully_shard(_gpt(), device_id=-1))
    case("fully_shard/device_id_meta", lambda: fully_shard(_gpt(), device_id=torch.device("meta")))
    # param_init_fn and the meta device
    case("fully_shard/param_init_fn_str", lambda: fully_shard(_gpt(), param_init_fn="reset"))  # type: ignore[arg-type]
    case("fully_shard/meta_without_init_fn", lambda: fully_shard(_meta_model()))
    case("fully_shard/meta_init_fn_leaves_meta", lambda: fully_shard(_meta_model(), param_init_fn=lambda m: None))
    case("fully_shard/meta_init_fn_no_argument", lambda: fully_shard(_meta_model(), param_init_fn=lambda: None))  # type: ignore[arg-type,misc]
    # booleans and backward_prefetch
    case("fully_shard/sync_module_states_str", lambda: fully_shard(_gpt(), sync_module_states="yes"))  # type: ignore[arg-type]
    case("fully_shard/sync_module_states_int", lambda: fully_shard(_gpt(), sync_module_states=1))  # type: ignore[arg-type]
    case("fully_shard/forward_prefetch_int", lambda: fully_shard(_gpt(), forward_prefetch=1))  # type: ignore[arg-type]
    case("fully_shard/limit_all_gathers_none", lambda: fully_shard(_gpt(), limit_all_gathers=None))  # type: ignore[arg-type]
    case("fully_shard/backward_prefetch_str", lambda: fully_shard(_gpt(), backward_prefetch="BACKWARD_PRE"))  # type: ignore[arg-type]
    case("fully_shard/unknown_keyword", lambda: fully_shard(_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block})))

    def twice() -> None:
        m = _gpt()
        fully_shard(m)
        fully_shard(m)

    def child_after_parent() -> None:
        m = _gpt()
        fully_shard(m)
        fully_shard(m.blocks[0])

    def unit_child_after_parent() -> None:
        m = _gpt()
        fully_shard(m, ModuleWrapPolicy({Block}))
        fully_shard(m.blocks[0])

    case("fully_shard/applied_twice", twice)
    case("fully_shard/child_after_parent", child_after_parent)
    case("fully_shard/policy_unit_child_after_parent", unit_child_after_parent)
    case("fully_shard/state_of_plain_module", lambda: fully_shard.state(_lin()))

    # FullyShardedDataParallel
    fsdp = FullyShardedDataParallel
    case("wrapper/module_str", lambda: fsdp("model"))  # type: ignore[arg-type]
    case("wrapper/process_group_str", lambda: fsdp(_gpt(), process_group="gloo"))  # type: ignore[arg-type]
    case("wrapper/sharding_strategy_str", lambda: fsdp(_gpt(), sharding_strategy="FULL_SHARD"))  # type: ignore[arg-type]
    case("wrapper/cpu_offload_bool", lambda: fsdp(_gpt(), cpu_offload=True))  # type: ignore[arg-type]
    case("wrapper/auto_wrap_policy_int", lambda: fsdp(_gpt(), auto_wrap_policy=5))
    case("wrapper/backward_prefetch_str", lambda: fsdp(_gpt(), backward_prefetch="BACKWARD_POST"))  # type: ignore[arg-type]
    case("wrapper/mixed_precision_dtype", lambda: fsdp(_gpt(), mixed_precision=torch.bfloat16))  # type: ignore[arg-type]
    gpt4 = _gpt()
    case("wrapper/ignored_modules_single_module", lambda: fsdp(gpt4, ignored_modules=gpt4.head))  # type: ignore[arg-type]
    case("wrapper/param_init_fn_int", lambda: fsdp(_gpt(), param_init_fn=5))  # type: ignore[arg-type]
    case("wrapper/device_id_str", lambda: fsdp(_gpt(), device_id="cpu"))  # type: ignore[arg-type]
    case("wrapper/sync_module_states_str", lambda: fsdp(_gpt(), sync_module_states="no"))  # type: ignore[arg-type]
    case("wrapper/forward_prefetch_int", lambda: fsdp(_gpt(), forward_prefetch=0))  # type: ignore[arg-type]
    case("wrapper/limit_all_gathers_none", lambda: fsdp(_gpt(), limit_all_gathers=None))  # type: ignore[arg-type]
    case("wrapper/use_orig_params_str", lambda: fsdp(_gpt(), use_orig_params="yes"))  # type: ignore[arg-type]
    case("wrapper/device_mesh_str", lambda: fsdp(_gpt(), device_mesh="dp"))
    mesh_1d = init_device_mesh("cpu", (dist.get_world_size(),))
    case("wrapper/device_mesh_and_process_group", lambda: fsdp(_gpt(), process_group=dist.group.WORLD, device_mesh=mesh_1d))

    def wrapper_twice() -> None:
        m = _gpt()
        fsdp(m)
        fsdp(m)

    case("wrapper/applied_twice", wrapper_twice)

    # policies
    case("ModuleWrapPolicy/single_class", lambda: ModuleWrapPolicy(Block))  # type: ignore[arg-type]
    case("ModuleWrapPolicy/class_names", lambda: ModuleWrapPolicy({"Block"}))  # type: ignore[arg-type]
    case("ModuleWrapPolicy/instances", lambda: ModuleWrapPolicy([_lin()]))  # type: ignore[list-item]
    case("ModuleWrapPolicy/empty", lambda: fully_shard(_gpt(), ModuleWrapPolicy(set())))
    case("SizeBasedPolicy/zero", lambda: SizeBasedPolicy(0))
    case("SizeBasedPolicy/negative", lambda: SizeBasedPolicy(-5))
    case("SizeBasedPolicy/float", lambda: SizeBasedPolicy(1.5))  # type: ignore[arg-type]
    case("SizeBasedPolicy/str", lambda: SizeBasedPolicy("1000"))  # type: ignore[arg-type]
    case("CustomPolicy/not_callable", lambda: fully_shard(_gpt(), CustomPolicy(5)))  # type: ignore[arg-type]
    case("CustomPolicy/returns_none", lambda: fully_shard(_gpt(), CustomPolicy(lambda m: None)))  # type: ignore[arg-type,return-value]
    case("CustomPolicy/returns_int", lambda: fully_shard(_gpt(), CustomPolicy(lambda m: 1)))  # type: ignore[arg-type,return-value]
    case(
        "CustomPolicy/unknown_override_key",
        lambda: fully_shard(_gpt(), CustomPolicy(lambda m: {"reshard": False} if isinstance(m, Block) else False)),
    )
    case(
        "CustomPolicy/override_wrong_type",
        lambda: fully_shard(
            _gpt(), CustomPolicy(lambda m: {"strategy": "NO_SHARD"} if isinstance(m, Block) else False)
        ),
    )
    case(
        "CustomPolicy/override_mixed_precision_dtype",
        lambda: fully_shard(
            _gpt(), CustomPolicy(lambda m: {"mixed_precision": torch.float16} if isinstance(m, Block) else False)
        ),
    )
    case(
        "CustomPolicy/override_hybrid_without_groups",
        lambda: fully_shard(
            _gpt(),
            CustomPolicy(lambda m: {"strategy": ShardingStrategy.HYBRID_SHARD} if isinstance(m, Block) else False),
        ),
    )
    # configs
    case("MixedPrecision/param_dtype_int", lambda: MixedPrecision(param_dtype=torch.int32))
    case("MixedPrecision/param_dtype_str", lambda: MixedPrecision(param_dtype="bfloat16"))  # type: ignore[arg-type]
    case("MixedPrecision/reduce_dtype_bool", lambda: MixedPrecision(reduce_dtype=torch.bool))
    case("MixedPrecision/output_dtype_int", lambda: MixedPrecision(output_dtype=torch.int64))
    case("MixedPrecision/buffer_dtype_python_float", lambda: MixedPrecision(buffer_dtype=float))  # type: ignore[arg-type]
    case("MixedPrecision/keep_low_precision_grads_str", lambda: MixedPrecision(keep_low_precision_grads="no"))  # type: ignore[arg-type]
    case("MixedPrecision/cast_forward_inputs_none", lambda: MixedPrecision(cast_forward_inputs=None))  # type: ignore[arg-type]
    case("MixedPrecision/cast_root_forward_inputs_int", lambda: MixedPrecision(cast_root_forward_inputs=0))  # type: ignore[arg-type]
    case("CPUOffload/offload_params_str", lambda: CPUOffload(offload_params="no"))  # type: ignore[arg-type]
    return case.outcomes


# ---------------------------------------------------------------------------- runtime cases
def _sharded_gpt() -> TinyGPT:
    return fully_shard(_gpt(), ModuleWrapPolicy({Block}))


def _step(model: nn.Module) -> None:
    model(torch.randint(0, 37, (2, 8))).sum().backward()


def _load(model: nn.Module, edit: Callable[[dict[str, Any]], None], kind: Optional[StateDictType] = None) -> None:
    """Save, ``edit`` the state dict, load it back (under ``kind`` if given)."""
    if kind is None:
        sd = model.state_dict()
        edit(sd)
        model.load_state_dict(sd)
        return
    with state_dict_type(model, kind):
        sd = model.state_dict()
        edit(sd)
        model.load_state_dict(sd)


def _wrong_shape_dtensor(sd: dict[str, Any]) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    mesh = sd["blocks.0.fc1.weight"].device_mesh
    sd["blocks.0.fc1.weight"] = DTensor.from_local(torch.zeros(3, 3), mesh, [Replicate()], run_check=False)


def runtime_cases() -> dict[str, Outcome]:
    """Bad uses of unshard_params, no_sync, clip_grad_norm_, state_dict_type, extra forward methods and
    state dicts (FULL, SHARDED, LOCAL)."""
    import torch.distributed.fsdp as torch_fsdp

    case = _Cases()
    plain = _gpt()
    model = _sharded_gpt()

    # unshard_params
    def forward_inside() -> None:
        fresh = _sharded_gpt()  # the failed forward must not disturb the cases below
        with unshard_params(fresh):
            _step(fresh)

    def nested() -> None:
        with unshard_params(model), unshard_params(model):
            pass

    case("unshard_params/forward_inside", forward_inside)
    case("unshard_params/nested", nested)
    case("unshard_params/inside_forward", lambda: fully_shard(_holder(_UnshardsInForward()))(torch.ones(2, 4)))
    case("unshard_params/writeback_and_rank0_only", lambda: _enter(unshard_params(model, rank0_only=True)))
    case("unshard_params/plain_module", lambda: _enter(unshard_params(plain)))
    case("unshard_params/non_unit_submodule_no_recurse", lambda: _enter(unshard_params(model.head, recurse=False)))
    case("unshard_params/parameters_instead_of_module", lambda: _enter(unshard_params(model.parameters())))  # type: ignore[arg-type]
    case("unshard_params/writeback_str", lambda: _enter(unshard_params(model, writeback="no")))  # type: ignore[arg-type]
    case("unshard_params/recurse_str", lambda: _enter(unshard_params(model, recurse="no")))  # type: ignore[arg-type]
    case("unshard_params/rank0_only_str", lambda: _enter(unshard_params(model, rank0_only="no")))  # type: ignore[arg-type]
    case("unshard_params/offload_to_cpu_str", lambda: _enter(unshard_params(model, offload_to_cpu="no")))  # type: ignore[arg-type]
    case("unshard_params/with_grads_str", lambda: _enter(unshard_params(model, with_grads="no")))  # type: ignore[arg-type]
    # no_sync
    case("no_sync/plain_module", lambda: _enter(no_sync(plain)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    case("no_sync/optimizer_instead_of_module", lambda: _enter(no_sync(opt)))  # type: ignore[arg-type]
    case("no_sync/inside_forward", lambda: fully_shard(_holder(_NoSyncInForward()))(torch.ones(2, 4)))
    case("no_sync/non_root_unit", lambda: _enter(no_sync(model.blocks[0])))

    def nested_non_root() -> None:
        m = _gpt()
        for block in m.blocks:
            fully_shard(block)
        fully_shard(m)
        _step(m)  # the first forward decides which state is the root
        _enter(no_sync(m.blocks[0]))

    case("no_sync/nested_non_root_after_forward", nested_non_root)
    # clip_grad_norm_
    _step(model)
    case("clip_grad_norm_/plain_module", lambda: clip_grad_norm_(plain, 1.0))
    case("clip_grad_norm_/parameters_instead_of_module", lambda: clip_grad_norm_(model.parameters(), 1.0))  # type: ignore[arg-type]
    case("clip_grad_norm_/max_norm_negative", lambda: clip_grad_norm_(model, -1.0))
    case("clip_grad_norm_/max_norm_str", lambda: clip_grad_norm_(model, "1.0"))  # type: ignore[arg-type]
    case("clip_grad_norm_/max_norm_nan", lambda: clip_grad_norm_(model, float("nan")))
    model.zero_grad()
    _step(model)
    case("clip_grad_norm_/norm_type_zero", lambda: clip_grad_norm_(model, 1.0, norm_type=0))
    case("clip_grad_norm_/norm_type_str", lambda: clip_grad_norm_(model, 1.0, norm_type="fro"))  # type: ignore[arg-type]
    case("clip_grad_norm_/non_root_unit", lambda: clip_grad_norm_(model.blocks[0], 1.0))
    model.zero_grad()
    # state_dict_type
    sdt = StateDictType.SHARDED_STATE_DICT
    case("state_dict_type/module_str", lambda: _enter(state_dict_type("model", sdt)))  # type: ignore[arg-type]
    case("state_dict_type/type_str", lambda: _enter(state_dict_type(model, "SHARDED_STATE_DICT")))  # type: ignore[arg-type]
    case(
        "state_dict_type/type_torch_fsdp",
        lambda: _enter(
            state_dict_type(model, torch_fsdp.StateDictType.SHARDED_STATE_DICT, torch_fsdp.FullStateDictConfig())  # type: ignore[arg-type]
        ),
    )
    case("state_dict_type/config_for_other_type", lambda: _enter(state_dict_type(model, sdt, FullStateDictConfig())))
    case(
        "state_dict_type/config_torch_fsdp",
        lambda: _enter(
            state_dict_type(model, StateDictType.FULL_STATE_DICT, torch_fsdp.FullOptimStateDictConfig())  # type: ignore[arg-type]
        ),
    )
    case("state_dict_type/plain_module", lambda: _enter(state_dict_type(plain, sdt, ShardedStateDictConfig())))
    # register_fsdp_forward_method
    case("register_fsdp_forward_method/plain_module", lambda: register_fsdp_forward_method(_Generator(), "generate"))
    gen = fully_shard(_Generator())
    case("register_fsdp_forward_method/missing_method", lambda: register_fsdp_forward_method(gen, "generat"))
    case("register_fsdp_forward_method/attribute_not_method", lambda: register_fsdp_forward_method(gen, "training"))
    case("register_fsdp_forward_method/name_not_str", lambda: register_fsdp_forward_method(gen, 5))  # type: ignore[arg-type]
    case("register_fsdp_forward_method/non_unit_submodule", lambda: register_fsdp_forward_method(gen.lin, "extra_repr"))

    def register_forward() -> None:
        m = fully_shard(_Generator())
        register_fsdp_forward_method(m, "forward")
        m(torch.ones(2, 4)).sum().backward()

    case("register_fsdp_forward_method/forward", register_forward)
    # FULL state dicts
    full = None
    case("full_state_dict/missing_key", lambda: _load(model, lambda sd: sd.pop("blocks.0.fc1.weight"), full))
    case("full_state_dict/unexpected_key", lambda: _load(model, lambda sd: sd.update(extra=torch.zeros(1)), full))
    case(
        "full_state_dict/wrong_shape",
        lambda: _load(model, lambda sd: sd.update({"blocks.1.fc2.weight": torch.zeros(3, 3)}), full),
    )
    case("full_state_dict/wrong_shape_root_unit", lambda: _load(model, lambda sd: sd.update(pos=torch.zeros(2)), full))
    case("full_state_dict/not_a_tensor", lambda: _load(model, lambda sd: sd.update({"head.weight": [1.0]}), full))
    # SHARDED state dicts
    sharded = StateDictType.SHARDED_STATE_DICT
    case("sharded_state_dict/missing_key", lambda: _load(model, lambda sd: sd.pop("blocks.0.fc1.weight"), sharded))
    case(
        "sharded_state_dict/unexpected_key",
        lambda: _load(model, lambda sd: sd.update({"blocks.0.extra": torch.zeros(1)}), sharded),
    )
    case(
        "sharded_state_dict/wrong_shape_plain_tensor",
        lambda: _load(model, lambda sd: sd.update({"blocks.1.fc2.weight": torch.zeros(3, 3)}), sharded),
    )
    case("sharded_state_dict/wrong_shape_dtensor", lambda: _load(model, _wrong_shape_dtensor, sharded))
    # LOCAL state dicts
    local = StateDictType.LOCAL_STATE_DICT
    case(
        "local_state_dict/other_layout",
        lambda: _load(model, lambda sd: sd["blocks.0._flat_param_layout"].update(world_size=4), local),
    )
    case(
        "local_state_dict/wrong_shape",
        lambda: _load(model, lambda sd: sd.update({"blocks.0._flat_param": torch.zeros(3)}), local),
    )
    return case.outcomes


# ---------------------------------------------------------------------------- checking
_RESULTS: dict[str, dict[str, str]] = {}
_KINDS: dict[str, set[str]] = {}  # case -> the exception type names its ranks raised


def _format(outcome: Outcome) -> str:
    """``Type: message``; torch's load_state_dict messages have tabs and trailing blanks, which go."""
    kind, message = outcome
    message = "\n".join(line.rstrip() for line in message.replace("\t", "    ").splitlines())
    return f"{kind}: {message}" if message else kind


def _results(dist_run: Any, fn: Callable[[], dict[str, Outcome]]) -> dict[str, str]:
    """One pool call per case function (cached across tests); ranks that differ are shown per rank."""
    if fn.__name__ not in _RESULTS:
        per_rank = dist_run(2, fn, timeout=120)
        merged: dict[str, str] = {}
        for name in per_rank[0]:
            texts = [_format(r[name]) for r in per_rank]
            _KINDS[name] = {r[name][0] for r in per_rank}
            merged[name] = (
                texts[0] if len(set(texts)) == 1 else "\n".join(f"rank {i}: {t}" for i, t in enumerate(texts))
            )
        _RESULTS[fn.__name__] = merged
    return _RESULTS[fn.__name__]


class _Expect:
    """``expect(case, '''text''')``: one inline expectation per case, tracked so none is forgotten."""

    def __init__(self, results: dict[str, str], prefixes: tuple[str, ...]) -> None:
        self.results = results
        self.names = {n for n in results if n.startswith(prefixes)}
        self.checked: set[str] = set()
        self.tc = expecttest.TestCase()

    def __call__(self, name: str, expected: str) -> None:
        assert name in self.names, f"no such case {name!r}"
        self.checked.add(name)
        self.tc.assertExpectedInline(self.results[name], expected, skip=1)

    def done(self) -> None:
        assert self.checked == self.names, f"cases without an expectation: {sorted(self.names - self.checked)}"
        for name in sorted(self.names - set(KNOWN_GAPS)):  # the rule every other case must meet
            allowed = {"TypeError", "ValueError", "RuntimeError", "UserWarning"}  # warnings: cases run by _warns
            assert _KINDS[name] <= allowed, f"{name}: {self.results[name]}"
