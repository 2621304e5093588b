"""OpenAI Chat Completions request models (only the fields the proxy reads; unknown fields ignored).

`messages` are validated lazily, each as a `ChatMessage` when it is new to the rollout (see
`clawfast.proxy.incremental`); `tools` each as a `ChatTool`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SkipValidation


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Model):
    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None  # an assistant's refusal part


class FunctionCall(_Model):
    name: str
    arguments: Union[str, dict[str, Any], None] = None


class ToolCallParam(_Model):
    id: str = ""
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: str
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[ToolCallParam]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None
    reasoning_content: Optional[str] = None


class FunctionDef(_Model):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ChatTool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Model):
    include_usage: Optional[bool] = None


class ChatRequest(_Model):
    model: str
    messages: SkipValidation[list[Any]]  # each a ChatMessage (the front checks it is a list)
    stream: Optional[bool] = None  # null is false, as the API takes it
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    n: Optional[int] = Field(default=None, ge=1, le=1)
    stop: Union[str, list[str], None] = None
    tools: Optional[list[Any]] = None  # each a ChatTool
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
