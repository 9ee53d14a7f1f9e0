"""A world whose process group serves only the ``meta`` device: the device audit of the CUDA path.

Run as a script (``python device_audit_world.py``) by ``test_device_paths.py``. NCCL serves CUDA
tensors only; here a backend registered for ``meta`` alone (torch's fake process group, which moves
no data) plays its part, and the model lives on ``meta``. Any collective of ours handed a tensor on
another device (a bare ``torch.tensor(...)`` on the CPU) fails exactly as on NCCL ("No backend type
associated with device type cpu"), while the model's own tensors pass. Meta tensors carry shapes
only, so the one place where the library reads a collective's result on the host
(`_collectives.host_values`) is stubbed to give zeros of the right shape (every rank agreeing), and
torch's object collectives (which choose the group's device themselves) return this rank's objects.

Three init functions treat ``meta`` as "not materialised yet" (a real concern for real devices);
they are patched so that ``meta`` is this world's compute device, and cannot be otherwise: for the
library a meta parameter means deferred initialisation (`_meta_modules` would materialise it on the
current device, the CPU here, and `_check_unit_params` refuses one left on meta), and
``device_id=meta`` is refused by `_check_device_id` as the user's mistake it is. Meta has no device
index either. So the construction path with a real device id (``device_id=torch.device("cuda")`` is
the current device, with its index) is pinned elsewhere, with two fake CUDA devices that hold data on
the CPU: tests/test_device_id_index.py (`_check_device_id` unpatched, the whole of ``fully_shard``).
Each check runs in isolation and its outcome ("ok" or the error) is printed as one JSON object on
the last line.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import Block, TinyGPT, gpt_loss  # noqa: E402
from reduction_copies import reduction_copies  # noqa: E402
from stream_recorder import check_streams, recording, storage_key  # noqa: E402

import fsdp_composable as fc  # noqa: E402
from fsdp_composable._comm import _collectives  # noqa: E402
from fsdp_composable._init import _init_utils  # noqa: E402

WORLD = 4
META = torch.device("meta")


def _host_values(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_meta:  # shapes only: every rank "agrees"
        return torch.zeros(tensor.shape, dtype=tensor.dtype)
    return tensor.detach().cpu()


def _all_gather_object(output: list[Any], obj: Any, group: Any = None) -> None:
    # torch's own object collectives pick the group's device themselves (correct on NCCL) but read
    # sizes with .item(), which meta tensors cannot answer: every rank "sends" this rank's object
    output[:] = [obj] * len(output)


def _broadcast_object_list(objects: list[Any], src: Any = None, group: Any = None, **kwargs: Any) -> None:
    pass  # rank 0's objects are this rank's


def setup() -> None:
    dist.Backend.register_backend(
        "auditmeta",
        lambda store, rank, size, timeout: FakeProcessGroup._create_internal(rank, size),
        devices=["meta"],
    )
    dist.init_process_group("auditmeta", store=FakeStore(), rank=0, world_size=WORLD)
    # the CPU companion groups of the presence flags ([Note: presence flags agreed on the host]): gloo
    # cannot meet fake peers, so torch's default CPU backend is a fake one here (its sums are this rank's)
    dist.Backend.register_backend(
        "auditcpu",
        lambda store, rank, size, timeout: FakeProcessGroup._create_internal(rank, size),
        devices=["cpu"],
    )
    dist.Backend.default_device_backend_map["cpu"] = "auditcpu"
    assert _collectives.comm_device(dist.group.WORLD) == META
    _collectives.host_values = _host_values  # type: ignore[assignment]
    dist.all_gather_object = _all_gather_object  # type: ignore[assignment]
    dist.broadcast_object_list = _broadcast_object_list  # type: ignore[assignment]
    _init_utils._check_device_id = lambda api, device_id: device_id  # type: ignore[assignment]
    _init_utils._meta_modules = lambda unit_module: []  # type: ignore[assignment]
    _init_utils._check_unit_params = lambda sub: None  # type: ignore[assignment]
    # DTensor's sharding propagation asks the mesh's device module how many devices a host has (as
    # torch.cuda answers); ``meta`` has no module, so the optimizer's DTensor math needs this one
    torch.meta = SimpleNamespace(device_count=lambda: WORLD)  # type: ignore[attr-defined]


def model(unused: bool = False, **kwargs: Any) -> torch.nn.Module:
    """TinyGPT on ``meta``, sharded by block; ``unused``: each unit holds a Linear the forward never
    uses (no gradient on any rank)."""
    with torch.device(META):
        torch.manual_seed(0)
        m = TinyGPT()
        if unused:
            m.unused = torch.nn.Linear(2, 2)
            for block in m.blocks:
                block.unused = torch.nn.Linear(2, 2)
    kwargs.setdefault("device_id", META)
    return fc.fully_shard(m, fc.ModuleWrapPolicy({Block}), **kwargs)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(4, 8, dtype=torch.long, device=META), torch.zeros(4, 8, dtype=torch.long, device=META)


def steps(m: torch.nn.Module, n: int = 2, clip: bool = False) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(n):
        gpt_loss(m, batch()).backward()
        if clip:
            fc.clip_grad_norm_(m, 1.0)
        opt.step()
        opt.zero_grad()
    return opt


# ---------------------------------------------------------------------------- checks
def training_full_shard() -> None:
    steps(model())  # the first step runs the order check; the second the steady state


def training_strategies() -> None:
    for strategy in (fc.ShardingStrategy.SHARD_GRAD_OP, fc.ShardingStrategy.NO_SHARD):
        steps(model(strategy=strategy))
    mp = fc.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    steps(model(mixed_precision=mp))


def training_hybrid() -> None:
    shard = dist.new_group([0, 1])
    replicate = dist.new_group([0, 2])
    steps(model(process_group=(shard, replicate), strategy=fc.ShardingStrategy.HYBRID_SHARD))


def no_sync_then_sync() -> None:
    m = model()
    with fc.no_sync(m):
        gpt_loss(m, batch()).backward()
    gpt_loss(m, batch()).backward()


def clip_ours() -> None:
    steps(model(), clip=True)


def clip_torch() -> None:
    m = model()
    gpt_loss(m, batch()).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)


def sync_module_states() -> None:
    steps(model(sync_module_states=True), n=1)


def reset_after_sharding() -> None:
    m = model()
    steps(m, n=1)
    m.blocks[0].fc1.reset_parameters()
    m.head.reset_parameters()


def unshard_params() -> None:
    m = model()
    steps(m, n=1)
    with fc.unshard_params(m):
        pass
    with fc.unshard_params(m, rank0_only=True, writeback=False):
        pass


def state_dict(kind: str) -> Callable[[], None]:
    def run() -> None:
        m = model()
        steps(m, n=1)
        with fc.state_dict_type(m, fc.StateDictType[kind]):
            sd = m.state_dict()
            m.load_state_dict(sd)

    run.__name__ = f"state_dict_{kind.lower()}"
    return run


def optim_state() -> None:
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    gpt_loss(m, batch()).backward()
    opt.step()
    osd = fc.optim_state_dict(m, opt)
    fc.optim_state_dict_to_load(m, opt, osd)


def streams_full_shard() -> None:
    m = model()
    with recording() as rec:
        steps(m, n=3)
    check_streams(rec, 3)


def streams_prefetch_and_mixed_precision() -> None:
    mp = fc.MixedPrecision(param_dtype=torch.bfloat16)
    m = model(forward_prefetch=True, backward_prefetch=fc.BackwardPrefetch.BACKWARD_POST, mixed_precision=mp)
    with recording() as rec:
        steps(m, n=3)
    check_streams(rec, 3)


def streams_hybrid() -> None:
    shard = dist.new_group([0, 1])
    replicate = dist.new_group([0, 2])
    m = model(process_group=(shard, replicate), strategy=fc.ShardingStrategy.HYBRID_SHARD)
    with recording() as rec:
        steps(m, n=2)
    check_streams(rec, 2)
    assert "all_reduce" in rec.compute.clock, "the all-reduce across replicas did not run on its own stream"
    # each reduce-scatter's input (a unit's unsharded gradient) goes once the reduce-scatter is done
    held = rec.held_at_commit
    assert held == [0, 0], f"reduce-scatter input bytes alive at the end of backward: {held}"


def streams_no_sync() -> None:
    m = model()
    with recording() as rec:
        with fc.no_sync(m):
            gpt_loss(m, batch()).backward()
        gpt_loss(m, batch()).backward()
    check_streams(rec, 2)


def streams_memory_between_steps() -> None:
    """Between steps (after a step, unshard_params, a failed forward) no unit keeps its unsharded
    storage: what a reshard deferred on CUDA is freed, after the unshard stream waited for it."""
    m = model()

    def held(when: str) -> None:
        kept = [
            h.unit_fqn or "<root>"
            for h in fc.fully_shard.state(m).handles
            if h._unsharded is not None and h._unsharded.untyped_storage().size()
        ]
        assert not kept, f"{when}: units still hold unsharded storage: {kept}"

    def fail(module: Any, args: Any, output: Any) -> None:
        raise RuntimeError("a failing forward")

    with recording() as rec:
        steps(m, n=2)
        held("after a step")
        with fc.unshard_params(m):
            pass
        held("after unshard_params")
        hook = m.blocks[1].register_forward_hook(fail)
        try:
            m(batch()[0])
        except RuntimeError:
            pass
        hook.remove()
        held("after a failed forward")
        steps(m, n=1)
    check_streams(rec, 4)


def streams_unit_called_alone() -> None:
    """A unit called outside the root's forward (after an optimizer step) orders its all-gather
    after the compute stream too: no root pre-forward did."""
    m = model()
    with recording() as rec:
        steps(m, n=1)
        with torch.no_grad():
            m.blocks[0](torch.zeros(4, 8, 16, device=META))
    check_streams(rec, 2)


def streams_all_reduce_hook_and_post_optim_event() -> None:
    """HYBRID_SHARD: the all-reduce hook runs on the all-reduce stream, once per unit per step; a
    post-optimizer event replaces the unshard stream's wait for the compute stream in the next root
    forward (so compute issued after the event is not waited for)."""
    shard = dist.new_group([0, 1])
    replicate = dist.new_group([0, 2])
    m = model(process_group=(shard, replicate), strategy=fc.ShardingStrategy.HYBRID_SHARD)
    ran_on: list[str] = []
    with recording() as rec:
        fc.set_all_reduce_hook(m, lambda grad: ran_on.append(rec.current.name), recurse=True)
        opt = steps(m, n=1)
        event = torch.cuda.Event()
        event.record(rec.compute)
        fc.set_post_optim_event(m, event)
        torch.zeros(3, device=META).add_(1)  # unrelated compute after the optimizer step
        steps(m, n=1)
        opt.step()
    check_streams(rec, 1)  # the second root forward waited for the event instead
    units = len(fc.fully_shard.state(m).handles)
    assert ran_on == ["all_reduce"] * (2 * units), ran_on


def streams_strategies_and_hooks() -> None:
    """The stream rules hold for SHARD_GRAD_OP, NO_SHARD, an int ``reshard_after_forward`` (gathering
    within a smaller group after forward) and a user's communication hook, as for FULL_SHARD."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    runs: list[tuple[str, dict[str, Any]]] = [
        ("SHARD_GRAD_OP", {"strategy": fc.ShardingStrategy.SHARD_GRAD_OP}),
        ("NO_SHARD", {"strategy": fc.ShardingStrategy.NO_SHARD}),
        ("reshard_after_forward=2", {"reshard_after_forward": 2}),
        ("comm hook", {}),
    ]
    for name, kwargs in runs:
        m = model(**kwargs)
        if name == "comm hook":
            fc.register_comm_hook(m, default_hooks.DefaultState(dist.group.WORLD), default_hooks.reduce_scatter_hook)
        with recording() as rec:
            steps(m, n=2)
        try:
            check_streams(rec, 2)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def hook_offload_copy_on_the_stream() -> None:
    """CPU offload with a communication hook: each unit's hooked gradient starts its copy to the host
    on the stream that ran the hook, during backward, as without a hook (not a blocking copy per unit
    when the gradient is committed). (`offload_copy`, whose pinned copy needs a real host shard, hands
    back a stand-in.)"""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    from fsdp_composable._grads import _reduce_utils

    m = model()
    fc.register_comm_hook(m, default_hooks.DefaultState(dist.group.WORLD), default_hooks.reduce_scatter_hook)
    copies: list[tuple[str, bool]] = []
    real = _reduce_utils.offload_copy
    with recording() as rec:
        steps(m, n=1)

        def stand_in(handle: Any, reduced: torch.Tensor) -> torch.Tensor:
            copies.append((rec.current.name, torch._C._current_graph_task_id() != -1))
            return torch.empty_like(reduced, dtype=handle.dtype)

        _reduce_utils.offload_copy = stand_in  # type: ignore[assignment]
        try:
            gpt_loss(m, batch()).backward()
        finally:
            _reduce_utils.offload_copy = real  # type: ignore[assignment]
    units = len(fc.fully_shard.state(m).handles)
    assert copies == [("reduce", True)] * units, copies


