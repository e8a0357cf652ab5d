"""vLLM's ``vllm serve`` flags that this server has no option of its own for, so that a launch line copied from a
Docker or Helm file starts it: a switch naming what this engine always does, or never needs, is accepted with a
one-line note; a value it cannot honour is a one-line error saying why. (vLLM's spellings of what the server
does have, ``-tp``, ``--block-size``, ``--served-model-name a b``, ..., are its own options: ``cli_args``.)
"""

import argparse
import dataclasses


ANY = ("*",)  # any value: noted, never refused


@dataclasses.dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    why: str  # the note when it is given and harmless; the error when it asks for what cannot be done
    values: tuple[str, ...] | None = None  # a valued flag's values that are harmless (ANY: all); None: a switch
    refused: bool = False  # a switch that always asks for what cannot be done

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_").replace(".", "_")

    def harmless(self, value) -> bool:
        if self.values is None:
            return not self.refused
        return self.values == ANY or str(value).lower() in self.values


FLAGS = (
    Flag(("--enable-chunked-prefill",), "prompts are always prefilled in chunks of --max-num-batched-tokens"),
    Flag(("--no-enable-chunked-prefill",), "prompts are always prefilled in chunks", refused=True),
    Flag(("--enforce-eager",), "the engine runs XLA-compiled programs, there are no CUDA graphs to turn off"),
    Flag(("--trust-remote-code",), "the architectures this engine supports (llama, qwen2, qwen3) need no remote code"),
    Flag(("--enable-tokenizer-info-endpoint",), "/tokenizer_info is always served"),
    Flag(("--disable-custom-all-reduce",), "tensor parallelism uses XLA's collectives"),
    Flag(("--disable-frontend-multiprocessing",), "the engine loop's process is --engine-process / "
                                                  "--no-engine-process"),
    Flag(("--swap-space",), "compressed requests swap to host memory when preempted; nothing is reserved", ANY),
    Flag(("--pipeline-parallel-size", "-pp"), "no pipeline parallelism here: shard with --tensor-parallel-size",
         ("1",)),
    Flag(("--data-parallel-size", "-dp"), "one engine per server: start several servers", ("1",)),
    Flag(("--quantization", "-q"), "quantized checkpoints are not supported", ("none",)),
    Flag(("--load-format",), "weights load from safetensors", ("auto", "safetensors")),
    Flag(("--tokenizer-mode",), "the tokenizer loads through transformers", ("auto", "hf")),
    Flag(("--structured-outputs-config.backend", "--guided-decoding-backend"),
         "structured outputs always compile with llguidance", ANY),
)


def add_vllm_flags(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("vLLM compatibility (accepted so vLLM launch lines start; see each note)")
    for flag in FLAGS:
        if flag.values is None:
            text = f"refused: {flag.why}" if flag.refused else f"no effect: {flag.why}"
            group.add_argument(*flag.names, dest=flag.dest, action="store_true", help=text)
        else:
            text = f"no effect: {flag.why}" if flag.values == ANY else f"{' or '.join(flag.values)}: {flag.why}"
            group.add_argument(*flag.names, dest=flag.dest, metavar="VALUE", help=text)


def vllm_flag_notes(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """(a one-line note per harmless flag given, the error of the first that cannot be honoured, or None)."""
    notes = []
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        if value in (None, False):
            continue
        shown = flag.names[0] if value is True else f"{flag.names[0]} {value}"
        if not flag.harmless(value):
            return notes, f"{shown}: {flag.why}"
        notes.append(f"{shown}: no effect ({flag.why})")
    return notes, None
