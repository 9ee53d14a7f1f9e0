# ruff: noqa: E501
"""Every bad input gets a named exception: the argument, the module/parameter FQN, and what to do.

Each case runs one mistake and records ``(exception type name, message)`` (or ``("<accepted>", "")``
when nothing is raised). The cases that need a process group run in two calls to a 2-rank gloo pool
(`constructor_cases`, `runtime_cases`, in bad_input_cases.py); the test functions compare each case
with its expected text. This file: the constructors, policies and configs; test_bad_runtime_inputs.py:
unshard_params, no_sync, clipping, state_dict_type, forward methods and state dicts.
A case whose current behaviour falls short (internal error, silent acceptance, a message that names
the wrong argument) is listed in `KNOWN_GAPS` with the message it should have; its expectation pins
the current behaviour so that improving the library shows up here. docs/errors.md quotes this file.
"""

from __future__ import annotations

from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
from bad_input_cases import (
    KNOWN_GAPS,
    _Expect,
    _format,
    _lin,
    _outcome,
    _results,
    constructor_cases,
    runtime_cases,
)

from fsdp_composable import FullyShardedDataParallel, fully_shard


def test_known_gaps_are_cases(dist_run: Any) -> None:
    names = set(_results(dist_run, constructor_cases)) | set(_results(dist_run, runtime_cases))
    if torch.cuda.is_available():  # these cases only run without CUDA
        names |= {"fully_shard/device_id_int_without_cuda", "fully_shard/device_id_negative"}
    assert set(KNOWN_GAPS) <= names, sorted(set(KNOWN_GAPS) - names)


def test_no_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this test needs a process without a default process group")
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        _format(_outcome(lambda: fully_shard(_lin()))),
        """RuntimeError: fully_shard needs an initialised default process group: call torch.distributed.init_process_group('gloo' or 'nccl', ...) first (torchrun sets the environment for you)""",
    )
    tc.assertExpectedInline(
        _format(_outcome(lambda: FullyShardedDataParallel(_lin()))),
        """RuntimeError: fully_shard needs an initialised default process group: call torch.distributed.init_process_group('gloo' or 'nccl', ...) first (torchrun sets the environment for you)""",
    )


