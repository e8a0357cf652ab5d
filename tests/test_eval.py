"""Answer checking, data loading and the `python -m zipage_jax.eval` command line."""

import json
import subprocess
import sys
import threading

import pytest

from waiting import HANG_S
from zipage_jax.entrypoints import answers
from zipage_jax.entrypoints.answers import extract_boxed, is_correct, math_verify_match, reference_answer
from zipage_jax.config import option_fields
from zipage_jax.entrypoints.eval import (build_parser, format_prompt, load_items, main, parse_jsonl, synthetic_items,
                                         warmup_phrase)
from zipage_jax.tasks import TASKS, sample_problems

MODEL = "tests/fixtures/hf/qwen3"  # random weights, character tokenizer, no chat template

REPORT_KEYS = {"model", "data", "accuracy", "num_questions", "samples", "num_requests", "mean_output_tokens",
               "generated_tokens", "elapsed_s", "warmup", "generated_tokens_per_s", "peak_pages_per_request",
               "peak_pages_after_compression_per_request", "compressions_per_request", "finish_reasons",
               "checker", "sampling", "engine_config", "records"}
RECORD_KEYS = {"index", "sample", "question", "answer", "reference", "output", "extracted", "correct", "length",
               "finish_reason", "peak_pages", "peak_pages_after_compression", "compressions"}


# -- answers ----------------------------------------------------------------------------------------------------
def test_extract_boxed_takes_the_last_box_with_nested_braces():
    assert extract_boxed(r"first \boxed{1} then \boxed{\frac{a^{2}}{b}} end") == r"\frac{a^{2}}{b}"
    assert extract_boxed(r"\fbox{ 7 }") == "7"
    assert extract_boxed(r"\boxed {x}") == "x"
    assert extract_boxed("no box here") is None
    assert extract_boxed(r"\boxed{never closed") is None
    assert extract_boxed(r"\boxed{12} \boxed{unclosed") == "12"


def test_reference_answer_formats():
    assert reference_answer("Natalia sold 48/2 = 24 clips.\n#### 1,072") == "1072"
    assert reference_answer(r"So the sum is $\boxed{\dfrac{3}{4}}$.") == r"\dfrac{3}{4}"
    assert reference_answer(" 33 ") == "33"
    assert reference_answer(204) == "204"


def test_math_verify_checks_equivalent_forms():
    pytest.importorskip("math_verify")
    assert is_correct(r"... so \boxed{0.5}", r"\frac{1}{2}")
    assert is_correct(r"The answer is \boxed{1072}.", "Step.\n#### 1,072")
    assert is_correct(r"\boxed{\frac{6}{8}}", r"$\boxed{\frac{3}{4}}$")
    assert not is_correct(r"\boxed{0.75}", r"\frac{1}{2}")
    assert not is_correct("no answer at all", "17")


def test_math_verify_is_safe_outside_the_main_thread():
    pytest.importorskip("math_verify")
    verdicts = []
    worker = threading.Thread(target=lambda: verdicts.append(math_verify_match(r"\boxed{2/4}", "1/2")))
    worker.start()
    worker.join(HANG_S)
    assert verdicts == [True]


def test_fallback_is_exact_boxed_match_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import now raises ImportError
    assert not answers.math_verify_available()
    assert math_verify_match(r"\boxed{0.5}", "0.5") is None
    assert is_correct(r"work \boxed{ 1072 }", "#### 1,072")
    assert is_correct(r"\boxed{\frac{1}{2}}", r"\frac{1}{2}")
    assert not is_correct(r"\boxed{0.5}", r"\frac{1}{2}")  # equal in value, but not the same text
    assert not is_correct("1072", "1072")  # no box, no answer


def test_fallback_when_math_verify_fails(monkeypatch):
    math_verify = pytest.importorskip("math_verify")

    def broken(*args, **kwargs):
        raise TimeoutError("parsing took too long")

    monkeypatch.setattr(math_verify, "parse", broken)
    assert math_verify_match(r"\boxed{3}", "3") is None
    assert is_correct(r"\boxed{3}", "3")
    assert not is_correct(r"\boxed{4}", "3")


# -- data -------------------------------------------------------------------------------------------------------
def test_parse_jsonl_accepts_aliases_numbers_and_blank_lines():
    lines = ['{"question": "1+1?", "answer": "2"}', "", '{"problem": "AIME?", "solution": 204}',
             '{"question": "GSM?", "answer": "x\\n#### 5", "id": 3}']
    assert parse_jsonl(lines) == [{"question": "1+1?", "answer": "2"}, {"question": "AIME?", "answer": "204"},
                                  {"question": "GSM?", "answer": "x\n#### 5"}]


