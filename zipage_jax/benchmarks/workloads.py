"""The throughput benchmark's workloads: requests as token ids with long-tailed output lengths, scaled by the KV
budget and the page size, and the aged start that enters a closed loop at its steady state."""

import dataclasses
import math

import numpy as np

WORKLOADS = ("reasoning", "mixed", "prefix", "long-reasoning")


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests as token ids and their output lengths (``ignore_eos``: a request's length is its ``max_tokens``)."""

    name: str
    prompts: list
    max_tokens: list
    description: str
    # an aged start's first requests as they were before ageing: (prompt, max_tokens) each (``with_residents``)
    fresh: list | None = None

    def with_residents(self, residents: int, history_tokens: int | None = None) -> "Workload":
        """An aged start with only its first ``residents`` requests mid-trace, the other aged ones fresh again: the
        aged requests are those a mode's engine holds at once, so none waits to bring its long context into the
        steady window (a request that waits in a loop at its steady state has not started). ``history_tokens``:
        the aged requests keep only that many of their latest generated tokens in their prompt (compressed mode,
        whose steady state holds only its latest ``M + 1`` pages: prefilling the rest of the trace only to evict
        it is work the steady state never does); their outputs keep their remaining length."""
        if self.fresh is None or (residents >= len(self.fresh) and history_tokens is None):
            return self
        prompts, outputs = list(self.prompts), list(self.max_tokens)
        residents = min(residents, len(self.fresh))
        for i in range(residents, len(self.fresh)):
            prompts[i], outputs[i] = self.fresh[i]
        description = f"{self.description}; {residents} of them resident"
        if history_tokens is not None:
            for i in range(residents):
                start = len(self.fresh[i][0])
                prompts[i] = prompts[i][:start] + prompts[i][max(start, len(prompts[i]) - history_tokens):]
            description += f", each with its latest {history_tokens} generated tokens"
        return dataclasses.replace(self, prompts=prompts, max_tokens=outputs, fresh=None, description=description)

    def summary(self) -> dict:
        prompt = [len(p) for p in self.prompts]
        return dict(name=self.name, description=self.description, requests=len(self.prompts),
                    prompt_tokens_mean=float(np.mean(prompt)), prompt_tokens_max=int(max(prompt)),
                    output_tokens_mean=float(np.mean(self.max_tokens)),
                    output_tokens_p50=float(np.percentile(self.max_tokens, 50)),
                    output_tokens_p99=float(np.percentile(self.max_tokens, 99)),
                    output_tokens_max=int(max(self.max_tokens)), output_tokens_total=int(sum(self.max_tokens)))


def long_tail(rng, mean: float, count: int, low: int, high: int, sigma: float = 0.8) -> list[int]:
    """Log-normal lengths of the given mean (before clipping to ``[low, high]``): reasoning traces are long-tailed."""
    mu = math.log(mean) - sigma ** 2 / 2
    return np.clip(rng.lognormal(mu, sigma, size=count), low, high).astype(int).tolist()


def make_workload(name: str, num_requests: int, budget_tokens: int, page_size: int, vocab: int,
                  max_model_len: int, seed: int = 0) -> Workload:
    """A named workload, scaled by the KV budget ``M * S`` (tokens) and the page size.

    - ``reasoning``: a shared system prefix (one page) plus a short question; outputs long-tailed with a mean of
      4.5 budgets (each request is compressed several times; full KV cannot hold every request at full length);
    - ``mixed``: short answers (under half a budget) interleaved with long reasoning outputs: admission matters;
    - ``prefix``: four long shared prompts (4 pages each) plus a short question, outputs around one budget: the
      prefix cache matters;
    - ``long-reasoning``: the paper's regime: a shared system prefix (one page) plus a short question (1/8 to 1/2
      page); outputs long-tailed with a mean of 7 budgets before clipping to ``max_model_len`` (~6.4 after: each
      request is compressed dozens of times). Run as a closed loop (``run_mode``'s ``concurrency``).
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload: unknown {name!r}; have {WORKLOADS}")
    if num_requests < 1:
        raise ValueError(f"requests: must be >= 1 (got {num_requests})")
    rng = np.random.default_rng(seed)

    def ids(n):
        return rng.integers(0, vocab, size=int(n)).tolist()

    def fit(prompts, outputs):  # every request fits max_model_len
        return [min(o, max_model_len - len(p)) for p, o in zip(prompts, outputs)]

    if name == "reasoning":
        system = ids(page_size)
        prompts = [system + ids(n) for n in rng.integers(page_size // 8, page_size, size=num_requests)]
        outputs = long_tail(rng, 4.5 * budget_tokens, num_requests, budget_tokens // 2, max_model_len)
        text = f"shared {page_size}-token prefix + short question; long-tailed outputs, mean 4.5 x budget"
    elif name == "mixed":
        prompts = [ids(n) for n in rng.integers(page_size // 8, 2 * page_size, size=num_requests)]
        short = rng.integers(16, max(17, budget_tokens // 2), size=num_requests).tolist()
        long = long_tail(rng, 4.5 * budget_tokens, num_requests, budget_tokens // 2, max_model_len)
        outputs = [s if i % 2 == 0 else t for i, (s, t) in enumerate(zip(short, long))]
        text = "short answers (< budget/2) interleaved with long-tailed reasoning outputs (mean 4.5 x budget)"
    elif name == "long-reasoning":
        system = ids(page_size)
        prompts = [system + ids(n) for n in rng.integers(page_size // 8, page_size // 2, size=num_requests)]
        outputs = long_tail(rng, 7 * budget_tokens, num_requests, budget_tokens // 2, max_model_len)
        text = (f"shared {page_size}-token system prefix + short question; long-tailed outputs, mean 7 x budget "
                f"before clipping at {max_model_len} tokens")
    else:
        shared = [ids(4 * page_size) for _ in range(4)]
        prompts = [shared[i % 4] + ids(n) for i, n in enumerate(rng.integers(8, page_size // 2, size=num_requests))]
        outputs = long_tail(rng, budget_tokens, num_requests, 16, max_model_len)
        text = f"4 shared {4 * page_size}-token prompts + short question; outputs mean 1 x budget"
    return Workload(name, prompts, fit(prompts, outputs), text)


def aged_start(workload: Workload, count: int, vocab: int, seed: int = 0) -> Workload:
    """The workload entered at a closed loop's steady state: its first ``count`` requests are replaced by requests
    caught mid-trace, as the ``count`` slots of a loop that has run for a long time hold them. A slot holds a
    request with probability proportional to its length (a long request holds its slot longer), at an age uniform
    over its length; what it has generated so far joins its prompt (its K/V is prefilled, as after a recompute)
    and its output is the rest. Full KV then starts with its pool full of long contexts, where a loop started
    with ``count`` fresh requests grows them together for a request lifetime (minutes) before it settles; the rest
    of the workload follows fresh. Every request keeps its prompt + output length."""
    if not 1 <= count <= len(workload.prompts):
        raise ValueError(f"concurrency: an aged start needs 1 to {len(workload.prompts)} requests (got {count})")
    rng = np.random.default_rng(seed + 1)
    lengths = np.array(workload.max_tokens, float)
    picks = rng.choice(len(lengths), size=count, replace=False, p=lengths / lengths.sum())
    ages = [int(rng.integers(0, workload.max_tokens[j])) for j in picks]  # at least one token left to generate
    prompts = [workload.prompts[j] + rng.integers(0, vocab, size=age).tolist() for j, age in zip(picks, ages)]
    outputs = [workload.max_tokens[j] - age for j, age in zip(picks, ages)]
    taken = set(picks.tolist())
    rest = [i for i in range(len(workload.prompts)) if i not in taken]
    return Workload(workload.name, prompts + [workload.prompts[i] for i in rest],
                    outputs + [workload.max_tokens[i] for i in rest],
                    f"{workload.description}; the first {count} entered mid-trace (aged start: length-biased, "
                    f"uniform ages)", fresh=[(workload.prompts[j], workload.max_tokens[j]) for j in picks])
