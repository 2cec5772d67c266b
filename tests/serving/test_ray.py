"""Scaling out on Ray: corpus embedding with Ray Data, the server as a Ray Serve deployment.

One local Ray cluster for the module, on loopback only (``runtime.cluster.init_ray``:
``ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False)``), checked with
``ray.nodes()``; Serve's HTTP proxy listens on 127.0.0.1. Every embedding is checked against the
MiniLM reference fixture to 1e-4. Skipped, with the reason, when ray (serve, data), pyarrow,
fastapi/httpx or the model files are missing, or when Ray cannot start here.
About 3-4 minutes measured on the shared 2-core machine at load 5-11 (cluster and the module's
corpus run ~50-60 s, the bad corpora through both paths ~40-60 s, the resumed run ~20 s, Serve
~70-90 s); less on a quiet one. Each Ray Data run costs mostly its actor starting (a process,
the imports, the model), so the corpus runs once for the module and the resume test resumes a
copy of it, and the bad corpora's Ray runs start their actors at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

for _mod in ("ray", "ray.serve", "ray.data", "pyarrow", "fastapi", "httpx", "safetensors",
             "tokenizers"):
    pytest.importorskip(_mod, reason=f"{_mod} is not installed (pip install 'runtime[ray]')")

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
# small bucket lists keep the captures few: batches of 1, 4 or 16; the rest are non-default
# values of every kind of serve flag, which /health must report from each replica
SERVE_ARGS = ["--ray", "--replicas", "2", "--replica-cpus", "0.25", "--max-graphs", "6",
              "--batch-buckets", "1,4,16", "--seq-buckets", "16,32,256", "--max-wait-ms", "5",
              "--max-queue", "1000", "--max-batch-tokens", "4096", "--max-inputs", "64",
              "--max-input-chars", "20000", "--grace", "3", "--token-ids", "wordpiece"]


@pytest.fixture(scope="module")
def cluster():
    """A local 2-CPU Ray cluster on 127.0.0.1 for this module."""
    import ray

    from runtime.cluster import NotLoopback, init_ray, node_addresses
    from runtime.models.minilm import default_model_dir
    try:
        if not (default_model_dir() / "model.safetensors").is_file():
            pytest.skip(f"no MiniLM model files in {default_model_dir()}")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    try:
        init_ray(num_cpus=2, log_to_driver=False)
    except NotLoopback:
        raise
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"ray cannot start here: {type(e).__name__}: {e}")
    addresses = node_addresses()
    assert addresses and all(a == LOOPBACK for a in addresses), addresses
    yield
    ray.shutdown()


def _rows(table, column="embedding") -> np.ndarray:
    """A fixed-size-list column as float32 [n, 384], NaN rows where null."""
    col = table.column(column)
    out = np.full((table.num_rows, 384), np.nan, np.float32)
    valid = np.asarray(col.is_valid())
    out[valid] = np.asarray(col.drop_null().combine_chunks().flatten(), np.float32).reshape(-1,
                                                                                          384)
    return out


ROWS, BLOCK_ROWS, NULL_ROW = 400, 100, 200
# the Ray run's settings; the resumed run must use the same ones (the same rows, bit for bit)
RAY_KW = {"use_ray": True, "actors": 1, "batch_size": 256, "block_rows": BLOCK_ROWS,
          "actor_cpus": 0.5, "backend": "cpu", "max_graphs": 8, "seq_buckets": (8, 32, 256),
          "progress": False}


@pytest.fixture(scope="module")
def corpus_run(ref, cluster, tmp_path_factory):
    """One corpus (12 reference sentences spread out, a null text, short texts) embedded once
    for the module: by the in-process CLI as a user runs it (a subprocess) and meanwhile by a
    1-actor Ray Data pool into a dataset folder of 4 blocks. Returns a dict: src, the Ray
    folder and summary, the CLI's file and (returncode, stdout + stderr), ``where`` (row ->
    reference sentence). The resume test copies the folder, so each test sees it as written."""
    from runtime.corpus import embed_corpus

    tmp = tmp_path_factory.mktemp("corpus")
    sents = [str(s) for s in ref["sentences"]]
    where = {i * 31 + 5: k for k, i in enumerate(range(12))}       # reference rows, spread out
    src = tmp / "corpus.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for i in range(ROWS):
            text = sents[where[i]] if i in where else None if i == NULL_ROW else f"item {i}"
            f.write(json.dumps({"id": i, "text": text, "tag": f"t{i % 7}"}) + "\n")
    local_out = tmp / "local.parquet"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH",
                                                                                 "")]))
    cli = subprocess.Popen([sys.executable, "-m", "runtime", "embed-corpus", str(src), "--out",
                            str(local_out), "--max-graphs", "8", "--seq-buckets", "8,32,256",
                            "--block-rows", str(BLOCK_ROWS)], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        summary = embed_corpus(src, tmp / "ray", **RAY_KW)
        out, err = cli.communicate(timeout=300)
    finally:
        cli.kill()
    return {"src": src, "ray": tmp / "ray", "summary": summary, "local": local_out,
            "cli": (cli.returncode, out + err), "where": where}


def test_embed_corpus_on_ray_data_equals_the_in_process_command(ref, corpus_run):
    import pyarrow.parquet as pq

    code, err = corpus_run["cli"]
    summary, where = corpus_run["summary"], corpus_run["where"]
    assert code == 1, err                                    # 1: a row failed, and says which
    assert f"row {NULL_ROW}: the text is null" in err and f"{ROWS} rows" in err
    assert (summary.rows, summary.failed, summary.blocks) == (ROWS, 1, 4)
    assert summary.failures == [(NULL_ROW, "the text is null")]
    # the workers wrote one file per block, the row index first; the driver wrote none
    parts = sorted(p.name for p in corpus_run["ray"].iterdir())
    assert parts == ["_plan.json"] + [f"part-{i:06d}.parquet" for i in range(4)]
    remote = pq.read_table(corpus_run["ray"])
    assert remote.column("input_row").to_pylist() == list(range(ROWS))
    local, remote = pq.read_table(corpus_run["local"]), remote.drop_columns(["input_row"])
    for t in (local, remote):
        assert t.column_names == ["id", "text", "tag", "embedding", "embedding_error"]
        assert t.num_rows == ROWS and t.column("id").to_pylist() == list(range(ROWS))
        assert t.column("tag").to_pylist() == [f"t{i % 7}" for i in range(ROWS)]
        kind = t.schema.field("embedding").type
        assert kind.list_size == 384 and str(kind.value_type) == "float"
        errors = t.column("embedding_error").to_pylist()
        assert [i for i, e in enumerate(errors) if e] == [NULL_ROW]
    a, b = _rows(local), _rows(remote)
    assert np.isnan(a[NULL_ROW]).all() and np.isnan(b[NULL_ROW]).all()
    keep = np.arange(ROWS) != NULL_ROW
    assert np.abs(a[keep] - b[keep]).max() < 1e-5
    assert np.abs(np.linalg.norm(b[keep], axis=1) - 1).max() < 1e-4
    rows = sorted(where)
    assert np.abs(b[rows] - ref["embeddings"][[where[i] for i in rows]]).max() < 1e-4


def _bad_corpora(tmp_path) -> dict:
    """name -> (file, the exit status embed-corpus must give)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    lines = ['{"id": 0, "tag": "x"}', '{"id": 1, "text": "hello there"}', "",
             '{"id": 2, "text": 5}', "not json", "[1, 2]", '{"id": 3, "text": null}',
             '{"id": 4, "text": {"a": 1}, "tag": 7}', '{"id": 5, "text": "bye now"}']
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines * 3) + "\n")
    out["mixed.jsonl"] = 1
    (tmp_path / "notext.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n')
    out["notext.jsonl"] = 2
    (tmp_path / "empty.jsonl").write_text("\n\n")
    out["empty.jsonl"] = 2
    rows = "".join(f'{i},"line {i}\nwith, a comma",{i if i % 4 else "x"}\n' for i in range(20))
    (tmp_path / "quoted.csv").write_text("id,text,n\n" + rows + "21,42,1\n")
    out["quoted.csv"] = 0
    pq.write_table(pa.table({"id": list(range(9)), "text": list(range(9))}),
                   tmp_path / "inttext.parquet", row_group_size=4)
    out["inttext.parquet"] = 1
    return out


def _status(run) -> tuple:
    """(exit status as the CLI gives it, summary or None)."""
    try:
        s = run()
    except (ValueError, FileNotFoundError):
        return 2, None
    return (1 if s.failed else 0), s


@pytest.fixture
def one_core():
    """This process's cpu thread rule on one core (as each 0.5-CPU actor's), restored after:
    the same thread split gives the same float32 sums, so the files can match byte for byte."""
    from runtime.cpu_threads import RULE

    yield 1
    RULE.set_cores(None)


def test_bad_corpora_give_byte_identical_files_and_statuses_on_both_paths(cluster, tmp_path,
                                                                        one_core):
    import pyarrow.parquet as pq

    from runtime.corpus import embed_corpus

    settings = {"backend": "cpu", "graph": False, "seq_buckets": (8, 32, 256),
                "cpu_threads": one_core}
    corpora = _bad_corpora(tmp_path)

    def run(name, use_ray):
        out = tmp_path / f"{name}.{'ray' if use_ray else 'local'}.parquet"
        kw = {"use_ray": True, "single_file": True, "actor_cpus": 0.5} if use_ray else {}
        return _status(lambda: embed_corpus(tmp_path / name, out, block_rows=4, progress=False,
                                            **kw, **settings))

    # every Ray run at once (a 0.5-CPU actor each, 1.5 of the cluster's 2 CPUs), the
    # in-process runs one after another beside them: most of a run is an actor starting
    pool = ThreadPoolExecutor(len(corpora) + 1)
    try:
        ray_runs = {name: pool.submit(run, name, True) for name in corpora}
        local = pool.submit(lambda: {name: run(name, False) for name in corpora}).result(600)
        done = {name: (local[name], f.result(600)) for name, f in ray_runs.items()}
    finally:
        pool.shutdown(wait=False)                    # bounded: each result waited 600 s at most
    for name, want in corpora.items():
        local, ray_file = tmp_path / f"{name}.local.parquet", tmp_path / f"{name}.ray.parquet"
        (got_local, s1), (got_ray, s2) = done[name]
        assert got_local == got_ray == want, name
        if want == 2:
            assert not local.exists() and not ray_file.exists(), name
            continue
        assert (s1.rows, s1.failed, s1.failures) == (s2.rows, s2.failed, s2.failures), name
        a, b = pq.read_table(local), pq.read_table(ray_file)
        assert ("text_raw" in a.column_names) == (name != "quoted.csv"), name  # values kept
        assert a.drop_columns(["embedding"]).equals(b.drop_columns(["embedding"])), name
        assert np.abs(np.nan_to_num(_rows(a) - _rows(b))).max() < 1e-6, name
        assert local.read_bytes() == ray_file.read_bytes(), name
        assert sorted(p.name for p in tmp_path.iterdir() if ".parts" in p.name
                      or ".partial" in p.name) == [], name


def test_a_stopped_ray_run_resumes_from_its_finished_blocks(corpus_run, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    from runtime.corpus import embed_corpus

    # a copy of the module's run, as if it had run on a copy of its input (same size and time)
    src, out = tmp_path / "c.jsonl", tmp_path / "out"
    shutil.copy2(corpus_run["src"], src)
    shutil.copytree(corpus_run["ray"], out)
    manifest = json.loads((out / "_plan.json").read_text())
    manifest["path"] = str(src.resolve())
    (out / "_plan.json").write_text(json.dumps(manifest))
    want = pq.read_table(corpus_run["ray"])
    (out / "part-000001.parquet").unlink()                       # as if stopped mid-run
    (out / "part-000003.parquet").rename(out / ".part-000003.parquet.99.tmp")
    with pytest.raises(ValueError, match="--resume"):
        embed_corpus(src, out, **RAY_KW)
    again = embed_corpus(src, out, resume=True, **RAY_KW)
    assert (again.blocks, again.resumed, again.rows, again.failed) == (4, 2, ROWS, 1)
    assert again.failures == [(NULL_ROW, "the text is null")]
    assert sorted(p.name for p in out.iterdir()) == \
        ["_plan.json"] + [f"part-{i:06d}.parquet" for i in range(4)]
    assert pq.read_table(out).equals(want)
    src.write_text(src.read_text() + '{"text": "one more"}\n')   # another input: refused
    with pytest.raises(ValueError, match="another run"):
        embed_corpus(src, out, resume=True, **RAY_KW)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(cluster):
    """The embeddings deployment with 2 replicas behind Serve's proxy on 127.0.0.1."""
    from ray import serve

    from runtime.serving.cli import parse_args, settings_from_args
    from runtime.serving.ray_serve import build_app_from_args, deploy

    args = parse_args(SERVE_ARGS)
    url = deploy(build_app_from_args(args, settings_from_args(args)), host=LOOPBACK,
                 port=_free_port())
    assert url.startswith(f"http://{LOOPBACK}:")
    yield url
    serve.shutdown()


async def _post_all(url: str, bodies: list, timeout: float = 120.0) -> list:
    import httpx

    async with httpx.AsyncClient(timeout=timeout) as c:
        return await asyncio.gather(*[c.post(url + "/v1/embeddings", json=b) for b in bodies])


def _check_rows(r, want: np.ndarray) -> None:
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    got = np.array([d["embedding"] for d in data], np.float32)
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-4


def _replica_names() -> list:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::runtime-embeddings#"))


def test_two_replicas_answer_concurrent_requests_with_the_reference(ref, served):
    import httpx

    from runtime.serving import MODEL_ID
    from runtime.serving.ray_serve import REPLICA_HEADER

    sents = [str(s) for s in ref["sentences"]]
    want = ref["embeddings"]
    plan = [[i] for i in range(12)] + [[0, 5, 3, 1], [2, 2, 7], [9, 4, 8, 10, 6]]
    rs = asyncio.run(_post_all(served, [{"input": [sents[i] for i in p], "model": MODEL_ID}
                                        for p in plan] + [{"input": []}]))
    for p, r in zip(plan, rs):
        _check_rows(r, want[p])
        assert r.json()["usage"]["prompt_tokens"] == int(ref["lengths"][p].sum())
    assert rs[-1].status_code == 400 and rs[-1].json()["error"]["message"]
    seen = {r.headers[REPLICA_HEADER] for r in rs}
    for _ in range(5):                       # bounded: Serve's router picks 2 of 2 at random
        if len(seen) == 2:
            break
        more = asyncio.run(_post_all(served, [{"input": sents[i]} for i in range(8)]))
        seen |= {r.headers[REPLICA_HEADER] for r in more}
    names = _replica_names()
    assert len(names) == 2 and seen == {n.rsplit("#", 1)[1] for n in names}
    assert httpx.get(served + "/v1/models", timeout=30).json()["data"][0]["id"] == MODEL_ID
    health = httpx.get(served + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["backend"] == "cpu"
    got = health.json()["settings"]                 # every flag reached the replica (issue 25)
    assert (got["max_queue"], got["max_batch_tokens"], got["max_inputs"], got["grace"],
            got["max_input_chars"], got["token_ids"], got["seq_buckets"]) == \
        (1000, 4096, 64, 3.0, 20000, "wordpiece", [16, 32, 256])
    too_many = httpx.post(served + "/v1/embeddings", json={"input": ["a"] * 65}, timeout=30)
    assert too_many.status_code == 400 and "at most 64" in too_many.text
    # a body over 64 KiB is parsed in the replica's spawn worker process (issue 25 item 2)
    big = httpx.post(served + "/v1/embeddings", timeout=300,
                     json={"input": [sents[i] + " and so on" * 1500 for i in range(5)]})
    assert big.status_code == 200, big.text
    rows = np.array([d["embedding"] for d in big.json()["data"]], np.float32)
    assert rows.shape == (5, 384) and np.abs(np.linalg.norm(rows, axis=1) - 1).max() < 1e-4
    metrics = httpx.get(served + "/metrics", timeout=30)
    assert 'runtime_serving_requests_total{code="200"}' in metrics.text
    assert metrics.headers[REPLICA_HEADER] in seen


def _wait_for_replicas(gone: str, timeout: float = 180.0) -> list:
    """Bounded wait until Serve runs 2 healthy replicas again, ``gone`` not among them."""
    from ray import serve

    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        app = serve.status().applications.get("runtime-embeddings")
        states = app.deployments["embeddings"].replica_states if app else {}
        names = _replica_names()
        if states == {"RUNNING": 2} and len(names) == 2 and gone not in names:
            return names
        time.sleep(0.5)
    raise AssertionError(f"Serve did not replace the killed replica in {timeout} s: {states}")


def test_a_killed_replica_is_replaced_and_no_accepted_request_is_lost(ref, served):
    import httpx
    import ray

    from runtime.serving.ray_serve import REPLICA_HEADER

    sents = [str(s) for s in ref["sentences"]]
    want = ref["embeddings"]
    victim = _replica_names()[0]
    plan = [[i % 12, (5 * i) % 12] for i in range(24)]

    async def load_and_kill():
        async with httpx.AsyncClient(timeout=120) as c:
            tasks = [asyncio.ensure_future(c.post(served + "/v1/embeddings",
                                                  json={"input": [sents[i] for i in p]}))
                     for p in plan]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            return await asyncio.gather(*tasks)

    rs = asyncio.run(load_and_kill())
    answered = 0
    for p, r in zip(plan, rs):                 # every request answered: right rows or an error
        if r.status_code == 200:
            _check_rows(r, want[p])
            answered += 1
        else:
            assert r.status_code >= 500 and r.text, (r.status_code, r.text)
    assert answered >= 1
    names = _wait_for_replicas(victim)
    tags = {n.rsplit("#", 1)[1] for n in names}
    seen = set()
    t_end = time.monotonic() + 60.0            # bounded: until both replicas have answered
    for _ in range(100):                       # (the proxy learns of a new replica a while
        rs = asyncio.run(_post_all(served, [{"input": [sents[i]]} for i in range(12)]))
        for i, r in enumerate(rs):             # after Serve calls it running: on a loaded
            _check_rows(r, want[[i]])          # host, seconds)
            seen.add(r.headers[REPLICA_HEADER])
        if seen == tags or time.monotonic() > t_end:
            break
        time.sleep(0.2)
    assert seen == tags and victim.rsplit("#", 1)[1] not in seen


def test_replicas_map_to_devices_and_autoscaling_passes_through():
    from runtime.serving.ray_serve import deployment_options
    gpu = deployment_options("cuda", replicas=2)
    assert gpu["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1}
    assert gpu["num_replicas"] == 2 and "autoscaling_config" not in gpu
    cpu = deployment_options("cpu", replicas=2, num_cpus=0.5, max_replicas=4,
                             target_ongoing_requests=8)
    assert cpu["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0}
    assert cpu["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 4,
                                         "initial_replicas": 2, "target_ongoing_requests": 8}
    assert "num_replicas" not in cpu
    for bad in ({"replicas": 0}, {"replicas": 3, "max_replicas": 2},
                {"target_ongoing_requests": 0}):
        with pytest.raises(ValueError):
            deployment_options("cpu", **bad)
