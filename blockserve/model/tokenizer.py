"""`Tokenizer`: a model's tokenizer as served, over Hugging Face `tokenizers` and jinja2 alone."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import tokenizers

BACKEND_FILE = "tokenizer.json"
SNAPSHOT_FILE = "blockserve_tokenizer.json"
SNAPSHOT_FORMAT = 1
# Names a message's reasoning may come under; templates read the first (transformers' aliases).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """Text ⇄ token ids and chat templates; the methods a caller of transformers' tokenizer
    knows, with the same results. Thread-safe; `chat_template` may be replaced (a str, a dict
    of named templates, or None).

    transformers builds a model's tokenizer once (its class resolution, added tokens, BOS/EOS
    post-processor, chat templates); what it built is saved as a snapshot (`save`): the
    backend's own JSON and a small file of special tokens, templates and the decode clean-up
    flag. A later start loads the snapshot (`load`) without importing transformers, whose import
    is over a second of every start on a 2-vCPU host. Encoding, decoding and chat templating
    give what transformers' tokenizer gives (tests/model/test_tokenizer.py compares them).

    One `Tokenizer` serves every thread at once: nothing here changes the backend after it is
    built (the one setting that differs, splitting special-token text, is a second backend).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str],
        chat_template: str | dict[str, str] | None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._splitting: tokenizers.Tokenizer | None = None
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (sent to another process, deep-copied) as what it was built from."""
        args = (
            self.backend_tokenizer,
            self.special_tokens_map,
            self.chat_template,
            self.clean_up_tokenization_spaces,
        )
        return (type(self), args)

    @classmethod
    def from_transformers(cls, hf_tokenizer: Any) -> Tokenizer:
        """What a transformers fast tokenizer does, taken from it: its backend (copied: the
        original stays the caller's), named special tokens, templates and clean-up flag.
        ValueError for a tokenizer with no `tokenizers` backend (a slow one)."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, tokenizers.Tokenizer):
            raise ValueError(
                f"{type(hf_tokenizer).__name__} has no `tokenizers` backend: blockserve serves "
                "fast tokenizers (a tokenizer.json) only"
            )
        backend = tokenizers.Tokenizer.from_str(backend.to_str())
        backend.no_padding()
        backend.no_truncation()
        # transformers skips its clean-up for BPE models unless told to corrupt them anyway.
        clean_up = bool(getattr(hf_tokenizer, "clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(
                getattr(
                    hf_tokenizer,
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                    False,
                )
            )
        )
        template = hf_tokenizer.chat_template
        return cls(
            backend,
            {name: str(value) for name, value in hf_tokenizer.special_tokens_map.items()},
            dict(template) if isinstance(template, dict) else template,
            clean_up,
        )

    # -- snapshot ---------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write the snapshot `load` reads into `directory` (which must exist)."""
        self.backend_tokenizer.save(str(directory / BACKEND_FILE))
        snapshot = {
            "format": SNAPSHOT_FORMAT,
            "special_tokens": self.special_tokens_map,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
        }
        (directory / SNAPSHOT_FILE).write_text(json.dumps(snapshot, indent=1))

    @classmethod
    def load(cls, directory: Path) -> Tokenizer | None:
        """The tokenizer `save` wrote into `directory`; None if there is none of this format."""
        snapshot_file = directory / SNAPSHOT_FILE
        if not snapshot_file.is_file():
            return None
        snapshot = json.loads(snapshot_file.read_text())
        if snapshot.get("format") != SNAPSHOT_FORMAT:
            return None
        return cls(
            tokenizers.Tokenizer.from_file(str(directory / BACKEND_FILE)),
            snapshot["special_tokens"],
            snapshot["chat_template"],
            snapshot["clean_up_tokenization_spaces"],
        )

    # -- ids ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        """The vocabulary, added tokens included."""
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> list[int]:
        """`text`'s token ids. `add_special_tokens`: the model's BOS/EOS around them, as its
        post-processor says. `split_special_tokens`: special-token text in `text` is
        tokenized as ordinary text, never as the special token."""
        backend = self._splitting_backend() if split_special_tokens else self.backend_tokenizer
        # The batch call lets go of the GIL while it encodes (`encode` holds it), and its fast
        # form skips the character offsets: 2.4x quicker on a long prompt, the same ids.
        return list(backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = str(
            self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        )
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(token_id) for token_id in token_ids]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int | None]:
        return [self.backend_tokenizer.token_to_id(token) for token in tokens]

    @property
    def added_tokens_decoder(self) -> dict[int, tokenizers.AddedToken]:
        return dict(sorted(self.backend_tokenizer.get_added_tokens_decoder().items()))

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        eos = self.eos_token
        return None if eos is None else self.backend_tokenizer.token_to_id(eos)

    def _splitting_backend(self) -> tokenizers.Tokenizer:
        """A second backend that reads special-token text as text, made on first use (a
        rare path: a message that holds special-token text), never changed after."""
        with self._lock:
            if self._splitting is None:
                splitting = tokenizers.Tokenizer.from_str(self.backend_tokenizer.to_str())
                splitting.encode_special_tokens = True
                self._splitting = splitting
            return self._splitting

    # -- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered by the model's chat template (given the named special
        tokens, `tools` and `template_kwargs`), as text or, with `tokenize`, as token ids
        without added special tokens. ValueError without a template; jinja2's
        TemplateError when the template fails (or raises) on the conversation."""
        template = _compile(self._template_for(tools))
        messages = [_normalized(message) for message in conversation]
        text = template.render(
            messages=messages,
            tools=[dict(tool) for tool in tools] if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **template_kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_for(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        """The template to render: the only one, else `tool_use` when there are tools, else
        `default` (transformers' choice among named templates)."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"no default among this model's chat templates {sorted(templates)}")
        if templates is None:
            raise ValueError("this model has no chat template")
        return templates


def _normalized(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates see it from transformers: keys whose value is None dropped
    (templates print "None" for them otherwise), reasoning under all of its names."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and English contractions."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


@cache
def _compile(source: str) -> Any:
    """A chat template compiled in the sandbox, with the names templates expect from
    transformers: `raise_exception`, `strftime_now`, an unescaped `tojson`, loop controls and
    the `{% generation %}` tag (which renders its body)."""
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training
        masks; rendering it is rendering its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(source)


def chat_template_text(value: str) -> str:
    """--chat-template's template: the file it names, or the value itself (as vLLM reads it)."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a file name
        pass
    return value