def test_fully_shard_arguments(dist_run: Any) -> None:
    """Every argument of `fully_shard`, the module itself, nesting and re-application."""
    expect = _Expect(_results(dist_run, constructor_cases), ("fully_shard/",))
    expect("fully_shard/module_str", """TypeError: fully_shard expects an nn.Module as its first argument, got str""")
    expect(
        "fully_shard/module_class", """TypeError: fully_shard expects an nn.Module as its first argument, got type"""
    )
    expect(
        "fully_shard/policy_int",
        """TypeError: fully_shard argument 'policy' must be None, ModuleWrapPolicy, SizeBasedPolicy, CustomPolicy or a callable(module) -> bool, got int""",
    )
    expect(
        "fully_shard/policy_set_of_classes",
        """TypeError: fully_shard argument 'policy' must be None, ModuleWrapPolicy, SizeBasedPolicy, CustomPolicy or a callable(module) -> bool, got set""",
    )
    expect(
        "fully_shard/policy_process_group_positional",
        """TypeError: fully_shard argument 'policy' must be None, ModuleWrapPolicy, SizeBasedPolicy, CustomPolicy or a callable(module) -> bool, got ProcessGroup""",
    )
    expect(
        "fully_shard/policy_module_class",
        """TypeError: fully_shard argument 'policy' is the module class Block; pass ModuleWrapPolicy({Block}) to make every Block a unit""",
    )
    expect(
        "fully_shard/policy_policy_class",
        """TypeError: fully_shard argument 'policy' is the class ModuleWrapPolicy, not an instance; pass ModuleWrapPolicy({MyBlock, ...})""",
    )
    expect(
        "fully_shard/policy_callable_returns_none",
        """TypeError: fully_shard argument 'policy' returned NoneType for module 'blocks.1.attn.out_proj'; return True or False (or use CustomPolicy for per-unit overrides)""",
    )
    expect(
        "fully_shard/policy_callable_returns_dict",
        """TypeError: fully_shard argument 'policy' returned a dict for module 'blocks.1'; per-unit overrides need CustomPolicy(fn), a plain callable must return True or False""",
    )
    expect(
        "fully_shard/policy_matches_nothing",
        """UserWarning: fully_shard: ModuleWrapPolicy({Conv2d}) matched no submodule of TinyGPT, so the whole module is one unit; check the classes""",
    )
    expect(
        "fully_shard/process_group_str",
        """TypeError: fully_shard argument 'process_group' must be a ProcessGroup, a DeviceMesh, a (shard_group, replicate_group) tuple or None, got str""",
    )
    expect(
        "fully_shard/process_group_int",
        """TypeError: fully_shard argument 'process_group' must be a ProcessGroup, a DeviceMesh, a (shard_group, replicate_group) tuple or None, got int""",
    )
    expect(
        "fully_shard/process_group_list",
        """TypeError: fully_shard argument 'process_group' must be a ProcessGroup, a DeviceMesh, a (shard_group, replicate_group) tuple or None, got list""",
    )
    expect(
        "fully_shard/process_group_pair_not_hybrid",
        """ValueError: a (shard, replicate) process_group or 2-D DeviceMesh is only for HYBRID_SHARD, not FULL_SHARD; pass one ProcessGroup""",
    )
    expect(
        "fully_shard/hybrid_without_replicate_group",
        """ValueError: ShardingStrategy.HYBRID_SHARD needs process_group=(shard_group, replicate_group) or a 2-D DeviceMesh (replicate, shard): say which ranks shard together and which replicate""",
    )
    expect(
        "fully_shard/hybrid_overlapping_groups",
        """ValueError: fully_shard argument 'process_group': for HYBRID_SHARD the shard group (ranks [0, 1]) and the replicate group (ranks [0, 1]) must have exactly one rank in common, this one; they share [0, 1]. Pass groups that cross at this rank, e.g. a 2-D DeviceMesh init_device_mesh(device_type, (num_replicas, shard_size)) laid out (replicate, shard)""",
    )
    expect(
        "fully_shard/process_group_3d_mesh",
        """ValueError: fully_shard argument 'process_group' must be a 1-D DeviceMesh (or a 2-D (replicate, shard) one for HYBRID_SHARD), got a 3-D DeviceMesh; slice or flatten it""",
    )
    expect(
        "fully_shard/process_group_2d_mesh_not_hybrid",
        """ValueError: a (shard, replicate) process_group or 2-D DeviceMesh is only for HYBRID_SHARD, not FULL_SHARD; pass one ProcessGroup""",
    )
    expect(
        "fully_shard/process_group_without_this_rank",
        """\
rank 0: ValueError: fully_shard argument 'process_group' does not contain this rank (0); call fully_shard only on the group's ranks
rank 1: ValueError: fully_shard argument 'process_group' does not contain this rank (1); call fully_shard only on the group's ranks""",
    )
    expect(
        "fully_shard/strategy_str",
        """TypeError: fully_shard argument 'strategy' must be a ShardingStrategy (e.g. ShardingStrategy.FULL_SHARD), got str: 'FULL_SHARD'""",
    )
    expect(
        "fully_shard/strategy_none",
        """TypeError: fully_shard argument 'strategy' must be a ShardingStrategy (e.g. ShardingStrategy.FULL_SHARD), got NoneType: None""",
    )
    expect(
        "fully_shard/strategy_torch_fsdp_enum",
        """ValueError: ShardingStrategy.HYBRID_SHARD needs process_group=(shard_group, replicate_group) or a 2-D DeviceMesh (replicate, shard): say which ranks shard together and which replicate""",
    )
    expect(
        "fully_shard/mixed_precision_dtype",
        """TypeError: fully_shard argument 'mixed_precision' must be a MixedPrecision or None, got dtype: torch.float16""",
    )
    expect(
        "fully_shard/mixed_precision_dict",
        """TypeError: fully_shard argument 'mixed_precision' must be a MixedPrecision or None, got dict: {'param_dtype': torch.float16}""",
    )
    expect(
        "fully_shard/mixed_precision_torch_fsdp",
        """ValueError: fully_shard argument 'mixed_precision': torch.distributed.fsdp.MixedPrecision(_module_classes_to_ignore=()) has no equivalent: every BatchNorm module (and only those) gets its own full-precision unit here; leave _module_classes_to_ignore at its default (a CustomPolicy can give other modules units with mixed_precision=None)""",
    )
    expect(
        "fully_shard/cpu_offload_bool",
        """TypeError: fully_shard argument 'cpu_offload' must be a CPUOffload or None, got bool: True""",
    )
    expect(
        "fully_shard/cpu_offload_torch_fsdp",
        """TypeError: CPUOffload.offload_params must be True or False, got int: 1""",
    )
    expect(
        "fully_shard/ignored_modules_single_module",
        """TypeError: fully_shard argument 'ignored_modules' must be an iterable of submodules (e.g. a list), got Linear""",
    )
    expect(
        "fully_shard/ignored_modules_contains_str",
        """TypeError: fully_shard argument 'ignored_modules' must contain nn.Module instances, got str""",
    )
    expect(
        "fully_shard/ignored_modules_contains_parameter",
        """TypeError: fully_shard argument 'ignored_modules' must contain nn.Module instances, got Parameter""",
    )
    expect(
        "fully_shard/ignored_modules_contains_root",
        """ValueError: fully_shard argument 'ignored_modules' cannot contain the module fully_shard is applied to""",
    )
    expect(
        "fully_shard/ignored_modules_not_submodule",
        """ValueError: fully_shard argument 'ignored_modules' contains a Linear that is not a submodule of the TinyGPT passed to fully_shard; pass only its submodules""",
    )
    expect(
        "fully_shard/device_id_str",
        """TypeError: fully_shard argument 'device_id' must be an int, a torch.device or None, got 'cpu'""",
    )
    expect(
        "fully_shard/device_id_float",
        """TypeError: fully_shard argument 'device_id' must be an int, a torch.device or None, got 0.0""",
    )
    if not torch.cuda.is_available():
        expect(
            "fully_shard/device_id_int_without_cuda",
            """ValueError: fully_shard argument 'device_id'=0 means cuda:0 but CUDA is not available; on CPU pass device_id=None or torch.device('cpu')""",
        )
        expect(
            "fully_shard/device_id_negative",
            """ValueError: fully_shard argument 'device_id' must be a CUDA device index >= 0 or a torch.device, got -1""",
        )
    expect(
        "fully_shard/device_id_meta",
        """ValueError: fully_shard argument 'device_id' must be a real device, got meta; to defer initialisation build the model on the meta device and pass param_init_fn""",
    )
    expect(
        "fully_shard/param_init_fn_str",
        """TypeError: fully_shard argument 'param_init_fn' must be a callable(module) or None, got 'reset'""",
    )
    expect(
        "fully_shard/meta_without_init_fn",
        """ValueError: unit '<root>' has parameters on the meta device and module '1' (_NoReset, parameter '1.w') has no reset_parameters(); pass param_init_fn= to fully_shard to materialise them""",
    )
    expect(
        "fully_shard/meta_init_fn_leaves_meta",
        """ValueError: parameter '0.weight' is still on the meta device after initialisation; check param_init_fn""",
    )
    expect(
        "fully_shard/meta_init_fn_no_argument",
        """TypeError: fully_shard argument 'param_init_fn' cannot be called with module '0' (Linear): it must take one argument, the module to materialise""",
    )
    expect(
        "fully_shard/sync_module_states_str",
        """TypeError: fully_shard argument 'sync_module_states' must be True or False, got str: 'yes'""",
    )
    expect(
        "fully_shard/sync_module_states_int",
        """TypeError: fully_shard argument 'sync_module_states' must be True or False, got int: 1""",
    )
    expect(
        "fully_shard/forward_prefetch_int",
        """TypeError: fully_shard argument 'forward_prefetch' must be True, False or None, got int: 1""",
    )
    expect(
        "fully_shard/limit_all_gathers_none",
        """TypeError: fully_shard argument 'limit_all_gathers' must be True or False, got NoneType: None""",
    )
    expect(
        "fully_shard/backward_prefetch_str",
        """TypeError: fully_shard argument 'backward_prefetch' must be a BackwardPrefetch or None, got str: 'BACKWARD_PRE'""",
    )
    expect(
        "fully_shard/unknown_keyword",
        """TypeError: fully_shard() got an unexpected keyword argument 'auto_wrap_policy'""",
    )
    expect(
        "fully_shard/applied_twice",
        """RuntimeError: fully_shard was already applied to this TinyGPT (directly or as a unit of a parent's policy); apply it once per module""",
    )
    expect(
        "fully_shard/child_after_parent",
        """RuntimeError: parameter 'ln1.weight' of this Block is already managed by fully_shard applied to a parent module. Apply fully_shard bottom-up: first to the children, then to the parent (or give the parent a policy)""",
    )
    expect(
        "fully_shard/policy_unit_child_after_parent",
        """RuntimeError: fully_shard was already applied to this Block (directly or as a unit of a parent's policy); apply it once per module""",
    )
    expect(
        "fully_shard/state_of_plain_module",
        """ValueError: fully_shard was not applied to this Linear; call fully_shard(module) first (APIs applied: none)""",
    )
    expect.done()


