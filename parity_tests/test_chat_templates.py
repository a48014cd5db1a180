"""`--chat` templates: what twincache's chat prompt renders and encodes equals transformers' `apply_chat_template` on
the same files, for templates that use transformers' `{% generation %}` tag, `tools` and `documents` (None there),
and special tokens other than BOS/EOS (`unk_token`, `pad_token`, ..., read from tokenizer_config.json, a legacy
special_tokens_map.json or a GGUF's metadata); and a template that fails is one line.

The tokenizer is a small SentencePiece-style BPE with byte fallback (as Mistral's), built here without training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.test_cli_bad_inputs import assert_one_line_error, run_in_process
from twincache.errors import CheckpointError, UnavailableError
from twincache.tokenizer import Tokenizer

PROMPTS = ["Hello world", "the café in the world\nline two"]

INST = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
TEMPLATES = {
    # TRL's assistant-mask tag, which transformers' environment defines
    "generation": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                   "[/INST]{% else %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}"
                   "{% endfor %}"),
    # tools is None under transformers, so no tools block
    "tools_is_not_none": ("{{ bos_token }}{% for m in messages %}{% if tools is not none and loop.last %}"
                          "[AVAILABLE_TOOLS][/AVAILABLE_TOOLS]{% endif %}[INST] {{ m['content'] }} [/INST]"
                          "{% endfor %}"),
    "tools_tojson": "{{ bos_token }}[TOOLS]{{ tools|tojson }}[DOCS]{{ documents|tojson }}" + INST,
    # every special token by name, and whether the names the checkpoint lacks are defined at all
    "special_tokens": (INST + "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|"
                       "{% for name in ['sep_token', 'cls_token', 'mask_token'] %}{{ name }}:"
                       "{% if name == 'sep_token' and sep_token is defined %}{{ sep_token }}{% endif %}"
                       "{% if name == 'mask_token' and mask_token is defined %}{{ mask_token }}{% endif %}"
                       "{% endfor %}{% if add_generation_prompt %} [REPLY]{% endif %}"),
}

ADDED_TOKENS_DECODER = {str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": True}
                        for i, token in enumerate(["<unk>", "<s>", "</s>"])}
# how each checkpoint names its special tokens: (tokenizer_config.json's fields, special_tokens_map.json or None)
SPECIAL_TOKEN_FILES = {
    "bos_eos_unk": ({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, None),
    # an AddedToken as transformers saves one, a pad token, a null
    "pad_and_added_token": ({"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>",
                                                               "lstrip": False, "normalized": False, "rstrip": False,
                                                               "single_word": False, "special": True},
                             "unk_token": "<unk>", "pad_token": "</s>", "mask_token": None}, None),
    # no added_tokens_decoder: transformers reads the legacy file too, and its tokens win
    "legacy_map": ({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"},
                   {"pad_token": {"content": "<unk>", "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False}, "sep_token": "[/INST]"}),
    # with an added_tokens_decoder, transformers ignores the legacy file
    "legacy_map_ignored": ({"bos_token": "<s>", "eos_token": "</s>", "added_tokens_decoder": ADDED_TOKENS_DECODER},
                           {"pad_token": "<unk>", "sep_token": "[/INST]"}),
}


def sp_tokenizer():
    """SentencePiece-style BPE over U+2581, byte fallback, <unk> <s> </s> and [INST] [/INST] special; BOS first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    merges = [("\u2581", "w"), ("o", "r"), ("\u2581w", "or"), ("l", "d"), ("\u2581wor", "ld"), ("\u2581", "t"),
              ("h", "e"), ("\u2581t", "he"), ("l", "l"), ("ll", "o"), ("H", "e"), ("He", "llo"), ("\u2581", "c"),
              ("a", "f"), ("\u2581c", "af"), ("\u2581caf", "é"), ("\u2581", "i"), ("\u2581i", "n")]
    for left, right in merges:
        for piece in (left, right, left + right):
            vocab.setdefault(piece, len(vocab))
    for char in "\u2581abcdefghijklmnopqrstuvwxyzHTN[]/{}:,\"":
        vocab.setdefault(char, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in (*specials, "[INST]", "[/INST]")])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


def tokenizer_dir(directory: Path, template: str, names: str) -> Path:
    config, legacy = SPECIAL_TOKEN_FILES[names]
    directory.mkdir(parents=True, exist_ok=True)
    sp_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    if legacy is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps(legacy))
    return directory


def hf_chat(tokenizer, prompt: str, tokenize: bool):
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=tokenize)
    return list(out["input_ids"] if hasattr(out, "keys") else out) if tokenize else out


