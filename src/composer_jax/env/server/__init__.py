"""The environment server process: the FastAPI app, sessions, and the transports over one tool
dispatcher (REST, OpenEnv's WebSocket, MCP JSON-RPC and streamable HTTP), with its metrics."""