def no_host_sync_in_steady_state() -> None:
    m = model()
    steps(m, n=1)  # the first iteration checks the order across ranks (reading values on the host)
    with recording() as rec:
        steps(m, n=2)
    assert rec.host_syncs == 0, f"{rec.host_syncs} host synchronisations in two steady-state steps"


class SelfCopies(TorchDispatchMode):
    """Counts ``copy_`` calls whose source is the destination's own memory."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if (
                isinstance(src, torch.Tensor)
                and storage_key(dst) == storage_key(src)
                and dst.storage_offset() == src.storage_offset()
                and dst.shape == src.shape
            ):
                self.count += 1
        return func(*args, **(kwargs or {}))


def no_self_copies() -> None:
    """Gradients land in the flat buffer's views (FLAT, the path of NCCL and every backend but gloo's
    point-to-point exchange): none is copied onto itself before the reduction."""
    for strategy in (fc.ShardingStrategy.FULL_SHARD, fc.ShardingStrategy.NO_SHARD):
        m = model(strategy=strategy)
        steps(m, n=1)
        with SelfCopies() as mode:
            steps(m, n=2)
        assert mode.count == 0, f"{strategy.name}: {mode.count} gradients copied onto themselves in two steps"


def no_unit_sized_copy_for_the_flags() -> None:
    """The reductions on native collectives take the flat gradient buffer as it is: no copy of a
    unit's gradient carries the presence flags (a reduce-scatter's flags go by their own all-reduce,
    NO_SHARD's ride after the gradient in its buffer)."""
    shard = dist.new_group([0, 1])
    replicate = dist.new_group([0, 2])
    for strategy in (fc.ShardingStrategy.FULL_SHARD, fc.ShardingStrategy.NO_SHARD, fc.ShardingStrategy.HYBRID_SHARD):
        group = (shard, replicate) if strategy is fc.ShardingStrategy.HYBRID_SHARD else None
        m = model(strategy=strategy, process_group=group)
        steps(m, n=1)
        with reduction_copies() as seen:
            steps(m, n=1)
        assert seen.collectives and not seen.copies, f"{strategy.name}: {seen.copies}"


