"""Anthropic Messages API request models (only the fields the proxy reads; unknown fields are ignored).

`messages` and `tools` are validated lazily: the request envelope keeps them as raw JSON (not even
walked: `SkipValidation`; the front checks they are lists), and each message is validated as a
`MessageParam` (each tool as a `Tool`) only when it is new to the rollout (see
`clawfast.proxy.incremental`), so a call's cost does not grow with the history it resends.

Content blocks are one permissive model keyed by `type` rather than a strict union: harnesses send
block types this proxy does not act on (documents, server tool results, redacted thinking), and those
must not turn a call into a 400.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SkipValidation


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(_Model):
    type: str
    text: Optional[str] = None
    # tool_use
    id: Optional[str] = None
    name: Optional[str] = None
    input: Any = None
    # tool_result (a server tool's result may hold one object instead: a web search's error)
    tool_use_id: Optional[str] = None
    content: Union[str, list["Block"], dict[str, Any], None] = None
    is_error: Optional[bool] = None
    # thinking
    thinking: Optional[str] = None


class MessageParam(_Model):
    role: str
    content: Union[str, list[Block]]


class Tool(_Model):  # a tool of the request's own (`type` absent or "custom"; the front skips the others)
    name: str
    description: Optional[str] = None
    input_schema: Optional[dict[str, Any]] = None


class ToolChoiceParam(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None  # for "tool"
    disable_parallel_tool_use: Optional[bool] = None


class MessagesRequest(_Model):
    model: str
    messages: SkipValidation[list[Any]]  # each a MessageParam
    max_tokens: int = Field(ge=1)
    system: Union[str, list[Block], None] = None
    tools: Optional[list[Any]] = None  # each a Tool
    stream: bool = False
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    stop_sequences: Optional[list[str]] = None
    tool_choice: Optional[ToolChoiceParam] = None


class CountTokensRequest(_Model):
    model: str
    messages: SkipValidation[list[Any]]  # each a MessageParam
    system: Union[str, list[Block], None] = None
    tools: Optional[list[Any]] = None  # each a Tool
    tool_choice: Optional[ToolChoiceParam] = None
