"""healthbot bench: the runs it makes, the JSON form, the table and the plot (fake engine, real tokenizer)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bot.config import Config, InferenceConfig
from inference import bench

ENGINES_DIR = Config().engines_path
needs_model = pytest.mark.skipif(not (ENGINES_DIR / "manifest.json").is_file(),
                                 reason="engines/ not prepared: run 'healthbot prepare-model'")


class InstantEngine:
    name, dim, max_batch_size, max_seq_len = "onnxruntime", 4, 256, 512
    precision = "int8"

    def infer(self, ids, mask):
        return np.ones((len(ids), self.dim), np.float32)

    def close(self):
        pass


def test_ceiling_batches_are_the_batches_the_batcher_would_form():
    windows = [[0] + [5] * (n - 2) + [2] for n in (10, 12, 20, 14, 30, 9, 16)]
    batches = bench.ceiling_batches(windows, max_batch_size=2, max_batch_tokens=8192)
    assert [[len(w) for w in b] for b in batches] == [[10, 12], [14, 9], [16], [20, 30]]
    # padded budget 40: 12 x 3 = 36 fits, 14 x 3 = 42 does not; 30 x 2 = 60 does not
    assert [len(b) for b in bench.ceiling_batches(windows, 32, max_batch_tokens=40)] == [2, 2, 1, 1, 1]


def test_engine_spec_parsing():
    assert bench.EngineSpec.parse("onnxruntime:int8") == bench.EngineSpec("onnxruntime", "int8")
    assert bench.EngineSpec.parse("torch_cuda") == bench.EngineSpec("torch_cuda", "")
    with pytest.raises(ValueError, match="only onnxruntime takes a precision"):
        bench.EngineSpec.parse("torch_cuda:int8")


@pytest.mark.model
@needs_model
async def test_bench_runs_every_concurrency_batched_and_not_and_the_ceiling(monkeypatch, tmp_path):
    from inference.engines import loader

    monkeypatch.setitem(loader.LOADERS, "onnxruntime", lambda cfg, d, device=None: InstantEngine())
    result = await bench.run_bench(InferenceConfig(max_queue_delay_ms=0), ENGINES_DIR, concurrencies=(1, 8),
                                   run_seconds=0.2, ceiling_seconds=0.1, engines=["onnxruntime:int8"])
    runs = result["runs"]
    assert [(r["batched"], r["concurrency"], r["engine_only"]) for r in runs] == [
        (True, 1, False), (True, 8, False), (False, 1, False), (False, 8, False), (True, None, True)]
    assert all(r["engine"] == "onnxruntime" and r["precision"] == "int8" for r in runs)
    assert all(r["throughput"] > 0 and r["errors"] == 0 for r in runs[:4])
    assert runs[3]["mean_batch_size"] == 1.0 and runs[1]["max_batch_size"] == 32
    assert runs[4]["batch_size"] == 32 and runs[4]["p99_ms"] is None
    json.dumps(result)  # the --json form is plain JSON
    table = bench.format_table(result)
    assert "engine-only" in table and "batched/unbatched" in table
    png = bench.write_plot(result, tmp_path / "bench.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.model
@needs_model
async def test_bench_through_worker_processes_sums_the_ceiling_of_every_process():
    cfg = InferenceConfig(device_processes=2, intra_op_threads=1, max_queue_delay_ms=0)
    result = await bench.run_bench(cfg, ENGINES_DIR, concurrencies=(8,), run_seconds=0.5, ceiling_seconds=0.3,
                                   engines=["onnxruntime:fp32"], modes=(True,))
    (info,) = result["engines"]
    assert info["processes"] == 2 and info["devices"] == ["cpu#0", "cpu#1"] and info["precision"] == "fp32"
    served, ceiling = result["runs"]
    assert served["processes"] == 2 and served["errors"] == 0 and served["throughput"] > 0
    assert served["mean_batch_size"] >= 1.0
    assert ceiling["engine_only"] and ceiling["processes"] == 2 and ceiling["throughput"] > 0
    assert "in 2 worker processes" in bench.format_table(result)


def test_scaling_needs_two_gpus(cli_main, capsys):
    assert cli_main(["bench", "--scaling", "--engines", "torch_cuda", "--seconds", "0.1"]) == 1
    assert "scaling: torch_cuda: no GPU visible" in capsys.readouterr().err


def test_scaling_table():
    result = {"engine": "torch_cuda", "device_processes": 2, "workers": 1, "max_queue_delay_ms": 0.0, "speedup": 1.9,
              "runs": [{"device_list": ["cuda:0#0", "cuda:0#1"], "concurrency": 256, "throughput": 29676.7,
                        "p50_ms": 8.52, "p99_ms": 11.78, "mean_batch_size": 37.18, "errors": 0},
                       {"device_list": ["cuda:0#0", "cuda:0#1", "cuda:1#2", "cuda:1#3"], "concurrency": 512,
                        "throughput": 56355.5, "p50_ms": 9.04, "p99_ms": 12.99, "mean_batch_size": 38.26,
                        "errors": 0}]}
    table = bench.format_scaling(result)
    assert "2 worker process(es) per device" in table and "56355.5" in table and "1.9x" in table


def test_rss_trend_is_a_fitted_slope_per_1000_encodes_not_last_minus_first():
    from inference.bench import rss_trend

    flat_but_noisy = [750.0, 700.0, 800.0, 720.0, 780.0, 705.0, 795.0, 750.0]
    assert abs(rss_trend(flat_but_noisy, 500)) < 10.0  # last - first would say 0, one step earlier +95
    growing = [600.0 + 3.0 * i for i in range(10)]  # +3 MiB every 500 encodes
    assert rss_trend(growing, 500) == pytest.approx(6.0)
    assert rss_trend([1.0, 2.0], 500) == 0.0
