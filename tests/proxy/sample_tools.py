"""Two tools in each protocol's shape, and a first user message, for the tool-call tests."""

TOOLS = [
    {"name": "Bash", "description": "Run a shell command",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
    {"name": "Read", "description": "Read a file",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}},
]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", "name": t["name"], "description": t["description"],
                    "parameters": t["input_schema"]} for t in TOOLS]
USER = {"role": "user", "content": "What files are here?"}
