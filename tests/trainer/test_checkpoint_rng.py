"""The checkpoint's RNG capture touches only the CUDA device this process already uses.

There is no GPU here: torch.cuda's functions are replaced by recorders of what the capture and the restore ask
for, which is the contract (`get_rng_state_all` would create a CUDA context on every visible GPU of the driver).
"""

from __future__ import annotations

import io

import pytest
import torch

from conveyor.trainer.checkpoint import rng_state, set_rng_state


@pytest.fixture
def cuda(monkeypatch) -> dict:
    """A fake CUDA: 4 visible devices, device 2 current; `calls` records every RNG call."""
    fake = {"initialized": False, "calls": []}

    def refuse(*args, **kwargs):
        raise AssertionError("touches every visible GPU")

    def get_rng_state(device="cuda"):
        fake["calls"].append(("get", device))
        return torch.full((16,), 7, dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: fake["initialized"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device="cuda": fake["calls"].append(("set", device, state.clone()))
    )
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", refuse)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", refuse)
    return fake


def test_a_process_without_cuda_in_use_captures_no_cuda_state(cuda) -> None:
    state = rng_state()
    assert "cuda" not in state and cuda["calls"] == []
    set_rng_state(state)
    assert cuda["calls"] == []


def test_the_current_device_alone_is_captured_and_restored(cuda) -> None:
    cuda["initialized"] = True
    state = rng_state()
    assert cuda["calls"] == [("get", 2)]
    buf = io.BytesIO()
    torch.save(state, buf)  # a checkpoint loads it without unpickling
    buf.seek(0)
    set_rng_state(torch.load(buf, weights_only=True))
    kind, device, restored = cuda["calls"][1]
    assert (kind, device) == ("set", "cuda")  # torch's "cuda": the current device
    assert torch.equal(restored, state["cuda"])


def test_an_older_checkpoint_restores_its_current_device_entry(cuda) -> None:
    cuda["initialized"] = True
    state = rng_state()
    state["cuda"] = [torch.full((16,), i, dtype=torch.uint8) for i in range(4)]  # get_rng_state_all's list
    set_rng_state(state)
    assert torch.equal(cuda["calls"][-1][2], state["cuda"][2])