def test_wrapper_arguments(dist_run: Any) -> None:
    """Every argument of `FullyShardedDataParallel`."""
    expect = _Expect(_results(dist_run, constructor_cases), ("wrapper/",))
    expect("wrapper/module_str", """TypeError: FullyShardedDataParallel expects an nn.Module, got str""")
    expect(
        "wrapper/process_group_str",
        """TypeError: FullyShardedDataParallel argument 'process_group' must be a ProcessGroup, a DeviceMesh, a (shard_group, replicate_group) tuple or None, got str""",
    )
    expect(
        "wrapper/sharding_strategy_str",
        """TypeError: FullyShardedDataParallel argument 'sharding_strategy' must be a ShardingStrategy (e.g. ShardingStrategy.FULL_SHARD), got str: 'FULL_SHARD'""",
    )
    expect(
        "wrapper/cpu_offload_bool",
        """TypeError: FullyShardedDataParallel argument 'cpu_offload' must be a CPUOffload or None, got bool: True""",
    )
    expect(
        "wrapper/auto_wrap_policy_int",
        """TypeError: FullyShardedDataParallel argument 'auto_wrap_policy' must be None, ModuleWrapPolicy, SizeBasedPolicy, CustomPolicy or a callable(module) -> bool, got int""",
    )
    expect(
        "wrapper/backward_prefetch_str",
        """TypeError: FullyShardedDataParallel argument 'backward_prefetch' must be a BackwardPrefetch or None, got str: 'BACKWARD_POST'""",
    )
    expect(
        "wrapper/mixed_precision_dtype",
        """TypeError: FullyShardedDataParallel argument 'mixed_precision' must be a MixedPrecision or None, got dtype: torch.bfloat16""",
    )
    expect(
        "wrapper/ignored_modules_single_module",
        """TypeError: FullyShardedDataParallel argument 'ignored_modules' must be an iterable of submodules (e.g. a list), got Linear""",
    )
    expect(
        "wrapper/param_init_fn_int",
        """TypeError: FullyShardedDataParallel argument 'param_init_fn' must be a callable(module) or None, got 5""",
    )
    expect(
        "wrapper/device_id_str",
        """TypeError: FullyShardedDataParallel argument 'device_id' must be an int, a torch.device or None, got 'cpu'""",
    )
    expect(
        "wrapper/sync_module_states_str",
        """TypeError: FullyShardedDataParallel argument 'sync_module_states' must be True or False, got str: 'no'""",
    )
    expect(
        "wrapper/forward_prefetch_int",
        """TypeError: FullyShardedDataParallel argument 'forward_prefetch' must be True, False or None, got int: 0""",
    )
    expect(
        "wrapper/limit_all_gathers_none",
        """TypeError: FullyShardedDataParallel argument 'limit_all_gathers' must be True or False, got NoneType: None""",
    )
    expect(
        "wrapper/use_orig_params_str",
        """TypeError: FullyShardedDataParallel argument 'use_orig_params' must be True or False, got 'yes'""",
    )
    expect(
        "wrapper/device_mesh_str",
        """TypeError: FullyShardedDataParallel argument 'device_mesh' must be a DeviceMesh, got str""",
    )
    expect(
        "wrapper/device_mesh_and_process_group",
        """ValueError: FullyShardedDataParallel got both process_group and device_mesh; pass one (device_mesh=mesh['dp'] for data parallelism over one mesh dimension, e.g. next to tensor parallelism on mesh['tp'])""",
    )
    expect(
        "wrapper/applied_twice",
        """RuntimeError: fully_shard was already applied to this TinyGPT (directly or as a unit of a parent's policy); apply it once per module""",
    )
    expect.done()


