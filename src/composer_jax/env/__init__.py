"""Environment server: sandboxed coding workspaces over HTTP (no JAX imports here)."""
