"""The OpenAI wire format: request bodies checked into a `GenerationRequest`, errors, response bodies.

Every refusal is an `APIError` whose body is OpenAI's {"error": {message, type, param, code}}, with
`param` naming the field at fault.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from sdsie.decoding import SamplingConfig

__all__ = ["APIError", "GenerationRequest", "Limits", "parse_chat", "parse_completion"]

MAX_STOPS = 4  # OpenAI's limit on stop strings
# Parameters this server does not implement, with the value that means "off" (sent as such, they are accepted).
UNSUPPORTED = {"best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "logit_bias": None,
               "presence_penalty": 0, "frequency_penalty": 0, "suffix": None, "tools": None, "tool_choice": None,
               "functions": None, "response_format": None}


class APIError(Exception):
    """An answer other than 200: HTTP status plus OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Limits:
    """What a request may ask of this server."""

    model: str
    max_tokens: int
    context: int
    vocab: int


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request. chat: answer as chat.completion; max_tokens counts new tokens."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def parse_completion(body: Any, limits: Limits, tokenizer: Any) -> GenerationRequest:
    """POST /v1/completions: `prompt` is a string or a list of token ids (or a list holding one of either)."""
    body = _object(body)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "missing required field 'prompt' (a string or a list of token ids)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
        if any(not 0 <= t < limits.vocab for t in ids):
            raise bad("prompt", f"prompt token ids must lie in [0, {limits.vocab})")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", f"a batch of {len(prompt)} prompts: this server answers one prompt per request")
    else:
        raise bad("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    return _request(body, ids, limits, chat=False, default_max=16, prompt_field="prompt")


def parse_chat(body: Any, limits: Limits, render: Any) -> GenerationRequest:
    """POST /v1/chat/completions: `messages` through `render(messages) -> ids` (the chat template)."""
    body = _object(body)
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "missing required field 'messages' (a list of {role, content} objects)")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with a string 'role'")
        flat.append({**m, "content": _content(m.get("content"), i)})
    try:
        ids = render(flat)
    except ValueError as err:
        raise bad("messages", str(err)) from err
    default_max = max(1, min(limits.max_tokens, limits.context - len(ids)))
    return _request(body, ids, limits, chat=True, default_max=default_max, prompt_field="messages")


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or OpenAI's list of {"type": "text", "text": ...} parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _request(body: dict[str, Any], ids: list[int], limits: Limits, chat: bool, default_max: int,
             prompt_field: str) -> GenerationRequest:
    model = body.get("model")
    if model is not None and model != limits.model:
        raise APIError(400, f"the model {model!r} does not exist: this server serves {limits.model!r}",
                       param="model", code="model_not_found")
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if not (value is None or value is False or value == off):
            raise bad(name, f"{name} is not supported by this server")
    n = body.get("n", 1)
    if n not in (1, None) or isinstance(n, bool):
        raise bad("n", f"n must be 1 (one choice per request), got {n!r}")
    if not ids:
        raise bad(prompt_field, f"{prompt_field} encodes to no tokens: at least one is needed")
    max_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, max_field, default_max)
    if max_tokens <= 0:
        raise bad(max_field, f"{max_field} must be >= 1, got {max_tokens}")
    if max_tokens > limits.max_tokens:
        raise bad(max_field, f"{max_field} is {max_tokens}, above this server's limit of {limits.max_tokens}")
    if len(ids) >= limits.context:
        raise bad(prompt_field, f"{prompt_field} is {len(ids)} tokens, too long for the cache of {limits.context} "
                                "positions", code="context_length_exceeded")
    if len(ids) + max_tokens > limits.context:
        raise bad(max_field, f"{prompt_field} ({len(ids)} tokens) plus {max_field} ({max_tokens}) exceeds the cache "
                             f"of {limits.context} positions", code="context_length_exceeded")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad("stream_options", "stream_options must be an object")
    return GenerationRequest(
        prompt_ids=tuple(ids), max_tokens=max_tokens, sampling=_sampling(body), stop=_stop(body.get("stop")),
        stream=_flag(body, "stream"), include_usage=_flag(stream_options, "include_usage", "stream_options."),
        chat=chat, ignore_eos=_flag(body, "ignore_eos"), return_token_ids=_flag(body, "return_token_ids"))


def _integer(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(name, f"{name} must be an integer, got {value!r}")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(name, f"{name} must be a finite number, got {value!r}")
    return float(value)


def _flag(body: dict[str, Any], name: str, prefix: str = "") -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(prefix + name, f"{prefix}{name} must be true or false, got {value!r}")
    return value


def _sampling(body: dict[str, Any]) -> SamplingConfig:
    """OpenAI's defaults (temperature 1, top_p 1); temperature 0 is greedy. No seed: a fresh random one."""
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise bad("temperature", f"temperature must be >= 0 (0 is greedy), got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad("top_p", f"top_p must lie in (0, 1], got {top_p}")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise bad("seed", f"seed must be an integer, got {seed!r}")
    return SamplingConfig(temperature=temperature, top_p=None if top_p == 1 else top_p, seed=seed)


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad("stop", f"stop must be a string or a list of at most {MAX_STOPS} strings, got {stop!r}")
    if any(not s for s in stops):
        raise bad("stop", "stop strings must not be empty")
    return tuple(stops)


# ----------------------------------------------------------------------------------------------------
# Response bodies


def completion_body(req: GenerationRequest, model: str, text: str, finish: str, usage: dict[str, Any],
                    token_ids: list[int]) -> dict[str, Any]:
    if req.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    return {**_head(req, model, chunk=False), "choices": [choice], "usage": usage}


def chunk_body(req: GenerationRequest, model: str, text: str | None, finish: str | None = None,
               first: bool = False) -> dict[str, Any]:
    """One streamed chunk; text None gives an empty delta (the chat stream's closing chunk)."""
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {**_head(req, model, chunk=True), "choices": [choice]}


def usage_chunk(req: GenerationRequest, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    """stream_options.include_usage: the last chunk, with no choices."""
    return {**_head(req, model, chunk=True), "choices": [], "usage": usage}


def _head(req: GenerationRequest, model: str, chunk: bool) -> dict[str, Any]:
    if req.chat:
        return {"id": f"chatcmpl-{req.id}", "object": "chat.completion.chunk" if chunk else "chat.completion",
                "created": req.created, "model": model}
    return {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created, "model": model}
