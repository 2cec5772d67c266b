"""``runtime.serving.metrics``: the Prometheus exposition of a batcher's counters."""

from __future__ import annotations

from runtime.serving.batcher import Batcher
from runtime.serving.metrics import ServingMetrics

from fakes import FakeModel, samples


def test_metrics_parse_as_prometheus_text_with_the_recorded_values():
    model = FakeModel()
    m = ServingMetrics(queue_depth=lambda: 3)
    with Batcher(model, metrics=m, batch_buckets=(1, 2, 4), seq_buckets=(4, 8, 16)) as b:
        b.embed(["a", "b c"], timeout=10)
    got = samples(m.render())
    g = (("path", "graph"),)
    assert got[("runtime_serving_batches_total", g)] == 1
    assert got[("runtime_serving_batch_size_bucket", (("le", "2.0"), ("path", "graph")))] == 1
    assert got[("runtime_serving_batch_size_bucket", (("le", "1.0"), ("path", "graph")))] == 0
    assert got[("runtime_serving_queue_wait_seconds_count", ())] == 2
    assert got[("runtime_serving_inputs_total", ())] == 2
    assert got[("runtime_serving_tokens_total", ())] == 3 + 4      # [CLS] words [SEP]
    assert got[("runtime_serving_queue_depth", ())] == 3
    assert m.value("batches_total", path="graph") == 1


