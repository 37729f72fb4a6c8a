"""Checkpoint -> Hugging Face folder: weights.py reads a checkpoint's weights (also for
`model.init_from_checkpoint`), hf.py writes the folder, cli.py is `python -m astrai export-hf`, reward.py an
rm's sequence-classifier export, best.py `--best`. Nothing below cli.py parses arguments or draws progress
the model build would import.
"""
