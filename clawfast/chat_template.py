"""The chat template clawfast writes into the models it builds or converts (the embedded model,
`clawfast.pretrained`'s packaged ones): ChatML turns (``<|im_start|>role ... <|im_end|>``) with tools
rendered the Hermes / Qwen way, which the proxy's tool-call parser reads:

- tools: a system block listing each tool's JSON schema inside ``<tools></tools>``, with the
  instruction to answer ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an assistant's tool calls: one ``<tool_call>`` JSON object each, after its text;
- a tool result: its own user turn, ``<tool_response>...</tool_response>``;
- reasoning: ``<think>...</think>`` at the start of the assistant turn.

It is *message-local*: each message renders to the same text wherever it appears, which is what lets
the proxy render a conversation incrementally and splice sampled tokens back in.
"""

# Message-local Qwen3-style template: each message renders on its own; tool results become their own
# user turn (Qwen3 groups consecutive ones), so a message's text never depends on its neighbours.
# transformers renders with trim_blocks (the newline right after a block tag is dropped), hence the
# '\\n' expressions after tags.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% if message.reasoning_content %}{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ message.content or '' }}"
    "{% for tool_call in message.tool_calls or [] %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    "{% if not loop.first or message.content %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}{% else %}{{ tool_call.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
