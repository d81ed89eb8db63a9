"""The Prometheus text of /metrics from the server's own measurements and an engine
stats snapshot."""

from serve_helpers import parse_metrics as parse

from framework.serve.metrics import ServingMetrics


def test_render_counts_latencies_blocks_and_prefix_hits():
    m = ServingMetrics()
    m.first_token(0.03)
    m.tokens(1, None, now=100.0)
    m.tokens(4, 0.02, now=100.02)  # 4 tokens in 20 ms: 5 ms each
    m.finish("length", 7)
    m.client_abort()
    m.reject(429)
    engine = {
        "kv_blocks_total": 10,
        "kv_blocks_free": 7,
        "preemptions": 2,
        "aborted": 1,
        "prefix_cache_queried_tokens": 40,
        "prefix_cache_hit_tokens": 10,
    }
    got = parse(m.render(running=1, waiting=2, engine=engine, model="m"))
    assert got['piecewise_model_info{model="m"}'] == 1
    assert got["piecewise_requests_running"] == 1 and got["piecewise_requests_waiting"] == 2
    assert got["piecewise_kv_blocks_used"] == 3 and got["piecewise_preemptions_total"] == 2
    assert got["piecewise_client_aborts_total"] == 1
    assert got['piecewise_requests_rejected_total{status="429"}'] == 1
    assert got['piecewise_requests_finished_total{finish_reason="length"}'] == 1
    assert got["piecewise_prefix_cache_hit_rate"] == 0.25
    assert got["piecewise_generation_tokens_total"] == 5
    assert got["piecewise_time_to_first_token_seconds_count"] == 1
    assert got['piecewise_time_to_first_token_seconds_bucket{le="0.02"}'] == 0
    assert got['piecewise_time_to_first_token_seconds_bucket{le="0.05"}'] == 1
    assert got["piecewise_inter_token_latency_seconds_count"] == 4
    assert got['piecewise_inter_token_latency_seconds_bucket{le="0.005"}'] == 4
    assert got["piecewise_inter_token_latency_seconds_sum"] == 0.02
    assert m.tokens_per_second(now=100.02) == 0.5  # 5 tokens over the 10 s window


def test_without_prefix_caching_there_is_no_hit_rate():
    got = parse(ServingMetrics().render(0, 0, {"kv_blocks_total": 4, "kv_blocks_free": 4}, "m"))
    assert "piecewise_prefix_cache_hit_rate" not in got and got["piecewise_kv_blocks_used"] == 0
