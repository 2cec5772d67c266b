"""The pool, retention of window allocations, warm-up priming (CubeCL D3), and leak checks."""

import gc

import numpy as np

from runtime import kernels as K
from runtime.server.memory import size_class


def usage(c):
    c.sync()
    return c.memory_usage()


def test_size_classes_round_up_within_a_quarter():
    for n in [1, 255, 256, 257, 1000, 4096, 4097, 3_145_733, 10**8]:
        cls = size_class(n)
        assert cls >= n and (cls <= 256 or cls < n * 1.25 + 1)


def test_freed_buffers_are_reused(client):
    base = usage(client)["bytes_reserved"]
    for _ in range(50):
        h = client.create(np.ones(1000, np.float32))
        client.read(h)
        del h
    grown = usage(client)["bytes_reserved"] - base
    assert grown <= size_class(4000), grown


def test_a_graph_pins_buffers_allocated_in_its_window(client):           # 31
    c = client
    c.empty_cache()          # idle buffers of earlier tests on this server would serve `held`
    x = c.create(np.ones(256, np.float32))
    c.graph_prepare()
    c.start_capture()
    tmp = c.empty(256, np.float32)
    c.launch(K.add_scalar, K.grid(256), [x, tmp], {"alpha": 1.0, "n": 256})
    g = c.stop_capture()
    assert g.info()["retained"] == 1
    del tmp
    before = usage(c)["bytes_reserved"]
    held = [c.empty(256, np.float32) for _ in range(2)]   # cannot land on the pinned buffer
    assert usage(c)["bytes_reserved"] >= before + size_class(1024)
    del held
    g.release()
    after_release = usage(c)["bytes_reserved"]
    again = [c.empty(256, np.float32) for _ in range(3)]   # now reuses all three
    assert usage(c)["bytes_reserved"] == after_release
    del again


def test_warmup_priming_leaves_the_working_set_in_the_pool(client):      # 37, 38
    c = client
    x = c.create(np.ones(512, np.float32))
    out = c.empty(512, np.float32)

    def work(hold):
        tmps = []
        for _ in range(3):
            t = c.empty(512, np.float32)
            c.launch(K.add_scalar, K.grid(512), [x, t], {"alpha": 1.0, "n": 512})
            c.launch(K.accumulate, K.grid(512), [t, out], {"n": 512})
            if hold:
                tmps.append(t)
            del t
        return tmps
    c.graph_prepare()
    work(hold=False)                 # sequential reserve/drop: priming keeps all three
    reserved = usage(c)["bytes_reserved"]
    c.start_capture()
    tmps = work(hold=True)           # the recorded run holds three at once: no growth
    g = c.stop_capture()
    assert usage(c)["bytes_reserved"] == reserved
    c.write(out, np.zeros(512, np.float32))
    g.replay()
    np.testing.assert_array_equal(c.read(out), np.full(512, 6, np.float32))
    del tmps


def test_handles_and_graphs_do_not_leak(client):
    c = client
    gc.collect()
    base = usage(c)
    for _ in range(20):
        a = c.create(np.ones(64, np.float32))
        b = c.empty(64, np.float32)
        c.graph_prepare()
        c.launch(K.copy, 1, [a, b], {"n": 64})
        c.start_capture()
        c.launch(K.copy, 1, [a, b], {"n": 64})
        g = c.stop_capture()
        g2 = g.clone()
        g.replay()
        del a, b, g, g2
    gc.collect()
    end = usage(c)
    assert end["handles"] == base["handles"] and end["graphs"] == base["graphs"]
    assert end["bytes_in_use"] == base["bytes_in_use"]
