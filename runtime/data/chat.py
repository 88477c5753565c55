"""Supervised fine-tuning examples: a record's conversation rendered with a chat template, tokenized, and
the tokens the loss keeps (the assistant's) marked.

A record holds `messages` (a list of {"role", "content"}) or `prompt` and `response` (one user turn and
the assistant's answer). The template is the model folder's (tokenizer_config.json's `chat_template`, or
a `chat_template.jinja` beside it), else PLAIN_TEMPLATE. Templates render in jinja2's
ImmutableSandboxedEnvironment, as transformers renders them: a template cannot reach Python objects
(`{{ ''.__class__ }}` and the like are refused) nor change the values it is given; an undefined name or
attribute fails the render (it would print nothing), and a template that renders none of the assistant's
words is refused (nothing would be learned).

The assistant's span of turn i is the text that rendering messages[:i + 1] adds to rendering messages[:i]
with the generation prompt (the turn's header, e.g. "<|im_start|>assistant\\n", stays out of the loss);
a token is kept when it starts inside such a span.
"""

from __future__ import annotations

from typing import Any

from tessera.topology.errors import ConfigError  # the hierarchy's: a ValueError too

# The documented fallback, for a tokenizer without a chat template: each turn as "### role\ncontent\n\n".
PLAIN_TEMPLATE = (
    "{% for message in messages %}### {{ message['role'] }}\n{{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)


def compile_template(source: str, where: str) -> Any:
    """The template compiled in jinja2's immutable sandbox (a jinja2 Template)."""
    # lazy: jinja2 comes with torch but is only needed for --sft
    from jinja2 import StrictUndefined, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    # undefined names and attributes fail the render instead of printing nothing (an empty template, or
    # `{{ m.content.__class__ }}`, which the sandbox turns into an undefined, trained on separators alone)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"{where}: the chat template does not compile ({e})") from None


def messages_of(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    """The record's conversation: its `messages`, or `prompt` and `response` as a user and an assistant turn."""
    if record.get("messages") is not None:  # (datasets gives a record its data set's every field: None if absent)
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{where}: 'messages' is {type(messages).__name__}, not a list of turns")
        for turn in messages:
            if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
                raise ConfigError(f"{where}: a turn of 'messages' has no string 'role' ({turn!r:.80})")
            if not isinstance(turn.get("content"), str):
                raise ConfigError(f"{where}: a {turn['role']!r} turn has no string 'content'")
        if not any(turn["role"] == "assistant" for turn in messages):
            raise ConfigError(f"{where}: 'messages' holds no assistant turn, so nothing would be learned")
        return [{"role": turn["role"], "content": turn["content"]} for turn in messages]
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    raise ConfigError(
        f"{where}: `sft` reads records with 'messages' (a list of role and content) or 'prompt' and 'response' "
        f"strings; this one has {sorted(k for k, v in record.items() if v is not None)}"
    )


class ChatRenderer:
    """Renders records with one template and tokenizes them: (ids, keep) with keep[t] true for the
    assistant's tokens."""

    def __init__(self, tokenizer: Any, template: str | None, specials: dict[str, str], where: str):
        self.tokenizer, self.specials, self.where = tokenizer, specials, where
        self.source = "the plain template" if template is None else "the chat template"
        self.template = compile_template(PLAIN_TEMPLATE if template is None else template, where)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError  # lazy: as compile_template
        from jinja2.sandbox import SecurityError  # lazy: as compile_template

        try:
            # the variables transformers' apply_chat_template passes, None where a record has none of them
            variables = {"tools": None, "documents": None, **self.specials}
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except SecurityError as e:
            raise ConfigError(
                f"{self.where}: {self.source} was refused: it reaches for Python objects ({e}); templates render "
                f"in jinja2's sandbox and run no code"
            ) from None
        except TemplateError as e:
            raise ConfigError(f"{self.where}: {self.source} failed to render ({e})") from None

    def encode(self, record: dict[str, Any], where: str) -> tuple[list[int], list[bool]]:
        messages = messages_of(record, where)
        text = self.render(messages, add_generation_prompt=False)
        spans = []
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1], add_generation_prompt=False)
            if not (text.startswith(through) and through.startswith(before)):
                raise ConfigError(
                    f"{where}: {self.source} does not render a conversation's turns as prefixes of each other, so "
                    f"the assistant's tokens cannot be found; use a template that appends each turn"
                )
            spans.append((len(before), len(through)))
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        keep = [any(a <= start < b for a, b in spans) for start, _ in encoding.offsets]
        said = any(turn["role"] == "assistant" and turn["content"].strip() for turn in messages)
        if said and not any(keep):
            raise ConfigError(
                f"{where}: {self.source} renders none of the assistant's words (it renders {text[:60]!r}), so "
                f"nothing would be learned; use a template that writes each turn's content"
            )
        return list(encoding.ids), keep
