# ruff: noqa: E501
"""Every bad input at run time gets a named exception: unshard_params, no_sync and clipping,
state_dict_type and forward methods, and state dicts (the cases: `runtime_cases` in bad_input_cases.py;
the constructors, policies and configs: test_bad_inputs.py). docs/errors.md quotes this file."""

from __future__ import annotations

from typing import Any

from bad_input_cases import _Expect, _results, runtime_cases


def test_unshard_params_no_sync_clip(dist_run: Any) -> None:
    """unshard_params (including forward inside it), no_sync and clip_grad_norm_."""
    expect = _Expect(_results(dist_run, runtime_cases), ("unshard_params/", "no_sync/", "clip_grad_norm_/"))
    expect(
        "unshard_params/forward_inside",
        """RuntimeError: forward of TinyGPT was called inside unshard_params(); leave the unshard_params context before running forward""",
    )
    expect(
        "unshard_params/nested",
        """RuntimeError: unshard_params cannot be used while fully_shard(TinyGPT) is in SUMMON_FULL_PARAMS: call it outside forward/backward (and not nested in itself)""",
    )
    expect(
        "unshard_params/inside_forward",
        """RuntimeError: unshard_params cannot be used while fully_shard(Sequential) is in FORWARD_BACKWARD: call it outside forward/backward (and not nested in itself)""",
    )
    expect(
        "unshard_params/writeback_and_rank0_only",
        """ValueError: unshard_params(writeback=True, rank0_only=True) is not supported: the other ranks would not see rank 0's writes. Pass writeback=False, or rank0_only=False""",
    )
    expect(
        "unshard_params/plain_module",
        """ValueError: unshard_params: no fully_shard state on this TinyGPT or its submodules; call fully_shard(module) first""",
    )
    expect(
        "unshard_params/non_unit_submodule_no_recurse",
        """ValueError: unshard_params: this Linear is not a fully_shard root or unit (its parameters belong to an enclosing unit); call it on the module fully_shard was applied to""",
    )
    expect(
        "unshard_params/parameters_instead_of_module",
        """TypeError: unshard_params argument 'module' must be the nn.Module fully_shard was applied to, got generator""",
    )
    expect(
        "unshard_params/writeback_str",
        """TypeError: unshard_params argument 'writeback' must be True or False, got str: 'no'""",
    )
    expect(
        "unshard_params/recurse_str",
        """TypeError: unshard_params argument 'recurse' must be True or False, got str: 'no'""",
    )
    expect(
        "unshard_params/rank0_only_str",
        """TypeError: unshard_params argument 'rank0_only' must be True or False, got str: 'no'""",
    )
    expect(
        "unshard_params/offload_to_cpu_str",
        """TypeError: unshard_params argument 'offload_to_cpu' must be True or False, got str: 'no'""",
    )
    expect(
        "unshard_params/with_grads_str",
        """TypeError: unshard_params argument 'with_grads' must be True or False, got str: 'no'""",
    )
    expect(
        "no_sync/plain_module",
        """ValueError: no_sync: no fully_shard state on this TinyGPT; call fully_shard(module) first""",
    )
    expect(
        "no_sync/optimizer_instead_of_module",
        """TypeError: no_sync argument 'module' must be the nn.Module fully_shard was applied to, got SGD""",
    )
    expect(
        "no_sync/inside_forward", """RuntimeError: no_sync must be entered between steps, not during forward/backward"""
    )
    expect(
        "no_sync/non_root_unit",
        """ValueError: no_sync must be called on the fully_shard root (TinyGPT), not on its unit 'blocks.0': it must skip the reduction of every unit""",
    )
    expect(
        "no_sync/nested_non_root_after_forward",
        """ValueError: no_sync must be called on the fully_shard root (TinyGPT), not on its unit 'blocks.0': it must skip the reduction of every unit""",
    )
    expect(
        "clip_grad_norm_/plain_module",
        """ValueError: clip_grad_norm_: no fully_shard state on this TinyGPT; call fully_shard(module) first""",
    )
    expect(
        "clip_grad_norm_/parameters_instead_of_module",
        """TypeError: clip_grad_norm_ argument 'module' must be the nn.Module fully_shard was applied to (not its parameters, unlike torch.nn.utils.clip_grad_norm_), got generator""",
    )
    expect(
        "clip_grad_norm_/max_norm_negative",
        """ValueError: clip_grad_norm_: max_norm must be a finite non-negative number, got -1.0""",
    )
    expect(
        "clip_grad_norm_/max_norm_str",
        """ValueError: clip_grad_norm_: max_norm must be a finite non-negative number, got '1.0'""",
    )
    expect(
        "clip_grad_norm_/max_norm_nan",
        """ValueError: clip_grad_norm_: max_norm must be a finite non-negative number, got nan""",
    )
    expect(
        "clip_grad_norm_/norm_type_zero",
        """ValueError: clip_grad_norm_: norm_type must be a positive number or inf, got int: 0""",
    )
    expect(
        "clip_grad_norm_/norm_type_str",
        """ValueError: clip_grad_norm_: norm_type must be a positive number or inf, got str: 'fro'""",
    )
    expect(
        "clip_grad_norm_/non_root_unit",
        """ValueError: clip_grad_norm_ must be called on the fully_shard root (TinyGPT), not on its unit 'blocks.0': the norm covers every unit""",
    )
    expect.done()


