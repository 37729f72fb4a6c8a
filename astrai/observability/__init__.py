"""What a run reports: metrics.py (metrics.jsonl, the progress bar), plot.py (`python -m astrai plot`) and
trackers/ (TensorBoard, W&B, MLflow beside metrics.jsonl). Knows no training: the loops hand it records.
"""
