"""Reasoning models under ``eval --chat``: GLM-5.x and Kimi K2.x write a reasoning trace
(``<think> ... </think>``) before their answer unless the chat template is told not to.

Left as the template defaults, a GSM8K answer is cut inside the trace at the task's generation
cap (256 tokens), and lm-eval's answer filters read numbers out of the reasoning; both models then
score noise. So a template with a thinking switch gets it set explicitly, on both sides of the
comparison, and the report says which:

- **off** (the default where the template has a switch): the switch is set False. Locally the
  template is rendered by transformers with it (lm-eval's ``chat_template_args``); through a server
  it travels as the request's ``chat_template_kwargs``, which vLLM's and SGLang's chat-completions
  endpoints pass to the same template (vLLM ``vllm/entrypoints/openai/chat_completion/protocol.py``,
  SGLang ``sglang/srt/entrypoints/openai/protocol.py``).
- **on**: the switch is set True, the generation cap must leave room for a trace (``MIN_GEN_TOKS``),
  the engine is launched with its reasoning parser for the model's family (the registry's
  ``reasoning_parsers``) so the message's ``content`` holds the answer alone, and lm-eval keeps only
  the text after ``</think>`` (``think_end_token``) where a trace still reaches the content
  (locally, or an engine without a parser for the family).

The switch is found by rendering, not by name: the first of ``SWITCHES`` under which the folder's
template renders a different generation prompt for True and for False (GLM's templates read
``enable_thinking``; SGLang's ``kimi_k2`` parser toggles ``thinking``, sglang/srt/parser/
reasoning_parser.py). A template without one (SmolLM2) is prompted as it is, and ``--thinking`` is
refused there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import QuantizeError

SWITCHES = ("enable_thinking", "thinking")
THINK_END = "</think>"
MIN_GEN_TOKS = 1024  # --thinking on: a reasoning trace of a GSM8K item runs to hundreds or thousands of tokens
PROBE = [{"role": "user", "content": "What is 2 + 2?"}]


@dataclass(frozen=True)
class Thinking:
    mode: str  # "on" | "off"
    switch: str  # the chat template's variable

    @property
    def on(self) -> bool:
        return self.mode == "on"

    def template_kwargs(self) -> dict:
        return {self.switch: self.on}

    def record(self, parser: str | None = None, served: bool = False) -> dict:
        """What the report says of it, per model (``measured.*.thinking``; ``prompts`` ends with its
        ``said`` form, which the card shows)."""
        r = {"mode": self.mode, "switch": f"{self.switch}={self.on}"}
        if self.on:
            r["trace"] = (f"split off by the engine's reasoning parser {parser}" if parser else
                          f"cut at {THINK_END} by lm-eval" + ("; no reasoning parser known for this model" if served
                                                               else ""))
        r["said"] = f"thinking {self.mode} (the template's {r['switch']}" + (f"; trace {r['trace']})" if self.on
                                                                            else ")")
        return r


def switch_of(tok, folder) -> str | None:
    """The chat-template variable that turns thinking on and off in the template of ``tok`` (the
    tokenizer of ``folder``): the first of ``SWITCHES`` whose True and False render different
    generation prompts; None if neither does."""
    if not getattr(tok, "chat_template", None):
        return None
    for var in SWITCHES:
        try:
            on, off = (tok.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=False, **{var: v})
                       for v in (True, False))
        except Exception as e:  # noqa: BLE001 - a template that fails to render, as one line
            raise QuantizeError(f"--chat: {folder}'s chat template fails to render ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:160] if str(e) else ''}); fix the template") from e
        if on != off:
            return var
    return None


def resolve(thinking: str | None, chat: bool, toks: dict, max_gen_toks: int | None) -> Thinking | None:
    """The thinking setting of this comparison, before anything runs: None where no generation task
    goes through a chat template that has a switch. ``toks``: {model folder: its tokenizer}, for the
    generation tasks' chat templates (empty: none goes through one)."""
    if thinking is not None and not chat:
        raise QuantizeError(f"--thinking {thinking}: a chat template's switch, so it needs --chat; add --chat, or "
                            "drop --thinking")
    if not (chat and toks):
        return None
    found = {f: switch_of(tok, f) for f, tok in toks.items()}
    if len(set(found.values())) > 1:
        (a, sa), (b, sb) = list(found.items())[:2]
        raise QuantizeError(f"--chat: {a}'s chat template switches thinking with {sa or 'nothing'}, {b}'s with "
                            f"{sb or 'nothing'}; both models need the same template (copy the baseline's)")
    switch = next(iter(found.values()))
    if switch is None:
        if thinking is not None:
            raise QuantizeError(f"--thinking {thinking}: {next(iter(found))}'s chat template has no thinking switch "
                                f"({' or '.join(SWITCHES)} changes nothing it renders); drop --thinking")
        return None
    t = Thinking(thinking or "off", switch)
    if t.on and (max_gen_toks is None or max_gen_toks < MIN_GEN_TOKS):
        cap = "the task's own cap (GSM8K: 256)" if max_gen_toks is None else f"--max-gen-toks {max_gen_toks}"
        raise QuantizeError(f"--thinking on: {cap} cuts a reasoning trace short, and both models would be scored on "
                            f"unfinished thoughts; pass --max-gen-toks {MIN_GEN_TOKS} or more (8192 for hard items), "
                            "or --thinking off")
    return t


def parser_of(folder: Path, engine: str) -> str | None:
    """The engine's reasoning parser for the model in ``folder`` (the registry), or None."""
    from ..archs import resolve as arch_of
    from ..parse import load_json

    cfg = load_json(Path(folder) / "config.json", "model config")
    try:
        return arch_of(cfg, str(Path(folder) / "config.json")).reasoning_parser(cfg, engine)
    except QuantizeError:  # an architecture this tool does not convert: no parser known
        return None
