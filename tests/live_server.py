"""A real uvicorn server on 127.0.0.1 (a free port) in a thread, configured as ``serve`` configures it
(``api_server.server_config``), for the tests that speak HTTP to it: it is ready when its startup event fires, and
every client of it waits as long as ``waiting.HANG_S``."""

import asyncio
import contextlib
import dataclasses
import socket
import threading

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from waiting import HANG_S, wait_until
from zipage_jax.entrypoints.api_server import create_app, server_config

ENGINE_LABELS = ("model_name", "engine")  # vLLM's labels of every engine metric: one engine, one name here


class _Server(uvicorn.Server):
    """uvicorn's server with an event for the end of its startup (or of its run, had the startup failed)."""

    def __init__(self, config):
        super().__init__(config)
        self.startup_done = threading.Event()

    async def startup(self, sockets=None):
        try:
            await super().startup(sockets=sockets)
        finally:
            self.startup_done.set()


@dataclasses.dataclass
class Live:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, api_key="unused", **kw):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=HANG_S, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=HANG_S, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", timeout=HANG_S, **kw)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics (parsed by prometheus_client) as ``name`` or ``name{label="value",...}``, the
        labels every engine metric carries (``ENGINE_LABELS``) left out."""
        return metric_samples(self.get("/metrics").text)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(HANG_S)
        assert not self.thread.is_alive(), "server did not shut down"


def stream_all_cancelling_odd(live: Live, model: str, prompts: list[str], wants: dict[int, str], max_tokens: int,
                              cancel_max_tokens: int) -> dict:
    """Stream every prompt at once (greedy); the odd ones ask for ``cancel_max_tokens`` tokens ignoring EOS and are
    closed by their client at their first text. Checks that each even one's text is ``wants[i]``, waits until no
    request is in flight or running, and returns the server's metrics then."""
    async def one(client, i):
        cancel = i % 2 == 1
        stream = await client.completions.create(
            model=model, prompt=prompts[i], temperature=0, stream=True,
            **({"max_tokens": cancel_max_tokens, "extra_body": {"ignore_eos": True}} if cancel
               else {"max_tokens": max_tokens}))
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text
            if cancel and text:
                await stream.close()
                return None
        return text

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0,
                                      timeout=HANG_S) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    for i, text in enumerate(asyncio.run(main())):
        if i % 2 == 0:
            assert text == wants[i], i
    wait_until(lambda: live.metrics()["zipage:server_requests_in_flight"] == 0, "all requests to close")
    wait_until(lambda: live.metrics()["vllm:num_requests_running"] == 0, "the batch to drain")
    return live.metrics()


def metric_samples(text: str) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ENGINE_LABELS}
            shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            samples[f"{sample.name}{{{shown}}}" if labels else sample.name] = sample.value
    return samples


@contextlib.contextmanager
def live_server(engine, *, grace_s: float = 1.0, **app_kwargs):
    """Serve ``create_app(engine, **app_kwargs)`` until the block ends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _Server(server_config(create_app(engine, **app_kwargs), log_level="warning", lifespan="on",
                                   shutdown_timeout=grace_s))

    def run():
        try:
            server.run(sockets=[sock])
        finally:
            server.startup_done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert server.startup_done.wait(HANG_S) and server.started, "server did not start"
    live = Live(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)
    try:
        yield live
    finally:
        if thread.is_alive():
            live.stop()
        sock.close()
