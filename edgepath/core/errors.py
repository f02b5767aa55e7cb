"""The one exception type the CLI turns into a clean message and exit status 2."""


class EdgepathError(ValueError):
    """Bad input or a refused operation. The message names the problem and, where
    one exists, the fix; nothing was written that a later stage would trust."""


def one_line(message: object) -> str:
    """A message (an exception's, a tool's such as git's or DVC's, which may span lines
    with hints) as the one line an edgepath error is."""
    return " ".join(str(message).split())
