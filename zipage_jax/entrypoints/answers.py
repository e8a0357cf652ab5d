"""Answer extraction and checking for math evaluation: math-verify when it works, exact `\\boxed{}` match otherwise.

math-verify compares answers symbolically (so `1/2` matches `\\frac{1}{2}`), but it is an optional dependency
and its timeouts rely on `signal.alarm`, which only works in the main thread; the wrapper below disables
those timeouts elsewhere and treats any failure as "undecided", so checking never crashes an evaluation.
"""

from __future__ import annotations

import re
import threading

VERIFY_TIMEOUT_S = 5
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, nested braces included; None if absent."""
    found = None
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found = text[start:i].strip()
                break
    return found


def reference_answer(answer) -> str:
    """The final answer of a dataset's reference: GSM8K's `#### 42`, a `\\boxed{}` solution, or the text itself."""
    text = str(answer).strip()
    gsm8k = _GSM8K_FINAL.search(text)
    if gsm8k:
        return gsm8k.group(1).replace(",", "").strip()
    boxed = extract_boxed(text)
    return boxed if boxed is not None else text


def _normalize(text: str) -> str:
    return re.sub(r"\s+", "", text).strip("$")


def boxed_match(output: str, reference: str) -> bool:
    """Exact match of the output's last `\\boxed{}` with the reference answer (whitespace and `$` ignored)."""
    predicted = extract_boxed(output)
    return predicted is not None and _normalize(predicted) == _normalize(reference_answer(reference))


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def math_verify_match(output: str, reference: str) -> bool | None:
    """math-verify's verdict on `output` against `reference`; None when it is not installed or fails."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    timeout = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_text = reference_answer(reference)
    try:
        gold = parse(f"${gold_text}$", parsing_timeout=timeout, raise_on_error=True)
        if not gold:
            gold = parse(gold_text, parsing_timeout=timeout, raise_on_error=True)
        predicted = parse(output, parsing_timeout=timeout, raise_on_error=True)
        if not gold or not predicted:
            return None
        return bool(verify(gold, predicted, timeout_seconds=timeout, raise_on_error=True))
    except Exception:  # math-verify raises timeouts and sympy errors of many kinds: all mean "undecided"
        return None


def is_correct(output: str, reference) -> bool:
    """True when the output's final answer equals the reference: exact boxed match first, then math-verify."""
    return boxed_match(output, reference) or bool(math_verify_match(output, str(reference)))