def test_policies(dist_run: Any) -> None:
    """ModuleWrapPolicy, SizeBasedPolicy and CustomPolicy (bad return values, unknown override keys)."""
    expect = _Expect(_results(dist_run, constructor_cases), ("ModuleWrapPolicy/", "SizeBasedPolicy/", "CustomPolicy/"))
    expect(
        "ModuleWrapPolicy/single_class",
        """TypeError: ModuleWrapPolicy expects an iterable of nn.Module subclasses, got the class Block; write ModuleWrapPolicy({Block})""",
    )
    expect(
        "ModuleWrapPolicy/class_names", """TypeError: ModuleWrapPolicy expects nn.Module subclasses, got ['Block']"""
    )
    expect(
        "ModuleWrapPolicy/instances",
        """TypeError: ModuleWrapPolicy expects nn.Module subclasses, got [Linear(in_features=4, out_features=4, bias=True)]""",
    )
    expect(
        "ModuleWrapPolicy/empty",
        """ValueError: ModuleWrapPolicy needs at least one nn.Module subclass; pass policy=None to make the whole module one unit""",
    )
    expect("SizeBasedPolicy/zero", """ValueError: SizeBasedPolicy.min_num_params must be a positive int, got 0""")
    expect("SizeBasedPolicy/negative", """ValueError: SizeBasedPolicy.min_num_params must be a positive int, got -5""")
    expect("SizeBasedPolicy/float", """ValueError: SizeBasedPolicy.min_num_params must be a positive int, got 1.5""")
    expect("SizeBasedPolicy/str", """ValueError: SizeBasedPolicy.min_num_params must be a positive int, got '1000'""")
    expect(
        "CustomPolicy/not_callable",
        """TypeError: CustomPolicy expects a callable(module) returning a bool or a dict of per-unit overrides, got int""",
    )
    expect(
        "CustomPolicy/returns_none",
        """TypeError: CustomPolicy's function returned NoneType for module 'blocks.1.attn.out_proj'; return a bool or a dict of per-unit overrides""",
    )
    expect(
        "CustomPolicy/returns_int",
        """TypeError: CustomPolicy's function returned int for module 'blocks.1.attn.out_proj'; return a bool or a dict of per-unit overrides""",
    )
    expect(
        "CustomPolicy/unknown_override_key",
        """ValueError: CustomPolicy returned an unknown override 'reshard' for module 'blocks.1'; allowed keys: ['mixed_precision', 'strategy']""",
    )
    expect(
        "CustomPolicy/override_wrong_type",
        """TypeError: CustomPolicy override 'strategy' for module 'blocks.1' must be ShardingStrategy, got str""",
    )
    expect(
        "CustomPolicy/override_mixed_precision_dtype",
        """TypeError: CustomPolicy override 'mixed_precision' for module 'blocks.1' must be MixedPrecision or NoneType, got dtype""",
    )
    expect(
        "CustomPolicy/override_hybrid_without_groups",
        """ValueError: CustomPolicy override strategy=HYBRID_SHARD for module 'blocks.0' needs a replicate group: pass process_group=(shard_group, replicate_group) or a 2-D DeviceMesh to fully_shard""",
    )
    expect.done()


