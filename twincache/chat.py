"""Chat prompts: a checkpoint's chat template (Jinja) turned into the text an -Instruct model expects.

Rendered by transformers' own renderer, `transformers.utils.chat_template_utils.render_jinja_template` (what its
`apply_chat_template` calls; transformers >= 4.52, the same signature and return value through 5.25), with what
`apply_chat_template` passes: the messages, `add_generation_prompt`, `tools=None`, `documents=None` and the
tokenizer's special tokens by name (`**special_tokens_map`). So a template sees what it sees under transformers: its
sandboxed environment, the `{% generation %}` tag, `raise_exception`, `strftime_now` and the HTML-safe `tojson`.
transformers is imported on the first render (~0.8 s), never when this module is imported. Whatever fails in the
template is one CheckpointError line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twincache.errors import CheckpointError, UnavailableError

CHAT_INSTALL = "pip install 'twincache[chat]'"
# What to do about a template that fails: it is the checkpoint's, so only its owner can mend it.
FIX_TEMPLATE = ("fix the template (chat_template.jinja, tokenizer_config.json chat_template or GGUF "
                "tokenizer.chat_template), or drop --chat")


def render_chat(template: str, messages: list[dict[str, str]], special_tokens: Mapping[str, str] | None = None, *,
                add_generation_prompt: bool = True) -> str:
    """The template applied to `messages` ([{"role": "user", "content": ...}, ...]), ending where the reply starts
    (with `add_generation_prompt`); `special_tokens`: name -> text, e.g. {"bos_token": "<s>", ...}."""
    import jinja2

    render = _renderer()
    try:
        rendered, _ = render(conversations=[messages], chat_template=template,
                             add_generation_prompt=add_generation_prompt, **dict(special_tokens or {}))
    except jinja2.TemplateSyntaxError as err:
        raise CheckpointError(f"the checkpoint's chat template is not valid Jinja: {_one_line(err.message)} "
                              f"(line {err.lineno}); {FIX_TEMPLATE}") from None
    except jinja2.TemplateError as err:  # raise_exception(...), an undefined value used, a sandbox refusal
        raise CheckpointError(f"the checkpoint's chat template fails: {_one_line(err)}; {FIX_TEMPLATE}") from None
    except ImportError as err:  # transformers refuses a jinja2 with known sandbox escapes
        raise UnavailableError(f"--chat cannot render the checkpoint's chat template: {_one_line(err)}") from None
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as err:  # the template's Python
        raise CheckpointError(f"the checkpoint's chat template fails: {type(err).__name__}: {_one_line(err)}; "
                              f"{FIX_TEMPLATE}") from None
    return rendered[0]


def _renderer() -> Callable[..., Any]:
    """render_jinja_template, which returns (rendered conversations, generation spans) despite its `-> str`."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:  # not installed, or older than 4.52
        raise UnavailableError("--chat renders the checkpoint's chat template with transformers' renderer "
                               "(transformers.utils.chat_template_utils.render_jinja_template, transformers >= 4.52), "
                               f"which is not installed: {CHAT_INSTALL} (the dev extra has it)") from None
    return render_jinja_template


def _one_line(message: object) -> str:
    return " ".join(str(message).split())
