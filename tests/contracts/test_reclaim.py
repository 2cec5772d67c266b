"""Nothing grows, on every backend: the streams of ended threads are reclaimed, reserved
memory goes back to its baseline, the pool keeps at most ``max_idle_bytes`` idle. The private
reaches (``c._server``) are the stream table and the backend's live allocations under test."""

import threading

import numpy as np

import runtime
from runtime import kernels as K
from helpers import LIMIT_S, until as _until


def test_short_lived_threads_leave_the_stream_table_at_its_baseline(backend):
    c = runtime.client(backend)
    srv = c._server                               # private: the stream table is tested
    x = c.create(np.ones(4, np.float32))
    base = c.memory_usage()["streams"]
    be_streams = getattr(srv.backend, "streams", None)
    be_base = len(be_streams) if be_streams is not None else None
    errors = []

    def work():
        try:
            t = runtime.client(backend)          # unpinned: this thread's own stream
            y = t.empty(4, np.float32)
            t.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
            if t.read(y)[0] != 2:
                errors.append("wrong value")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    for _ in range(10):                          # 500 threads, 50 at a time
        batch = [threading.Thread(target=work) for _ in range(50)]
        for t in batch:
            t.start()
        for t in batch:
            t.join(LIMIT_S)
    assert not errors
    _until(lambda: c.memory_usage()["streams"] <= base, "the ended threads' streams to go")
    if be_base is not None:
        assert len(be_streams) <= be_base


def test_empty_cache_returns_reserved_bytes_to_the_baseline(backend):
    c = runtime.client(backend)
    be = c._server.backend                        # private: the backend's live allocations
    c.empty_cache()
    base = c.memory_usage()["bytes_reserved"]
    freed = []
    free = be.free
    be.free = lambda buf: (freed.append(buf), free(buf))[1]
    try:
        hs = [c.empty(1 << 20) for _ in range(8)]
        c.write(hs[0], np.ones(1 << 20, np.uint8))
        assert c.read(hs[0])[0] == 1
        assert c.memory_usage()["bytes_reserved"] == base + 8 * (1 << 20)
        for h in hs:
            h.release()
        assert c.empty_cache() == 8 * (1 << 20)
        assert c.memory_usage()["bytes_reserved"] == base and len(freed) == 8
    finally:
        del be.free


def test_the_pool_keeps_at_most_max_idle_bytes(backend):
    c = runtime.client(backend, max_idle_bytes=1 << 20)
    hs = [c.empty(1 << 20) for _ in range(4)]
    c.sync()
    for h in hs:
        h.release()
    use = c.memory_usage()
    assert use["bytes_idle"] <= 1 << 20 and use["bytes_reserved"] <= use["bytes_in_use"] + (1 << 20)
    h = c.create(np.arange(4, dtype=np.float32))       # still works after trimming
    np.testing.assert_array_equal(c.read(h), np.arange(4, dtype=np.float32))
    c.shutdown()
