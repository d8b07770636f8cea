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
from conveyor.data_plane.served import DataPlaneServer, ServedDataPlane, deferred_writes


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
    script = (
        "import sys\nfrom conveyor.data_plane import make_data_plane\n"
        "from conveyor.data_plane.served import DataPlaneServer\n"
        "s = DataPlaneServer(make_data_plane('memory'))\n"
        "c = s.client(); c.kv_list('p')\n"  # a client connected: the socket is live
        "print(repr(s.address), flush=True)\nsys.stdin.read()\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where a file-backed socket would go
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        address = ast.literal_eval(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert address.startswith("\0conveyor-dp-")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="is gone"):
        ServedDataPlane(address, b"any key").kv_list("p")


def _counting(server: DataPlaneServer, monkeypatch) -> list[str]:
    """The operations the server answers, in order."""
    ops: list[str] = []
    answer = server.answer

    def counted(request: bytes) -> bytes:
        ops.append(pickle.loads(request)[0])
        return answer(request)

    monkeypatch.setattr(server, "answer", counted)
    return ops


def test_deferred_writes_of_one_batch_leave_as_one_put_and_are_read_where_they_were_written(served, monkeypatch):
    plane, server = served
    client = server.client()
    keys = ["s0", "s1", "s2"]
    plane.kv_batch_put(keys, "p", {"prompts": torch.arange(6).reshape(3, 2), "data_source": ["a", "b", "c"]})
    ops = _counting(server, monkeypatch)
    with deferred_writes():
        responses = torch.tensor([[1, 2], [3, 4], [5, 6]])
        handle = client.kv_batch_put(keys, "p", {"responses": responses, "uid": ["u", "u", "v"]})
        assert handle.fields == ["responses", "uid"] and handle.keys == keys
        responses += 100  # after the put: what is written is what was put
        assert plane.kv_list("p") == keys and "responses" not in plane.kv_batch_get(keys, "p", ["prompts"]).keys()
        td = client.kv_batch_get(keys, "p", ["responses", "data_source", "uid"])  # held ones here, the rest served
        assert td["responses"].tolist() == [[1, 2], [3, 4], [5, 6]]
        assert list(td["data_source"]) == ["a", "b", "c"] and list(td["uid"]) == ["u", "u", "v"]
        client.kv_batch_put(keys, "p", {"rm_scores": torch.ones(3, 2)}, tags=[{"seq_len": 4}] * 3)
        assert ops == ["get"]  # only data_source crossed the socket so far
    assert ops == ["get", "write"]  # one request, which answers no handle
    td = plane.kv_batch_get(keys, "p", ["responses", "uid", "rm_scores"])
    assert td["responses"].tolist() == [[1, 2], [3, 4], [5, 6]] and td["rm_scores"].sum() == 6
    assert plane.kv_batch_put(keys[:1], "p", {"x": torch.zeros(1)}).tags == [{"seq_len": 4}]


def test_deferred_writes_are_sent_before_anything_that_could_see_them_and_dropped_when_the_block_fails(
    served, monkeypatch
):
    plane, server = served
    client = server.client()
    ops = _counting(server, monkeypatch)
    with deferred_writes():
        client.kv_batch_put(["a"], "p", {"x": torch.zeros(1, 2)})
        client.kv_batch_put(["b"], "p", {"x": torch.ones(1, 2)})  # other keys: the held put goes first
        assert ops == ["write"] and plane.kv_list("p") == ["a"]
        client.kv_batch_put(["b"], "p", {"x": torch.full((1, 2), 2.0)})  # a held field again: checked put by put
        assert ops == ["write", "write"]
        assert client.kv_list("p") == ["a", "b"]  # a listing sees every write before it
        client.kv_batch_put(["c"], "p", {"x": torch.zeros(1, 3)})  # another row shape: refused when it is sent
        with pytest.raises(ValueError, match="'x'"):
            client.kv_clear("q")
    assert plane.kv_batch_get(["b"], "p", ["x"])["x"].tolist() == [[2.0, 2.0]]
    with pytest.raises(RuntimeError, match="boom"), deferred_writes():
        client.kv_batch_put(["d"], "p", {"x": torch.zeros(1, 2)})
        raise RuntimeError("boom")
    assert plane.kv_list("p") == ["a", "b"]  # the failed block wrote nothing
    with deferred_writes() as writes:  # nested blocks: the outer one sends
        with deferred_writes():
            client.kv_batch_put(["e"], "p", {"x": torch.zeros(1, 2)})
        assert writes.held is not None and plane.kv_list("p") == ["a", "b"]
    assert plane.kv_list("p") == ["a", "b", "e"]
