"""The `serve:` section of a job YAML, checked on the host (python3 + PyYAML only, see job_yaml.py).

The wrappers own this section: the trainer's schema accepts it as given (astrai/config/schema.py), so
every key and value is judged here. scripts/serve.sh reads it; scripts/train.sh checks it too, so that a
wrong serve: key fails before a training container starts, as it did when the trainer checked it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from lib.job_yaml import JobFileError, check_known_keys, host_path, section, text_value

SERVE_KEYS = ("model_dir", "image", "port", "served_model_name", "extra_args")
DEFAULT_IMAGE = "vllm/vllm-openai:latest"
DEFAULT_PORT = 8000


def serve_section_variables(document: dict, job_file: Path) -> dict[str, str]:
    """Variable -> value for each serve: key the YAML sets; JobFileError naming the key for a wrong one."""
    variables: dict[str, str] = {}
    serve = section(document, "serve", job_file)
    check_known_keys(serve, SERVE_KEYS, "serve", job_file)
    model_dir = text_value(serve, "model_dir", "serve", job_file)
    if model_dir is not None:
        variables["SERVE_MODEL_DIR"] = host_path(model_dir, job_file)
    image = text_value(serve, "image", "serve", job_file)
    if image is not None:
        variables["SERVE_IMAGE"] = image
    port = serve.get("port")
    if port is not None:
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise JobFileError(f"{job_file}: serve.port: expected a port number (1-65535), got {port!r}")
        variables["SERVE_PORT"] = str(port)
    name = text_value(serve, "served_model_name", "serve", job_file)
    if name is not None:
        variables["SERVE_MODEL_NAME"] = name
    extra_args = serve.get("extra_args")
    if extra_args is not None:
        scalars = isinstance(extra_args, list) and all(
            isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in extra_args
        )
        if not scalars:
            raise JobFileError(
                f"{job_file}: serve.extra_args: expected a list of arguments like ['--max-model-len', 4096], got "
                f"{extra_args!r}"
            )
        # One string, quoted for the server's `sh -c 'eval set -- ...'`, so each argument arrives intact.
        variables["SERVE_EXTRA_ARGS"] = shlex.join(str(argument) for argument in extra_args)
    return variables
