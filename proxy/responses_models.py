"""OpenAI Responses API request models (only the fields the proxy reads; unknown fields ignored).

Input items are one permissive model keyed by `type`: Codex sends item types the proxy does not act
on (web search calls, local shell calls), and those must not turn a call into a 400. `input` items
are validated lazily, each as an `Item` when it is new to the rollout (see
`clawfast.proxy.incremental`); `tools` each as a `ToolDef`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SkipValidation


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Part(_Model):
    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None  # an assistant message's refusal part


class Item(_Model):
    type: Optional[str] = None  # absent on bare {"role", "content"} messages
    role: Optional[str] = None
    content: Union[str, list[Part], None] = None
    # function_call / custom_tool_call
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Union[str, dict[str, Any], None] = None
    input: Optional[str] = None
    # function_call_output / custom_tool_call_output
    output: Union[str, list[Part], None] = None
    # reasoning
    summary: Optional[list[Part]] = None
    # item_reference (refused: the proxy stores no items)
    id: Optional[str] = None


class ToolDef(_Model):
    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ToolChoiceParam(_Model):
    type: str  # "function" or "custom" name one of the request's tools; hosted tools are refused
    name: Optional[str] = None


class ResponsesRequest(_Model):
    model: str
    input: SkipValidation[Union[str, list[Any]]]  # a user message, or items (each an Item; the front checks)
    instructions: Optional[str] = None
    tools: Optional[list[Any]] = None  # each a ToolDef
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceParam, None] = None
    parallel_tool_calls: Optional[bool] = None
    stream: Optional[bool] = None  # null is false, as the API takes it
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    previous_response_id: Optional[str] = None  # refused: the proxy keeps no responses (`ResponsesFront.parse`)
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)  # above 0: refused (`ResponsesFront.parse`)
