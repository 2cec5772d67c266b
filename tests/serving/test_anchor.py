"""The demo's sentence-transformers comparison (``runtime.serving.anchor``): found or not, the
worker's answer parsed, a failing worker reported as ``RuntimeError``. No torch needed: the
interpreter is replaced by a small script that answers as the worker would."""

from __future__ import annotations

import importlib.util
import json
import stat

import pytest

from runtime.serving import anchor
from runtime.serving.demo import print_anchor


def fake_python(tmp_path, body: str):
    p = tmp_path / "fake-python"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def test_absent_sentence_transformers_gives_none_and_a_hint(monkeypatch, capsys):
    if importlib.util.find_spec("sentence_transformers") is not None:
        pytest.skip("sentence-transformers is importable here")
    monkeypatch.delenv("RUNTIME_ST_PYTHON", raising=False)
    assert anchor.st_python() is None
    assert anchor.anchor_throughput(["a"], "/nonexistent") is None
    print_anchor({"texts_per_s": 10.0}, [[["a"]]])
    assert "not importable" in capsys.readouterr().out


def test_worker_answer_is_parsed_and_printed_with_the_ratio(tmp_path, monkeypatch, capsys):
    ans = {"texts_per_s": 40.0, "min": 38.0, "max": 41.0, "threads": {"torch": 2},
           "versions": {"torch": "9.9", "sentence_transformers": "8.8"}}
    py = fake_python(tmp_path, f"cat > /dev/null; echo '{json.dumps(ans)}'")
    assert anchor.anchor_throughput(["a", "b"], str(tmp_path), python=py) == ans
    monkeypatch.setenv("RUNTIME_ST_PYTHON", py)
    monkeypatch.setenv("RUNTIME_MINILM_DIR", str(tmp_path))
    print_anchor({"texts_per_s": 60.0}, [[["a"], ["b", "c"]]])
    out = capsys.readouterr().out
    assert "40.0 texts/s" in out and "60.0 texts/s" in out and "(1.50x)" in out
    assert "same 3 texts" in out


def test_a_failing_worker_raises_runtime_error(tmp_path):
    py = fake_python(tmp_path, "echo boom >&2; exit 3")
    with pytest.raises(RuntimeError, match="boom"):
        anchor.anchor_throughput(["a"], str(tmp_path), python=py)
