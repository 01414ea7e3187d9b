"""Request models that constrain the output (`response_format`, vLLM's `structured_outputs`,
`tools` and `tool_choice`), and the fields OpenAI or vLLM define that blockserve refuses."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import StructuredOutputsParams
from blockserve.server.body import Body, Text


class JsonSchemaFormat(Body):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's `response_format`: free text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.json_schema is None
        ):
            raise ValueError('type "json_schema" needs json_schema.schema')
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            assert self.json_schema is not None and self.json_schema.json_schema is not None
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


class StructuredOutputs(Body):
    """vLLM's `structured_outputs`: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[Text] | None = None
    grammar: str | None = None

    def constraint(self) -> StructuredOutputsParams:
        schema = self.json_
        if isinstance(schema, str):  # vLLM takes the schema as JSON text too
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(
                    f"structured_outputs.json is not valid JSON: {exc}", "structured_outputs"
                ) from None
        return StructuredOutputsParams(
            json=schema,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
        )


# Fields OpenAI or vLLM define that blockserve does not implement: set (non-null, not the
# default), each is refused with a 400 naming it rather than ignored.
class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


UNSUPPORTED_FIELDS = (
    "logits_processors",
    "use_beam_search",
    "truncate_prompt_tokens",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "structural_tag",
)
_HINTS = {
    "guided_json": "; use structured_outputs.json or response_format",
    "guided_regex": "; use structured_outputs.regex",
    "guided_choice": "; use structured_outputs.choice",
    "guided_grammar": "; use structured_outputs.grammar",
}


def refuse_unsupported(data: Any, names: tuple[str, ...]) -> Any:
    if isinstance(data, dict):
        for name in names:
            value = data.get(name)
            if value not in (None, False, {}, []) and not (name == "best_of" and value == 1):
                raise InvalidRequestError(f"{name} is not supported{_HINTS.get(name, '')}", name)
    return data