def test_configs(dist_run: Any) -> None:
    """MixedPrecision and CPUOffload fields."""
    expect = _Expect(_results(dist_run, constructor_cases), ("MixedPrecision/", "CPUOffload/"))
    expect(
        "MixedPrecision/param_dtype_int",
        """ValueError: MixedPrecision.param_dtype must be a floating-point torch.dtype or None, got torch.int32; use e.g. torch.bfloat16 or torch.float16""",
    )
    expect(
        "MixedPrecision/param_dtype_str",
        """ValueError: MixedPrecision.param_dtype must be a floating-point torch.dtype or None, got 'bfloat16'; use e.g. torch.bfloat16 or torch.float16""",
    )
    expect(
        "MixedPrecision/reduce_dtype_bool",
        """ValueError: MixedPrecision.reduce_dtype must be a floating-point torch.dtype or None, got torch.bool; use e.g. torch.bfloat16 or torch.float16""",
    )
    expect(
        "MixedPrecision/output_dtype_int",
        """ValueError: MixedPrecision.output_dtype must be a floating-point torch.dtype or None, got torch.int64; use e.g. torch.bfloat16 or torch.float16""",
    )
    expect(
        "MixedPrecision/buffer_dtype_python_float",
        """ValueError: MixedPrecision.buffer_dtype must be a floating-point torch.dtype or None, got <class 'float'>; use e.g. torch.bfloat16 or torch.float16""",
    )
    expect(
        "MixedPrecision/keep_low_precision_grads_str",
        """TypeError: MixedPrecision.keep_low_precision_grads must be True or False, got str: 'no'""",
    )
    expect(
        "MixedPrecision/cast_forward_inputs_none",
        """TypeError: MixedPrecision.cast_forward_inputs must be True or False, got NoneType: None""",
    )
    expect(
        "MixedPrecision/cast_root_forward_inputs_int",
        """TypeError: MixedPrecision.cast_root_forward_inputs must be True or False, got int: 0""",
    )
    expect(
        "CPUOffload/offload_params_str", """TypeError: CPUOffload.offload_params must be True or False, got str: 'no'"""
    )
    expect.done()
