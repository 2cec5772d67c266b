"""The pytest plugin (runtime.testing.plugin) through pytester: variants, options, the failure
section and its reproduce commands (run again in a subprocess), the README example.

The plugin is loaded with ``-p runtime.testing.plugin`` so the tests do not depend on the
package being installed (the entry point has the same name, so both ways coexist).
"""

import pathlib
import re
import shlex
import sys

import hypothesis  # noqa: F401 - imported once here, not again by every inline pytester run
import pytest

pytest_plugins = ("pytester",)
PLUGIN = ("-p", "runtime.testing.plugin")
README = pathlib.Path(__file__).resolve().parents[2] / "README.md"

USER_TEST = '''
import numpy as np, pytest, runtime
from runtime import kernels as K


def step(c, wait):
    loader, worker = (c.with_stream(runtime.StreamId.new()) for _ in range(2))
    x, y = c.create(np.zeros(4, np.float32)), c.create(np.zeros(4, np.float32))
    c.sync()
    worker.graph_prepare(); worker.start_capture()
    worker.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    g = worker.stop_capture()
    loader.write(x, np.full(4, 5, np.float32))
    if wait:
        worker.wait_event(loader.record_event())
    g.replay()
    return worker.read(y)


@pytest.mark.interleavings(20, check=False)
def test_missing_wait(runtime_client):
    assert step(runtime_client, wait=False).tolist() == [6, 6, 6, 6]


@pytest.mark.interleavings(20)
def test_with_wait(runtime_client):
    assert step(runtime_client, wait=True).tolist() == [6, 6, 6, 6]
'''


def ids(result) -> list:
    return re.findall(r"\[([\w-]+)\]", result.stdout.str())


def test_the_options_choose_the_variants(pytester):
    pytester.makepyfile(test_v='''
import pytest

def test_default(runtime_client):
    pass

@pytest.mark.interleavings(3)
def test_marked(runtime_variant):
    pass
''')
    r = pytester.runpytest(*PLUGIN, "--collect-only", "-q")
    got = ids(r)
    assert got == [f"cpu-seed{s}" for s in range(10)] + ["wgpu", "cuda"] + [
        f"cpu-seed{s}" for s in range(3)] + ["wgpu", "cuda"], got
    r = pytester.runpytest(*PLUGIN, "--collect-only", "-q", "--runtime-seeds", "2",
                           "--runtime-backends", "cpu")
    assert ids(r) == ["cpu-seed0", "cpu-seed1"] * 2
    r = pytester.runpytest(*PLUGIN, "--collect-only", "-q", "--runtime-seed", "17")
    assert ids(r) == ["cpu-seed17"] * 2
    r = pytester.runpytest(*PLUGIN, "--collect-only", "-q", "--runtime-backends", "wgpu")
    assert ids(r) == ["wgpu"] * 2
    (pytester.path / "t.trace").write_text("0*2,1\n")
    r = pytester.runpytest(*PLUGIN, "--collect-only", "-q", "--runtime-trace", "t.trace")
    assert ids(r) == ["cpu-trace"] * 2
    r = pytester.runpytest(*PLUGIN, "--collect-only", "-q", "--runtime-backends", "tpu")
    assert r.ret != 0 and "unknown ['tpu']" in r.stdout.str() + r.stderr.str()


def test_each_variant_gets_its_own_scheduler_and_checker(pytester):
    pytester.makepyfile(test_s='''
def test_server(runtime_client, runtime_variant):
    sched = runtime_client._server.backend.scheduler   # private: the seed the plugin promises
    assert sched.seed == runtime_variant.seed
    assert runtime_client.capabilities["checked"]
''')
    pytester.runpytest(*PLUGIN, "--runtime-backends", "cpu", "--runtime-seeds", "3"
                       ).assert_outcomes(passed=3)


def run_command(pytester, line: str):
    """Run a printed ``pytest ...`` command in a subprocess, as a user would paste it."""
    args = shlex.split(line)
    assert args[0] == "pytest"
    return pytester.run(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args[1:],
                        timeout=300)


def test_a_missing_wait_fails_some_seeds_and_the_printed_commands_reproduce_it(pytester):
    pytester.makepyfile(test_user=USER_TEST)
    r = pytester.runpytest(*PLUGIN, "--runtime-backends", "cpu")
    out = r.stdout.str()
    failed = sorted({int(s) for s in re.findall(r"test_missing_wait\[cpu-seed(\d+)\] - ", out)})
    assert failed and len(failed) < 20, out[-3000:]          # within 20 seeds, not every seed
    assert "test_with_wait" not in "".join(re.findall(r"FAILED .*", out))  # correct: every seed
    r.assert_outcomes(failed=len(failed), passed=40 - len(failed))
    seed = failed[0]
    line = re.search(rf"reproduce: (pytest .*--runtime-seed {seed} .*)", out).group(1)
    assert line.endswith("test_user.py::test_missing_wait")
    again = run_command(pytester, line)
    again.assert_outcomes(failed=1)
    assert f"test_missing_wait[cpu-seed{seed}]" in again.stdout.str()
    assert "assert [1.0, 1.0, 1.0, 1.0] == [6, 6, 6, 6]" in again.stdout.str()
    same = re.search(rf"same schedule: (pytest .*-cpu-seed{seed}\.trace .*)", out).group(1)
    trace = pathlib.Path(shlex.split(same)[-2])
    assert trace.is_file()
    replayed = run_command(pytester, same)
    replayed.assert_outcomes(failed=1)
    assert "assert [1.0, 1.0, 1.0, 1.0] == [6, 6, 6, 6]" in replayed.stdout.str()


def test_the_readme_example_fails_under_interleavings_with_the_seed_and_a_reproduce_line(
        pytester):
    text = README.read_text()
    section = text[text.index("## Testing your stream ordering"):]
    block = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    pytester.makepyfile(test_step=block)
    r = pytester.runpytest(*PLUGIN, "--runtime-backends", "cpu", "-k", "not plain",
                           "--runtime-seeds", "2")
    r.assert_outcomes(failed=2, deselected=1)
    out = r.stdout.str()
    assert "StreamRaceError" in out and "runtime schedule" in out
    assert "reproduce: pytest -p runtime.testing.plugin --runtime-seed 1 test_step.py::test_step" \
        in out


@pytest.mark.parametrize("marker", ["@pytest.mark.interleavings(0)", ""])
def test_a_bad_marker_is_a_usage_error_and_a_marker_without_the_fixture_warns(pytester, marker):
    if marker:
        pytester.makepyfile(test_m=f"import pytest\n{marker}\ndef test_x(runtime_client): pass\n")
        r = pytester.runpytest(*PLUGIN, "-q")
        assert r.ret != 0 and "number of seeds must be >= 1" in r.stdout.str() + r.stderr.str()
    else:
        pytester.makepyfile(test_m="import pytest\n@pytest.mark.interleavings(3)\n"
                                   "def test_x(): pass\n")
        r = pytester.runpytest(*PLUGIN, "-q")
        r.assert_outcomes(passed=1)     # (an installed plugin adds pytest's rewrite warning)
        assert "has no effect without the runtime_client fixture" in r.stdout.str()
