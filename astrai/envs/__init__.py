"""Multi-turn environments and the tools a model calls in them; `astrai.envs.python:run_python` is the sandboxed
Python tool."""
