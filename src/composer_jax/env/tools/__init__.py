"""The agent's tools: file and shell tools over a workspace, web search and page reading, the offline
documentation index, and ranked code search."""
