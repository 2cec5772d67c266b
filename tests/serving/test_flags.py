"""Every ``serve`` flag takes the same effect through ``serve`` and ``serve --ray``, and a bad
flag value gets argparse's answer on every command (issue 25 items 1 and 5).

Both paths run their real ``main`` in this process with the model load replaced by a recorder
returning the fake model of ``tests/fakes.py``: ``serve`` up to the call that would start
uvicorn, ``serve --ray`` up to ``deploy`` (no Ray cluster starts), then the replica the Ray
deployment would build is built from its bound arguments with the deployment's own class.
"""

from __future__ import annotations

import pytest

for _mod in ("fastapi", "httpx"):
    pytest.importorskip(_mod, reason=f"{_mod} is not installed (pip install 'runtime[serve]')")

from fakes import FakeModel  # noqa: E402


class Stop(Exception):
    pass


@pytest.fixture
def paths(monkeypatch):
    """``run(path, argv)`` -> a view of what that path built: ``app``, ``load`` (the model
    load's arguments) and the HTTP settings (``host``, ``port``, ``grace``, ``log_level``,
    ``header_timeout``; with Ray also ``deployment``, its options)."""
    import runtime.serving as serving
    from runtime import cluster
    from runtime.serving import cli, http

    loads = []

    def load_model(backend="cpu", *, path=None, max_graphs=8):
        loads.append({"backend": backend, "path": path, "max_graphs": max_graphs})
        return FakeModel(max_graphs=max_graphs)

    monkeypatch.setattr(serving, "load_model", load_model)
    built = []

    def run(path: str, argv: list) -> dict:
        loads.clear()
        view: dict = {}
        if path == "serve":
            def fake_serve(app, **kw):
                view.update(kw, app=app)
            monkeypatch.setattr(http, "serve", fake_serve)
            assert cli.main(argv) == 0
        else:
            ray_serve = pytest.importorskip("runtime.serving.ray_serve",
                                            reason="ray[serve] is not installed")
            real_build = ray_serve.build_app
            bound = {}

            def build_app(settings=None, **options):
                bound.update(settings=settings, options=options)
                return real_build(settings, **options)

            def deploy(app, *, host, port, **kw):
                view.update(host=host, port=port)
                raise Stop

            monkeypatch.setattr(ray_serve, "build_app", build_app)
            monkeypatch.setattr(ray_serve, "deploy", deploy)
            monkeypatch.setattr(cluster, "init_ray", lambda address=None: None)
            monkeypatch.setattr(ray_serve.serve, "delete", lambda name: None)
            monkeypatch.setattr(ray_serve.serve, "shutdown", lambda: None)
            monkeypatch.setattr(ray_serve.serve, "get_replica_context",
                                lambda: type("Ctx", (), {"replica_tag": "r0"})())
            import signal
            handler = signal.getsignal(signal.SIGTERM)
            with pytest.raises(Stop):
                cli.main(["--ray"] + argv)
            # main_ray ignores SIGTERM during its cleanup only: left ignored, every child this
            # process started later inherited it (test_http's SIGTERM tests failed after this)
            assert signal.getsignal(signal.SIGTERM) is handler
            opts = ray_serve.deployment_options(bound["settings"].backend,
                                                **dict(bound["options"],
                                                       grace=bound["settings"].grace,
                                                       log_level=bound["settings"].log_level))
            replica = ray_serve.ReplicaServer(bound["settings"])
            s = bound["settings"]
            view.update(app=replica.__serve_build_asgi_app__(), grace=s.grace, replica=replica,
                        log_level=s.log_level, header_timeout=None, deployment=opts)
        view["load"] = dict(loads[0]) if loads else None
        built.append(view["app"])
        return view

    yield run
    for app in built:
        app.state.batcher.close()


def _client(app):
    from starlette.testclient import TestClient
    return TestClient(app)


def _post(app, body, headers=None):
    return _client(app).post("/v1/embeddings", json=body, headers=headers or {})


def _queue_full(v):
    # the case: 6 requests of 4 texts with --max-queue 4: the batcher takes 4 texts
    b = v["app"].state.batcher
    assert b.max_queue == 4
    import threading
    gate = threading.Event()
    b.model.gate = gate
    try:
        first = b.submit(["a"] * 4)
        from runtime.serving.batcher import QueueFull
        while not b.model.entered.is_set():
            gate.wait(0.01)
        second = b.submit(["b"] * 4)
        with pytest.raises(QueueFull):
            b.submit(["c"])
    finally:
        gate.set()
    first.result(10), second.result(10)
    return True


