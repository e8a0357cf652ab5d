"""Decode steps of one batch at one context length, timed: the decode benchmark's row, and the throughput
benchmark's yardstick (its decode capacity at the steady window's rows and context).

Every request is held out of scheduling once its prompt is prefilled (``probes.HoldingScheduler``), so all of them
decode together at the same length; then ``steps`` pipelined engine steps are timed through the public step loop,
and the same decode step alone, dispatched back to back (``probes.DecodeReplay``), gives the device's time.
"""

import dataclasses
import time

import jax
import numpy as np

from zipage_jax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class DecodeTiming:
    """Seconds per step of a batch decoding together (``engine_step_s``: pipelined engine steps;
    ``device_step_s``: the step alone), and where the engine step's host time went."""

    batch: int
    kv_tokens: float  # KV tokens the step reads, summed over its rows (mean over the timed steps)
    engine_step_s: float
    device_step_s: float
    host_s: float  # host time of an engine step outside the wait for the previous step's tokens
    blocked_s: float  # that wait
    jit_call_s: float  # of the host time, inside compiled calls (dispatch)
    first_step_s: float  # the first step after release, compiles included

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.engine_step_s

    @property
    def device_tokens_per_s(self) -> float:
        return self.batch / self.device_step_s


def replay_seconds(replay, n: int) -> float:
    """Seconds per step of ``n`` back-to-back dispatches of the last decode step (device-bound time)."""
    jax.block_until_ready(replay())
    start = time.perf_counter()
    for _ in range(n):
        tokens = replay()
    jax.block_until_ready(tokens)
    return (time.perf_counter() - start) / n


def time_decode_steps(engine, replay, prompts: list[list[int]], steps: int, warmup_steps: int = 3,
                      tag: str = "decode") -> tuple[DecodeTiming, list]:
    """Decode one request per prompt together, each prompt's length its context (see the module docstring); the
    engine's scheduler must be a ``HoldingScheduler`` and ``replay`` a ``DecodeReplay`` of its worker. Each request
    generates its prefill token, the warm-up steps' and the timed steps' tokens, then ends: returns the timing and
    the final outputs."""
    batch = len(prompts)
    observed = []  # per step: (rows decoded, prompt chunks, KV tokens read, host s, blocked s)

    def observe(record):
        s = record.scheduled
        observed.append((len(s.decodes), len(s.prefills), sum(r.num_computed_tokens for r in s.decodes),
                         record.step_s - record.read_back_s, record.read_back_s))

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1 + warmup_steps + steps)
    ids = [f"{tag}{batch}-{i}" for i in range(batch)]
    engine.add_step_observer(observe)
    try:
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, prompt, params)
        waiting, scheduler = set(ids), engine.scheduler
        while waiting:  # a prefilled request (its whole prompt computed) waits until every one is
            del observed[:]
            engine.step(only_finished=True)
            if observed[-1][:2] == (0, 0):
                raise RuntimeError(f"{tag}: a step computed nothing before every request was prefilled")
            done = [r for r in scheduler.running
                    if r.request_id in waiting and r.num_computed_tokens >= len(r.prompt_token_ids)]
            scheduler.hold(done)
            waiting -= {r.request_id for r in done}
        engine.drain(only_finished=True)
        engine.scheduler.release([engine.requests[request_id] for request_id in ids])
        t = time.perf_counter()
        engine.step(only_finished=True)
        engine.drain(only_finished=True)
        first_step_s = time.perf_counter() - t
        for _ in range(warmup_steps - 1):
            engine.step(only_finished=True)
        engine.drain(only_finished=True)
        del observed[:]
        calls = replay.worker.programs.call_s
        start = time.perf_counter()
        for _ in range(steps):
            engine.step(only_finished=True)
        outputs = engine.drain(only_finished=True)  # the last step's tokens: every request ends here
        engine_step_s = (time.perf_counter() - start) / steps
        jit_call_s = (replay.worker.programs.call_s - calls) / steps
    finally:
        engine.remove_step_observer(observe)
    assert all(decodes == batch and not chunks for decodes, chunks, *_ in observed) and len(outputs) == batch
    kv_tokens, host, blocked = ([step[i] for step in observed] for i in (2, 3, 4))
    return DecodeTiming(batch=batch, kv_tokens=float(np.mean(kv_tokens)), engine_step_s=engine_step_s,
                        device_step_s=replay_seconds(replay, steps), host_s=float(np.mean(host)),
                        blocked_s=float(np.mean(blocked)), jit_call_s=jit_call_s,
                        first_step_s=first_step_s), outputs
