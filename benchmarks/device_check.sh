#!/usr/bin/env bash
# One device check of the cuda backend, for a machine with an NVIDIA GPU and nothing reachable
# outside it (the `device` tool's machine). Under 6 minutes:
#   1. install wheels carried in .whl/ (if any) into /tmp/site; nothing is fetched;
#   2. record the environment (GPU, driver, python, numpy, cupy);
#   3. the conformance suite (graph update/instantiate and conditionals included: on cuda CUDA
#      12.4 conditional nodes and in-place kernel-node updates), the cuda tests (with
#      tests/backends/cuda/test_cuda_graph.py) and the one-replay decode loops, raw and as a
#      StaticGraph(loop=) (tests/models/test_decode_loop.py), on cuda (RUNTIME_TEST_BACKENDS=cuda);
#   4. the latency benchmarks (benchmarks/cuda_latency.py: eager vs replay for graph lengths
#      1/10/100/1000, replay enqueue p50/p99, MiniLM forward eager vs replay);
#   5. examples/decode.py on cuda: per-token replays vs one replay per sequence.
# Writes into $OUT when set (else benchmarks/results/): device_check.json (summary), env.txt,
# cuda_tests.log, cuda_tests.xml, cuda_latency.json, cuda_latency.log, decode.log (7 files: the
# tool brings back at most 8).
#
# Run through the device tool from the repo root, e.g.
#   run(command="bash benchmarks/device_check.sh", timeout_s=420)
# adding carry=[".whl"] only when a package is missing there (the image has numpy, pytest and
# cupy-cuda13x; conditional nodes and kernel-node updates also need cuda-bindings, e.g.
# NAME==VERSION = cuda-bindings==12.9.10 and cuda-pathfinder==1.9.1, without which those tests
# skip with the reason); to make
# that folder here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl NAME==VERSION
set -u
cd "$(dirname "$0")/.."
RES="${OUT:-benchmarks/results}"
mkdir -p "$RES"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
START=$(date +%s)

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "wheel install failed" >&2; exit 2; }
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

{
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1; else echo "nvidia-smi: not found"; fi
    "$PY" - <<'EOF' 2>&1
import platform, numpy
print("python", platform.python_version(), "numpy", numpy.__version__)
try:
    import cupy
    rt = cupy.cuda.runtime
    print("cupy", cupy.__version__, "hip", rt.is_hip, "runtime", rt.runtimeGetVersion(),
          "driver", rt.driverGetVersion(), "devices", rt.getDeviceCount())
    from runtime.backends.cuda import CudaBackend
    print("probe", CudaBackend.probe())
    from runtime.backends import cuda_graph as cg
    print("conditional nodes:", cg.support_reason(cg.driver_version(), rt.is_hip,
                                                  cg.BINDINGS_MISSING) or "supported")
except Exception as e:
    print("cuda unavailable:", type(e).__name__, e)
EOF
} | tee "$RES/env.txt"

# 3. tests: 150 s at most; faulthandler dumps stacks of a test stuck for 60 s
T0=$(date +%s)
RUNTIME_TEST_BACKENDS=cuda timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider \
    -o faulthandler_timeout=60 --junitxml="$RES/cuda_tests.xml" \
    tests/contracts tests/backends/cuda tests/models/test_decode_loop.py > "$RES/cuda_tests.log" 2>&1
TESTS_RC=$?
TESTS_S=$(( $(date +%s) - T0 ))
tail -n 25 "$RES/cuda_tests.log"

# 4. latency: 100 s at most
T0=$(date +%s)
timeout 100 "$PY" benchmarks/cuda_latency.py --backend cuda --out "$RES/cuda_latency.json" \
    > "$RES/cuda_latency.log" 2>&1
BENCH_RC=$?
BENCH_S=$(( $(date +%s) - T0 ))
cat "$RES/cuda_latency.log" | tail -n 12

# 5. the decode example on cuda: per token vs one replay per sequence (conditional WHILE node,
#    raw and StaticGraph(loop=)); identical tokens or exit status 1. 60 s at most
timeout 60 "$PY" examples/decode.py --backend cuda --tokens 32 --repeats 2 > "$RES/decode.log" 2>&1
DECODE_RC=$?
tail -n 12 "$RES/decode.log"

TESTS_RC=$TESTS_RC BENCH_RC=$BENCH_RC DECODE_RC=$DECODE_RC TESTS_S=$TESTS_S BENCH_S=$BENCH_S \
TOTAL_S=$(( $(date +%s) - START )) \
RES="$RES" "$PY" - <<'EOF'
import json, os, xml.etree.ElementTree as ET
res = os.environ["RES"]
out = {k.lower(): int(os.environ[k]) for k in ("TESTS_RC", "BENCH_RC", "DECODE_RC", "TESTS_S",
                                                "BENCH_S", "TOTAL_S")}
try:
    suite = ET.parse(os.path.join(res, "cuda_tests.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    out["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    out["tests"]["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                              if c.find("failure") is not None or c.find("error") is not None]
except Exception as e:
    out["tests"] = {"unreadable": f"{type(e).__name__}: {e}"}
try:
    with open(os.path.join(res, "cuda_latency.json")) as f:
        lat = json.load(f)
    out["device"] = lat.get("device")
    out["chain_p50_us"] = {r["length"]: {"eager": r["eager_e2e_us"]["p50"],
                                         "replay": r["replay_e2e_us"]["p50"],
                                         "x": r["speedup_e2e_p50"], "checked": r["checked"]}
                           for r in lat["chain"]}
    out["replay_enqueue_us"] = lat["replay_enqueue"]["us"]
    out["minilm"] = lat["minilm"]
except Exception as e:
    out["latency"] = {"unreadable": f"{type(e).__name__}: {e}"}
with open(os.path.join(res, "device_check.json"), "w") as f:
    json.dump(out, f, indent=1)
print(json.dumps(out))
EOF
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$DECODE_RC" -eq 0 ]
