"""Request bodies of the HTTP API (OpenAI's fields plus kvblend's extensions), validated strictly:
a string where a number belongs is an error, not a conversion. Fields OpenAI clients send that
change nothing here (user, frequency_penalty at 0, ...) are ignored; fields that would change the
answer in ways kvblend does not do (n > 1, echo) are refused."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Mode = Literal["full", "prefix", "reuse", "blend"]
# Namespaces join cache keys: short, printable, no separators that could alias another tenant's.
NAMESPACE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_SEED = 2**63 - 1
# Most likely tokens a reply lists per position: OpenAI's chat cap (its legacy completions cap is 5;
# kvblend allows 20 there too, so both endpoints can feed a top-20 comparison).
MAX_LOGPROBS = 20
# An empty document is no chunk: it would silently shift which key belongs to which document.
Document = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class KvblendOptions(Strict):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)  # a typo here is a mistake
    mode: Mode | None = None
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    # Teacher forcing: these ids are fed as the continuation instead of sampled ones (EOS does not
    # end it; max_tokens is their count), so logprobs score a given answer under this mode's KV.
    forced_tokens: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)


class Sampling(Strict):
    """Fields shared by completions and chat completions."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict | None = None
    # vLLM's flag: logprobs name each token "token_id:<id>" rather than by its text, which is
    # ambiguous (several ids can decode to the same text).
    return_tokens_as_token_ids: bool = False
    ignore_eos: bool = False  # vLLM's flag: decode on past EOS, to max_tokens (EOS tokens included)
    # kvblend extensions.
    documents: list[Document] | None = None
    system: str | None = None  # the system prompt placed before `documents`
    kvblend: KvblendOptions | None = None
    namespace: str | None = Field(default=None, pattern=NAMESPACE_PATTERN)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        if any(not s or len(s) > 256 for s in stops):
            raise ValueError("stop strings must be 1 to 256 characters long")
        return stops

    # Accepted only at their no-op values: anything else would be silently ignored otherwise.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    tools: list | None = None
    response_format: dict | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value):
        if value != 0:
            raise ValueError("penalties are not supported (only 0)")
        return value

    @field_validator("logit_bias", "tools")
    @classmethod
    def _not_supported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value and value.get("type", "text") != "text":
            raise ValueError("only the text response format is supported")
        return value


class CompletionRequest(Sampling):
    # Text, token ids, or a list holding one text (OpenAI's batch form, with one prompt).
    prompt: Union[str, list[int], list[str]]
    echo: bool = False
    best_of: int = Field(default=1, ge=1, le=1)
    suffix: str | None = Field(default=None, max_length=0)
    # OpenAI's legacy form: the log-probability of each token and of the `logprobs` most likely ones.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_wanted(self) -> int | None:
        """How many most likely tokens each position lists; None: no logprobs at all."""
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("one prompt per request (n=1 only)")
            return value[0]
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise ValueError("echo is not supported")
        return value


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class ChunksRequest(Strict):
    documents: list[Document] = Field(min_length=1)
    system: str | None = None
    namespace: str | None = Field(default=None, pattern=NAMESPACE_PATTERN)
