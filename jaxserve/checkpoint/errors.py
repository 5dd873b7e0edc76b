"""The one error type of checkpoint conversion and loading."""


class CheckpointError(ValueError):
    """A model source or checkpoint cannot be used; the message names the architecture,
    tensor, or file at fault (and what was expected), in one line."""
