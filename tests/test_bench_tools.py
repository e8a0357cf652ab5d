"""The small `python -m zipage_jax.bench` tools that were one-off scripts: each answers its command line, and what
it computes or times is right on a case small enough to check."""

import importlib
import socket
import sys

import pytest

from zipage_jax.benchmarks import cli, concurrency, logprobs_cost, serve_ready

TOOLS = ["concurrency", "eviction-diagnosis", "logprobs", "prefill-work", "serve-ready"]


@pytest.mark.parametrize("name", TOOLS)
def test_each_tool_is_a_bench_subcommand_with_its_own_help(name, capsys):
    module = importlib.import_module(cli.OWN_COMMAND_LINE[name][0])
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"python -m zipage_jax.bench {name}" in capsys.readouterr().out
    assert module.build_parser().prog == f"python -m zipage_jax.bench {name}"


def test_concurrency_the_pool_binds_an_h100_and_max_num_seqs_an_h200():
    rows = {(r["card"], r["max_num_seqs"]): r for r in concurrency.main(["--max-num-seqs", "256", "384"])}
    h100, h200 = rows["H100 80 GB", 256], rows["H200 141 GB", 256]
    assert h100["bound"] == "pool / (M+1)" and h100["compressed"] == h100["query_rows"] < 256
    assert h200["bound"] == "max_num_seqs" and h200["compressed"] == 256
    assert rows["H200 141 GB", 384]["compressed"] > 256  # a larger max_num_seqs lifts it until the pool binds
    for r in rows.values():  # a compressed request holds at most M + 1 = 9 pages; full KV ~53 at 13.4k tokens
        assert r["compressed"] * 9 <= r["pool_pages"] and r["full_kv_at_mean"] == (r["pool_pages"] - 1) // 53


def test_logprobs_times_each_part_per_row_count(tmp_path):
    report = logprobs_cost.main(["--vocab", "256", "--hidden", "32", "--rows", "1", "3", "--prompt-rows", "4",
                                 "--reps", "1", "--json", str(tmp_path / "lp.json")])
    assert [r["rows"] for r in report["rows"]] == [1, 3] and report["k"] == 20
    assert all(r[k] > 0 for r in report["rows"] for k in ("greedy_sampling_ms", "token_logprobs_ms", "lax_top_k_ms"))
    assert report["prompt_dispatch_ms"] > 0 and (tmp_path / "lp.json").is_file()


STUB_SERVER = """
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_serve_ready_times_the_first_health_200_cold_and_warm():
    """Against a stand-in server that answers /health at once: every run is timed and stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = serve_ready.ready_times(2, port, [], limit_s=60, command=[sys.executable, "-c", STUB_SERVER])
    assert len(report["cold_s"]) == len(report["warm_s"]) == 2
    assert 0 < report["cold_median_s"] < 60 and 0 < report["warm_median_s"] < 60
