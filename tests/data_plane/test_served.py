"""The memory data plane served to other processes: one store, reached from a process of its own, safely.

The contract (every put, get and error the same as in-process) is the
backend-agreement test's; these are what only a second process shows.
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import pickle
import subprocess
import sys

import pytest
import torch

from conveyor.data_plane import FieldNotFoundError, make_data_plane
from conveyor.data_plane.served import DataPlaneServer, ServedDataPlane


def _writer(client: ServedDataPlane, out: mp.Queue) -> None:
    """In a spawned process: write a batch, read part of it back, and report what a missing field raises."""
    try:
        keys = [f"s{i}" for i in range(4)]
        client.kv_batch_put(keys, "p", {"responses": torch.arange(12).reshape(4, 3), "uid": ["a", "a", "b", "b"]})
        td = client.kv_batch_get(keys[::-1], "p", ["responses", "uid"])
        try:
            client.kv_batch_get(keys, "p", ["values"])
            missing = None
        except FieldNotFoundError as err:
            missing = (err.partition_id, err.fields, str(err))
        out.put(("ok", td["responses"].tolist(), td["uid"], missing))
    except BaseException as err:  # the test reports it
        out.put(("failed", repr(err)))


@pytest.fixture
def served():
    plane = make_data_plane("memory")
    server = DataPlaneServer(plane)
    yield plane, server
    server.close()
    plane.close()


def test_a_worker_in_another_process_writes_into_the_trainers_store(served):
    plane, server = served
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_writer, args=(server.client(), out))
    proc.start()
    try:
        result = out.get(timeout=120)
    finally:
        proc.join(timeout=30)
    assert result[0] == "ok", result
    _, responses, uids, missing = result
    assert responses == [[9, 10, 11], [6, 7, 8], [3, 4, 5], [0, 1, 2]]  # in the order asked for
    assert uids == ["b", "b", "a", "a"]
    assert missing == ("p", ["values"], "field(s) ['values'] not found in partition 'p'")
    # The trainer reads it from the plane itself: no copy of the data on its side of the socket.
    assert plane.kv_list("p") == ["s0", "s1", "s2", "s3"]
    assert torch.equal(plane.kv_batch_get(["s2"], "p", ["responses"])["responses"], torch.tensor([[6, 7, 8]]))


def test_a_refused_put_is_refused_in_the_caller_and_writes_nothing(served):
    plane, server = served
    client = server.client()
    client.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="'x'.*partition 'p'"):
        client.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 4), "y": torch.ones(2)})
    assert "y" not in plane.kv_batch_put(["a"], "p", {"x": torch.ones(1, 3)}).fields
    client.kv_clear("p", ["a"])
    assert client.kv_list("p") == ["b"]
    client.close()


def test_the_client_pickles_without_its_connection_and_reconnects(served):
    _, server = served
    client = server.client()
    client.kv_batch_put(["k"], "p", {"x": torch.ones(1)})
    again = pickle.loads(pickle.dumps(client))  # what a Ray actor receives
    assert not vars(again._local)  # no connection came with it
    assert again.kv_list("p") == ["k"]  # it opens its own


def test_a_wrong_key_cannot_read_the_store(served):
    _, server = served
    stranger = ServedDataPlane(server.address, b"not the key")
    with pytest.raises(mp.AuthenticationError):
        stranger.kv_list("p")


def test_a_client_whose_server_is_gone_says_so(served):
    _, server = served
    client = server.client()
    client.kv_batch_put(["k"], "p", {"x": torch.ones(1)})
    server.close()
    with pytest.raises(RuntimeError, match="served at .* is gone"):
        client.kv_list("p")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux's")
def test_a_killed_server_leaves_no_file_behind(tmp_path):
    # What SIGKILL does to a trainer serving its plane: no clean-up runs, so the socket must not be a file.
    script = ("import sys\nfrom conveyor.data_plane import make_data_plane\n"
              "from conveyor.data_plane.served import DataPlaneServer\n"
              "s = DataPlaneServer(make_data_plane('memory'))\n"
              "c = s.client(); c.kv_list('p')\n"  # a client connected: the socket is live
              "print(repr(s.address), flush=True)\nsys.stdin.read()\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where a file-backed socket would go
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                            text=True)
    try:
        address = ast.literal_eval(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert address.startswith("\0conveyor-dp-")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="is gone"):
        ServedDataPlane(address, b"any key").kv_list("p")