def test_state_dict_type_and_forward_methods(dist_run: Any) -> None:
    """state_dict_type and register_fsdp_forward_method."""
    expect = _Expect(_results(dist_run, runtime_cases), ("state_dict_type/", "register_fsdp_forward_method/"))
    expect(
        "state_dict_type/module_str", """TypeError: state_dict_type argument 'module' must be an nn.Module, got str"""
    )
    expect(
        "state_dict_type/type_str",
        """TypeError: state_dict_type argument 'state_dict_type' must be a StateDictType (e.g. StateDictType.SHARDED_STATE_DICT), got str: 'SHARDED_STATE_DICT'""",
    )
    expect(
        "state_dict_type/type_torch_fsdp",
        """TypeError: state_dict_type argument 'config' must be a ShardedStateDictConfig or None for StateDictType.SHARDED_STATE_DICT, got FullStateDictConfig""",
    )
    expect(
        "state_dict_type/config_for_other_type",
        """TypeError: state_dict_type argument 'config' must be a ShardedStateDictConfig or None for StateDictType.SHARDED_STATE_DICT, got FullStateDictConfig""",
    )
    expect(
        "state_dict_type/config_torch_fsdp",
        """TypeError: state_dict_type argument 'config' must be a FullStateDictConfig or None for StateDictType.FULL_STATE_DICT, got FullOptimStateDictConfig""",
    )
    expect(
        "state_dict_type/plain_module",
        """ValueError: state_dict_type: no fully_shard state on this TinyGPT or its submodules; call fully_shard(module) first""",
    )
    expect(
        "register_fsdp_forward_method/plain_module",
        """ValueError: register_fsdp_forward_method: call fully_shard on this _Generator before registering 'generate'""",
    )
    expect(
        "register_fsdp_forward_method/missing_method",
        """ValueError: register_fsdp_forward_method: _Generator has no method 'generat'""",
    )
    expect(
        "register_fsdp_forward_method/attribute_not_method",
        """ValueError: register_fsdp_forward_method: _Generator has no method 'training'""",
    )
    expect(
        "register_fsdp_forward_method/name_not_str",
        """TypeError: register_fsdp_forward_method argument 'method_name' must be a str, got int: 5""",
    )
    expect(
        "register_fsdp_forward_method/non_unit_submodule",
        """ValueError: register_fsdp_forward_method: this Linear is not a fully_shard root or unit; register the method on the module fully_shard was applied to (or make this module a unit with the policy)""",
    )
    expect(
        "register_fsdp_forward_method/forward",
        """ValueError: register_fsdp_forward_method: 'forward' already runs fully_shard's hooks; register only other methods (e.g. 'generate')""",
    )
    expect.done()