def no_device_collective_for_the_flags() -> None:
    """Off the CPU the host sums the presence flags ([Note: presence flags agreed on the host]): a
    reduction issues its reduce-scatter (and HYBRID_SHARD's all-reduce of that shard across replicas)
    and no device all-reduce of the flags, which nothing would read."""
    shard = dist.new_group([0, 1])
    replicate = dist.new_group([0, 2])
    for strategy in (fc.ShardingStrategy.FULL_SHARD, fc.ShardingStrategy.HYBRID_SHARD):
        group = (shard, replicate) if strategy is fc.ShardingStrategy.HYBRID_SHARD else None
        m = model(strategy=strategy, process_group=group)
        steps(m, n=1)
        with reduction_copies() as seen:
            steps(m, n=1)
        scattered = {c.split()[1] for c in seen.collectives if c.startswith("reduce_scatter")}
        others = [c for c in seen.collectives if not c.startswith("reduce_scatter")]
        if strategy is fc.ShardingStrategy.FULL_SHARD:
            assert scattered and not others, f"{strategy.name}: {seen.collectives}"
        else:  # the replicas' all-reduce takes the reduce-scatter's output, nothing more
            assert others and all(c.split()[1] in scattered for c in others), f"{strategy.name}: {seen.collectives}"


def cpu_inputs_moved() -> None:
    """The root pre-forward moves the batch (integer token ids here) to the compute device."""
    m = model()
    seen: list[torch.device] = []
    m.tok.register_forward_pre_hook(lambda module, args: seen.append(args[0].device))
    idx, target = torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)
    gpt_loss(m, (idx, target.to(META))).backward()
    assert seen == [META], f"the embedding got its token ids on {seen}"


