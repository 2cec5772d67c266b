"""Policy decided once for every backend (issue 13): aliasing, workgroup counts, the backend
interface and ``probe()``'s shape. Each is checked by the client or the registry, never by one
backend alone."""

import numpy as np
import pytest

import runtime
import runtime.server as server_mod
from runtime import kernels as K
from runtime.backends.base import Backend, Completion
from runtime.errors import LaunchError, UnsupportedError


def test_a_buffer_bound_read_and_read_write_is_refused_on_every_backend(client):
    x = client.create(np.ones(4, np.float32))
    with pytest.raises(LaunchError, match=r"to x \(read\) and also to y \(write\).*every backend"):
        client.launch(K.mul_scalar, 1, [x, x], {"alpha": 2.0, "n": 4})
    with pytest.raises(LaunchError, match=r"and also to y \(read_write\)"):
        client.launch(K.accumulate, 1, [x, x], {"n": 4})   # the message names the other binding
    y = client.empty(4, np.float32)
    client.launch(K.add, 1, [x, x, y], {"n": 4})          # two read bindings may alias
    np.testing.assert_array_equal(client.read(y), np.full(4, 2.0, np.float32))
    np.testing.assert_array_equal(client.read(x), np.ones(4, np.float32))   # nothing ran


def test_a_count_over_the_backend_limit_is_refused_by_the_client(client, monkeypatch):
    be = client._server.backend          # private: declare a smaller limit on cpu
    if be.max_workgroups is None:                 # cpu: no limit of its own; declare one
        monkeypatch.setitem(vars(be), "max_workgroups", (8, 8, 8))
    lim = be.max_workgroups
    y = client.create(np.zeros(4, np.float32))
    with pytest.raises(LaunchError, match="per dimension"):
        client.launch(K.fill, (lim[0] + 1, 1, 1), [y], {"value": 1.0, "n": 4})
    with pytest.raises(LaunchError, match="per dimension"):
        client.launch(K.fill, (1, 1, lim[2] + 1), [y], {"value": 1.0, "n": 4})
    np.testing.assert_array_equal(client.read(y), np.zeros(4, np.float32))


class _Half(Backend):
    """Implements a few verbs only."""

    name = "half"

    def alloc(self, nbytes):
        return bytearray(nbytes)

    def synchronize(self, stream):
        return Completion.ready()


class _NoReplay(Backend):
    """Every verb, but only part of the graph verbs."""

    name = "noreplay"

    @classmethod
    def probe(cls):
        return {"hardware": False, "device": "none"}

    def begin_graph(self, stream):
        return []


for _v in ("alloc", "free", "new_stream", "record_event", "wait_event", "synchronize", "copy_in",
           "copy_out", "compile", "launch"):
    setattr(_NoReplay, _v, lambda self, *a, **k: None)


class _BadProbe(_NoReplay):
    name = "badprobe"
    begin_graph = Backend.begin_graph             # no graphs at all: allowed

    @classmethod
    def probe(cls):
        return {"name": "old shape", "hardware": True, "hip": False}


def test_an_incomplete_backend_is_refused_at_registration(monkeypatch):
    monkeypatch.setattr(server_mod, "BACKENDS", dict(server_mod.BACKENDS))
    with pytest.raises(TypeError, match=r"_Half does not implement \[.*'free'.*'probe'"):
        server_mod.register_backend("half", _Half)
    with pytest.raises(TypeError, match="record_launch"):
        server_mod.register_backend("noreplay", _NoReplay)
    with pytest.raises(TypeError, match="probe\\(\\) must return"):
        server_mod.register_backend("badprobe", _BadProbe)
    with pytest.raises(TypeError, match="subclass"):
        server_mod.register_backend("plain", object)
    assert not {"half", "noreplay", "badprobe", "plain"} & set(server_mod.BACKENDS)
    with pytest.raises(ValueError, match="unknown backend"):
        runtime.client("half")


def test_a_complete_backend_registers_and_serves(monkeypatch):
    from runtime.backends.cpu import CpuBackend

    class Mine(CpuBackend):
        name = "mine"
    monkeypatch.setattr(server_mod, "BACKENDS", dict(server_mod.BACKENDS))
    server_mod.register_backend("mine", Mine)
    c = runtime.client("mine")
    try:
        x = c.create(np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(c.read(x), np.arange(4, dtype=np.float32))
    finally:
        c.shutdown()


@pytest.mark.parametrize("name", sorted(server_mod.BACKENDS))
def test_every_probe_has_the_declared_shape(name):
    try:
        cls = server_mod.backend_class(name)
        info = cls.probe()
    except UnsupportedError as e:
        pytest.skip(f"{name} unavailable here: {e}")
    assert set(info) == {"hardware", "device"}
    assert isinstance(info["hardware"], bool) and isinstance(info["device"], str)


def test_available_backends_and_backend_unavailable_are_one_answer(monkeypatch):
    """``runtime.available_backends()``, ``runtime.server.backend_unavailable`` and
    ``runtime.testing.backend_unavailable`` are one function over one cache (issue 29 item 5)."""
    import runtime.testing
    assert runtime.testing.backend_unavailable is server_mod.backend_unavailable
    avail = runtime.available_backends()
    assert avail == {n: runtime.testing.backend_unavailable(n) for n in server_mod.BACKENDS}
    assert avail["cpu"] is None
    for name, why in avail.items():
        assert why is None or (isinstance(why, str) and name in why)
    with pytest.raises(ValueError, match="unknown backend"):
        runtime.testing.backend_unavailable("nope")

    monkeypatch.setattr(server_mod, "BACKENDS", dict(server_mod.BACKENDS))
    from runtime.backends.cpu import CpuBackend

    class Absent(CpuBackend):
        calls = 0

        @classmethod
        def probe(cls):
            cls.calls += 1
            raise UnsupportedError("no such device here")
    server_mod.register_backend("absent", Absent)
    calls = Absent.calls
    assert "no such device here" in runtime.available_backends()["absent"]
    assert "no such device here" in runtime.testing.backend_unavailable("absent")
    assert Absent.calls == calls + 1                   # probed once: one cache
    with pytest.raises(UnsupportedError):
        runtime.client("absent")