def test_state_dicts(dist_run: Any) -> None:
    """Loading state dicts with missing, unexpected and mis-shaped keys (FULL, SHARDED, LOCAL)."""
    expect = _Expect(
        _results(dist_run, runtime_cases), ("full_state_dict/", "sharded_state_dict/", "local_state_dict/")
    )
    expect(
        "full_state_dict/missing_key",
        """\
RuntimeError: Error(s) in loading state_dict for TinyGPT:
    Missing key(s) in state_dict: "blocks.0.fc1.weight".
    fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",
    )
    expect(
        "full_state_dict/unexpected_key",
        """\
RuntimeError: Error(s) in loading state_dict for TinyGPT:
    Unexpected key(s) in state_dict: "extra".
    fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",
    )
    expect(
        "full_state_dict/wrong_shape",
        """\
RuntimeError: Error(s) in loading state_dict for TinyGPT:
    size mismatch for blocks.1.fc2.weight: copying a param with shape torch.Size([3, 3]) from checkpoint, the shape in current model is torch.Size([16, 64]).
    fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",
    )
    expect(
        "full_state_dict/wrong_shape_root_unit",
        """\
RuntimeError: Error(s) in loading state_dict for TinyGPT:
    size mismatch for pos: copying a param with shape torch.Size([2]) from checkpoint, the shape in current model is torch.Size([8, 16]).
    fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",
    )
    expect(
        "full_state_dict/not_a_tensor",
        """\
RuntimeError: Error(s) in loading state_dict for TinyGPT:
    While copying the parameter named "head.weight", expected torch.Tensor or Tensor-like object from checkpoint but received <class 'list'>
    fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",
    )
    expect(
        "sharded_state_dict/missing_key",
        """\
RuntimeError: Error(s) in loading state_dict for TinyGPT:
    Missing key(s) in state_dict: "blocks.0.fc1.weight".
    fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",
    )
    expect(
        "sharded_state_dict/unexpected_key",
        """\
RuntimeError: Error(s) in loading state_dict for TinyGPT:
    Unexpected key(s) in state_dict: "blocks.0.extra".
    fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",
    )
    expect(
        "sharded_state_dict/wrong_shape_plain_tensor",
        """\
RuntimeError: Error(s) in loading state_dict for TinyGPT:
    size mismatch for blocks.1.fc2.weight: copying a param with shape torch.Size([3, 3]) from checkpoint, the shape in current model is torch.Size([16, 64]).
    fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",
    )
    expect(
        "sharded_state_dict/wrong_shape_dtensor",
        """\
RuntimeError: Error(s) in loading state_dict for TinyGPT:
    size mismatch for blocks.0.fc1.weight: copying a param with shape torch.Size([3, 3]) from checkpoint, the shape in current model is torch.Size([64, 16]).
    fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",
    )
    expect(
        "local_state_dict/other_layout",
        """\
rank 0: RuntimeError: Error(s) in loading state_dict for TinyGPT:
    LOCAL_STATE_DICT layout mismatch for unit 'blocks.0' (key blocks.0._flat_param): the checkpoint was saved with rank=0, world_size=4, padded_numel=3216, 10 parameters, this model has rank=0, world_size=2, padded_numel=3216, 10 parameters. A local state dict only loads at the same rank, world size and policy; use SHARDED_STATE_DICT to change them.
rank 1: RuntimeError: Error(s) in loading state_dict for TinyGPT:
    LOCAL_STATE_DICT layout mismatch for unit 'blocks.0' (key blocks.0._flat_param): the checkpoint was saved with rank=1, world_size=4, padded_numel=3216, 10 parameters, this model has rank=1, world_size=2, padded_numel=3216, 10 parameters. A local state dict only loads at the same rank, world size and policy; use SHARDED_STATE_DICT to change them.""",
    )
    expect(
        "local_state_dict/wrong_shape",
        """\
RuntimeError: Error(s) in loading state_dict for TinyGPT:
    size mismatch for blocks.0._flat_param of unit 'blocks.0': expected a flat shard of shape (1608,), got torch.Size([3]).""",
    )
    expect.done()