def model_on_a_device_the_group_does_not_serve() -> str:
    """A model left on the CPU with a group that serves another device: a clear error, before any
    collective, naming the fix."""
    torch.manual_seed(0)
    try:
        fc.fully_shard(TinyGPT(), fc.ModuleWrapPolicy({Block}))
    except ValueError as e:
        return str(e)
    return "no error"


def no_host_sync_for_parameters_without_gradient() -> None:
    """A parameter that gets no gradient on this rank (an unused branch, an MoE expert): its presence
    flag is written on the device (no host value copied there), and whether it got one on some rank
    is agreed on the host (a CPU group's sum of every rank's flags): no host read of the device, ever.
    (The fake peers of this world add nothing to the sum: the parameter's ``.grad`` stays None.)"""
    hybrid = (dist.new_group([0, 1]), dist.new_group([0, 2]))
    for strategy in (fc.ShardingStrategy.FULL_SHARD, fc.ShardingStrategy.NO_SHARD, fc.ShardingStrategy.HYBRID_SHARD):
        group = hybrid if strategy is fc.ShardingStrategy.HYBRID_SHARD else None
        m = model(strategy=strategy, unused=True, process_group=group)
        steps(m, n=1)
        with recording() as rec:
            syncs = []
            for _ in range(2):
                before = rec.host_syncs
                steps(m, n=1)
                syncs.append(rec.host_syncs - before)
        assert not rec.host_writes, f"{strategy.name}: host values written to the device: {rec.host_writes}"
        assert syncs == [0, 0], f"{strategy.name}: host synchronisations per step: {syncs}"
        assert all(p.grad is None for p in m.blocks[0].unused.parameters())


