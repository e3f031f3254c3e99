"""The prompt file of `kvoffload warmup`.

Two formats, chosen by --format (default: by the file name):

- JSONL (`.jsonl`, `.ndjson`, `.json`): one JSON object per line, either
  `{"prompt": "some text"}` or `{"prompt_token_ids": [1, 2, 3]}`. Other keys
  are ignored; blank lines are skipped.
- text (anything else): one prompt per line, taken verbatim without its line
  end; blank lines are skipped. There is no escaping, so a prompt with a
  line break needs JSONL.

Text prompts are tokenized with the model's own tokenizer (special tokens
added, as vLLM does for a completion) when warming an engine; a server is
sent the text and tokenizes it itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message names the line."""


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    token_ids: list[int] | None = None


def detect_format(path: Path) -> str:
    return "jsonl" if path.suffix.lower() in (".jsonl", ".ndjson", ".json") else "text"


def load(path: str | Path, fmt: str = "auto") -> list[Prompt]:
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{p}: cannot read: {e}") from None
    fmt = detect_format(p) if fmt == "auto" else fmt
    out: list[Prompt] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if fmt == "text":
            out.append(Prompt(text=line))
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise PromptFileError(f"{p}:{n}: not JSON ({e}); use --format text for plain text") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f'{p}:{n}: expected an object with "prompt" or "prompt_token_ids"')
        ids, text = obj.get("prompt_token_ids"), obj.get("prompt")
        if ids is not None:
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise PromptFileError(f"{p}:{n}: prompt_token_ids must be a non-empty list of token ids")
            out.append(Prompt(token_ids=ids))
        elif isinstance(text, str) and text:
            out.append(Prompt(text=text))
        else:
            raise PromptFileError(f'{p}:{n}: expected "prompt" (non-empty text) or "prompt_token_ids"')
    if not out:
        raise PromptFileError(f"{p}: no prompts")
    return out


def token_ids(prompts: list[Prompt], model: str) -> list[list[int]]:
    """Token ids of every prompt; text is tokenized with `model`'s tokenizer."""
    if all(p.token_ids is not None for p in prompts):
        return [list(p.token_ids or []) for p in prompts]
    fix = "give prompt_token_ids in JSONL instead"
    local = Path(model)
    if local.is_dir() and not any((local / f).exists() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json alone and return no tokens
        raise PromptFileError(f"text prompts need a tokenizer, and {model} has none "
                              f"(none of {', '.join(TOKENIZER_FILES)}); {fix}")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
    except Exception as e:  # any failure means: no usable tokenizer
        raise PromptFileError(f"text prompts need a tokenizer, and {model} has none that loads "
                              f"({type(e).__name__}: {e}); {fix}") from None
    out = [list(p.token_ids) if p.token_ids is not None else tok(p.text).input_ids for p in prompts]
    if any(not ids for ids in out):
        raise PromptFileError(f"{model}'s tokenizer turned a text prompt into no tokens; {fix}")
    return out
