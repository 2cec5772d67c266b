"""Environment variables with a typo are a ValueError naming the variable, not ignored or a
bare ``int()`` error (USER8). Before: ``RUNTIME_CPU_FUSE=false`` / ``off`` left fusion on
(anything but ``0`` was on), ``RUNTIME_CHECK=off`` / ``false`` turned the checker ON (anything
but empty or ``0``), and ``RUNTIME_TRACE_EVENTS=abc`` made ``import runtime`` fail with
"invalid literal for int() with base 10: 'abc'" (``=0``: "a trace keeps >= 1 events"), neither
naming the variable. A few seconds (one subprocess)."""

import os
import subprocess
import sys

import pytest

import runtime
from runtime import tracing
from runtime._env import env_positive_int, env_switch


@pytest.mark.parametrize("text, want", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                        ("0", False), ("false", False), ("Off", False),
                                        ("no", False), ("", False)])
def test_a_switch_reads_the_usual_spellings(monkeypatch, text, want):
    monkeypatch.setenv("RUNTIME_TEST_SWITCH", text)
    assert env_switch("RUNTIME_TEST_SWITCH", not want) is want


def test_a_switch_or_a_count_with_a_typo_is_a_value_error_naming_the_variable(monkeypatch):
    monkeypatch.delenv("RUNTIME_TEST_SWITCH", raising=False)
    assert env_switch("RUNTIME_TEST_SWITCH", True) is True
    assert env_positive_int("RUNTIME_TEST_COUNT", 7) == 7
    monkeypatch.setenv("RUNTIME_TEST_SWITCH", "flase")
    with pytest.raises(ValueError, match=r"RUNTIME_TEST_SWITCH='flase' is neither on"):
        env_switch("RUNTIME_TEST_SWITCH", True)
    for bad in ("abc", "0", "-5", "1.5"):
        monkeypatch.setenv("RUNTIME_TEST_COUNT", bad)
        with pytest.raises(ValueError, match=rf"RUNTIME_TEST_COUNT='{bad}' must be a positive"):
            env_positive_int("RUNTIME_TEST_COUNT", 7)
    monkeypatch.setenv("RUNTIME_TEST_COUNT", "12")
    assert env_positive_int("RUNTIME_TEST_COUNT", 7) == 12


def test_runtime_check_off_spelled_out_leaves_the_checker_off(monkeypatch):
    monkeypatch.setenv("RUNTIME_CHECK", "off")
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) - 17)       # a server of its own
    try:
        assert c.capabilities["checked"] is False
    finally:
        c.shutdown()
    monkeypatch.setenv("RUNTIME_CHECK", "maybe")
    with pytest.raises(ValueError, match="RUNTIME_CHECK='maybe'"):
        runtime.client("cpu", max_idle_bytes=(1 << 30) - 19)


def test_runtime_trace_events_with_a_typo_names_the_variable(monkeypatch):
    monkeypatch.setenv("RUNTIME_TRACE", os.devnull)
    monkeypatch.setenv("RUNTIME_TRACE_EVENTS", "abc")
    if tracing._active is not None:
        pytest.skip("a trace is running (RUNTIME_TRACE): from_env does nothing then")
    with pytest.raises(ValueError, match="RUNTIME_TRACE_EVENTS='abc'"):
        tracing.from_env()
    assert tracing._active is None


def test_runtime_cpu_fuse_false_turns_fusion_off():
    code = "import runtime.backends.cpu_fuse as f; print(f.ENABLED)"
    env = dict(os.environ, RUNTIME_CPU_FUSE="false")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr
    env["RUNTIME_CPU_FUSE"] = "flase"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "RUNTIME_CPU_FUSE='flase' is neither on" in out.stderr


def test_runtime_cpu_whole_with_a_typo_names_the_variable_when_the_cpu_backend_starts(tmp_path):
    """USER8: ``RUNTIME_CPU_WHOLE`` took anything but ``0``/``1`` as ``auto``, silently
    (``=off`` left whole calls on). ``import runtime`` still works (the rule is made at import);
    the cpu backend refuses to start, naming the variable."""
    code = ("import runtime\nprint('imported', flush=True)\n"
            "from runtime.cpu_threads import WholeCalls\n"
            "assert WholeCalls(mode='0').forced is False\n"
            "runtime.client('cpu')\n")
    env = dict(os.environ, RUNTIME_CPU_WHOLE="off", RUNTIME_BACKEND="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)       # (not a clone's folder: PYTHONPATH's)
    assert out.stdout.strip() == "imported", out.stderr
    assert out.returncode != 0 and "RUNTIME_CPU_WHOLE='off' must be one of auto, 0" in out.stderr


def test_whole_calls_mode_and_its_variable_are_read_strictly(monkeypatch):
    from runtime.cpu_threads import WholeCalls, whole_mode_from_env
    for text, want in (("0", False), (" 1 ", True), ("auto", None), ("", None)):
        monkeypatch.setenv("RUNTIME_CPU_WHOLE", text)
        assert WholeCalls().forced is want
    monkeypatch.setenv("RUNTIME_CPU_WHOLE", "yes")
    with pytest.raises(ValueError, match="RUNTIME_CPU_WHOLE='yes' must be one of"):
        WholeCalls()
    assert whole_mode_from_env(strict=False) == "auto"         # the rule made at import
    with pytest.raises(ValueError, match="mode must be auto, 0 or 1, got 'on'"):
        WholeCalls(mode="on")


@pytest.mark.parametrize("options, match", [
    ({"threads": "a"}, "threads must be an int >= 1 .* got 'a'"),
    ({"threads": True}, "threads must be an int >= 1 .* got True"),
    ({"max_idle_bytes": -5}, r"max_idle_bytes must be a number of bytes >= 0 .* got -5"),
    ({"max_idle_bytes": "1e9"}, r"max_idle_bytes must be a number of bytes >= 0 .* got '1e9'"),
])
def test_client_options_that_are_not_numbers_are_value_errors_naming_them(options, match):
    """USER8: ``runtime.client("cpu", threads="a")`` raised a bare "invalid literal for int()
    with base 10: 'a'", and ``max_idle_bytes=-5`` was accepted (the pool kept nothing idle)."""
    with pytest.raises(ValueError, match=match):
        runtime.client("cpu", **options)
