"""scripts/decode_variants.py: a variant XLA cannot compile is a row of its own, and the others are measured."""

import json
import sys

from helpers import load_script

variants = load_script("decode_variants")


def test_a_variant_that_does_not_compile_is_a_row_and_the_others_still_run(monkeypatch, tmp_path):
    """On an H100 XLA rejected a variant (a second-stream annotation) and the script stopped with every other
    variant unmeasured; now the error is that variant's row."""
    monkeypatch.setitem(variants.VARIANTS, "broken", ("serving", {"xla_no_such_option": True}))
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["decode_variants", "--model-shape", "tiny", "--batch", "2", "--ctx", "16",
                                      "--page-size", "16", "--variants", "broken", "unrolled",
                                      "--attention-backend", "reference", "--json", str(out)])
    variants.main()
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert "xla_no_such_option" in rows["broken"]["error"] and "ms" not in rows["broken"]
    assert rows["unrolled"]["ms"] > 0 and "error" not in rows["unrolled"]
