"""Host-side helpers shared by scripts/docker/train_runtime.py and serve_runtime.py (python3 + PyYAML only)."""