CHECKS: list[Callable[[], Any]] = [
    training_full_shard,
    training_strategies,
    training_hybrid,
    no_sync_then_sync,
    clip_ours,
    clip_torch,
    sync_module_states,
    reset_after_sharding,
    unshard_params,
    state_dict("FULL_STATE_DICT"),
    state_dict("SHARDED_STATE_DICT"),
    state_dict("LOCAL_STATE_DICT"),
    optim_state,
    streams_full_shard,
    streams_prefetch_and_mixed_precision,
    streams_hybrid,
    streams_no_sync,
    streams_memory_between_steps,
    streams_unit_called_alone,
    streams_all_reduce_hook_and_post_optim_event,
    streams_strategies_and_hooks,
    hook_offload_copy_on_the_stream,
    no_host_sync_in_steady_state,
    no_self_copies,
    no_unit_sized_copy_for_the_flags,
    no_device_collective_for_the_flags,
    cpu_inputs_moved,
    no_host_sync_for_parameters_without_gradient,
    model_on_a_device_the_group_does_not_serve,
]


def main() -> None:
    setup()
    # what the imports made lives as long as the process: the recorder's gc.collect() at every
    # gradient commit then walks only what the checks make (a tenth of a second less each)
    gc.freeze()
    wanted = set(sys.argv[1:])
    results: dict[str, str] = {}
    for check in CHECKS:
        if wanted and check.__name__ not in wanted:
            continue
        try:
            with contextlib.redirect_stdout(sys.stderr):
                value = check()
            results[check.__name__] = "ok" if value is None else value
        except Exception as e:  # noqa: BLE001 - reported to the test
            traceback.print_exc()
            results[check.__name__] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(json.dumps(results))


if __name__ == "__main__":
    main()