@pytest.mark.parametrize("line, why", [
    ("{not json", "not valid JSON"),
    ('["question", "answer"]', "expected a JSON object"),
    ('{"answer": "2"}', "question"),
    ('{"question": "  ", "answer": "2"}', "question"),
    ('{"question": "1+1?"}', "answer"),
    ('{"question": "1+1?", "answer": ""}', "answer"),
])
def test_parse_jsonl_errors_name_the_line(line, why):
    with pytest.raises(ValueError, match=rf"f\.jsonl: line 2: .*{why}"):
        parse_jsonl(['{"question": "ok?", "answer": "1"}', line], source="f.jsonl")


def test_load_items_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="no items"):
        load_items(str(empty))
    with pytest.raises(ValueError, match="data: no such file"):
        load_items(str(tmp_path / "missing.jsonl"))


def test_synthetic_items_come_from_the_task_generator():
    items = synthetic_items("synthetic:test:7:3")
    problems = sample_problems(7, 3, "test")
    assert items == [{"question": p.question, "answer": p.answer} for p in problems]
    assert all(is_correct(p.solution(), item["answer"]) for p, item in zip(problems, items))
    assert synthetic_items("synthetic:test:4") == synthetic_items("synthetic:test:4:0")
    assert synthetic_items("synthetic:repeated_addition:test:4") == synthetic_items("synthetic:test:4")
    moving = synthetic_items("synthetic:interleaved_sums:test:5:2")
    problems = TASKS["interleaved_sums"](5, 2, "test")
    assert moving == [{"question": p.question, "answer": p.answer} for p in problems]
    assert all(is_correct(p.solution(), item["answer"]) for p, item in zip(problems, moving))
    stored = synthetic_items("synthetic:stored_product:test:5:2")
    problems = TASKS["stored_product"](5, 2, "test")
    assert stored == [{"question": p.question, "answer": p.answer} for p in problems]
    assert all(is_correct(p.solution(), item["answer"]) for p, item in zip(problems, stored))
    assert not any(is_correct(p.solution().replace(p.answer, p.answer[:-1]), p.answer) for p in problems)
    for bad in ("synthetic:test", "synthetic:dev:5", "synthetic:test:zero", "synthetic:test:0",
                "synthetic:test:5:1:2", "synthetic:interleaved_sums:test", "synthetic:other_task:test:5"):
        with pytest.raises(ValueError, match="data: "):
            synthetic_items(bad)


def test_format_prompt_applies_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from zipage_jax.tasks.tokenizer import chat_prompt, save_tokenizer

    save_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert format_prompt(tokenizer, "What is 2*3?") == chat_prompt("What is 2*3?")
    system = format_prompt(tokenizer, "What is 2*3?", system_prompt="Be brief.")
    assert system == "<|im_start|>system\nBe brief.<|im_end|>\n" + chat_prompt("What is 2*3?")


def test_format_prompt_without_a_template_falls_back_to_the_question():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    with pytest.warns(UserWarning, match="no chat template"):
        assert format_prompt(tokenizer, "What is 2*3?") == "What is 2*3?"


# -- command line -----------------------------------------------------------------------------------------------
def test_every_engine_field_is_an_option():
    parser, names = build_parser()
    assert names == list(option_fields())  # EngineConfig's fields, the nested scoring knobs flat
    assert {"window", "eviction_policy"} < set(names) and "scoring" not in names
    args = parser.parse_args(["--data", "d", "--no-enable-prefix-caching", "--compression", "--decay", "0.65",
                              "--kv-budget-pages", "4", "--max-model-len", "none", "--eviction-policy", "window"])
    assert (args.enable_prefix_caching, args.compression, args.decay, args.kv_budget_pages, args.max_model_len,
            args.eviction_policy) == (False, True, 0.65, 4, None, "window")
    assert "global_score" not in vars(args)  # unset options leave the engine default in place


@pytest.mark.parametrize("argv, option", [
    (["--page-size", "17"], "--page-size"),
    (["--page-size", "many"], "--page-size"),
    (["--eviction-policy", "random"], "--eviction-policy"),
    (["--decay", "2"], "--decay"),
    (["--samples", "0"], "--samples"),
    (["--top-p", "0"], "--top-p"),
    (["--bogus-knob", "1"], "--bogus-knob"),
    (["--model", "tests/fixtures/hf/no-such-model"], "--model"),
])
def test_bad_arguments_name_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", MODEL, "--data", "synthetic:test:1", *argv])
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


def test_bad_data_is_an_argparse_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(SystemExit):
        main(["--model", MODEL, "--data", str(bad)])
    err = capsys.readouterr().err
    assert "--data" in err and "line 1" in err