# flag -> (argv, check(view) -> truthy): each check looks at the effect, not the argument
FLAGS = {
    "--backend": (["--backend", "wgpu"], lambda v: v["load"]["backend"] == "wgpu"),
    "--host": (["--host", "127.0.0.2"], lambda v: v["host"] == "127.0.0.2"),
    "--port": (["--port", "8123"], lambda v: v["port"] == 8123),
    "--eager": (["--eager"], lambda v: v["app"].state.batcher.path == "eager"),
    "--max-graphs": (["--max-graphs", "3"], lambda v: v["load"]["max_graphs"] == 3
                     and v["app"].state.batcher.model.max_graphs == 3),
    "--warmup": (["--warmup", "2x16"], lambda v: v["app"].state.batcher.model.buckets
                 == [(2, 16)]),
    "--batch-buckets": (["--batch-buckets", "1,3"],
                        lambda v: v["app"].state.batcher.batch_buckets == (1, 3)),
    "--seq-buckets": (["--seq-buckets", "8,256"],
                      lambda v: v["app"].state.batcher.seq_buckets == (8, 256)),
    "--max-batch": (["--max-batch", "4"], lambda v: v["app"].state.batcher.row_cap(16) == 4),
    "--max-batch-tokens": (["--max-batch-tokens", "256"],
                           lambda v: v["app"].state.batcher.row_cap(256) == 1),
    "--max-wait-ms": (["--max-wait-ms", "7"],
                      lambda v: v["app"].state.batcher.max_wait == 0.007),
    "--max-queue": (["--max-queue", "4"], _queue_full),
    "--streams": (["--streams", "2", "--warmup", "2x16"], lambda v: len({
        id(b.model) for b in getattr(v["app"].state.batcher, "batchers", ())}) == 2 and all(
        b.model.buckets == [(2, 16)] for b in v["app"].state.batcher.batchers)
        and _post(v["app"], {"input": ["a", "b"]}).status_code == 200),
    "--max-inputs": (["--max-inputs", "2"],
                     lambda v: _post(v["app"], {"input": ["a", "b", "c"]}).status_code == 400
                     and _post(v["app"], {"input": ["a", "b"]}).status_code == 200),
    "--max-input-chars": (["--max-input-chars", "5"],
                          lambda v: _post(v["app"], {"input": "abcdef"}).status_code == 400
                          and _post(v["app"], {"input": "abcde"}).status_code == 200),
    "--max-body-bytes": (["--max-body-bytes", "40"],
                         lambda v: _post(v["app"], {"input": "a" * 40}).status_code == 413),
    "--body-timeout": (["--body-timeout", "3"], lambda v: _client(v["app"]).get(
        "/health").json()["settings"]["body_timeout"] == 3),
    "--grace": (["--grace", "3"], lambda v: v["grace"] == 3 and (
        "deployment" not in v or v["deployment"]["graceful_shutdown_timeout_s"] == 8)),
    "--api-key": (["--api-key", "k"],
                  lambda v: _client(v["app"]).get("/v1/models").status_code == 401
                  and _client(v["app"]).get("/v1/models", headers={
                      "authorization": "Bearer k"}).status_code == 200),
    "--token-ids": (["--token-ids", "wordpiece"], lambda v: _client(v["app"]).get(
        "/v1/models").json()["data"][0]["token_ids"] == "wordpiece"),
    "--otlp-endpoint": (["--otlp-endpoint", "http://127.0.0.1:9/v1/traces"],
                        lambda v: v["app"].state.tracing is not None),
    "--model-dir": (["--model-dir", "/models/minilm"],
                    lambda v: v["load"]["path"] == "/models/minilm"),
    "--log-level": (["--log-level", "debug"], lambda v: v["log_level"] == "debug" and (
        "deployment" not in v or v["deployment"]["logging_config"]["log_level"] == "DEBUG")),
}
#: Flags of one path only, and why (each refused on the other with argparse's answer).
ONE_PATH = {"--header-timeout": "serve only: Serve's proxy reads the request headers",
            "--ray": "the switch itself", "--replicas": "--ray only", "--address": "--ray only",
            "--min-replicas": "--ray only", "--max-replicas": "--ray only",
            "--target-ongoing-requests": "--ray only", "--replica-cpus": "--ray only",
            "--trace": "serve only: traces this process (tests/test_tracing.py)"}


def test_every_serve_flag_is_covered():
    from runtime.serving.cli import build_parser

    names = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert names - {"--help"} == set(FLAGS) | set(ONE_PATH)


@pytest.mark.parametrize("flag", sorted(FLAGS))
@pytest.mark.parametrize("path", ["serve", "serve --ray"])
def test_each_serve_flag_takes_effect_on_both_paths(flag, path, paths, monkeypatch):
    argv, check = FLAGS[flag]
    monkeypatch.delenv("RUNTIME_API_KEY", raising=False)
    view = paths(path, argv)
    assert check(view), (flag, path)
    default = paths(path, [])                     # and without the flag, it does not hold
    if flag not in ("--otlp-endpoint",):
        assert not _safe(check, default), (flag, path, "holds without the flag")


