"""``device_id`` and CUDA device indices, checked on CPU with CUDA faked as present."""

from __future__ import annotations

import pytest
import torch
from models import TinyGPT

from fsdp_composable import _init_utils


def test_cuda_device_id_without_index_is_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device_id=torch.device("cuda")`` means the current CUDA device, as in FSDP1: the compute
    device carries its index, so it equals the moved parameters' device (``cuda`` alone never equals
    ``cuda:1``, which made the first forward refuse the model as edited)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cuda1 = torch.device("cuda", 1)
    assert _init_utils._check_device_id("fully_shard", torch.device("cuda")) == cuda1
    assert _init_utils._init_device(TinyGPT(), torch.device("cuda"), set()) == cuda1
    assert _init_utils._check_device_id("fully_shard", torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert _init_utils._check_device_id("fully_shard", 1) == cuda1
