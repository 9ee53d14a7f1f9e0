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
they are patched so that ``meta`` is this world's compute device. Each check runs in isolation and
its outcome ("ok" or the error) is printed as one JSON object on the last line.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import Block, TinyGPT, gpt_loss  # noqa: E402

import fsdp_composable as fc  # noqa: E402
from fsdp_composable import _collectives, _init_utils  # noqa: E402

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
    assert _collectives.comm_device(dist.group.WORLD) == META
    _collectives.host_values = _host_values  # type: ignore[assignment]
    dist.all_gather_object = _all_gather_object  # type: ignore[assignment]
    dist.broadcast_object_list = _broadcast_object_list  # type: ignore[assignment]
    _init_utils._check_device_id = lambda api, device_id: device_id  # type: ignore[assignment]
    _init_utils._meta_modules = lambda unit_module: []  # type: ignore[assignment]
    _init_utils._check_unit_params = lambda sub: None  # type: ignore[assignment]


def model(**kwargs: Any) -> torch.nn.Module:
    with torch.device(META):
        torch.manual_seed(0)
        m = TinyGPT()
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


CHECKS: list[Callable[[], None]] = [
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
]


def main() -> None:
    setup()
    wanted = set(sys.argv[1:])
    results: dict[str, str] = {}
    for check in CHECKS:
        if wanted and check.__name__ not in wanted:
            continue
        try:
            with contextlib.redirect_stdout(sys.stderr):
                check()
            results[check.__name__] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the test
            traceback.print_exc()
            results[check.__name__] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(json.dumps(results))


if __name__ == "__main__":
    main()
