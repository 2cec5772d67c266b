"""``python -m runtime <command>``: a failing command prints one line and exits non-zero, never
a traceback (``runtime/__main__.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]


def _one_line(err: str, command: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"python -m runtime {command}: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("argv,expect", [
    (["bench", "--backend", "nope"], "ValueError: --backend: unknown backend 'nope'"),
    (["bench", "--sections", "nope"], "ValueError: --sections/--skip: unknown section(s) ['nope']"),
    (["bench", "--skip", "nope"], "ValueError: --sections/--skip: unknown section(s) ['nope']"),
    (["embed", "--backend", "nope", "a text"], "ValueError: --backend: unknown backend 'nope'"),
    (["capture-demo", "--backend", "nope"], "ValueError: --backend: unknown backend 'nope'"),
])
def test_bad_input_is_one_line_and_exit_2(argv, expect, capsys):
    """The one line names the flag whose value was refused (README "Commands"; USER6: bench,
    embed and capture-demo named only the value)."""
    assert cli.main(argv) == 2
    assert expect in _one_line(capsys.readouterr().err, argv[0])


def test_any_other_failure_is_one_line_and_exit_1(monkeypatch, capsys):
    def broken(argv):
        raise RuntimeError("the device fell over\nsecond line of detail")
    monkeypatch.setitem(cli.COMMANDS, "bench", (__name__, "_broken", "x"))
    monkeypatch.setitem(globals(), "_broken", broken)
    monkeypatch.delenv("RUNTIME_TRACEBACK", raising=False)
    assert cli.main(["bench"]) == 1
    assert _one_line(capsys.readouterr().err, "bench") == \
        "python -m runtime bench: RuntimeError: the device fell over"
    monkeypatch.setenv("RUNTIME_TRACEBACK", "1")         # the opt-in for a bug report
    with pytest.raises(RuntimeError, match="fell over"):
        cli.main(["bench"])


def test_unknown_command_exits_2_with_the_usage(capsys):
    assert cli.main(["nope"]) == 2
    out = capsys.readouterr()
    assert "unknown command 'nope'" in out.err and "bench" in out.out


def test_a_failing_command_in_a_subprocess_from_another_folder(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RUNTIME_TRACEBACK", None)
    r = subprocess.run([sys.executable, "-m", "runtime", "bench", "--readme", "--out", "x",
                        "--backend", "nope"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "unknown backend 'nope'" in _one_line(r.stderr, "bench")


def test_capture_demo_runs_the_replay_workload_and_checks_it(tmp_path):
    """``capture-demo`` (runtime/bench/capture_demo.py, on the bench's replay workload): the
    buffers hold the count of launches that ran, on both paths."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "runtime", "capture-demo", "--length", "10",
                        "--rounds", "3", "--elems", "64"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # 2 passes at capture, 1 warm-up and 3 timed passes per path: 10 launches each
    assert "values match numpy: True (a=100, b=99" in r.stdout
    assert "µs/launch" in r.stdout
    r = subprocess.run([sys.executable, "-m", "runtime", "capture-demo", "--length", "3"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--length must be even" in r.stderr


def test_version_prints_the_version(capsys):
    # USER8: `python -m runtime --version` printed the usage and exited 2
    import runtime
    assert cli.main(["--version"]) == 0 and cli.main(["-V"]) == 0
    assert capsys.readouterr().out == f"runtime {runtime.__version__}\n" * 2


@pytest.mark.parametrize("argv", [["embed", "--backend", "cpu", "a text"],
                                  ["serve", "--backend", "cpu", "--port", "0"], ["demo"]])
def test_missing_model_files_are_one_line_naming_the_flag(argv, tmp_path, monkeypatch, capsys):
    """USER8: ``embed`` printed "error: .../model.safetensors is missing: point path= or ..." and
    exited 1 (``serve`` and ``demo``: "cannot load the model: ..."): not the README's one line,
    and ``path=`` is the Python API's name; the commands take ``--model-dir``."""
    monkeypatch.setenv("RUNTIME_MINILM_DIR", str(tmp_path))
    if argv[0] != "demo":                              # demo has no flag: the variable only
        argv = argv[:1] + ["--model-dir", str(tmp_path)] + argv[1:]
    assert cli.main(argv) == 2
    line = _one_line(capsys.readouterr().err, argv[0])
    assert f"ModelFilesMissing: {tmp_path / 'model.safetensors'} is missing: " in line
    assert "path=" not in line and "RUNTIME_MINILM_DIR" in line
    assert ("--model-dir DIR" in line) == (argv[0] != "demo")
