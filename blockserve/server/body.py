"""The building blocks of every request model: strict bodies and encodable text."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


def encodable(text: str) -> str:
    """JSON may spell lone surrogates ("\\ud800"); no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: {exc.reason} at {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(encodable)]


class Body(BaseModel):
    """A request body, or a part of one: unknown fields ignored, types strict."""

    model_config = ConfigDict(extra="ignore", strict=True)