def _safe(check, view):
    try:
        return check(view)
    except (AssertionError, TypeError, KeyError):
        return False


def test_header_timeout_and_ray_flags_are_refused_on_the_other_path(capsys):
    from runtime.serving.cli import parse_args

    for argv in (["--ray", "--header-timeout", "3"], ["--replicas", "2"],
                 ["--ray", "--replicas", "2", "--max-replicas", "1"]):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: python -m runtime serve") and err.count("error:") == 1


BAD_VALUES = [
    ["serve", "--warmup", "3x16"], ["serve", "--warmup", "1x512"], ["serve", "--warmup", "0x16"],
    ["serve", "--max-batch-tokens", "100"], ["serve", "--seq-buckets", "16,32"],
    ["serve", "--grace", "-5"], ["serve", "--max-wait-ms", "-1"], ["serve", "--port", "70000"],
    ["serve", "--batch-buckets", "4,2"], ["serve", "--max-queue", "0"],
    ["serve", "--replicas", "0", "--ray"], ["serve", "--replica-cpus", "-1", "--ray"],
    ["serve", "--token-ids", "gpt2"], ["serve", "--grace", "nan"],
    ["serve", "--batch-buckets", "2,4", "--max-batch-tokens", "256"],
    ["embed-corpus", "x.jsonl", "--out", "y", "--batch-size", "0"],
    ["embed-corpus", "x.jsonl", "--out", "y", "--actors", "0"],
    ["embed-corpus", "x.jsonl", "--out", "y", "--seq-buckets", "16,32"],
    ["embed-corpus", "x.jsonl", "--out", "y", "--max-graphs", "-2"],
    ["embed-corpus", "x.jsonl", "--out", "y", "--actor-cpus", "-1"],
    ["demo", "--clients", "0"], ["demo", "--requests", "-3"],
]


@pytest.mark.parametrize("argv", BAD_VALUES, ids=lambda a: " ".join(a))
def test_a_bad_flag_value_gets_the_usage_and_one_error_line(argv, capsys, monkeypatch):
    from runtime import __main__ as cli
    import runtime.serving as serving

    def no_model(*a, **k):
        raise AssertionError("the command started before its flags were checked")

    monkeypatch.setattr(serving, "load_model", no_model)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[0].startswith(f"usage: python -m runtime {argv[0]}"), err
    assert sum(ln.startswith("python -m runtime") and "error:" in ln for ln in lines) == 1, err
    assert "Traceback" not in err


def test_serve_on_a_port_another_process_holds_says_so_and_exits_1(monkeypatch, capsys):
    """USER7: ``serve`` on a taken port printed only uvicorn's "OSError: [Errno 98] Address
    already in use"; it says which address and what to do (--port 0), exit status 1."""
    import socket

    import runtime.serving as serving
    from runtime.serving import cli

    monkeypatch.setattr(serving, "load_model",
                        lambda backend="cpu", *, path=None, max_graphs=8: FakeModel())
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        assert cli.main(["--host", "127.0.0.1", "--port", str(port), "--backend", "cpu"]) == 1
    finally:
        held.close()
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port 0" in err, err


def test_health_reports_the_buckets_and_limits_that_run_when_the_flags_left_them_default(paths):
    """USER7: /health said ``batch_buckets: null`` and ``max_batch_tokens: null`` for the
    defaults; it reports what the batcher runs with (the README's 1,2,4,8,16,32 and 8192)."""
    v = paths("serve", [])
    b = v["app"].state.batcher
    got = _client(v["app"]).get("/health").json()["settings"]
    assert got["batch_buckets"] == list(b.batch_buckets) and None not in got["batch_buckets"]
    assert got["seq_buckets"] == list(b.seq_buckets)
    assert got["max_batch_tokens"] == b.max_batch_tokens > 0
    assert got["max_batch"] == b.max_batch > 0


def test_serve_trace_with_a_bad_event_count_says_which_variable_and_exits_2(monkeypatch, capsys):
    """USER8: ``serve --trace`` read ``RUNTIME_TRACE_EVENTS`` with a bare ``int()`` (a
    traceback for ``abc``); it names the variable in one error line, exit status 2, before
    the server starts."""
    import runtime.serving as serving
    from runtime.serving import cli

    def no_model(*a, **k):
        raise AssertionError("the server started with a bad RUNTIME_TRACE_EVENTS")

    monkeypatch.setattr(serving, "load_model", no_model)
    monkeypatch.setenv("RUNTIME_TRACE_EVENTS", "abc")
    assert cli.main(["--host", "127.0.0.1", "--port", "0", "--trace", "t.json"]) == 2
    err = capsys.readouterr().err
    assert "RUNTIME_TRACE_EVENTS='abc'" in err and "positive integer" in err, err
    assert "Traceback" not in err