@pytest.mark.parametrize("names", list(SPECIAL_TOKEN_FILES))
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_chat_prompt_equals_apply_chat_template(tmp_path, template, names):
    from transformers import AutoTokenizer

    directory = tokenizer_dir(tmp_path / "tokenizer", TEMPLATES[template], names)
    ours, theirs = Tokenizer.from_checkpoint(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.special_tokens == theirs.special_tokens_map
    for prompt in PROMPTS:
        assert ours.chat_prompt(prompt) == hf_chat(theirs, prompt, tokenize=False), prompt
        assert ours.encode_chat(prompt) == hf_chat(theirs, prompt, tokenize=True), prompt


def test_gguf_special_tokens_and_chat_prompt_equal_transformers_gguf_loading(tmp_path):
    """A GGUF's special tokens are its bos/eos/unknown/padding token ids' tokens (the ids read with gguf's reader, as
    transformers 5.24 reads them; 5.17 misreads EOS: trained_model.with_gguf_special_tokens); its chat template renders
    as transformers renders it. (The ids are compared on directories above: transformers versions
    differ on a SentencePiece GGUF's prefix space, test_gguf.py.)"""
    import gguf
    from transformers import AutoTokenizer

    from parity_tests.test_gguf import spm_tokenizer, spm_tokenizer_fields, write_spm_gguf
    from parity_tests.trained_model import with_gguf_special_tokens

    fields = spm_tokenizer_fields(spm_tokenizer())
    V = gguf.GGUFValueType
    fields |= {"tokenizer.ggml.padding_token_id": (2, V.UINT32),
               "tokenizer.chat_template": (TEMPLATES["special_tokens"] + TEMPLATES["tools_tojson"], V.STRING)}
    path = write_spm_gguf(tmp_path / "spm.gguf", fields)
    ours = Tokenizer.from_checkpoint(path)
    theirs = with_gguf_special_tokens(AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name), path)
    assert ours.special_tokens == theirs.special_tokens_map
    assert set(ours.special_tokens) == {"bos_token", "eos_token", "unk_token", "pad_token"}
    for prompt in PROMPTS:
        assert ours.chat_prompt(prompt) == hf_chat(theirs, prompt, tokenize=False), prompt


def test_chat_flag_on_a_generation_tag_template_gives_transformers_prompt(tmp_path, capsys):
    """The audit's checkpoint: `twincache generate --chat` on a template with `{% generation %}` and a tools block,
    which it refused as invalid Jinja: the prompt ids are apply_chat_template's."""
    from transformers import AutoTokenizer

    from parity_tests.conftest import save_hf_checkpoint

    template = TEMPLATES["generation"] + TEMPLATES["tools_is_not_none"]
    directory = tokenizer_dir(tmp_path / "model", template, "pad_and_added_token")
    save_hf_checkpoint(directory, vocab_size=sp_tokenizer().get_vocab_size())
    code, out, err = run_in_process(["generate", "--model", str(directory), "--mode", "eager", "--chat", "--json",
                                     "--max-new-tokens", "1", "--prompt", PROMPTS[1]], capsys)
    assert code == 0, err
    assert json.loads(out)["prompt_ids"] == hf_chat(AutoTokenizer.from_pretrained(directory), PROMPTS[1], True)


BAD_TEMPLATES = {  # template -> what the one line says
    "{% if %}x{% endif %}": "the checkpoint's chat template is not valid Jinja: ",
    "{% for m in messages %}{{ raise_exception('only system and user roles') }}{% endfor %}":
        "the checkpoint's chat template fails: only system and user roles",
    "{{ messages[0]['content'] + 1 }}": "the checkpoint's chat template fails: TypeError: ",
    "{{ 1 // (messages|length - 1) }}": "the checkpoint's chat template fails: ZeroDivisionError: ",
}


@pytest.mark.parametrize("template", list(BAD_TEMPLATES))
def test_a_failing_template_is_one_checkpoint_error_line(tmp_path, template):
    ours = Tokenizer.from_checkpoint(tokenizer_dir(tmp_path / "tokenizer", template, "bos_eos_unk"))
    with pytest.raises(CheckpointError) as error:
        ours.chat_prompt("Hello")
    assert str(error.value).startswith(BAD_TEMPLATES[template]) and "\n" not in str(error.value), str(error.value)
    assert str(error.value).endswith("or drop --chat"), "what to do: it said only what failed"


