"""The README's Python API example runs as written on the shipped model and prints what the README shows."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_api_example_prints_what_the_readme_shows():
    section = README.read_text().split("## Python API", 1)[1]
    code, shown = re.findall(r"```(?:python)?\n(.*?)```", section, re.S)[:2]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    assert printed.getvalue() == shown
    assert "\\boxed{3729825}" in shown and "\\boxed{1260463}" in shown  # 67815*55 and 30743*41
