"""Decode in one replay per sequence (issue 27 item 3): ``Decoder.generate(per_sequence=True)``
runs ``capture_while`` around the step with the end test on the device, and gives the same
tokens as the per-token loop and the numpy reference, stopping at an end token."""

import numpy as np
import pytest

import runtime
from runtime.errors import UnsupportedError
from runtime.models.decoder import Decoder, DecoderConfig, reference_generate


@pytest.fixture
def decoder(backend):
    cfg = DecoderConfig(layers=1, dim=32, heads=2, ffn=64, max_len=32)
    dec = Decoder(runtime.client(backend), cfg)
    yield dec
    dec.release()


def _per_sequence(dec, *args, **kw):
    try:
        return dec.generate(*args, per_sequence=True, **kw)
    except UnsupportedError as e:
        pytest.skip(str(e))


def test_one_replay_per_sequence_matches_the_reference(decoder):
    for prompt, n in (([1], 12), ([4, 9, 2], 9), ([1], 12)):
        ref = reference_generate(decoder.weights, decoder.config, prompt, n)
        np.testing.assert_array_equal(_per_sequence(decoder, prompt, n), ref)
        np.testing.assert_array_equal(decoder.generate(prompt, n, graph=True), ref)


def test_end_token_stops_on_the_device(decoder):
    full = decoder.generate([3], 14)
    end = int(full[4])
    want = full[:list(full).index(end) + 1]
    np.testing.assert_array_equal(decoder.generate([3], 14, end_token=end), want)
    got = _per_sequence(decoder, [3], 14, end_token=end)
    np.testing.assert_array_equal(got, want)
    g, st = decoder.loop_graph(14)
    hist = st["hist"].numpy()
    assert (hist[1 + len(want):] == 0).all()       # the loop stopped: no step after the end
    assert st["pos"].numpy()[0] == len(want)


def _static_sequence(dec, *args, **kw):
    try:
        return dec.generate(*args, per_sequence=True, graph=True, **kw)
    except UnsupportedError as e:
        pytest.skip(str(e))


def test_static_graph_one_replay_per_sequence_matches_the_per_token_loop(decoder):
    """``StaticGraph(loop="go")`` (``Decoder.sequence_graph``) vs the per-token replays of the
    step ``StaticGraph`` and the numpy reference."""
    for prompt, n in (([1], 12), ([4, 9, 2], 9), ([1], 12)):
        per_token = decoder.generate(prompt, n, graph=True)
        np.testing.assert_array_equal(per_token, reference_generate(
            decoder.weights, decoder.config, prompt, n))
        np.testing.assert_array_equal(_static_sequence(decoder, prompt, n), per_token)
    g = decoder.sequence_graph(12)
    assert g.recorded and g.fallback_reason is None


def test_static_graph_sequence_stops_at_the_end_token_on_the_device(decoder):
    full = decoder.generate([3], 14, graph=True)
    end = int(full[4])
    want = full[:list(full).index(end) + 1]
    np.testing.assert_array_equal(_static_sequence(decoder, [3], 14, end_token=end), want)
    g = decoder.sequence_graph(14)
    hist, pos = g.read("hist", "pos").values()
    assert (hist[1 + len(want):] == 0).all() and pos[0] == len(want)   # no step after the end


def test_static_graph_loop_limit_marks_the_state(backend):
    """A loop still going after max_iterations: the replay fails on the state, typed."""
    c = runtime.client(backend)

    def body(x, go, one):
        return {"x": x.add(one)}                            # x += 1 per iteration
    try:
        g = runtime.StaticGraph(c, inputs={}, outputs={"x": ((1,), "f32")},
                                state={"go": ((1,), "i32"), "one": np.ones(1, np.float32)},
                                body=body, loop="go", max_iterations=3)
    except UnsupportedError as e:
        pytest.skip(str(e))
    g.write(go=[0])
    g.replay()
    np.testing.assert_array_equal(g.read("x"), [1.0])      # the warm-up's one run only
    g.write(go=[1])                                         # never cleared by the body
    g.replay()
    with pytest.raises(runtime.ReplayFailed, match="LoopLimitExceeded|max_iterations"):
        g.read("x")


def test_static_graph_loop_argument_errors(backend):
    c = runtime.client(backend)
    body = lambda x, go: None  # noqa: E731
    for loop, state in (("nope", {"go": ((1,), "i32")}), ("go", {"go": ((2,), "i32")}),
                        ("go", {"go": ((1,), "f32")}), ("x", {"go": ((1,), "i32")})):
        with pytest.raises(ValueError, match="loop="):
            runtime.StaticGraph(c, inputs={}, outputs={"x": ((1,), "f32")}, state=state,
                                body=body, loop=loop, max_iterations=2)
    with pytest.raises(ValueError, match="max_iterations is given without loop"):
        runtime.StaticGraph(c, inputs={}, outputs={"x": ((1,), "f32")}, body=body,
                            max_iterations=2)


@pytest.mark.parametrize("graph", [False, True], ids=["loop_graph", "sequence_graph"])
def test_the_per_sequence_graphs_stay_bounded_over_many_lengths(decoder, graph):
    """A service asks for many lengths: one graph per bucket (the loop bound rounded up to a
    power of two, at most max_len), never one per distinct ``n``, each with its own KV cache
    (before: one per n, 19 here, growing with the requests); the tokens are still the
    reference's (the loop stops on the device at the last position, not at the bound). ADV3"""
    ref = reference_generate(decoder.weights, decoder.config, [5], 19)
    c = decoder.client
    before = c.memory_usage()["graphs"]
    for n in range(1, 20):
        try:
            got = decoder.generate([5], n, per_sequence=True, graph=graph)
        except UnsupportedError as e:
            pytest.skip(str(e))
        np.testing.assert_array_equal(got, ref[:n])
    made = c.memory_usage()["graphs"] - before
    assert made <= 6, made                          # buckets 1, 2, 4, 8, 16, 32
    assert len(decoder._sequences if graph else decoder._loops) == 6


def test_a_loop_decoder_recovers_after_a_failed_generation(decoder):
    """A failure inside the decode loop graph (here a token outside the table, which embed_at
    refuses: cpu raises, wgpu's device check fails it) marks the loop's state. Before (ADV6)
    every later ``generate(per_sequence=True)`` raised ReplayFailed for ever: the loop's
    temporaries counted as state and the KV cache was never rewritten. Now the next one is
    right (per_sequence with and without the StaticGraph)."""
    prompt = [3, 1, 2]
    try:
        want = decoder.generate(prompt, 5, per_sequence=True)
    except UnsupportedError as e:
        pytest.skip(str(e))
    np.testing.assert_array_equal(want, reference_generate(decoder.weights, decoder.config,
                                                           prompt, 5))
    g, st = decoder.loop_graph(5)
    c = decoder.client
    c.write(st["token"].handle, np.array([10**6], np.int32))
    c.write(st["stop"].handle, np.array([-1, 1], np.int32))
    c.write(st["go"].handle, np.ones(1, np.int32))
    g.replay()
    sg = decoder.sequence_graph(5)
    sg.write(token=[10**6], stop=[-1, 1], go=[1])
    sg.replay()
    for client in (c, sg.client):
        with pytest.raises(runtime.ServerError):
            client.sync()
    np.testing.assert_array_equal(decoder.generate(prompt, 5, per_sequence=True), want)
    np.testing.assert_array_equal(decoder.generate(prompt, 5, graph=True, per_sequence=True),
                                  want)
