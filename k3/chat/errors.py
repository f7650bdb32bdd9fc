"""Errors raised by the chat renderer."""

from __future__ import annotations


class ChatFormatError(ValueError):
    """A conversation (or a rendering option) that cannot be rendered in the XTML format.

    Raised for caller-supplied input only (unknown roles, tool results without a matching call,
    tool-call arguments that are JSON but not an object, invalid thinking effort, ...). The HTTP
    server maps it to a 400 response. Model output is never rejected: the parser falls back to
    plain text instead.
    """
