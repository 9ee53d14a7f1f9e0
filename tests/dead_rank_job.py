"""A 2-rank job in which rank 1 dies in the middle of its second step (run by test_reliability).

``dead_rank_job.py state_dict``: rank 1 is SIGKILLed inside ``state_dict()`` instead;
``dead_rank_job.py optim_state_dict``: inside ``optim_state_dict()``, after the first unit's gather;
``dead_rank_job.py optim_state_dict_check``: inside ``optim_state_dict()``, in its first exchange (the
check that every rank holds the same state), after the ranks agreed on it."""

from __future__ import annotations

import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import Block, TinyGPT, gpt_batch, gpt_loss  # noqa: E402

from fsdp_composable import ModuleWrapPolicy, fully_shard, optim_state_dict  # noqa: E402
from fsdp_composable._state import _optim_convert  # noqa: E402


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(), ModuleWrapPolicy({Block}))
    step = {"n": 0}

    def die(module: torch.nn.Module, args: tuple) -> None:
        if rank == 1 and step["n"] == 1:
            os._exit(3)

    if sys.argv[1:] == ["state_dict"]:
        gpt_loss(model, gpt_batch(0, 2)).backward()

        def kill(*args: object) -> None:
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        # our pre-hook of blocks.0 gathers it first; the survivor then waits for blocks.1 in vain
        model.blocks[0].register_state_dict_pre_hook(kill)
        model.state_dict()
        print("finished without noticing", flush=True)
        return
    if sys.argv[1:] == ["optim_state_dict"]:
        optim = torch.optim.Adam(model.parameters())
        gpt_loss(model, gpt_batch(0, 2)).backward()
        optim.step()
        gather = _optim_convert._gather_full_flat
        calls = {"n": 0}

        def gather_then_die(*args: object) -> torch.Tensor:
            calls["n"] += 1
            if rank == 1 and calls["n"] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return gather(*args)  # type: ignore[arg-type]

        _optim_convert._gather_full_flat = gather_then_die  # type: ignore[assignment]
        optim_state_dict(model, optim)
        print("finished without noticing", flush=True)
        return
    if sys.argv[1:] == ["optim_state_dict_check"]:
        optim = torch.optim.Adam(model.parameters())
        gpt_loss(model, gpt_batch(0, 2)).backward()
        optim.step()
        exchange = _optim_convert.all_gather_object

        def die_then_exchange(*args: object) -> list:
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return exchange(*args)  # type: ignore[arg-type]

        _optim_convert.all_gather_object = die_then_exchange  # type: ignore[assignment]
        optim_state_dict(model, optim)
        print("finished without noticing", flush=True)
        return
    model.blocks[1].register_forward_pre_hook(die, prepend=True)
    for n in range(3):
        step["n"] = n
        gpt_loss(model, gpt_batch(n, 2)).backward()
    print("finished without noticing", flush=True)


if __name__ == "__main__":
    main()
