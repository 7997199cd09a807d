"""User-facing errors.

`WanInputError` is raised for anything the user can fix (a size, a path, a checkpoint, a stage file,
a mesh). Its message is one line that says what is wrong and how to fix it; the CLI prints it and
exits with status 2. Everything else is a bug and keeps its traceback.
"""


class WanInputError(ValueError):
    """Bad input from the user: a one-line message naming the fix."""


class NonFiniteError(RuntimeError):
    """A result became NaN or Inf (latents, actions, states): the run failed; command lines exit 1 with one
    line and keep no output."""