def _check_report(report, num_questions, samples):
    assert set(report) == REPORT_KEYS
    records = report["records"]
    assert len(records) == report["num_requests"] == num_questions * samples
    assert all(set(r) == RECORD_KEYS for r in records)
    assert [(r["index"], r["sample"]) for r in records] == [(i, s) for i in range(num_questions)
                                                          for s in range(samples)]
    for r in records:
        assert r["correct"] == is_correct(r["output"], r["answer"])
        assert 1 <= r["length"] <= report["sampling"]["max_tokens"]
    assert report["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / len(records))
    assert report["generated_tokens"] == sum(r["length"] for r in records)
    assert report["mean_output_tokens"] == pytest.approx(report["generated_tokens"] / len(records))
    assert report["peak_pages_per_request"]["max"] == max(r["peak_pages"] for r in records)
    assert report["compressions_per_request"]["max"] == max(r["compressions"] for r in records)
    assert report["generated_tokens_per_s"] > 0
    assert set(report["engine_config"]) == {"model", *option_fields()}


def test_cli_end_to_end_on_a_jsonl_file(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"question": "What is 12*3?", "answer": "36"}\n'
                    '{"problem": "Compute 1+1.", "solution": "It is $\\\\boxed{2}$."}\n')
    out = tmp_path / "out" / "report.json"
    run = subprocess.run([sys.executable, "-m", "zipage_jax.eval", "--model", MODEL, "--data", str(data),
                          "--samples", "2", "--temperature", "1.0", "--max-tokens", "12", "--page-size", "16",
                          "--no-warmup", "--output", str(out)], capture_output=True, text=True,
                          timeout=HANG_S)
    assert run.returncode == 0, run.stderr
    assert "accuracy" in run.stdout and "no chat template" in run.stderr
    report = json.loads(out.read_text())
    _check_report(report, num_questions=2, samples=2)
    assert [r["reference"] for r in report["records"]] == ["36", "36", "2", "2"]
    assert report["sampling"]["temperature"] == 1.0 and report["engine_config"]["page_size"] == 16
    assert report["warmup"] is None
    by_question = [[r["output"] for r in report["records"] if r["index"] == i] for i in range(2)]
    assert any(a != b for a, b in by_question)  # distinct seeds per sample


def test_cli_on_the_synthetic_split_with_compression(tmp_path, capsys):
    out = tmp_path / "report.json"
    report = main(["--model", MODEL, "--data", "synthetic:test:5", "--limit", "3", "--max-tokens", "40",
                   "--page-size", "16", "--compression", "--kv-budget-pages", "2", "--no-progress",
                   # 18-token prompts + 40 tokens fit 64: a warm-up of few programs (one prefill bucket, two
                   # compression widths)
                   "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--max-model-len", "64",
                   "--output", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    _check_report(report, num_questions=3, samples=1)
    assert [r["question"] for r in report["records"]] == [p.question for p in sample_problems(3, 0, "test")]
    assert report["engine_config"]["compression"] and report["engine_config"]["kv_budget_pages"] == 2
    # a prompt of ~20 tokens plus 40 generated ones outgrows a 2-page budget of 16-token pages
    assert report["compressions_per_request"]["mean"] >= 1
    printed = capsys.readouterr().out
    assert "compressed (zipage, budget 2 pages of 16)" in printed
    # warm-up is on by default and reported apart from the generation throughput
    assert report["warmup"]["programs"] > 0 and report["warmup"]["compile_s"] > 0
    assert warmup_phrase(report["warmup"]) in printed


def test_the_summary_says_whether_warmup_compiled_or_loaded_its_programs():
    assert warmup_phrase(dict(programs=18, loaded=0, compile_s=21.04)) == "after compiling 18 programs in 21.0s"
    assert warmup_phrase(dict(programs=18, loaded=18, compile_s=1.9)) == "after loading 18 programs in 1.9s"
    assert warmup_phrase(dict(programs=18, loaded=3, compile_s=5.0)) == \
        "after compiling 15 and loading 3 programs in 5.0s"


def test_one_description_per_engine_field_serves_both_helps_and_the_readme():
    from pathlib import Path

    from zipage_jax.config import DESCRIPTIONS, reference_table
    from zipage_jax.entrypoints.cli_args import build_parser as serve_parser

    assert set(DESCRIPTIONS) == {"model", *option_fields()}
    eval_help = " ".join(build_parser()[0].format_help().split())
    serve_help = " ".join(serve_parser().format_help().split())
    for name, text in DESCRIPTIONS.items():
        if name != "model":
            flat = " ".join(text.replace("`", "").split())
            assert flat in eval_help and flat in serve_help, name
    # regenerate with: python -c "from zipage_jax.config import reference_table; print(reference_table())"
    assert reference_table() in (Path(__file__).resolve().parents[1] / "README.md").read_text()
