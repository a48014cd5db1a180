"""Chat prompts: a checkpoint's chat template (Jinja) turned into the text an -Instruct model expects.

Rendered as transformers' `apply_chat_template` renders it: a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, loop controls, a `tojson` filter that does not escape HTML, and the `raise_exception` and
`strftime_now` helpers that Hub templates call. Templates come with downloaded checkpoints, so they run sandboxed.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

from twincache.errors import CheckpointError


def render_chat(template: str, messages: list[dict[str, str]], *, bos_token: str | None = None,
                eos_token: str | None = None, add_generation_prompt: bool = True) -> str:
    """The template applied to `messages` ([{"role": "user", "content": ...}, ...]), ending where the reply starts."""
    import jinja2

    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token or "", eos_token=eos_token or "")
    except jinja2.TemplateError as err:
        raise CheckpointError(f"the checkpoint's chat template fails: {' '.join(str(err).split())}") from None


@functools.lru_cache(maxsize=4)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise CheckpointError(f"the checkpoint's chat template is not valid Jinja: {err.message} "
                              f"(line {err.lineno})") from None
