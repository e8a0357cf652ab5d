"""What a closed loop's steady window is, how steady it was, and where its time went.

The window: ``steady_window`` over the run's samples (from the end of the admission ramp, or of an aged start's
initial prefill: ``prefill_over_s``, to where the loop stopped adding). Steadiness: the drift of the running count
and of the pages a running request holds across the window, and the spread of the per-second rate over its second
half. The time split: every engine step of the window by what it ran (decode only, prefill and decode together,
prefill only, nothing to read back), each step's wall seconds split into the wait for the device (the previous
step's tokens) and the host's own time, and the loop's time outside its steps.
"""

import dataclasses

import numpy as np


def steady_window(samples, skip_tokens: int, end_s: float | None = None,
                  start_s: float | None = None) -> dict | None:
    """The steady part of a run, from its samples ``[(time_s, generated tokens)]`` in time order: from the first
    sample with at least ``skip_tokens`` generated (past the admission ramp and, with one KV budget per concurrent
    request, the first wave's first compressions), or the first at or after ``start_s`` when given, to the last
    sample at or before ``end_s`` (when the closed loop stopped adding: the tail, where requests drain, is left
    out; None: the last sample). Returns ``dict(start_s, end_s, tokens, tokens_per_s)``, or None when the window
    holds no time."""
    start = next((i for i, (t, generated) in enumerate(samples)
                  if (t >= start_s if start_s is not None else generated >= skip_tokens)), None)
    end = max((i for i, (t, _) in enumerate(samples) if end_s is None or t <= end_s), default=None)
    if start is None or end is None or samples[end][0] <= samples[start][0]:
        return None
    (t0, g0), (t1, g1) = samples[start], samples[end]
    return dict(start_s=t0, end_s=t1, tokens=g1 - g0, tokens_per_s=(g1 - g0) / (t1 - t0))


def prefill_over_s(samples, end_s: float | None = None) -> float | None:
    """When an aged start's initial prefill is over: the first sample (up to ``end_s``) at which every aged request
    has been through its prompt (the trace so far) once, or has finished (``num_aged_unprefilled`` 0). Admission
    prefills the long contexts a few at a time (compressed mode compresses each before the next fits), so a pause
    with none mid-prefill, or a running count near its typical one, is not yet the end. None: it never ended."""
    return next((h["time_s"] for h in samples
                 if (end_s is None or h["time_s"] <= end_s) and h.get("num_aged_unprefilled") == 0), None)


def _drift_per_min(times, values) -> float | None:
    """The least-squares slope of ``values`` over ``times``, per minute, relative to their mean (None: too few)."""
    mean = float(np.mean(values)) if len(values) else 0.0
    if len(values) < 3 or mean == 0 or times[-1] <= times[0]:
        return None
    return float(np.polyfit(times, values, 1)[0]) * 60 / mean


def steadiness(inside: list[dict]) -> dict:
    """How steady a window's samples are: the running count's and the pages per running request's drift (relative,
    per minute) and the coefficient of variation of the per-sample rate over the window's second half."""
    t = [h["time_s"] for h in inside]
    rates = [(b["generated"] - a["generated"]) / (b["time_s"] - a["time_s"])
             for a, b in zip(inside, inside[1:]) if b["time_s"] > a["time_s"]]
    second = rates[len(rates) // 2:]
    mean = float(np.mean(second)) if second else 0.0
    return dict(running_drift_per_min=_drift_per_min(t, [h["num_running"] for h in inside]),
                pages_per_running_drift_per_min=_drift_per_min(t, [h["pages_per_running_mean"] for h in inside]),
                second_half_rate_cv=float(np.std(second)) / mean if len(second) > 1 and mean else None)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One engine step as the time split reads it (``time_s``: when it returned, on the samples' clock)."""

    time_s: float
    step_s: float
    read_back_s: float
    decode_rows: int
    prefill_tokens: int
    stalled: int
    compressions: int

    @property
    def kind(self) -> str:
        if self.decode_rows and self.prefill_tokens:
            return "mixed"
        return "decode" if self.decode_rows else "prefill" if self.prefill_tokens else "other"


def time_split(steps: list[StepTime], start_s: float, end_s: float) -> dict:
    """The window's wall seconds by step kind (see the module docstring); ``per_decode_step_ms``: the window's wall
    per step that decoded, the figure to hold against the decode step alone at the same shape."""
    inside = [s for s in steps if start_s < s.time_s <= end_s]
    wall = end_s - start_s
    kinds = {}
    for kind in ("decode", "mixed", "prefill", "other"):
        group = [s for s in inside if s.kind == kind]
        if not group:
            continue
        seconds = sum(s.step_s for s in group)
        kinds[kind] = dict(steps=len(group), seconds=seconds, share=seconds / wall,
                           ms_per_step=seconds / len(group) * 1e3,
                           blocked_ms_per_step=sum(s.read_back_s for s in group) / len(group) * 1e3,
                           host_ms_per_step=sum(s.step_s - s.read_back_s for s in group) / len(group) * 1e3,
                           decode_rows_mean=float(np.mean([s.decode_rows for s in group])),
                           prefill_tokens_mean=float(np.mean([s.prefill_tokens for s in group])),
                           compression_steps=sum(bool(s.compressions) for s in group))
    decoding = sum(bool(s.decode_rows) for s in inside)
    in_steps = sum(s.step_s for s in inside)
    return dict(wall_s=wall, steps=len(inside), kinds=kinds, outside_steps_s=max(0.0, wall - in_steps),
                stalled_request_steps=sum(s.stalled for s in inside),
                stalled_per_decode_step=sum(s.stalled for s in inside) / max(decoding, 1),
                per_decode_step_ms=wall / max(decoding, 1) * 1e3)
