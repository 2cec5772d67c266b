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
