"""Request bodies of the OpenAI-compatible API, and its error shape.

This file owns the pydantic models that validate ``/v1/completions`` and
``/v1/chat/completions`` bodies (OpenAI's fields plus the vLLM extras
``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty``,
``priority``, ``cache_salt``, ``prompt_logprobs``, ...), ``APIError`` (an error as an HTTP status
plus OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body) and
the conversion of a request body into ``SamplingParams``; ``parse_body`` reads a
raw body into one of the models (400 for JSON that is malformed or nested too
deeply) and ``check_unicode`` refuses text that is not valid Unicode.

A client that hangs up before its body is read (``ClientDisconnect``) cannot flood an
open server's log: ``parse_body`` logs one INFO line for it, no traceback, and ends the
request before it runs, with an ``APIError`` of nginx's 499 that no one receives.

Models are strict (no "5" for 5) and ignore unknown fields. Integers the
Rust core keeps in fixed-width fields are bounded here (a 400 naming the
field, not an overflow inside the engine), and so are the fields the engine
keeps per request (``cache_salt``, ``stop_token_ids``), so that the memory a
queued request holds is bounded.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import ClientDisconnect

from kvpage.sampling.params import SamplingParams
from kvpage.structured_outputs.params import KINDS, StructuredOutputsParams

if TYPE_CHECKING:
    from starlette.requests import Request

M = TypeVar("M", bound="_Strict")
CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client went away before it was read."""

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error response: HTTP ``status`` and OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first offending top-level field of a pydantic error."""
    errors = exc.errors()
    first = errors[0]
    loc = first.get("loc", ())
    if not loc:
        return bad_request(str(first.get("msg", "invalid request body")))
    param = str(loc[0])
    same = [e for e in errors if e.get("loc", ())[:1] == loc[:1]]
    if len(same) == 1:
        where = ".".join(str(part) for part in loc)
        return bad_request(f"{where}: {first.get('msg')}", param=param)
    messages = list(dict.fromkeys(str(e.get("msg")) for e in same))
    return bad_request(f"{param}: invalid value ({'; or '.join(messages[:4])})", param=param)


_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_I32_MAX = 2**31 - 1
MAX_CACHE_SALT_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    NOT_IMPLEMENTED: ClassVar[dict[str, Any]] = {}
    """Fields kvpage does not implement, with their "off" value (see below)."""


_NOT_IMPLEMENTED_COMMON: dict[str, Any] = {
    # vLLM (and OpenAI) request fields kvpage does not implement, with the value
    # that means "off": sent with any other value they are a 400 naming the
    # field, never silently ignored
    "use_beam_search": False,
    "length_penalty": 1.0,
    "early_stopping": False,
    "allowed_token_ids": None,
    "bad_words": None,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "logits_processors": None,
    "return_tokens_as_token_ids": False,
    "truncate_prompt_tokens": None,
    "spaces_between_special_tokens": True,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "prompt_embeds": None,
    "mm_processor_kwargs": None,
    "request_id": None,
    "processor": None,
}
_NOT_IMPLEMENTED_CHAT: dict[str, Any] = {
    **_NOT_IMPLEMENTED_COMMON,
    "documents": None,
    "chat_template": None,
    "chat_template_kwargs": None,
    "parallel_tool_calls": None,
    "functions": None,
    "function_call": None,
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
    "include_reasoning": True,
    "web_search_options": None,
}
_NOT_IMPLEMENTED_COMPLETION: dict[str, Any] = _NOT_IMPLEMENTED_COMMON


def _is_off(value: Any, off: Any) -> bool:
    """``value`` asks for nothing beyond what ``off`` does (an empty
    container or null counts as off when ``off`` is null)."""
    if value is None or value == off:
        return True
    return off is None and isinstance(value, dict | list | str) and not value


def refuse_not_implemented(data: dict[str, Any], fields: dict[str, Any]) -> None:
    """400 naming the first field of ``fields`` present in the request body
    ``data`` with a value other than its "off" value."""
    for name, off in fields.items():
        if name in data and not _is_off(data[name], off):
            raise bad_request(f"{name} is not supported by this server (kvpage)", param=name,
                              code="unsupported_parameter")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, le=_I32_MAX)
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    priority: int = Field(0, ge=_I64_MIN, le=_I64_MAX)
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    add_special_tokens: bool | None = None
    return_token_ids: bool = False
    # structured outputs: vLLM's guided_* extras and structured_outputs, and OpenAI's
    # response_format (declared by the subclasses)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    prompt_logprobs: int | None = None

    NOT_IMPLEMENTED: ClassVar[dict[str, Any]] = _NOT_IMPLEMENTED_COMMON

    @field_validator("cache_salt")
    @classmethod
    def _salt_is_unicode(cls, value: str | None) -> str | None:
        if value is not None:
            value.encode("utf-8")  # UnicodeEncodeError (a ValueError) for lone surrogates
        return value

    def check_supported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true",
                              param="stream_options")
        if self.return_token_ids and self.stream:
            raise bad_request("return_token_ids is only supported without stream",
                              param="return_token_ids")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is only supported without stream",
                              param="prompt_logprobs")
        self.structured_outputs_params()  # 400 naming the field, before any work

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint the body asks for (``response_format``, a
        ``guided_*`` extra or ``structured_outputs``), or None; 400 naming the field."""
        candidates: list[tuple[str, Any]] = [
            (name, {kind: getattr(self, name)})
            for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                               ("guided_choice", "choice"), ("guided_grammar", "grammar"))
            if getattr(self, name) is not None
        ]
        if self.structured_outputs is not None:  # other vLLM keys only with "off" values
            candidates.append(("structured_outputs", {
                k: v for k, v in self.structured_outputs.items()
                if k in KINDS or v not in (None, False)}))
        found: list[tuple[str, StructuredOutputsParams]] = []
        for name, fields in candidates:
            try:
                found.append((name, StructuredOutputsParams.coerce(fields, name)))
            except (ValueError, TypeError) as exc:
                message = str(exc) if str(exc).startswith(name) else f"{name}: {exc}"
                raise bad_request(message, param=name) from None
        response = response_format_params(self.response_format)
        if response is not None:
            found.append(("response_format", response))
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise bad_request(f"give at most one output constraint, got {names}",
                              param=found[1][0])
        return found[0][1] if found else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ``APIError`` 400 naming the field for invalid values.
        ``prompt_logprobs`` (default: the request's) is what the engine scores."""
        if prompt_logprobs is None:
            prompt_logprobs = self.prompt_logprobs
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(1.0 if self.repetition_penalty is None
                                    else self.repetition_penalty),
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=self.structured_outputs_params(),
            )
        except ValueError as exc:
            raise value_error(exc) from None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    NOT_IMPLEMENTED: ClassVar[dict[str, Any]] = _NOT_IMPLEMENTED_COMPLETION

    @property
    def scores_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt and its logprobs, nothing generated
        (the engine generates one token, which the response leaves out)."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_max_tokens(self) -> int | None:
        return 1 if self.scores_only else self.max_tokens

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine scores: enough for ``echo`` + ``logprobs`` and for
        ``prompt_logprobs``, whichever asks more."""
        wanted = [k for k in (self.prompt_logprobs,
                              self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens is not None and self.max_tokens < 1 and not \
                (self.echo and self.max_tokens == 0):
            raise bad_request(f"max_tokens must be >= 1 (0 only with echo: true, to score the "
                              f"prompt), got {self.max_tokens}", param="max_tokens")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", param="best_of")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    echo: bool = False

    NOT_IMPLEMENTED: ClassVar[dict[str, Any]] = _NOT_IMPLEMENTED_CHAT

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported on chat completions; use "
                              "/v1/completions with echo (or prompt_logprobs here)",
                              param="echo")
        if self.tools:
            raise bad_request("tools are not supported", param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice is not supported", param="tool_choice")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both "
                              "be true (set add_generation_prompt=false)",
                              param="continue_final_message")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def response_format_params(response_format: dict[str, Any] | None) -> (
        StructuredOutputsParams | None):
    """OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint),
    ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}``; a 400 naming the field otherwise."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, "
                          f"got {kind!r}", param="response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                          param="response_format")
    return StructuredOutputsParams(json=spec["schema"])


