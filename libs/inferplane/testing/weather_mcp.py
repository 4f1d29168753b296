"""A stdio MCP server with one tool, `get_weather(city, unit)` (kimi-tiny's training schema:
`inferplane.fixtures.kimi_tiny.TOOLS`), that answers a fixed report and appends each call's
arguments as a JSON line to the file named by `$WEATHER_MCP_CALLS` (when set), so a test can
see that an agent's tool round trip reached the tool.

    python -m inferplane.testing.weather_mcp      # what an agent's MCP config runs
"""

from __future__ import annotations

import json
import os
from typing import Literal

CALLS_ENV = "WEATHER_MCP_CALLS"
SERVER_NAME = "weather"
TOOL_NAME = "get_weather"
REPORT = {"temperature": 18, "condition": "cloudy"}


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Current weather for a city."""
    calls = os.environ.get(CALLS_ENV)
    if calls:
        with open(calls, "a", encoding="utf-8") as out:
            out.write(json.dumps({"city": city, "unit": unit}) + "\n")
    return json.dumps({"city": city, "unit": unit, **REPORT})


def main() -> None:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer(SERVER_NAME)
    server.tool(name=TOOL_NAME, description="Current weather for a city.")(get_weather)
    server.run("stdio")


if __name__ == "__main__":
    main()
