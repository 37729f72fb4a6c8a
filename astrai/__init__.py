"""AstrAI: a DeepSpeed-backed trainer for large language models."""

import os

__version__ = "0.1.0"

# No hub at run time: models, tokenizers and data come from local paths. huggingface_hub and datasets
# read these once, when they are first imported, so they are set here, before any AstrAI module imports
# them (a later `os.environ` change is not seen). Without them every `datasets.load_dataset("json", ...)`
# sends a download-count request to S3 (3 s timeout) from every rank, and a typo'd path could start a
# hub download. A user's own setting wins.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")
