"""``python -m runtime bench --compare REF``: the core rows against another checkout.

Not a timed test: it compares this checkout with itself (a checkout path as ``REF``) in one
round of few repetitions and checks the JSON has every core row for both sides with sane
numbers, the speed-ups and floor ratios are positive and finite, and a bad ``REF`` is refused.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from runtime.bench import core

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "runtime", "bench", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)


def test_compare_against_a_checkout_writes_every_core_row(tmp_path):
    out = tmp_path / "cmp.json"
    proc = _run(tmp_path, "--compare", str(ROOT), "--rounds", "1", "--reps", "4", "--quick",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    expected = [r for r in core.rows() if r != "enqueue_10000"]
    assert sorted(data["rows"]) == sorted(expected)
    for side in ("ref", "new"):
        rows = data["rounds"][0][side]
        for r in expected:
            s = rows[r]
            assert s["n"] > 0 and 0 < s["p10"] <= s["p50"] <= s["p90"], (side, r, s)
    for r, v in data["rows"].items():
        assert math.isfinite(v["speedup"]) and v["speedup"] > 0, (r, v)
    assert set(data["floor"]["new"]) == {"1", "10", "100", "1000"}
    assert "REF/NEW" in proc.stdout and "sync" in proc.stdout


def test_compare_refuses_an_unknown_ref(tmp_path):
    proc = _run(tmp_path, "--compare", str(tmp_path / "nowhere"), "--rounds", "1")
    assert proc.returncode == 2
    assert "neither a checkout" in proc.stderr
