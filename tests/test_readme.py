"""The README's Python API example runs as written on the shipped model and prints what the README shows."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_api_examples_print_what_the_readme_shows():
    """The first example, then the structured-output one, which continues with its ``llm``."""
    section = README.read_text().split("## Python API", 1)[1]
    code, shown = re.findall(r"```(?:python)?\n(.*?)```", section, re.S)[:2]
    structured = section.split("### Structured outputs", 1)[1]
    structured_code, structured_shown = re.findall(r"```(?:python)?\n(.*?)```", structured, re.S)[:2]
    namespace = {}
    for block, expected in ((code, shown), (structured_code, structured_shown)):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block, "README.md", "exec"), namespace)
        assert printed.getvalue() == expected
    assert "\\boxed{3729825}" in shown and "\\boxed{1260463}" in shown  # 67815*55 and 30743*41


def test_the_server_example_uses_the_budget_the_python_example_shows_answering_correctly():
    """The server example's compression settings are the Python example's, whose correct answers the test above
    checks (at the tighter budget it once showed, 4 pages, the shipped model gets the second one wrong)."""
    text = README.read_text()
    python = text.split("## Python API", 1)[1]
    server = re.search(r"python -m zipage_jax\.serve [^\n]*", text.split("## Server", 1)[1]).group(0)
    budget = re.search(r"kv_budget_pages=(\d+)", python).group(1)
    page_size = re.search(r"page_size=(\d+)", python).group(1)
    assert f"--kv-budget-pages {budget}" in server and f"--page-size {page_size}" in server
    assert "--compression" in server and "compression=True" in python
