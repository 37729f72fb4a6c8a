"""The one family of errors AstrAI reports as a single line.

Every error that names a bad input or a failed step (config, data, model, tokenizer, checkpoint, export,
rewards, the rendezvous, preflight, the output_dir lock, a non-finite loss) derives from `AstraiError`, so an
entry point catches the family once instead of a list of names that drifts as rooms are added. A class may
also keep a builtin base (ValueError, RuntimeError) where callers catch that.
"""


class AstraiError(Exception):
    """Base of every error AstrAI reports to its user as one line."""