def test_a_failing_template_is_one_line_exit_2_in_the_cli(tmp_path, capsys):
    from parity_tests.conftest import save_hf_checkpoint

    directory = tokenizer_dir(tmp_path / "model", "{% for m in messages %}{{ m.content + 1 }}{% endfor %}",
                              "bos_eos_unk")
    save_hf_checkpoint(directory, vocab_size=sp_tokenizer().get_vocab_size())
    code, _, err = run_in_process(["generate", "--model", str(directory), "--chat", "--prompt", "hi"], capsys)
    assert_one_line_error(code, err, "the checkpoint's chat template fails: TypeError: ")


def test_chat_without_transformers_says_how_to_install_it(tmp_path, monkeypatch):
    ours = Tokenizer.from_checkpoint(tokenizer_dir(tmp_path / "tokenizer", INST, "bos_eos_unk"))
    monkeypatch.setitem(sys.modules, "transformers.utils.chat_template_utils", None)  # imports as ImportError
    with pytest.raises(UnavailableError, match=r"transformers >= 4\.52.*pip install 'twincache\[chat\]'"):
        ours.chat_prompt("Hello")


def test_a_template_that_renders_no_tokens_is_blamed_not_the_prompt(tmp_path):
    """A template that renders a prompt as nothing was refused as 'the prompt encodes to zero tokens; give a non-empty
    prompt', for a non-empty prompt."""
    directory = tokenizer_dir(tmp_path / "tokenizer", "{% for m in messages %}{% endfor %}", "bos_eos_unk")
    with pytest.raises(CheckpointError, match="chat template renders the prompt as '', which encodes to zero tokens; "
                                              "fix the template .*, or drop --chat"):
        Tokenizer.from_checkpoint(directory).encode_chat("Hello world")


def test_named_templates_without_a_default_are_named_in_the_refusal(tmp_path):
    """tokenizer_config.json's list of named templates without a 'default' one (transformers refuses it too) was
    refused as a checkpoint that 'has none (no ... tokenizer_config.json chat_template ...)'."""
    from transformers import AutoTokenizer

    named = [{"name": "tool_use", "template": "[TOOLS]" + INST}, {"name": "rag", "template": "[DOCS]" + INST}]
    directory = tokenizer_dir(tmp_path / "tokenizer", named, "bos_eos_unk")  # a list: json.dumps writes it
    with pytest.raises(ValueError, match="multiple chat templates with no default"):
        hf_chat(AutoTokenizer.from_pretrained(directory), "Hello", tokenize=False)
    with pytest.raises(CheckpointError, match="names only 'tool_use', 'rag'; save the one to use as "
                                              "chat_template.jinja beside tokenizer.json, or drop --chat"):
        Tokenizer.from_checkpoint(directory).chat_prompt("Hello")
    (directory / "chat_template.jinja").write_text(INST, encoding="utf-8")  # what the refusal advises
    assert Tokenizer.from_checkpoint(directory).chat_prompt("Hello") == "[INST] Hello [/INST]"


def test_template_files_are_read_as_utf8_whatever_the_locale(tmp_path):
    """tokenizer_config.json and chat_template.jinja were read in the locale's encoding: a non-ASCII template (as
    transformers' save_pretrained writes it, ensure_ascii=False) failed with 'unexpected UnicodeDecodeError' under
    LC_ALL=C PYTHONUTF8=0 (and would read as mojibake under a latin-1 locale); transformers reads both as UTF-8."""
    templates = ["[CONFIG \u2581 café 🙂] " + INST, "[JINJA \u2581 naïve] " + INST]
    in_config = tokenizer_dir(tmp_path / "config", INST, "bos_eos_unk")
    (in_config / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": templates[0]},
                                                                ensure_ascii=False), encoding="utf-8")
    in_jinja = tokenizer_dir(tmp_path / "jinja", INST, "bos_eos_unk")
    (in_jinja / "chat_template.jinja").write_text(templates[1], encoding="utf-8")
    code = ("import json, sys; from twincache.tokenizer import Tokenizer; "
            "print(json.dumps([Tokenizer.from_checkpoint(d).chat_template for d in sys.argv[1:]]))")
    run = subprocess.run([sys.executable, "-c", code, str(in_config), str(in_jinja)], capture_output=True, text=True,
                         env={**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"})
    assert run.returncode == 0, run.stderr[-500:]
    assert json.loads(run.stdout) == templates


def test_the_floor_imports_transformers_only_to_render():
    code = ("import sys, twincache.chat, twincache.tokenizer; "
            "assert 'transformers' not in sys.modules, 'imported transformers'")
    subprocess.run([sys.executable, "-c", code], check=True)
