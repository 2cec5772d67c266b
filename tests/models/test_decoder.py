"""The decode-step example: device-position kernels, one captured step for every position, and
identical tokens eager vs replayed on every backend."""

import importlib.util
import pathlib

import numpy as np
import pytest

import runtime
from runtime.kernels import decode as D
from runtime.models.decoder import Decoder, DecoderConfig, reference_generate

SMALL = DecoderConfig(vocab=64, dim=32, heads=2, layers=1, ffn=64, max_len=40, seed=3)


@pytest.fixture
def decoder(client):
    d = Decoder(client, SMALL)
    yield d
    d.release()


def test_eager_and_replayed_tokens_are_identical(decoder):
    prompt, n = [5, 9, 2], 24
    eager = decoder.generate(prompt, n)
    replayed = decoder.generate(prompt, n, graph=True)
    np.testing.assert_array_equal(eager, replayed)
    np.testing.assert_array_equal(eager, reference_generate(decoder.weights, SMALL, prompt, n))
    assert decoder.step_graph().recorded
    # the per-step-read variants give the same tokens
    np.testing.assert_array_equal(decoder.generate(prompt, n, graph=True, read_each_step=True),
                                  eager)
    np.testing.assert_array_equal(decoder.generate(prompt, n, read_each_step=True), eager)


def test_one_graph_serves_every_step_without_recapture(decoder):
    g = decoder.step_graph()
    gid = g.graph.id
    a = decoder.generate([1], 12, graph=True, timings=(t := {}))
    b = decoder.generate([7, 3], 30, graph=True)     # other positions, longer: same graph
    assert decoder.step_graph() is g and g.graph.id == gid
    assert t["steps"] == 12 and t["per_token_ms"] > 0
    np.testing.assert_array_equal(a, decoder.generate([1], 12))
    np.testing.assert_array_equal(b, decoder.generate([7, 3], 30))
    # the device position advanced by one per step; hist holds the prompt's predictions + tokens
    assert int(g.read("pos")[0]) == 2 + 30 - 1
    np.testing.assert_array_equal(g.read("hist")[2:32], b)


def test_bad_prompts_are_refused(decoder):
    for prompt, n in (([], 3), ([1.5], 3), ([SMALL.vocab], 3), ([1], 0), ([1] * 30, 11)):
        with pytest.raises(ValueError):
            decoder.generate(prompt, n)


@pytest.mark.parametrize("token", [-2, -3, 3, -1])
def test_embed_at_with_a_token_outside_its_table_raises_on_cpu(token):
    """A device token id outside ``wte``'s rows: the cpu body sliced ``wte[t*H:(t+1)*H]``, so a
    negative id other than -1 silently read a row from the end of the table (-2 -> row V-2),
    while -1 and V failed by accident (a shape mismatch). Now every id outside ``[0, V)``
    raises (``IndexError`` -> ``LaunchError``; ``ReplayFailed`` on read), as ``embedding``'s
    cpu body does. (wgpu/cuda do not check on the device: docs in runtime.kernels.decode.)"""
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    H, V, T = 4, 3, 5
    wte = c.create(np.arange(V * H, dtype=np.float32))
    wpe = c.create(np.zeros(T * H, np.float32))
    tok, pos = c.create(np.array([token], np.int32)), c.create(np.array([0], np.int32))
    out = c.create(np.zeros(H, np.float32))
    c.launch(D.embed_at, 1, [tok, pos, wte, wpe, out], {"H": H, "T": T})
    with pytest.raises(runtime.ServerError, match="outside"):
        c.sync()
    with pytest.raises(runtime.ReplayFailed):
        c.read(out)


def test_argmax_ties_go_to_the_lowest_index(client):
    x = np.zeros(200, np.float32)
    x[[17, 150, 199]] = 3.0
    out = client.empty(1, np.int32)
    client.launch(D.argmax, (1, 1, 1), [client.create(x), out], {"n": 200})
    assert int(client.read(out)[0]) == 17 == int(np.argmax(x))


def test_example_runs(capsys):
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--tokens", "8", "--repeats", "1", "--layers", "1", "--dim", "32"]) == 0
    out = capsys.readouterr().out
    assert "identical tokens in every mode: True" in out and "replayed read at end" in out


@pytest.mark.parametrize("flags, says", [(["--tokens", "0"], "argument --tokens"),
                                         (["--prompt", "99999"], "argument --prompt"),
                                         (["--dim", "3"], "--layers/--dim"),
                                         (["--backend", "tpu"], "argument --backend"),
                                         (["--end-token", "-5"], "argument --end-token")])
def test_example_refuses_a_bad_flag_with_one_error_line(flags, says, capsys):
    """USER5: a bad value (``--tokens 0``, a prompt id outside the vocabulary, a width that does
    not split into heads, an unknown backend; USER8: an end token outside the vocabulary) ended
    in a traceback from deep in the decoder; now argparse's answer: usage, one ``error:`` line naming the flag, exit status 2."""
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as info:
        mod.main(flags)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: " + says in err, err


def test_decoder_under_the_interleaving_scheduler_and_checker():
    d = Decoder(runtime.client("cpu", scheduler="interleave", seed=5, check=True), SMALL)
    eager = d.generate([5, 9, 2], 12)
    np.testing.assert_array_equal(d.generate([5, 9, 2], 12, graph=True), eager)
    np.testing.assert_array_equal(eager, reference_generate(d.weights, SMALL, [5, 9, 2], 12))


def test_timings_count_the_steps_each_mode_ran_with_an_end_token(decoder):
    """Per sequence the device loop stops after the end token; the per-step modes decode all
    ``n`` steps and cut. ``steps`` used to be ``n`` in every mode, so the per-sequence per-token
    time (and the example's speed-up) was divided by steps that never ran."""
    prompt, n = [5, 9, 2], 24
    full = decoder.generate(prompt, n)
    end = int(full[4])
    cut = full[:int(np.flatnonzero(full == end)[0]) + 1]
    t = {}
    np.testing.assert_array_equal(decoder.generate(prompt, n, timings=t, end_token=end), cut)
    assert t["steps"] == len(prompt) - 1 + n and t["tokens"] == cut.size
    try:
        got = decoder.generate(prompt, n, timings=(t := {}), end_token=end, per_sequence=True)
    except runtime.UnsupportedError:
        pytest.skip("no loop nodes on this backend")
    np.testing.assert_array_equal(got, cut)
    assert t["steps"] == len(prompt) - 1 + cut.size and t["tokens"] == cut.size
    assert t["per_token_ms"] == pytest.approx(1e3 * t["seconds"] / t["steps"])