def value_error(exc: ValueError) -> APIError:
    """A 400 for a ``ValueError`` from ``SamplingParams`` or the engine; the
    param is the field the message starts with, when it names one."""
    message = str(exc)
    bare = message.removeprefix("invalid argument: ")  # the Rust core's prefix
    first = bare.split(" ", 1)[0].split("=", 1)[0].strip(":,")
    fields = set(SamplingParams.__dataclass_fields__) | set(_GenerationRequest.model_fields)
    param = first if first in fields else None
    if param is None and bare.startswith("prompt"):
        param = "prompt"
    return bad_request(message, param=param)


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` (templated)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    NOT_IMPLEMENTED: ClassVar[dict[str, Any]] = {
        "chat_template": None, "chat_template_kwargs": None, "tools": None,
        "mm_processor_kwargs": None,
    }

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        if self.continue_final_message and self.add_generation_prompt \
                and self.messages is not None:
            raise bad_request("continue_final_message and add_generation_prompt cannot both "
                              "be true (set add_generation_prompt=false)",
                              param="continue_final_message")


class DetokenizeRequest(_Strict):
    """vLLM's ``/detokenize``."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def check_unicode(text: str, param: str) -> None:
    """400 for text that is not valid Unicode: JSON can spell lone surrogates
    (``"\\ud800"``), which no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} is not valid Unicode: {exc.reason} at position "
                          f"{exc.start}", param=param) from None


def client_gone(request: Request) -> APIError:
    """Log, in one INFO line, that ``request``'s client hung up before its body was
    read; the error that ends the request."""
    client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
    logger.info("%s hung up while sending %s %s (content-length %s): not run", client,
                request.method, request.url.path, request.headers.get("content-length", "-"))
    return APIError(CLIENT_CLOSED_REQUEST, "the client closed the connection while sending "
                    "the request body", code="client_disconnected")


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's body as ``model``: 400 for a body that is not a JSON object, is
    nested too deeply, sets a field kvpage does not implement or fails validation; a
    499 for a client that hung up while sending it (see the module's docstring)."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise client_gone(request) from None
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request("the request body is not valid JSON: it is nested too deeply",
                          code="invalid_json") from None
    except ValueError as exc:  # bad JSON or UTF-8, an integer of over 4300 digits
        raise bad_request(f"the request body is not valid JSON: {exc}",
                          code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    refuse_not_implemented(data, model.NOT_IMPLEMENTED)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
