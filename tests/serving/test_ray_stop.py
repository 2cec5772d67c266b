"""``serve --ray`` stopped by a SIGTERM to its whole process group exits cleanly (SOAK8).

Ray starts a local cluster's processes in the driver's process group with only SIGINT
blocked, so ``kill -TERM -PGID`` (a service manager, ``timeout``) stops the raylet and the
Serve controller too: the driver's ``serve.delete`` then waited on the dead controller until
Ray's GCS client gave up after 60 s and ended the process with status 1, spinning a core
meanwhile (``python -m runtime serve --ray``, and the same cleanup in a script: 71 s, status 1).
:func:`runtime.cluster.stop_serve` (``main_ray``'s cleanup) stops waiting once the local raylet
exits and stops Ray. A driver in a session of its own starts a local cluster and Serve,
SIGTERMs its group, cleans up as ``main_ray`` does and must exit 0 (about 30 s here: Ray's
start and its raylet's own 10 s shutdown). Skipped where Ray or Serve is missing or cannot start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'runtime[ray]')")

REPO = Path(__file__).resolve().parents[2]
DRIVER = """
import os, signal, sys, time
from runtime.cluster import init_ray, stop_serve
try:
    init_ray(num_cpus=1, log_to_driver=False)
    from ray import serve
    serve.start(http_options={{"host": "127.0.0.1", "port": {port}}})
except Exception as e:
    print("SKIP", type(e).__name__, e, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.default_int_handler)     # as main_ray
try:
    os.killpg(os.getpgid(0), signal.SIGTERM)
    time.sleep(120)
except KeyboardInterrupt:
    pass
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("finished", stop_serve("runtime-test-app", local=True, grace_s=1.0), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_sigterm_to_the_process_group_of_a_local_serve_driver_exits_cleanly():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH",
                                                                                 "")]))
    proc = subprocess.Popen([sys.executable, "-c", DRIVER.format(port=_free_port())], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if out.startswith("SKIP"):
        pytest.skip(f"ray cannot start here: {out.strip()}")
    assert proc.returncode == 0, (proc.returncode, out, err[-3000:])
    assert "finished False" in out, out     # the cluster went away: cleanup skipped, not hung
