"""Prompt text -> token ids for one model folder: prompt template, chat template, stop tokens.

The ids the trainer scores must be the ids the rollout server saw (a prompt-token mismatch
between trainer and server is a silent logit mismatch), so every prompt is tokenized here, once,
and the same ids go to the rollout backend, the trainer, the eval and the rollout dumps.

Steps for one `Example` (`PromptFormat.render`):
1. `data.prompt_template`: a Python format string with one field, `{prompt}`, and literal
   braces doubled (`"{prompt} Let's think step by step and output the final answer within
   \\boxed{{}}."`), applied to the prompt text; for a message-list prompt to the content of the
   last user message.
2. `data.chat_template`: with "auto" the chat template of the model folder (`chat_template` in
   `tokenizer_config.json`, a string or verl/HF's list of named templates ("default" is used),
   else `chat_template.jinja`) renders the messages (a plain prompt becomes one user message)
   with `add_generation_prompt=True` and `data.chat_template_kwargs`; a folder without one
   leaves plain prompts as they are and refuses message lists. "none" never renders.
3. The text is tokenized without adding special tokens.

Rendering follows transformers (`utils/chat_template_utils.py`, `_compile_jinja_template` and
`render_jinja_template`; `PreTrainedTokenizerBase.apply_chat_template`): jinja2's
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the `loopcontrols`
extension, a `tojson` filter that does not escape HTML (`json.dumps(ensure_ascii=False)`), the
globals `raise_exception` and `strftime_now`, and the variables `messages`, `tools=None`,
`documents=None`, `add_generation_prompt`, the named special tokens of tokenizer_config.json
(`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`,
as strings, when set), then the chat template kwargs (which override them). The rendered text
is tokenized with `add_special_tokens=False`, as transformers does, so the ids equal
`apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)`
(tests/jfp8rl/trainer/test_chat_runs.py checks this against transformers).

Stop tokens (`models.tokenizer.stop_token_ids`): the tokenizer's eos (`eos_token` of
tokenizer_config.json) and every `eos_token_id` of config.json and generation_config.json
(Qwen3 instruct: `<|im_end|>` and `<|endoftext|>`), as transformers' `generate` and vLLM stop
on them.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jfp8rl.data.records import DataError, Example
from jfp8rl.data.stream import encode_texts
from models.tokenizer import read_json_file, stop_token_ids

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def check_prompt_template(template: str) -> None:
    """Raises ValueError unless `template` is a format string whose only field is `{prompt}`."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(
            f"{template!r} is not a valid format string ({e}); write literal braces doubled, "
            "e.g. \\boxed{{}}"
        ) from e
    bad = [f for f in fields if f != "prompt"]
    if bad or not fields:
        raise ValueError(
            f"{template!r} must hold the field {{prompt}} and no other (found "
            f"{['{' + f + '}' for f in fields]}); write literal braces doubled, e.g. \\boxed{{{{}}}}"
        )


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(folder: str | Path) -> dict[str, Any]:
    """`<folder>/tokenizer_config.json` as a dict ({} when absent)."""
    try:
        return read_json_file(Path(folder) / "tokenizer_config.json")
    except ValueError as e:
        raise DataError(str(e)) from e


def find_chat_template(folder: str | Path) -> str | None:
    """The folder's chat template source (module docstring, step 2), or None."""
    folder = Path(folder)
    tpl = read_tokenizer_config(folder).get("chat_template")
    if isinstance(tpl, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if isinstance(tpl, str):
        return tpl
    jinja = folder / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else None


def compile_chat_template(source: str) -> Any:
    """The jinja2 template, compiled in transformers' environment (module docstring)."""
    # jinja2 is needed only by folders with a chat template: imported when one is compiled.
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class PromptFormat:
    """Renders, tokenizes and decodes prompts for one model folder (module docstring)."""

    def __init__(
        self,
        folder: str | Path,
        tokenizer: Any,
        *,
        prompt_template: str = "",
        chat_template: str = "auto",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.tokenizer = tokenizer
        if prompt_template:
            check_prompt_template(prompt_template)
        self.prompt_template = prompt_template
        self.chat_template = chat_template
        self.template_source = find_chat_template(self.folder) if chat_template == "auto" else None
        self._template = (
            compile_chat_template(self.template_source) if self.template_source else None
        )
        tok_cfg = read_tokenizer_config(self.folder)
        specials = {n: _token_text(tok_cfg.get(n)) for n in SPECIAL_TOKEN_NAMES}
        self.template_vars: dict[str, Any] = {k: v for k, v in specials.items() if v is not None}
        self.template_vars.update(chat_template_kwargs or {})
        self.stop_ids = stop_token_ids(self.folder, tokenizer)
        self.pad_id = self.stop_ids[0]

    @classmethod
    def from_config(cls, folder: str | Path, tokenizer: Any, data: Any) -> PromptFormat:
        """From a `jfp8rl.config.DataConfig`."""
        return cls(
            folder,
            tokenizer,
            prompt_template=data.prompt_template,
            chat_template=data.chat_template,
            chat_template_kwargs=dict(data.chat_template_kwargs),
        )

    def _apply_prompt_template(self, text: str) -> str:
        return self.prompt_template.format(prompt=text) if self.prompt_template else text

    def render(self, ex: Example) -> str:
        """The prompt text the model sees (module docstring, steps 1-2)."""
        if ex.messages is None:
            text = self._apply_prompt_template(ex.prompt)
            if self._template is None:
                return text
            messages = [{"role": "user", "content": text}]
        else:
            if self._template is None:
                why = (
                    "data.chat_template=none"
                    if self.chat_template == "none"
                    else f"{self.folder} has no chat_template in tokenizer_config.json"
                )
                raise DataError(
                    f"a message-list prompt ({ex.prompt[:40]!r}...) needs a chat template, "
                    f"but {why}; set data.chat_template=auto with a model folder that has one, "
                    "or use plain-string prompts"
                )
            messages = [dict(m) for m in ex.messages]
            last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[last_user]["content"] = self._apply_prompt_template(
                messages[last_user]["content"]
            )
        return self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=True,
            **self.template_vars,
        )

    def encode(self, examples: Sequence[Example], max_tokens: int) -> list[list[int]]:
        """Token ids of each rendered prompt (no special tokens added); too long is an error."""
        return encode_texts([self.render(ex) for ex in examples], self.tokenizer, max_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens kept (what the ids say, for dumps)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def response_text(self, ids: Sequence[int]) -> str:
        """The response text up to (not including) the first stop token."""
        ids = list(ids)
        cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return self.decode(ids[:cut])
